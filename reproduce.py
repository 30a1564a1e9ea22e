"""Reproduce the paper's Countdown comparisons (§5, Figures 3-6) on the shipped tiny model.

    python reproduce.py                 # everything, into results/ (about an hour on a 2-core CPU)
    python reproduce.py --jobs 2        # two training runs at a time, one CPU thread each

It trains five runs from tiny/ with its defaults (tiny/ngc.json), each only if results/runs/<name>
has not finished yet, then evaluates them with eval.py on the held-out problems:

    ngc               the method                        train.py
    no-evict          the full-cache model              train.py --mode no-evict
    token-only        ablation: no eviction loss        train.py --mode token-only
    targeted-dropout  ablation: causal log-probs        train.py --mode targeted-dropout
    interoception     ε written into the prompt         train.py --interoception

and writes results/<study>.jsonl, results/<study>.png, results/ngc-vs-heuristics.png and results/summary.md:

    1. baselines      NGC (greedy top-K) vs SnapKV, KeyDiff, KNorm, StreamingLLM on the no-evict
                      model, and its full cache, at ε = 0.5 (Figure 3)
    2. sweep          the same at stricter ε than training saw (0.5 -> 0.8)
    3. ablations      ngc vs token-only vs targeted-dropout at ε = 0.5, with their reward and
                      grad-norm curves (Figure 5)
    4. interoception  budget-aware NGC vs plain NGC across ε (Figure 6)
"""
import argparse
import json
import os
import subprocess
import sys
import time

import eval as ev

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = {"ngc": [], "no-evict": ["--mode", "no-evict"], "token-only": ["--mode", "token-only"],
        "targeted-dropout": ["--mode", "targeted-dropout"], "interoception": ["--interoception"]}
HEURISTICS = ["snapkv", "keydiff", "knorm", "streamingllm"]
SWEEP = [0.5, 0.6, 0.7, 0.8]  # with b=4, δ=24 on tiny/, ε=0.75 keeps the same blocks as 0.7 (rounding of K)


def finished(run_dir) -> bool:
    state = os.path.join(run_dir, "checkpoint", "ngc.json")
    if not os.path.exists(state):
        return False
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        last = [json.loads(line) for line in f if '"reward"' in line][-1:]
    with open(state) as f:
        return bool(last) and last[0]["step"] + 1 >= json.load(f)["steps"]


def train_all(out, model, jobs, extra):
    """Run the missing training runs, `jobs` at a time, logging each to results/runs/<name>.log."""
    todo = [name for name in RUNS if not finished(os.path.join(out, "runs", name))]
    threads = max(1, (os.cpu_count() or 1) // jobs)
    running = []
    while todo or running:
        while todo and len(running) < jobs:
            name = todo.pop(0)
            run_dir = os.path.join(out, "runs", name)
            saved = os.path.exists(os.path.join(run_dir, "checkpoint"))
            resume = ["--resume", run_dir] if saved else ["--overwrite"]  # a run that never saved starts afresh
            cmd = [sys.executable, os.path.join(HERE, "train.py"), "--model", model, "--out", run_dir,
                   "--threads", str(threads), *RUNS[name], *extra, *resume]
            os.makedirs(run_dir, exist_ok=True)
            print(f"[{time.strftime('%H:%M:%S')}] start {name}: {' '.join(cmd[1:])}", flush=True)
            log = open(run_dir + ".log", "w")
            running.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log, time.time()))
        time.sleep(5)
        for item in [r for r in running if r[1].poll() is not None]:
            name, proc, log, t0 = item
            log.close()
            running.remove(item)
            status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}, see {log.name})"
            print(f"[{time.strftime('%H:%M:%S')}] {name} {status} in {(time.time() - t0) / 60:.1f} min", flush=True)
            if proc.returncode:
                sys.exit(f"error: training run {name} failed; see {log.name}")


def eval_study(out, study, run, policies, rates, problems=None):
    """eval.py on one run's final checkpoint; returns its rows."""
    path = os.path.join(out, f"{study}.jsonl")
    argv = ["--model", os.path.join(out, "runs", run, "checkpoint"), "--policy", *policies,
            "--eviction-rate", *map(str, rates), "--out", path] + (["--problems", str(problems)] if problems else [])
    print(f"[{time.strftime('%H:%M:%S')}] eval {study}: {run} {' '.join(policies)} at ε {rates}", flush=True)
    ev.main(argv + (["--plot", path[:-6] + ".png"] if have_matplotlib() else []))
    with open(path) as f:
        return [json.loads(line) for line in f]


def have_matplotlib() -> bool:
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None


