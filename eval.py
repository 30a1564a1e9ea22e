"""Held-out evaluation of a checkpoint on Countdown: NGC against the baselines (paper §5.1, Figure 3).

    python eval.py --model DIR --task countdown --policy ngc snapkv keydiff knorm streamingllm none \\
        --eviction-rate 0.5 0.75 [--samples k] [--problems n] [--out results.jsonl] [--plot acc.png]

Policies:
    ngc                    greedy top-K blocks on NGC's scores: the paper's evaluation
    ngc-sample             Gumbel-top-k blocks, as in training
    snapkv, keydiff, knorm, streamingllm   the heuristics of baselines.py (deterministic)
    none                   the full cache: one row, reported at ε = 0 (reduction 1.0)

The problems are the test split of the run's settings (train.run_defaults: the paper's, or the
checkpoint's ngc.json). Tokens are greedy, one completion per problem; with --samples k, k
completions per problem at the run's temperature and top-k, pass@1 = mean fraction correct and
pass@j = 1 - C(n-c, j)/C(n, j) (n = k samples, c correct) for j = 1, 2, 4, ..., k. Every run
draws its noise from the same seed. The peak-KV reduction (§5.1) divides, per problem, the peak KV
entries of one shared no-eviction run by the peak under the policy (each a mean over the k
samples), averaged over problems. One JSONL line per policy x rate.
"""
import argparse
import importlib.util
import json
import os
import sys
from dataclasses import replace
from math import comb

import torch
from tqdm import tqdm

import baselines
import countdown
from model import CheckpointError, from_pretrained, load_tokenizer
from ngc import Eviction, Sampling, rollout
from train import run_defaults

CLI_POLICIES = {  # --policy name -> how Eviction chooses the kept blocks (None: the full cache)
    "ngc": dict(greedy=True), "ngc-sample": dict(greedy=False), "snapkv": dict(greedy=True, score=baselines.snapkv),
    "keydiff": dict(greedy=True, score=baselines.keydiff), "knorm": dict(greedy=True, score=baselines.knorm),
    "streamingllm": dict(greedy=True, score=baselines.streamingllm), "none": None}


def solve(model, tokenizer, style, problems, sampling, eviction, tag_rate=None, generator=None, samples=1,
          batch_size=64, desc=None):
    """Roll out `samples` completions per problem. Returns rewards, completion lengths, rounds and
    peak KV entries, each (problems, samples). tag_rate: write <eviction_rate> into the prompts."""
    jobs = [p for p in problems for _ in range(samples)]
    out = {"reward": [], "length": [], "rounds": [], "peak_kv": []}
    for start in tqdm(range(0, len(jobs), batch_size), desc=desc, leave=False, disable=desc is None):
        chunk = jobs[start:start + batch_size]
        prompts = [countdown.encode(tokenizer, p, style, tag_rate) for p in chunk]
        ro = rollout(model, prompts, sampling, eviction, eos_ids=model.config.eos_ids, generator=generator,
                     progress=desc is not None)
        texts = tokenizer.decode_batch(ro.completions(), skip_special_tokens=True)
        out["reward"] += [countdown.reward(t, p) for t, p in zip(texts, chunk)]
        out["length"] += (ro.lengths - ro.prompt_lens).tolist()
        out["rounds"] += ro.n_rounds.tolist()
        out["peak_kv"] += ro.peak_kv.tolist()
    return {k: torch.tensor(v, dtype=torch.float64).view(len(problems), samples) for k, v in out.items()}


def kv_reduction(ref_peak, peak) -> float:
    """§5.1: mean over problems of peak(no eviction) / peak(policy); rows are problems, columns
    samples (a problem's peak is the mean over its samples)."""
    return (ref_peak.mean(1) / peak.mean(1)).mean().item()


