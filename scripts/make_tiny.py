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
import json
import math
import os
import random
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
from lib import mathtask, settings
from lib.checkpoint import load, save_pretrained
from lib.cli import (Error, at_least, check_values, exits, make_output_dir, one_line_errors, parser,
                     positive)
from lib.files import recover_swap, swap_in, write_text
from evaluation.scoring import roll_out_and_score
from lib.tasks import TASK_REWARD, prompt_encoder

# `train.py --task countdown`'s default run on this model (tiny/ngc.json): searches that leave
# their first pair, 96 tokens, δ = 20 (prompts of 18); ε -> 0.5, 2.3-2.4x on the samples'
# completions; 120 steps of 8 x 8 rollouts, as results/toy/rows.md chose.
TINY_RUN = dict(
    task="countdown", prompt="tiny-shift", difficulty="tiny-deep", train_problems=20_000,
    eval_problems=None, seed=0, steps=120, prompts=8, group=8, max_new_tokens=96,
    temperature=1.0, top_k=0, delta=20, block=4, window=4, retention="0.9,0.7,0.5",
    stage_steps=10, alpha=0.6, mem_norm="joint", interoception_rates="0.35,0.55,0.75",
    eviction_temperature=0.25, lr=1e-4, beta2=0.99, adam_eps=1e-8, micro_batch=32,
    eval_every=120, eval_batch=200, save_every=10)
# `train.py --task math`'s default run on tiny-math/: prompts of 29-33 tokens, so the first round
# (δ = 32) comes as the question ends.
MATH_RUN = dict(
    task="math", data="data/math-demo/train.jsonl", eval_data="data/math-demo/test.jsonl", seed=0,
    steps=60, prompts=16, group=8, max_new_tokens=128, temperature=1.0, top_k=0, top_p=1.0,
    min_length=0, delta=32, block=4, window=4, retention="0.9,0.7,0.5", stage_steps=10,
    alpha=0.6, lr=1e-4, beta2=0.99, adam_eps=1e-8, micro_batch=32, eval_every=60, eval_batch=200,
    save_every=10, eval_max_new_tokens=128, eval_samples=None)  # eval.py: greedy, as for tiny/
FLAGS = {  # name: (type, default: Countdown's, rule, help); None: the task's run (ngc.json)
    "out": (str, "tiny", None, "output directory, replaced whole; refused if it holds more"),
    "seed": (int, 0, None, "seed for the problems, the weights and the batches"),
    "steps": (int, 1000, at_least(1), "optimizer steps; the lr schedule spans them"),
    "threads": (int, 1, settings.RULES["threads"], "torch CPU threads (the bits depend on it)"),
    "batch": (int, 64, at_least(1), "examples per optimizer step"),
    "micro": (int, 16, at_least(1), "examples per forward pass (length-sorted)"),
    "lr": (float, 2e-3, positive, "peak learning rate (warmup, then cosine to 10%)"),
    "warmup": (int, 100, at_least(0), "warmup steps"),
    "d": (int, 192, at_least(1), "hidden size"),
    "layers": (int, 4, at_least(1), "decoder layers"),
    "heads": (int, 4, at_least(1), "query heads (2 key/value heads)"),
    "ffn": (int, 512, at_least(1), "MLP intermediate size"),
    "n_test": (int, 500, at_least(1), "held-out problems to evaluate on"),
    "train_problems": (int, 300_000, at_least(1), "distinct training problems drawn"),
    "shuffle_order": (float, 0.5, lambda v: 0 <= v <= 1 or "must lie in [0, 1]",
                      "Countdown: the probability that a trace shuffles its moves' order"),
    "max_new_tokens": (int, None, at_least(1), "the run's completion cap in ngc.json"),
    "delta": (int, None, None, "the run's δ in ngc.json"),
    "retention": (str, None, None, "the run's curriculum in ngc.json (evaluated at its last ε)"),
}
# --task math's defaults where they differ: a smaller model, more steps of smaller batches
MATH_BUILD = dict(
    out="tiny-math", steps=1440, batch=32, lr=3e-3, warmup=120, d=128, ffn=384, n_test=200,
    train_problems=20_000, shuffle_order=0.0)
# the probability that a Countdown trace restates the target after a `[ ... ]` or a `back`
RESTATE = 0.25
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
WORDS = ["Countdown", ":", "reach", "with", ".", "[", "]", "+", "*", "-", "/", "=", "no", "yes",
         "back", "<answer>", "</answer>", "(", ")", "<eviction_rate>", "%", "</eviction_rate>",
         "none"]  # written no more (the earlier models' failed search): tiny/'s vocabulary
# the demo questions' words without their placeholders, R1's instruction, the traces'
MATH_WORDS = sorted(
    {w for text, _, _ in mathtask.TEMPLATES for w in text.split()} - {"{n}", "{a}", "{b}", "{c}"}
    | set(mathtask.NAMES) | set(mathtask.INSTRUCTION.split())
    | {":", ",", ".", "so", "+", "-", "/", "=", "\\boxed", "{", "}"})
