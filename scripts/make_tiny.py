"""Build the tiny reasoners shipped in tiny/ (Countdown) and tiny-math/ (word problems): traces,
a word-level tokenizer, a 1-2M-parameter Qwen2 and its next-token pretraining on the CPU.

    python scripts/make_tiny.py              # rebuild tiny/ (about 35 minutes on one core)
    python scripts/make_tiny.py --task math  # rebuild tiny-math/ (about 15 minutes on one core)
    python scripts/make_tiny.py --steps 300 --out runs/tiny-smoke

Countdown: the model learns to write a depth-first search (countdown.trace) whose every leaf needs
the prompt's target, its moves tried in a shuffled order half the time (the order is what RL
improves); a bare `back`, shifted prompt layouts and the target restated with probability RESTATE
make what a cache must keep more than the one fact a hand-written rule knows about
(docs/departures.md). Math: mathtask.py's demo word problems, solved step by step
(mathtask.demo_trace). With the same flags, torch (2.13.0, CPU wheel) and kind of CPU it writes
the same files byte for byte: tiny/ and tiny-math/ are the defaults of each task.
"""
import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from tqdm import tqdm

# the repository root first
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import countdown as cd
from model import Qwen2, Qwen2Config, init_weights
from ngc import Sampling, check_eviction
from lib import mathtask, settings
from lib.checkpoint import load, save_pretrained
from lib.cli import (Error, at_least, check_values, exits, make_output_dir, one_line_errors, parser,
                     positive)
from lib.files import recover_swap, swap_in, write_text
from lib.scoring import roll_out_and_score
from lib.settings import add_flags
from lib.tasks import TASK_REWARD, prompt_encoder

# The default run of `python train.py --task countdown` on this model (tiny/ngc.json): the
# searches that must leave their first pair, capped at 96 tokens (prompts of 18; δ = 20, so the
# first round follows the prompt); 120 steps of 8 x 8 rollouts, τ = 0.25 and ε -> 0.55, just
# stricter than ε* = 0.51 (results/deep/budget.json), as results/toy chose (rows.md, the default
# run's steps and group shape: at equal rollouts 8 x 8 for 120 steps kept more).
TINY_RUN = dict(
    task="countdown", prompt="tiny-shift", difficulty="tiny-deep", train_problems=20_000,
    eval_problems=None, seed=0,
    steps=120, prompts=8, group=8, max_new_tokens=96, temperature=1.0, top_k=0,
    delta=20, block=4, window=4, retention="0.9,0.7,0.45", stage_steps=10, alpha=0.6,
    mem_norm="joint",
    interoception_rates="0.35,0.55,0.75", eviction_temperature=0.25,
    lr=1e-4, beta2=0.99, adam_eps=1e-8, micro_batch=32, eval_every=120, eval_batch=200,
    save_every=10,
)
# The default run of `python train.py --task math` on tiny-math/ (tiny-math/ngc.json), on the demo
# set: prompts of 29-33 tokens, completions of 22-80, so the first round comes as the question
# ends (δ = 32) and c must outlive it.
MATH_RUN = dict(
    task="math", data="data/math-demo/train.jsonl", eval_data="data/math-demo/test.jsonl", seed=0,
    steps=60, prompts=16, group=8, max_new_tokens=128, temperature=1.0, top_k=0, top_p=1.0,
    min_length=0,
    delta=32, block=4, window=4, retention="0.9,0.7,0.5", stage_steps=10, alpha=0.6,
    lr=1e-4, beta2=0.99, adam_eps=1e-8, micro_batch=32, eval_every=60, eval_batch=200,
    save_every=10,
    eval_max_new_tokens=128, eval_samples=None,  # eval.py: greedy, as for tiny/
)
# --task math's defaults where they differ: a smaller model, more steps of smaller batches
MATH_BUILD = dict(
    out="tiny-math", steps=1440, batch=32, lr=3e-3, warmup=120, d=128, ffn=384, n_test=200,
    train_problems=20_000, shuffle_order=0.0)
# the probability that a Countdown trace restates the target after a `[ ... ]` or a `back`
RESTATE = 0.25
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
WORDS = ["Countdown", ":", "reach", "with", ".", "[", "]", "+", "*", "-", "/", "=", "no", "yes",
         "back", "<answer>", "</answer>", "(", ")", "<eviction_rate>", "%", "</eviction_rate>",
         # `none`, the earlier models' failed search, is written no more: it keeps tiny/'s
         # vocabulary as shipped
         "none"]
