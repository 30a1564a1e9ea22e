"""Held-out evaluation of a checkpoint: NGC against the baselines (paper §5.1, Figure 3; §5.4,
pass@k).

    python scripts/eval.py --model DIR --task countdown --eviction-rate 0.5 0.75 \\
        --policy ngc snapkv keydiff knorm streamingllm none \\
        [--samples k] [--problems n] [--out results.jsonl] [--plot acc.png]
    python scripts/eval.py --model DIR --task math --eval-data aime25.jsonl \\
        --policy none ngc snapkv keydiff knorm streamingllm --eviction-rate 0.5
                                   # pass@1..32 at T=0.6, top-p 0.95, 3850 new tokens
    torchrun --nproc_per_node 8 scripts/eval.py --model DIR ...   # the problems over 8 GPUs

The problems are the held-out test split of the run's settings (its ngc.json, else the task's
recipe; --split validation: the problems recipes are chosen on, which train.py evaluates on),
whose values the flags shared with train.py replace. With --samples k: pass@1 = mean fraction
correct (± 1 SE over problems) and the unbiased pass@j for j = 1, 2, 4, ..., k, every run drawing
its noise from the same seed. The peak-KV reduction (§5.1) is, averaged over problems, the full
cache's peak KV entries (of --base-model, the paper's c_base, else of --model) over the policy's.
One JSONL line per policy x rate (docs/evaluation.md).
"""
import argparse
import contextlib
import os
import sys
from dataclasses import replace
from math import comb

import torch

# the repository root first
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import countdown
from ngc import Eviction
from evaluation import baselines
from lib import distributed, settings
from lib.checkpoint import META_TOKEN, load
from lib.cli import (Error, at_least, check_output_file, check_values, exits, need, one_line_errors,
                     parser, pyplot, writing)
from lib.files import save_figure, write_jsonl
from evaluation.scoring import kv_reduction, roll_out_and_score, standard_error
from lib.settings import Settings, add_flags, run_defaults
from lib.tasks import TASK_REWARD, check_prompts, held_out, prompt_encoder

# --policy name -> its --help line
POLICIES = {**{name: p.help for name, p in baselines.POLICIES.items()},
            "none": "the full cache: one row, reported at ε = 0 "
                    "(reduction 1.0 without --base-model)"}
RUN = ["task", "prompt", "difficulty", "eval_data", "question_field", "answer_field", "delta",
       "block", "window"]  # settings.py's flags that replace the run's settings
# the flags of one task
TASK_FLAGS = {"eval_data": "math", "question_field": "math", "answer_field": "math",
              "prompt": "countdown", "difficulty": "countdown", "tag": "countdown"}
# what these settings mean here
HELPS = {"model": "Qwen2 checkpoint directory (required)",
         "task": "countdown or math (default: the checkpoint's ngc.json, else countdown)",
         "question_field": "math: the question's field in --eval-data rows (a.b for nested)",
         "dtype": "compute dtype (default: bf16 on cuda, fp32 on cpu)",
         "compile": "capture the decode step with torch.compile (CUDA graphs on CUDA): "
                    "the same rollouts up to float rounding"}


def make_eviction(name, cfg, rate, model, tokenizer, reference=None) -> Eviction | None:
    """--policy `name` at ε = rate with the run's δ, b, w (None: the full cache)."""
    if name == "none":
        return None
    layout = settings.eviction(cfg, rate)
    inputs = baselines.PolicyInputs(layout, model, tokenizer, cfg.task, reference)
    return baselines.build(name, inputs)