OUT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "ngc.json"}  # a build's files


def build_tokenizer(words=WORDS) -> Tokenizer:
    """Word-level: the words and every integer 0..cd.MAX_LEAF are single tokens."""
    vocab = SPECIALS + words + [str(n) for n in range(cd.MAX_LEAF + 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    return tok


def split_problems(seed: int, n_test: int, n_train: int = 300_000):
    """countdown.splits at the tiny difficulty: pretraining never sees a held-out problem."""
    return cd.splits(seed, n_train, n_test, cd.SMALL, unique=False)


def countdown_example(tok, problem, rng, shuffle=0.0):
    """(prompt ids, completion ids) in tiny/'s prompt style, half with a budget tag of a random
    whole percent (half of those blind) for train.py --interoception; see countdown.trace."""
    rate = rng.randrange(101) / 100 if rng.random() < 0.5 else None
    blind = rate is not None and rng.random() < 0.5
    prompt = cd.encode(tok, problem, TINY_RUN["prompt"], rate, blind)
    return prompt, tok.encode(cd.trace(problem, RESTATE, rng, shuffle)).ids


def math_example(tok, problem, rng):
    """(prompt ids, completion ids): the prompt exactly as train.py --task math encodes it."""
    return mathtask.encode(tok, problem), tok.encode(mathtask.demo_trace(problem)).ids


def batches(tok, problems, rng, n: int, micro: int, example=countdown_example):
    """n random examples as length-sorted micro-batches (tokens, targets): only the completion and
    EOS are learned (-100 elsewhere)."""
    eos = tok.token_to_id("<eos>")
    examples = []
    for _ in range(n):
        prompt, completion = example(tok, problems[rng.randrange(len(problems))], rng)
        examples.append((prompt, completion + [eos]))
    examples.sort(key=lambda e: len(e[0]) + len(e[1]))
    for first in range(0, n, micro):
        chunk = examples[first: first + micro]
        width = max(len(prompt) + len(completion) for prompt, completion in chunk)
        tokens = torch.zeros(len(chunk), width, dtype=torch.long)
        targets = torch.full((len(chunk), width), -100, dtype=torch.long)
        for row, (prompt, completion) in enumerate(chunk):
            end = len(prompt) + len(completion)
            tokens[row, :end] = torch.tensor(prompt + completion)
            targets[row, len(prompt) - 1: end - 1] = torch.tensor(completion)
        yield tokens, targets


@dataclass(frozen=True)
class Task:
    words: list  # the tokenizer's words besides the specials and the integers
    splits: Callable  # (seed, n_test, n_train) -> (train, held-out) problems
    example: Callable  # (tokenizer, problem, rng) -> (prompt ids, completion ids) to pretrain on
    valid: Callable  # (problem, completion text) -> whether it is a correct trace
    run: dict  # ngc.json: train.py's default run on the model


TASKS = {
    "countdown": Task(WORDS, split_problems, countdown_example, cd.check_trace, TINY_RUN),
    "math": Task(MATH_WORDS,
                 lambda seed, n_test, n_train: mathtask.demo_splits(seed, n_train, n_test),
                 math_example, lambda p, text: text == mathtask.demo_trace(p), MATH_RUN),
}


@exits(memory="lower --batch")  # bad input, out of memory, a signal: one line
def main(argv=None):
    args = parse_args(argv)
    task = TASKS[args.task]
    with one_line_errors():
        check_flags(args)
        run, cfg = ngc_run(task, args)
        pretraining, test = draw_problems(task, args)
        check_out(args.out)
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
    report(model, tok, test, task, cfg)


def parse_args(argv):
    ap = parser(__doc__)
    for name, (kind, default, _, text) in FLAGS.items():
        shown = ("the task's" if default is None else f"{default}" + (
            f"; --task math: {MATH_BUILD[name]}" if name in MATH_BUILD else ""))
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind,
                        help=f"{text} (default {shown})".replace("%", "%%"))
    ap.add_argument("--task", choices=sorted(TASKS), default="countdown",
                    help="countdown (tiny/) or math (tiny-math/)")
    args = ap.parse_args(argv)
    defaults = {name: default for name, (_, default, _, _) in FLAGS.items()}
    for name, default in {**defaults, **(MATH_BUILD if args.task == "math" else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def check_flags(args):
    check_values(args, {name: rule for name, (_, _, rule, _) in FLAGS.items() if rule})
    if args.task == "math" and args.shuffle_order:
        raise Error("--shuffle-order is Countdown's (tiny/): --task math has no search")
    if args.heads % 2 or args.d % args.heads or (args.d // args.heads) % 2:
        raise Error(f"--d {args.d} --heads {args.heads}: the heads must be a multiple of the 2 "
                    f"key/value heads, and --d of 2 x --heads (an even head size for RoPE)")


def ngc_run(task, args):
    """(ngc.json's run, its settings): the task's run with the run's flags over it, checked."""
    flags = {k: getattr(args, k) for k in ("max_new_tokens", "delta", "retention")}
    run = {**task.run, **{k: value for k, value in flags.items() if value is not None}}
    cfg = settings.from_dict(run, settings.RECIPES[run["task"]])
    if args.retention is not None:
        run["retention"] = settings.written(cfg.retention)
    if not all(0 <= rho < 1 for rho in cfg.retention):
        raise Error(f"the run's retention {run['retention']} must lie in [0, 1) (ε = 1 - ρ)")
    settings.eviction(cfg, 1 - cfg.retention[-1])  # δ, b, w and the last ε
    return run, cfg


def check_out(out: str):
    """A build replaces --out whole: refuse a path that holds what a build did not write."""
    if not str(out).strip():
        raise Error("--out is empty; give the directory to build the model in")
    if os.path.exists(out) and not os.path.isdir(out):
        raise Error(f"--out {out} is a file; give a directory (a build replaces it whole)")
    other = sorted(set(os.listdir(out)) - OUT_FILES) if os.path.isdir(out) else []
    if other:
        raise Error(f"--out {out} holds {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}, "
                    f"which a build would delete; choose another --out")
    make_output_dir(os.path.dirname(os.path.abspath(out)))  # <out>.tmp/ is written beside it


def draw_problems(task, args):
    if args.task == "countdown" and args.n_test > cd.SMALL.held_out:
        raise Error(f"--n-test {args.n_test}: the tiny difficulty's held-out set "
                    f"(countdown.held_out) has {cd.SMALL.held_out} problems; ask for fewer")
    try:
        return task.splits(args.seed, args.n_test, args.train_problems)
    except ValueError as e:  # mathtask.demo_splits: train and held-out problems distinct
        raise Error(f"--train-problems {args.train_problems} --n-test {args.n_test}: {e}")


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup)
                                                 / max(1, steps - warmup))))