# the demo questions' words without their placeholders, R1's instruction, the traces'
MATH_WORDS = sorted(
    {w for text, _, _ in mathtask.TEMPLATES for w in text.split()} - {"{n}", "{a}", "{b}", "{c}"}
    | set(mathtask.NAMES) | set(mathtask.INSTRUCTION.split())
    | {":", ",", ".", "so", "+", "-", "/", "=", "\\boxed", "{", "}"})
AT_LEAST = {"steps": 1, "threads": 1, "batch": 1, "micro": 1, "warmup": 0, "d": 1, "layers": 1,
            "heads": 1, "ffn": 1, "n_test": 1, "train_problems": 1, "max_new_tokens": 1}
# the flags that write ngc.json's run (TINY_RUN's by default)
RUN_FLAGS = ["max_new_tokens", "delta", "retention"]
# what a build writes into --out
OUT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "ngc.json"}


def build_tokenizer(words=WORDS) -> Tokenizer:
    """Word-level: the words and every integer 0..cd.MAX_LEAF (the largest a trace writes) are
    single tokens."""
    vocab = SPECIALS + words + [str(n) for n in range(cd.MAX_LEAF + 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    return tok


def split_problems(seed: int, n_test: int, n_train: int = 300_000):
    """countdown.splits at the tiny difficulty: pretraining never sees a problem of the held-out
    set."""
    return cd.splits(seed, n_train, n_test, cd.SMALL, unique=False)


def countdown_example(tok, problem, rng, shuffle=0.0):
    """(prompt ids, completion ids) in tiny/'s prompt style. Half the prompts carry a budget tag of
    a random whole percent, half of those blind, so that train.py --interoception and its control
    start from a model that has read it; the trace restates the target with probability RESTATE,
    its moves shuffled with probability shuffle (countdown.trace)."""
    rate = rng.randrange(101) / 100 if rng.random() < 0.5 else None
    blind = rate is not None and rng.random() < 0.5
    prompt = cd.encode(tok, problem, TINY_RUN["prompt"], rate, blind)
    return prompt, tok.encode(cd.trace(problem, RESTATE, rng, shuffle)).ids


def math_example(tok, problem, rng):
    """(prompt ids, completion ids): the prompt exactly as train.py --task math encodes it."""
    return mathtask.encode(tok, problem), tok.encode(mathtask.demo_trace(problem)).ids


def batches(tok, problems, rng, n: int, micro: int, example=countdown_example):
    """n random training examples as micro-batches of similar length: (tokens, targets),
    targets -100 on the prompt and padding, so only the completion and EOS are learned."""
    eos = tok.token_to_id("<eos>")
    examples = []
    for _ in range(n):
        prompt, completion = example(tok, problems[rng.randrange(len(problems))], rng)
        examples.append((prompt, completion + [eos]))
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


@dataclass(frozen=True)
class Task:
    words: list  # the tokenizer's words besides the specials and the integers
    splits: Callable  # (seed, n_test, n_train) -> (train, held-out) problems
    example: Callable  # (tokenizer, problem, rng) -> (prompt ids, completion ids) to pretrain on
    valid: Callable  # (problem, completion text) -> whether it is a correct trace
    run: dict  # ngc.json: train.py's default run on the model
    flags: dict  # this script's defaults that differ from Countdown's


TASKS = {
    "countdown": Task(WORDS, split_problems, countdown_example, cd.check_trace, TINY_RUN, {}),
    "math": Task(MATH_WORDS,
                 lambda seed, n_test, n_train: mathtask.demo_splits(seed, n_train, n_test),
                 math_example, lambda p, text: text == mathtask.demo_trace(p), MATH_RUN,
                 MATH_BUILD),
}


@exits(memory="lower --batch")  # bad input, out of memory, a signal: one line
def main(argv=None):
    args = parse_args(argv)
    task = TASKS[args.task]
    with one_line_errors():
        check_flags(args)
        run, c = ngc_run(task, args)
        pretraining, test = draw_problems(task, args)
        check_out(args.out)
        # <out>.tmp/ is written beside <out>
        make_output_dir(os.path.dirname(os.path.abspath(args.out)))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = build_tokenizer(task.words)
    config = Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=args.d,
                         intermediate_size=args.ffn, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=2,
                         tie_word_embeddings=True, max_position_embeddings=1024,
                         bos_token_id=tok.token_to_id("<bos>"),
                         eos_token_id=tok.token_to_id("<eos>"))
    model = init_weights(Qwen2(config), seed=args.seed)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{len(pretraining)} training / {len(test)} held-out problems")
    example = (partial(task.example, shuffle=args.shuffle_order) if args.shuffle_order
               else task.example)
    pretrain(model, tok, pretraining, example, args)
    save_build(model, tok, run, args.out)
    model, tok = load(args.out)  # evaluated as shipped
    report(model, tok, test, task, c)


def parse_args(argv) -> argparse.Namespace:
    """The flags, their defaults the task's (MATH_BUILD for --task math)."""
    ap = parser(__doc__)
    ap.add_argument("--out", default="tiny",
                    help="output directory, replaced whole (one holding other files: refused)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed for the problems, the weights and the batches")
    ap.add_argument("--steps", type=int, default=1000,
                    help="optimizer steps; the lr schedule spans them")
    add_flags(ap, None, names=["threads"],
              helps={"threads": "torch CPU threads (default 1; the bits depend on it)"})
    ap.add_argument("--batch", type=int, default=64, help="examples per optimizer step")
    ap.add_argument("--micro", type=int, default=16,
                    help="examples per forward pass (length-sorted)")
    ap.add_argument("--lr", type=float, default=2e-3,
                    help="peak learning rate (warmup, then cosine to 10%%)")
    ap.add_argument("--warmup", type=int, default=100, help="warmup steps")
    ap.add_argument("--d", type=int, default=192, help="hidden size")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers")
    ap.add_argument("--heads", type=int, default=4, help="query heads (2 key/value heads)")
    ap.add_argument("--ffn", type=int, default=512, help="MLP intermediate size")
    ap.add_argument("--n-test", type=int, default=500, help="held-out problems to evaluate on")
    ap.add_argument("--train-problems", type=int, default=300_000,
                    help="distinct training problems drawn")
    ap.add_argument("--shuffle-order", type=float, default=0.5,
                    help="Countdown: the probability that a trace tries "
                    "its moves in a shuffled order (default 0.5: tiny/'s)")
    ap.add_argument("--max-new-tokens", type=int,
                    help="the run's completion cap in ngc.json (default: the task's)")
    ap.add_argument("--delta", type=int, help="the run's δ in ngc.json (default: the task's)")
    ap.add_argument("--retention",
                    help="the run's curriculum in ngc.json; the evaluation's ε is 1 - its last")
    add_flags(ap, None, names=["task"],
              helps={"task": "countdown (tiny/) or math (tiny-math/: MATH_BUILD)"})
    pre = parser(add_help=False)
    add_flags(pre, None, names=["task"])
    task = pre.parse_known_args(argv)[0].task or "countdown"
    ap.set_defaults(**TASKS[task].flags, task=task, threads=1)
    return ap.parse_args(argv)


def check_flags(args):
    """A one-line ValueError for the first flag a build cannot use."""
    check_values(args, {**{name: at_least(low) for name, low in AT_LEAST.items()}, "lr": positive})
    if not 0 <= args.shuffle_order <= 1:
        raise ValueError(f"--shuffle-order {args.shuffle_order} must lie in [0, 1]: "
                         f"it is a probability")
    if args.task == "math" and args.shuffle_order:
        raise ValueError("--shuffle-order is Countdown's (tiny/): --task math has no search")
    if args.heads % 2 or args.d % args.heads or (args.d // args.heads) % 2:
        raise ValueError(f"--d {args.d} --heads {args.heads}: the heads must be a multiple of the "
                         f"2 key/value heads, and --d a multiple of 2 x --heads "
                         f"(an even head size for RoPE)")


def ngc_run(task, args):
    """(ngc.json's run, its settings): the task's run with RUN_FLAGS over it, checked as train.py
    would."""
    run = dict(task.run)
    run.update({k: getattr(args, k) for k in RUN_FLAGS if getattr(args, k) is not None})
    c = settings.from_dict(run, settings.RECIPES[run["task"]])
    if args.retention is not None:
        run["retention"] = settings.written(c.retention)
    if not all(0 <= rho < 1 for rho in c.retention):
        raise ValueError(f"the run's retention {run['retention']} must lie in [0, 1) "
                         f"(ε = 1 - ρ, in (0, 1])")
    check_eviction(c.delta, c.block, c.window, 1 - c.retention[-1])
    return run, c


def check_out(out: str):
    """A build replaces --out whole: refuse a path whose contents a build did not write (they would
    be lost)."""
    if not str(out).strip():
        raise ValueError("--out is empty; give the directory to build the model in")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file; give a directory (a build replaces it whole)")
    if os.path.isdir(out):
        other = sorted(set(os.listdir(out)) - OUT_FILES)
        if other:
            raise ValueError(f"--out {out} holds {', '.join(other[:3])}"
                             f"{' ...' if len(other) > 3 else ''}, which a build would delete "
                             f"(it replaces the directory whole); choose another --out")


def draw_problems(task, args):
    """(pretraining problems, held-out problems), none of the held-out ones among the others; a
    one-line ValueError when the task cannot draw as many."""
    if args.task == "countdown" and args.n_test > cd.SMALL.held_out:
        raise ValueError(f"--n-test {args.n_test}: the tiny difficulty's held-out set "
                         f"(countdown.held_out) has {cd.SMALL.held_out} problems; "
                         f"ask for at most that many")
    try:
        return task.splits(args.seed, args.n_test, args.train_problems)
    except ValueError as e:  # mathtask.demo_splits: train and held-out problems distinct
        raise ValueError(f"--train-problems {args.train_problems} --n-test {args.n_test}: {e}")


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup)
                                                 / max(1, steps - warmup))))


