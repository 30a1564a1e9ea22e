"""Build the tiny Countdown reasoner shipped in tiny/: search traces, a word-level tokenizer,
a ~2M-parameter Qwen2 and its next-token pretraining on the CPU.

    python make_tiny.py                      # rebuild tiny/ (about 45 minutes on one core)
    python make_tiny.py --steps 300 --out runs/tiny-smoke

The model learns to write a depth-first search, Stream-of-Search style. The target appears
only in the prompt; the trace never restates it, so every leaf's yes/no must look it up
far back and a KV-cache policy that evicts the prompt loses:

    prompt:     <bos> Countdown : reach 16 with 3 5 2 .
    completion: [ 5 3 2 ] 5 + 3 = 8 [ 8 2 ] + 10 no * 16 yes <answer> ( 5 + 3 ) * 2 </answer> <eos>

`[ ... ]` states the numbers left, largest first. A move `a op b = v` picks two of them
(pairs in order, larger first, ops + * - /, / only when exact); with two numbers x >= y
left, each leaf `op w` is x op y, judged yes (w is the target) or no (leaves above 999
are skipped). A dead end returns with `back [ ... ]` restating the numbers.
With the same flags (--seed, --steps, --threads, ...), the same torch and the same kind of CPU,
it writes the same files byte for byte. tiny/ is `python make_tiny.py` with every default, run
with torch 2.13.0 (CPU wheel) on a 2-core AMD EPYC machine.
"""
import argparse
import json
import math
import os
import random
import shutil
import time

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from tqdm import tqdm

import countdown as cd
from countdown import tiny_prompt
from model import Qwen2, Qwen2Config, from_pretrained, init_weights, load_tokenizer, num_params, save_pretrained
from ngc import Eviction, Sampling
from train import solve

# The default run of `python train.py --task countdown` on this model (tiny/ngc.json): δ, b, w and
# lengths scaled to its traces (prompt ~12 tokens, full-cache completions ~75, capped at 256).
TINY_RUN = dict(
    prompt="tiny", difficulty="tiny", train_problems=20_000, eval_problems=200, seed=0,
    steps=60, prompts=16, group=8, max_new_tokens=256, temperature=1.0, top_k=0,
    delta=24, block=4, window=4, retention="0.9,0.7,0.5", stage_steps=10, alpha=0.6,
    lr=3e-5, beta2=0.99, adam_eps=1e-8, micro_batch=32, eval_every=60, eval_batch=200, save_every=10,
    term_grad_norms=True,
)
MAX_NUM = 999  # every integer 0..MAX_NUM is one token; larger leaves are not written
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
WORDS = ["Countdown", ":", "reach", "with", ".", "[", "]", "+", "*", "-", "/", "=", "no", "yes", "back",
         "<answer>", "</answer>", "(", ")", "<eviction_rate>", "%", "</eviction_rate>"]

# ---------------------------------------------------------------------------------------
# Search traces