def pretrain(model, tok, problems, example, args):
    """Next-token prediction: AdamW (weight decay on the matrices), gradients clipped at 1."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    rng, start, seen = random.Random(args.seed), time.time(), 0
    bar = tqdm(range(args.steps), desc="pretrain")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        micro = list(batches(tok, problems, rng, args.batch, args.micro, example))
        loss = backward(model, micro)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += sum(tokens.numel() for tokens, _ in micro)
        bar.set_postfix(loss=f"{loss:.4f}", tokens=f"{seen / 1e6:.1f}M")
    print(f"pretraining: {(time.time() - start) / 60:.1f} min, {seen / 1e6:.1f}M tokens, "
          f"final loss {loss:.4f}")


def backward(model, micro) -> float:
    """Accumulate the gradient of a batch's mean completion-token loss; return the loss."""
    n_targets = sum(int((targets != -100).sum()) for _, targets in micro)
    total = 0.0
    for tokens, targets in micro:
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = model.logits(model(tokens, pos))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                               reduction="sum") / n_targets
        loss.backward()
        total += loss.item()
    return total


def save_build(model, tok, run, out):
    """The four files, written into <out>.tmp/ and swapped in whole (files.swap_in)."""
    final = out.rstrip("/")
    recover_swap(final)  # an earlier build's leftovers
    try:
        save_pretrained(model.to(torch.bfloat16), final + ".tmp")  # bf16 keeps the files small
        tok.save(os.path.join(final + ".tmp", "tokenizer.json"))
        write_text(os.path.join(final + ".tmp", "ngc.json"), json.dumps(run, indent=1) + "\n")
        swap_in(final)
    except OSError as e:
        recover_swap(final)
        raise Error(f"could not write {out} ({e.strerror or e}); nothing half-written is left")


def report(model, tok, test, task, cfg):
    """Accuracy (greedy, and pass@1 sampled as train.py's evaluations sample), valid traces and
    mean length, with the full cache and at the run's final ε (greedy top-K)."""
    eviction = settings.eviction(cfg, 1 - cfg.retention[-1], greedy=True)
    encode, reward = prompt_encoder(cfg.task, cfg.prompt), TASK_REWARD[cfg.task]
    evicting = f"ngc-greedy δ={cfg.delta} b={cfg.block} w={cfg.window} ε={eviction.rate}"
    for name, evicted in [("full cache", None), (evicting, eviction)]:
        for tokens, greedy in [("greedy tokens", True), ("pass@1", False)]:
            sampling = settings.sampling(cfg, held_out=True, greedy=greedy)
            out = roll_out_and_score(model, tok, test, sampling, evicted, encode=encode,
                                     reward_fn=reward, batch_size=128,
                                     generator=torch.Generator().manual_seed(0))
            valid = sum(task.valid(p, texts[0]) for p, texts in zip(test, out["texts"])) / len(test)
            print(f"{name}, {tokens}:  accuracy {out['reward'].mean().item():.3f}  "
                  f"valid traces {valid:.3f}  mean length {out['length'].mean().item():.0f}  "
                  f"({len(test)} held out, at most {cfg.max_new_tokens} tokens)")


if __name__ == "__main__":
    main()