def pass_at_k(n: int, c, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021), averaged over problems: 1 - C(n-c, k) / C(n, k)."""
    return sum(1 - comb(n - int(ci), k) / comb(n, k) for ci in c) / len(c)


def compare(model, tokenizer, cfg, problems, policies, rates, samples=None, batch_size=None,
            progress=True, compile=False, tag=None, base_model=None, draws=baselines.DRAWS):
    """One row per (policy, rate). tag: --tag (None: the run's); base_model: §5.1's c_base (None:
    `model`); batch_size None: the run's eval_batch, so that the samples are train.py's."""
    n, batch_size = samples or 1, batch_size or cfg.eval_batch
    meta = tokenizer.token_to_id(META_TOKEN) if cfg.meta_token else None
    sampling = settings.sampling(cfg, held_out=True, greedy=samples is None, meta_token=meta)
    prompts = with_tag(cfg, tag)
    tagged, blind = prompts.interoception, prompts.blind_tag

    def run(name, rate, on=model):
        kind = None if name == "none" else baselines.POLICIES[name].kind
        written = (tag if isinstance(tag, float) else rate) if tagged and kind else None
        per_batch = kind in ("oracle", "bound")  # it reads each batch's reference rollout
        policy = lambda reference: make_eviction(name, cfg, rate, on, tokenizer, reference)
        desc = (f"{name} ε={rate:g}" if kind else "no eviction") if progress else None
        return roll_out_and_score(
            on, tokenizer, problems, sampling, None if per_batch else policy(None),
            prompt_encoder(cfg.task, cfg.prompt, written, blind), TASK_REWARD[cfg.task],
            torch.Generator(on.lm_head.weight.device).manual_seed(cfg.seed), n, batch_size, desc,
            compile, policy if per_batch else None, draws if kind == "bound" else None)

    def row(name, rate):
        out = own_full if name == "none" else run(name, rate)
        r = {"policy": name, "eviction_rate": rate, "problems": len(problems), "samples": n,
             "accuracy": out["reward"].mean().item(), "se": standard_error(out["reward"]),
             "length": out["length"].mean().item(), "rounds": out["rounds"].mean().item(),
             "peak_kv": out["peak_kv"].mean().item(),
             "kv_reduction": kv_reduction(base["peak_kv"], out["peak_kv"]),
             "base_length": base["length"].mean().item(), "rewards": out["reward"].tolist()}
        if name != "none" and baselines.POLICIES[name].kind == "bound":
            r |= {"draws": draws, "draw_accuracy": out["draw_reward"].mean().item()}
        # per problem, the entries one layer of the full cache held: peak(p, c, 0, δ) of §5.1
        if name == "none":
            r["full_cache_entries"] = (out["peak_kv"].mean(1)
                                       / model.config.num_hidden_layers).tolist()
        if samples:
            ks = sorted({min(2 ** i, n) for i in range(n.bit_length() + 1)})
            r["pass_at_k"] = {str(k): pass_at_k(n, out["reward"].sum(1), k) for k in ks}
        return r

    own_full = run("none", 0.0)
    base = own_full if base_model is None else run("none", 0.0, on=base_model)
    return [row(name, rate) for name in policies for rate in ([0.0] if name == "none" else rates)]


def table(rows) -> str:
    n = rows[0]["samples"]
    k = f" {f'pass@{n}':>8}" if n > 1 else ""
    lines = [f"{'policy':<13} {'ε':>5} {'pass@1':>7}{k} {'length':>7} {'rounds':>6} "
             f"{'peak KV':>8} {'KV reduction':>12}"]
    for r in rows:
        k = f" {r['pass_at_k'][str(n)]:>8.1%}" if n > 1 else ""
        lines.append(f"{r['policy']:<13} {r['eviction_rate']:>5.2f} {r['accuracy']:>7.1%}{k} "
                     f"{r['length']:>7.1f} {r['rounds']:>6.2f} {r['peak_kv']:>8.0f} "
                     f"{r['kv_reduction']:>11.2f}x")
    return "\n".join(lines)


def error_bar(r) -> float:
    """The sd across seeds (reproduce.py's rows), else 1 SE over problems (older rows: binomial)."""
    if r.get("seeds", 1) > 1:
        return r["accuracy_sd"]
    return r["se"] if "se" in r else (r["accuracy"] * (1 - r["accuracy"])
                                      / (r["problems"] * r["samples"])) ** 0.5


def error_bar_note(rows) -> str:
    return (f"error bars: sd across {rows[0]['seeds']} seeds" if rows[0].get("seeds", 1) > 1
            else "error bars: 1 SE over problems")


def plot(rows, path):
    """pass@1 (pass@k with k samples) against peak-KV reduction, a line per "label" or policy."""
    plt = pyplot("--plot")
    # reproduce.py's rows over seeds: pass@1
    n = rows[0]["samples"] if "pass_at_k" in rows[0] else 1
    score = (lambda r: r["pass_at_k"][str(n)]) if n > 1 else (lambda r: r["accuracy"])
    fig, ax = plt.subplots(figsize=(5.5, 4))
    label = lambda r: r.get("label", r["policy"])
    for name in dict.fromkeys(map(label, rows)):  # pass@k (k > 1) gets no error bar
        pts = sorted((r["kv_reduction"], score(r), error_bar(r) if n == 1 else 0.0)
                     for r in rows if label(r) == name)
        if name.startswith("none"):
            ax.axhline(pts[0][1], color="gray", linestyle="--",
                       label=name.replace("none", "full cache"))
        else:
            ax.errorbar(*list(zip(*pts))[:2], yerr=[p[2] for p in pts], marker="o", capsize=3,
                        label=name)
    ax.set_xlabel("average peak KV cache reduction (x)")
    ax.set_ylabel(f"pass@{n}" if n > 1 else "accuracy (pass@1)")
    if n == 1:
        ax.set_title(error_bar_note(rows), fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=150)


def with_tag(cfg, tag):
    """The settings the prompts are written under: --tag (a rate or blind) tags every prompt."""
    return cfg if tag is None else replace(cfg, interoception=True, blind_tag=tag == "blind")


def tag_flag(text: str):
    if text in ("rate", "blind"):
        return text
    with contextlib.suppress(ValueError):
        if 0 <= float(text) <= 1:
            return float(text)
    raise argparse.ArgumentTypeError(f"{text!r}: give rate, blind or a rate in [0, 1]")


def flags(argv):
    p = parser(__doc__)
    p.epilog = "policies (--policy):\n" + "\n".join(f"  {name:14s} {text}"
                                                    for name, text in POLICIES.items())
    p.add_argument("--policy", nargs="+", default=["ngc"], choices=POLICIES, metavar="NAME",
                   help=" | ".join(POLICIES) + " (below)")
    p.add_argument("--eviction-rate", nargs="+", type=float, default=[0.5],
                   help="ε values: the fraction of blocks evicted per round")
    p.add_argument("--samples", type=int,
                   help="k sampled completions per problem; 0: greedy (default: the run's)")
    p.add_argument("--tag", type=tag_flag,
                   help="the budget tag in the evicting runs' prompts: rate, blind or a rate")
    p.add_argument("--split", choices=countdown.SPLITS, default="test",
                   help="Countdown's held-out split: test (default) or validation (train.py's)")
    p.add_argument("--problems", type=int, help="the first N problems of the split "
                   "(default: the run's eval_problems, all if none)")
    p.add_argument("--draws", type=int, default=baselines.DRAWS, help="eviction draws (rollouts) "
                   f"per problem and sample of bound and luck (default {baselines.DRAWS})")
    p.add_argument("--base-model",
                   help="the checkpoint whose full cache is the peak-KV reference (§5.1's c_base)")
    p.add_argument("--run-settings", help="score --model under this checkpoint's ngc.json "
                   "instead of its own (a starting model on a trained run's problems)")
    p.add_argument("--out", help="JSONL file, one line per policy x rate")
    p.add_argument("--plot", help="PNG of accuracy against peak-KV reduction (needs matplotlib)")
    p.add_argument("--batch-size", type=int, help="rollouts per batch (default: the run's "
                   "eval_batch, so that the samples are train.py's: the noise depends on it)")
    add_flags(p, None, ["model", "device", "dtype", "compile"] + RUN, HELPS, required=["model"])
    return p.parse_args(argv)


def run_settings(args) -> Settings:
    """The run's settings with the flags given, every flag checked first."""
    check_values(args, {"samples": lambda v: v >= 0 or "must be at least 0 (0: greedy tokens)",
                        "problems": at_least(1), "batch_size": at_least(1), "draws": at_least(1)})
    if args.plot:
        need("matplotlib", "--plot")
    for flag in ("out", "plot"):
        if getattr(args, flag) is not None:
            check_output_file(getattr(args, flag), f"--{flag}")
    args.device = distributed.pick_device(args.device)  # under torchrun: this process's GPU
    cfg = run_defaults(args.model, args.task)
    if args.run_settings:
        if not os.path.isfile(os.path.join(args.run_settings, "ngc.json")):
            raise ValueError(f"--run-settings {args.run_settings} has no ngc.json: "
                             f"give a run's checkpoint directory")
        cfg = replace(run_defaults(args.run_settings, cfg.task, "--run-settings"), model=args.model)
    for flag, task in TASK_FLAGS.items():
        if getattr(args, flag) is not None and cfg.task != task:
            raise ValueError(f"--{flag.replace('_', '-')} is for --task {task}; "
                             f"this evaluation's task is {cfg.task}")
    cfg = replace(cfg, **{k: getattr(args, k) for k in RUN if getattr(args, k) is not None})
    args.samples = (cfg.eval_samples if args.samples is None else args.samples) or None
    for rate in args.eviction_rate:
        settings.eviction(cfg, rate)  # one-line errors for bad ε, δ, b, w
    return cfg


def load_base_model(path, device, cfg, tokenizer):
    """--base-model: a checkpoint of the evaluation's task with the same tokenizer."""
    run_defaults(path, cfg.task, "--base-model")
    model, base_tokenizer = load(path, device)
    if base_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise Error(f"--base-model {path} has another tokenizer than --model: "
                    f"its completions cannot be compared")
    return model


def evaluate_policies(args, cfg, model, tokenizer, problems, base_model=None):
    """compare() in --dtype over torchrun's processes: the rows on the first, None elsewhere."""
    device = torch.device(args.device)
    distributed.start(device)  # after every check: no process fails alone after the rendezvous
    rank = distributed.rank_and_world()[0]
    bf16 = args.dtype == "bf16" if args.dtype else device.type == "cuda"
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        rows = compare(model, tokenizer, cfg, problems, list(dict.fromkeys(args.policy)),
                       list(dict.fromkeys(args.eviction_rate)), args.samples, args.batch_size,
                       progress=rank == 0 and sys.stderr.isatty(), compile=bool(args.compile),
                       tag=args.tag, base_model=base_model, draws=args.draws)
    distributed.stop()
    return None if rank else rows


@exits(memory="lower --batch-size")  # bad input, out of memory, a signal: one line
def main(argv=None):
    args = flags(argv)
    # every check (problems, device, load) before any rollout
    with one_line_errors(ValueError, RuntimeError):
        cfg = run_settings(args)
        problems = held_out(cfg, args.problems, args.split)
        model, tokenizer = load(args.model, args.device, cfg.meta_token)
        check_prompts(with_tag(cfg, args.tag), tokenizer, args.model, problems,
                      model.config.max_position_embeddings,
                      cfg.eval_max_new_tokens or cfg.max_new_tokens)
        base_model = args.base_model and load_base_model(args.base_model, args.device, cfg,
                                                         tokenizer)
        for name in args.policy:  # the tokenizer has what the policy reads
            make_eviction(name, cfg, args.eviction_rate[0], model, tokenizer)
    rows = evaluate_policies(args, cfg, model, tokenizer, problems, base_model)
    if rows is None:
        return
    each = f"{args.samples} samples each" if args.samples else "greedy"
    base = f"{args.base_model}'s" if args.base_model else "its own"
    split = args.split if cfg.task == "countdown" else "held-out"
    print(f"{args.model}: {len(problems)} {split} problems, {each}; "
          f"peak-KV reduction against {base} full cache "
          f"(completions of {rows[0]['base_length']:.1f} tokens on average)")
    print(table(rows))
    with writing():
        if args.out:
            write_jsonl(args.out, rows)
        if args.plot:
            plot(rows, args.plot)


if __name__ == "__main__":
    main()