def pass_at_k(n: int, c, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021), averaged over problems: 1 - C(n-c, k) / C(n, k)."""
    return sum(1 - comb(n - int(ci), k) / comb(n, k) for ci in c) / len(c)


def evaluate(model, tokenizer, style, problems, eviction: Eviction, max_new_tokens, batch_size=64,
             interoception=False, progress=False):
    """Greedy accuracy with the full cache and under `eviction` (NGC with greedy top-K), and the
    peak-KV reduction. train.py calls this every --eval-every steps."""
    s = Sampling(max_new_tokens=max_new_tokens, greedy=True)
    greedy = replace(eviction, greedy=True)
    full = solve(model, tokenizer, style, problems, s, None, batch_size=batch_size,
                 desc="eval full cache" if progress else None)
    ev = solve(model, tokenizer, style, problems, s, greedy, eviction.rate if interoception else None,
               batch_size=batch_size, desc=f"eval ε={eviction.rate:g}" if progress else None)
    return {"acc_full": full["reward"].mean().item(), "acc": ev["reward"].mean().item(),
            "kv_reduction": kv_reduction(full["peak_kv"], ev["peak_kv"]),
            "length": ev["length"].mean().item(), "rounds": ev["rounds"].mean().item()}


def compare(model, tokenizer, d, problems, policies, rates, samples=None, batch_size=64, progress=True):
    """One result row per (policy, rate), all against one shared no-eviction reference run."""
    n = samples or 1
    sampling = Sampling(d["max_new_tokens"], d["temperature"], d["top_k"], greedy=samples is None)
    device = model.lm_head.weight.device

    def run(name, rate):
        ev = None if CLI_POLICIES[name] is None else Eviction(d["delta"], d["block"], d["window"], rate,
                                                               **CLI_POLICIES[name])
        tag = rate if d["interoception"] and ev else None
        gen = torch.Generator(device=device).manual_seed(d["seed"])
        return solve(model, tokenizer, d["prompt"], problems, sampling, ev, tag, gen, n, batch_size,
                     desc=(f"{name} ε={rate:g}" if ev else "no eviction") if progress else None)

    ref = run("none", 0.0)
    rows = []
    for name in policies:
        for rate in [0.0] if name == "none" else rates:
            out = ref if name == "none" else run(name, rate)
            c = out["reward"].sum(1)
            row = {"policy": name, "eviction_rate": rate,
                   "problems": len(problems), "samples": n, "accuracy": out["reward"].mean().item(),
                   "length": out["length"].mean().item(), "rounds": out["rounds"].mean().item(),
                   "peak_kv": out["peak_kv"].mean().item(),
                   "kv_reduction": kv_reduction(ref["peak_kv"], out["peak_kv"])}
            if samples:
                ks = sorted({min(2 ** i, n) for i in range(n.bit_length() + 1)})
                row["pass_at_k"] = {str(k): pass_at_k(n, c, k) for k in ks}
            rows.append(row)
    return rows


def table(rows) -> str:
    n = rows[0]["samples"]
    head = f"{'policy':<13} {'ε':>5} {'pass@1':>7}" + (f" {f'pass@{n}':>8}" if n > 1 else "")
    lines = [head + f" {'length':>7} {'rounds':>6} {'peak KV':>8} {'KV reduction':>12}"]
    for r in rows:
        line = f"{r['policy']:<13} {r['eviction_rate']:>5.2f} {r['accuracy']:>7.1%}"
        line += f" {r['pass_at_k'][str(n)]:>8.1%}" if n > 1 else ""
        lines.append(line + f" {r['length']:>7.1f} {r['rounds']:>6.2f} {r['peak_kv']:>8.0f}"
                            f" {r['kv_reduction']:>11.2f}x")
    return "\n".join(lines)


def write_jsonl(rows, path):
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".tmp", path)


def plot(rows, path):
    """Accuracy against peak-KV reduction, one line per policy (paper Figure 3, right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["kv_reduction"], r["accuracy"]) for r in rows if r["policy"] == name)
        if name == "none":
            ax.axhline(pts[0][1], color="gray", linestyle="--", label="full cache")
        else:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xlabel("average peak KV cache reduction (x)")
    ax.set_ylabel("accuracy (pass@1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=150)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda message: sys.exit(f"error: {message}")  # one line, no usage dump
    p.add_argument("--model", required=True, help="Qwen2 checkpoint directory")
    p.add_argument("--task", default="countdown", choices=["countdown"])
    p.add_argument("--policy", nargs="+", default=["ngc"], help=" | ".join(CLI_POLICIES))
    p.add_argument("--eviction-rate", nargs="+", type=float, default=[0.5],
                   help="ε values: the fraction of blocks evicted per round")
    p.add_argument("--samples", type=int, default=None, help="k sampled completions per problem: pass@1 and pass@k")
    p.add_argument("--problems", type=int, default=None, help="held-out problems to use (default: all)")
    p.add_argument("--out", default=None, help="JSONL file, one line per policy x rate")
    p.add_argument("--plot", default=None, help="PNG of accuracy against peak-KV reduction (needs matplotlib)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args(argv)
    try:
        bad = [x for x in args.policy if x not in CLI_POLICIES]
        if bad:
            raise ValueError(f"unknown policy {bad[0]!r}; choose from {', '.join(CLI_POLICIES)}")
        for flag in ("samples", "problems", "batch_size"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install matplotlib")
        for path in filter(None, [args.out, args.plot]):
            if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise ValueError(f"cannot write {path}: its directory does not exist")
        d = run_defaults(args.model)
        for rate in args.eviction_rate:
            Eviction(d["delta"], d["block"], d["window"], rate)  # one-line errors for bad ε, δ, b, w
        _, test = countdown.splits(d["seed"], n_train=0, n_test=d["eval_problems"],
                                   difficulty=countdown.DIFFICULTIES[d["difficulty"]])
        if args.problems and args.problems > len(test):
            raise ValueError(f"--problems {args.problems}: the run's test split has {len(test)} problems")
        model = from_pretrained(args.model, dtype=torch.float32, device=args.device).eval()
        tokenizer = load_tokenizer(args.model)
    except (CheckpointError, ValueError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    problems = test[: args.problems]
    bf16 = (args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")) == "bf16"
    with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=bf16):
        rows = compare(model, tokenizer, d, problems, list(dict.fromkeys(args.policy)),
                       list(dict.fromkeys(args.eviction_rate)), args.samples, args.batch_size)
    print(f"{args.model}: {len(problems)} held-out problems, "
          + (f"{args.samples} samples each (T={d['temperature']:g}, top-k {d['top_k']})" if args.samples else "greedy"))
    print(table(rows))
    if args.out:
        write_jsonl(rows, args.out)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