def moves(a, b):
    """(op, value) for a >= b, in search order: + * - and / when exact."""
    out = [("+", a + b), ("*", a * b), ("-", a - b)]
    return out + [("/", a // b)] if b and a % b == 0 else out


def state(nums) -> str:
    return "[ " + " ".join(map(str, sorted(nums, reverse=True))) + " ]"


def trace(problem) -> str:
    """The deterministic depth-first search trace for a 3-number problem, answer included."""
    nums = sorted(problem.nums, reverse=True)
    assert len(nums) == 3, "traces are written for 3 numbers"
    out = [state(nums)]
    for i, j in [(0, 1), (0, 2), (1, 2)]:
        a, b, c = nums[i], nums[j], nums[3 - i - j]
        for op, v in moves(a, b):
            out.append(f"{a} {op} {b} = {v} {state([v, c])}")
            x, y = max(v, c), min(v, c)
            for op2, w in moves(x, y):
                if w > MAX_NUM:
                    continue
                if w != problem.target:
                    out.append(f"{op2} {w} no")
                    continue
                inner = f"( {a} {op} {b} )"
                expr = f"{inner} {op2} {c}" if v >= c else f"{c} {op2} {inner}"
                return " ".join(out + [f"{op2} {w} yes <answer> {expr} </answer>"])
            out.append(f"back {state(nums)}")
    raise ValueError(f"{problem} has no solution")


def replay_trace(problem, text: str) -> bool:
    """Re-execute a trace: every move and leaf must be correct arithmetic on the numbers at
    hand, every verdict right, and the final answer must reach the target."""
    words, k = text.split(), 0
    start, nums = sorted(problem.nums, reverse=True), None

    def take(n):
        nonlocal k
        k += n
        return words[k - n: k]

    try:
        while k < len(words) and words[k] != "<answer>":
            if words[k] in ("[", "back"):  # the start, or a return to it
                k += words[k] == "back"
                if take(len(start) + 2) != state(start).split():
                    return False
                nums = list(start)
            elif words[k] in ("+", "*", "-", "/") and nums is not None and len(nums) == 2:  # a leaf
                op, w, verdict = take(3)
                value = dict(moves(max(nums), min(nums))).get(op)
                if int(w) != value or verdict != ("yes" if value == problem.target else "no"):
                    return False
            else:  # a move: a op b = v [ x y ]
                a, op, b, eq, v = take(5)
                a, b, v = int(a), int(b), int(v)
                rest = list(nums)
                rest.remove(a), rest.remove(b)
                if eq != "=" or a < b or dict(moves(a, b)).get(op) != v or take(4) != state(rest + [v]).split():
                    return False
                nums = rest + [v]
        return cd.reward(" ".join(words[k:]), problem) == 1.0
    except (ValueError, TypeError, IndexError):
        return False


# ---------------------------------------------------------------------------------------
# Tokenizer, data and model


def build_tokenizer() -> Tokenizer:
    """Word-level: the trace words and every integer 0..999 are single tokens."""
    vocab = SPECIALS + WORDS + [str(n) for n in range(MAX_NUM + 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    return tok


def split_problems(seed: int, n_test: int, n_train: int = 300_000):
    """countdown.splits at the TINY difficulty: the held-out problems come first in the seed's
    stream, so train.py and eval.py (same seed, at most n_test problems) evaluate on problems
    pretraining never saw."""
    return cd.splits(seed, n_train, n_test, cd.TINY, unique=False)


def batches(tok, problems, rng, n: int, micro: int):
    """n random training examples as micro-batches of similar length: (tokens, targets),
    targets -100 on the prompt and padding, so only the completion and EOS are learned."""
    eos = tok.token_to_id("<eos>")
    examples = []
    for p in (problems[rng.randrange(len(problems))] for _ in range(n)):
        # Half the prompts carry a random budget tag (it says nothing yet) so that
        # train.py --interoception starts from a model that has read it.
        rate = rng.randrange(101) / 100 if rng.random() < 0.5 else None
        prompt = tok.encode(tiny_prompt(p, rate)).ids
        examples.append((prompt, tok.encode(trace(p)).ids + [eos]))
    examples.sort(key=lambda e: len(e[0]) + len(e[1]))
    for i in range(0, n, micro):
        chunk = examples[i: i + micro]
        T = max(len(a) + len(b) for a, b in chunk)
        x = torch.zeros(len(chunk), T, dtype=torch.long)
        y = torch.full((len(chunk), T), -100, dtype=torch.long)
        for r, (a, b) in enumerate(chunk):
            x[r, : len(a) + len(b)] = torch.tensor(a + b)
            y[r, len(a) - 1: len(a) + len(b) - 1] = torch.tensor(b)
        yield x, y


def tiny_config(tok, d=192, layers=4, heads=4, kv_heads=2, ffn=512) -> Qwen2Config:
    return Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=d, intermediate_size=ffn,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       tie_word_embeddings=True, max_position_embeddings=1024,
                       bos_token_id=tok.token_to_id("<bos>"), eos_token_id=tok.token_to_id("<eos>"))


# ---------------------------------------------------------------------------------------
# Evaluation


def trace_accuracy(model, tok, problems, eviction=None, max_new_tokens=400, batch=128):
    """Greedy accuracy (mean reward), the fraction of completions that replay as correct
    traces, and the mean completion length."""
    out = solve(model, tok, problems, Sampling(max_new_tokens=max_new_tokens, greedy=True), eviction,
                encode=lambda t, p: t.encode(tiny_prompt(p)).ids, batch_size=batch)
    valid = sum(replay_trace(p, texts[0]) for p, texts in zip(problems, out["texts"]))
    return out["reward"].mean().item(), valid / len(problems), out["length"].mean().item()


# ---------------------------------------------------------------------------------------
# Pretraining


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tiny", help="output directory (written via a temporary dir, then renamed)")
    ap.add_argument("--seed", type=int, default=0, help="seed for the problems, the weights and the batches")
    ap.add_argument("--steps", type=int, default=1000, help="optimizer steps; the lr schedule spans them")
    ap.add_argument("--minutes", type=float, default=0, help="stop early after this many minutes (0 = never); "
                    "an early stop makes the result depend on the machine's speed")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the bits of the result depend on it)")
    ap.add_argument("--batch", type=int, default=64, help="examples per optimizer step")
    ap.add_argument("--micro", type=int, default=16, help="examples per forward pass (length-sorted)")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (warmup, then cosine to 10%%)")
    ap.add_argument("--warmup", type=int, default=100, help="warmup steps")
    ap.add_argument("--d", type=int, default=192, help="hidden size")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers")
    ap.add_argument("--heads", type=int, default=4, help="query heads (2 key/value heads)")
    ap.add_argument("--ffn", type=int, default=512, help="MLP intermediate size")
    ap.add_argument("--n-test", type=int, default=500, help="held-out problems to evaluate on")
    ap.add_argument("--train-problems", type=int, default=300_000, help="distinct training problems drawn")
    ap.add_argument("--eval-only", action="store_true", help="evaluate --out instead of training")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train, test = split_problems(args.seed, args.n_test, args.train_problems)

    if args.eval_only:
        model, tok = from_pretrained(args.out), load_tokenizer(args.out)
        report(model, tok, test)
        return

    tok = build_tokenizer()
    model = init_weights(Qwen2(tiny_config(tok, args.d, args.layers, args.heads, ffn=args.ffn)), seed=args.seed)
    print(f"{num_params(model) / 1e6:.2f}M parameters, {len(train)} training / {len(test)} held-out problems")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    rng, t0, seen = random.Random(args.seed), time.time(), 0
    bar = tqdm(range(args.steps), desc="pretrain")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        micro = list(batches(tok, train, rng, args.batch, args.micro))
        n_targets = sum(int((y != -100).sum()) for _, y in micro)
        total = 0.0
        for x, y in micro:
            pos = torch.arange(x.shape[1]).expand_as(x)
            logits = model.logits(model(x, pos))
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum") / n_targets
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += sum(x.numel() for x, _ in micro)
        bar.set_postfix(loss=f"{total:.4f}", tokens=f"{seen / 1e6:.1f}M")
        if args.minutes and time.time() - t0 > 60 * args.minutes:
            print(f"stopping early at step {step + 1} (--minutes {args.minutes})")
            break
    print(f"pretraining: {(time.time() - t0) / 60:.1f} min, {seen / 1e6:.1f}M tokens, final loss {total:.4f}")

    tmp = args.out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model.to(torch.bfloat16), tmp)  # bf16 on disk keeps the files small
    tok.save(os.path.join(tmp, "tokenizer.json"))
    write_run_defaults(tmp)
    if os.path.exists(args.out):  # swap in the new directory, then drop the old one
        os.rename(args.out, tmp + ".old")
    os.rename(tmp, args.out)
    shutil.rmtree(tmp + ".old", ignore_errors=True)
    report(from_pretrained(args.out), load_tokenizer(args.out), test)  # the weights as shipped


def write_run_defaults(model_dir):
    with open(os.path.join(model_dir, "ngc.json"), "w") as f:
        json.dump(TINY_RUN, f, indent=1)
        f.write("\n")


def report(model, tok, test):
    acc, valid, length = trace_accuracy(model, tok, test)
    print(f"full cache:  accuracy {acc:.3f}  valid traces {valid:.3f}  mean length {length:.0f}  ({len(test)} held out)")
    ev = Eviction(TINY_RUN["delta"], TINY_RUN["block"], TINY_RUN["window"], rate=0.5, greedy=True)
    acc, valid, length = trace_accuracy(model, tok, test, ev)
    print(f"ngc-greedy δ={ev.delta} b={ev.block} w={ev.window} ε={ev.rate}:  accuracy {acc:.3f}  "
          f"valid traces {valid:.3f}  mean length {length:.0f}")


if __name__ == "__main__":
    main()