def curves(out, names, path):
    """Reward and grad-norm curves per step of the given runs (Figure 5)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name in names:
        with open(os.path.join(out, "runs", name, "log.jsonl")) as f:
            steps = [json.loads(line) for line in f if '"reward"' in line]
        x = [s["step"] for s in steps]
        axes[0].plot(x, smooth([s["reward"] for s in steps]), label=name)
        for ax, key in ((axes[1], "grad_norm_token"), (axes[2], "grad_norm_mem")):  # null: not measured that step
            pts = [(s["step"], s[key]) for s in steps if s.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), label=name)
    for ax, title in zip(axes, ["reward (moving mean of 5)", "grad norm of L_token", "grad norm of L_mem"]):
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path + ".tmp", dpi=120, format="png")
    os.replace(path + ".tmp", path)


def accuracy_vs_rate(curves_by_label, path):
    """Accuracy against ε, one line per label (Figure 6)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for label, rows in curves_by_label.items():
        pts = sorted((r["eviction_rate"], r["accuracy"]) for r in rows)
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xlabel("eviction rate ε")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path + ".tmp", dpi=120, format="png")
    os.replace(path + ".tmp", path)


def smooth(xs, n=5):
    return [sum(xs[max(0, i - n + 1): i + 1]) / len(xs[max(0, i - n + 1): i + 1]) for i in range(len(xs))]


def markdown(rows) -> str:
    lines = ["| run | policy | ε | accuracy | length | rounds | peak-KV reduction |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['policy']} | {r['eviction_rate']:g} | {r['accuracy']:.1%} | "
                     f"{r['length']:.0f} | {r['rounds']:.2f} | {r['kv_reduction']:.2f}x |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results", help="directory for runs/, *.jsonl, *.png and summary.md")
    p.add_argument("--model", default=os.path.join(HERE, "tiny"), help="the starting checkpoint (default: tiny/)")
    p.add_argument("--jobs", type=int, default=1, help="training runs at a time (CPU threads are shared out)")
    p.add_argument("--train-args", default="", help="extra train.py flags for every run, e.g. '--steps 60'")
    p.add_argument("--problems", type=int, default=None, help="held-out problems per evaluation (default: the run's)")
    args = p.parse_args()
    if args.jobs < 1 or (args.problems is not None and args.problems < 1):
        sys.exit("error: --jobs and --problems must be at least 1")
    t0 = time.time()
    train_all(args.out, args.model, args.jobs, args.train_args.split())
    sections = []

    def study(name, title, run, policies, rates):
        rows = [dict(r, run=run) for r in eval_study(args.out, name, run, policies, rates, args.problems)]
        sections.append(f"## {title}\n\n{markdown(rows)}\n")
        return rows

    full = study("baselines", "1. NGC vs the heuristics at ε = 0.5 (heuristics on the no-evict model)", "no-evict",
                 ["none", *HEURISTICS, "ngc"], [0.5])[:1]
    study("baselines-ngc", "1. (NGC on its own model)", "ngc", ["none", "ngc"], [0.5])
    sweep = study("sweep", "2. Stricter ε than training saw: NGC", "ngc", ["ngc"], SWEEP)
    heuristics = study("sweep-heuristics", "2. Stricter ε: the heuristics on the no-evict model", "no-evict",
                       HEURISTICS, SWEEP)
    if have_matplotlib():  # Figure 3 (right): trained NGC against the heuristics, full cache as the line
        ev.plot(full + sweep + heuristics, os.path.join(args.out, "ngc-vs-heuristics.png"))
    for run in ["token-only", "targeted-dropout"]:
        study(f"ablation-{run}", f"3. Ablation: {run}", run, ["none", "ngc"], [0.5])
    if have_matplotlib():
        curves(args.out, ["ngc", "token-only", "targeted-dropout"], os.path.join(args.out, "ablations.png"))
    intero = study("interoception", "4. Budget-aware interoception across ε", "interoception", ["ngc"], SWEEP)
    if have_matplotlib():
        accuracy_vs_rate({"NGC": sweep, "NGC + interoception": intero},
                         os.path.join(args.out, "interoception-vs-ngc.png"))
    summary = os.path.join(args.out, "summary.md")
    with open(summary + ".tmp", "w") as f:
        f.write(f"# Reproduction on {os.path.relpath(args.model)}\n\n" + "\n".join(sections)
                + f"\nTotal wall time {(time.time() - t0) / 60:.1f} min.\n")
    os.replace(summary + ".tmp", summary)
    print(f"wrote {summary}")


if __name__ == "__main__":
    main()