def pretrain(model, tok, problems, example, args):
    """Next-token prediction on --steps batches of --batch examples: AdamW (weight decay on the
    matrices), lr_at's schedule, gradients clipped at norm 1."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    rng, t0, seen = random.Random(args.seed), time.time(), 0
    bar = tqdm(range(args.steps), desc="pretrain")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        micro = list(batches(tok, problems, rng, args.batch, args.micro, example))
        loss = backward(model, micro)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += sum(x.numel() for x, _ in micro)
        bar.set_postfix(loss=f"{loss:.4f}", tokens=f"{seen / 1e6:.1f}M")
    print(f"pretraining: {(time.time() - t0) / 60:.1f} min, {seen / 1e6:.1f}M tokens, "
          f"final loss {loss:.4f}")


def backward(model, micro) -> float:
    """Accumulate the gradient of one batch's loss, given as micro-batches: the summed cross-entropy
    of its completion tokens over their count. Returns the loss."""
    n_targets = sum(int((y != -100).sum()) for _, y in micro)
    total = 0.0
    for x, y in micro:
        pos = torch.arange(x.shape[1]).expand_as(x)
        logits = model.logits(model(x, pos))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100,
                               reduction="sum") / n_targets
        loss.backward()
        total += loss.item()
    return total


def save_build(model, tok, run, out):
    """The four files, written into <out>.tmp/ and swapped in whole: --out is the new build, or (a
    full disk) the one before it, never half of one."""
    path = out.rstrip("/")
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_pretrained(model.to(torch.bfloat16), tmp)  # bf16 on disk keeps the files small
        tok.save(os.path.join(tmp, "tokenizer.json"))
        write_text(os.path.join(tmp, "ngc.json"), json.dumps(run, indent=1) + "\n")
        swap_in(path)
    except OSError as e:
        recover_swap(path)
        raise Error(f"could not write {out} ({e.strerror or e}); nothing half-written is left")


def report(model, tok, test, task, c):
    """Accuracy (greedy tokens, and pass@1 of one sample at temperature 1, seed 0), the fraction of
    correct traces and the mean length, with the full cache and at the run's final ε."""
    rate = 1 - c.retention[-1]  # the curriculum's last stage
    ev, max_new_tokens = settings.eviction(c, rate, greedy=True), c.max_new_tokens
    # as train.py's evaluations
    encode, reward = prompt_encoder(c.task, c.prompt), TASK_REWARD[c.task]
    evicting = f"ngc-greedy δ={ev.delta} b={ev.block} w={ev.window} ε={ev.rate}"
    for name, eviction in [("full cache", None), (evicting, ev)]:
        for tokens, greedy in [("greedy tokens", True), ("pass@1", False)]:
            sampling = Sampling(max_new_tokens=max_new_tokens, greedy=greedy, temperature=1.0)
            out = roll_out_and_score(model, tok, test, sampling, eviction, encode=encode,
                                     reward_fn=reward, batch_size=128,
                                     generator=torch.Generator().manual_seed(0))
            valid = sum(task.valid(p, texts[0]) for p, texts in zip(test, out["texts"])) / len(test)
            print(f"{name}, {tokens}:  accuracy {out['reward'].mean().item():.3f}  "
                  f"valid traces {valid:.3f}  mean length {out['length'].mean().item():.0f}  "
                  f"({len(test)} held out, at most {max_new_tokens} tokens)")


if __name__ == "__main__":
    main()
