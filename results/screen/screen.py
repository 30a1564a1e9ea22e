"""The screen toward the hindsight bound: one factor per row against the control, each trained
from tiny/ and scored on the validation split (never the test split) at ε = 0.51, with the
hindsight bound on the same model beside it. Rows train one at a time and resume; rows.md is
written from the evaluations in evals.jsonl.

    python results/screen/screen.py [ROW ...]     # train and score these rows (default: all)
    python results/screen/screen.py --table       # only rewrite rows.md
    python results/screen/screen.py --versus ROW:CONTROL ...  # paired differences, seeds stacked
    python results/screen/screen.py --rate 0.57 ROW ...  # NGC and the bound at another ε too
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]  # claims and reproduce, imported where used
# the claims' recipe, seed 0, at the final rate tiny/ngc.json had when the screen ran (ε = 0.55)
CONTROL = ["--model", "tiny", "--group", "16", "--eval-every", "0",
           "--retention", "0.9,0.7,0.45"]
NO_EVICT = "no-evict"  # the reference: its full cache is every share's denominator
DELTA, BLOCK = 20, 4  # tiny/'s δ and b, which no no-evict row changes
RATE, DRAWS, SAMPLES = 0.51, 16, 4  # --rate: NGC and the bound at another ε (rows-ε.md)
PROBLEMS = 47  # the whole validation split (the copied runs' eval_problems predates it)
HEADER = """# The screen toward the hindsight bound (written by screen.py)

Each row is the claims' recipe (train.py on tiny/, 8 prompts x 16, 120 steps, seed 0, toward ε =
0.55: `--retention 0.9,0.7,0.45`) with one factor changed from the row it builds on: the
control, or the run it resumes ("resumes ROW": more steps of that run) or starts from (`--model
.../no-evict/checkpoint`: NGC trained from the no-evict run's weights). Each is scored by
`scripts/eval.py --split validation` (the 47 validation problems, {samples} samples each, pass@1
± 1 SE) at ε = {rate:g}: the full cache, NGC, and the hindsight bound ({draws} eviction draws per
problem and sample, solved if any draw solves) on the same model. Peak-KV reductions are of the
no-evict row's full cache; "NGC / no-evict full" divides by that row's 120-step full cache. The
reward is the mean of the last 20 training steps. Commands and consoles: logs/ROW.txt;
evaluations: evals.jsonl (an eval.py row per line, with its screen row). Notes: notes.md.
"""


def from_no_evict(run, mode="ngc"):
    """`mode` (NGC, or no-evict trained on) from the weights of the no-evict row `run`."""
    return ["--model", os.path.join(HERE, "runs", run, "checkpoint"), "--mode", mode,
            "--eval-problems", str(PROBLEMS)]  # its ngc.json: the pool before the split


def resumed(steps):
    """The flags of a row that resumes another up to `steps`."""
    return ["--steps", str(steps), "--eval-problems", str(PROBLEMS)]


def group_64_reference(seed=0):
    """The claims' reference's flags: the no-evict row of `seed` trained on at a group of 64."""
    if not seed:
        return [*from_no_evict(NO_EVICT, "no-evict"), "--group", "64"]
    start = f"{NO_EVICT}-seed{seed}"
    return [*from_no_evict(start, "no-evict"), "--group", "64", "--seed", str(seed)]


FROM_NO_EVICT = from_no_evict(NO_EVICT)
THIRD_START = f"{NO_EVICT}-third-start"
THIRD_GROUP_64 = [*from_no_evict(THIRD_START), "--group", "64", "--steps", "240"]
EVALS = os.path.join(HERE, "evals.jsonl")
STEP_LINE = re.compile(r"step (\d+)/\d+ \| reward ([\d.]+)")
ROWS = {  # name: (train.py flags beyond the control's, the row whose last checkpoint it resumes)
    "control": ([], None),
    NO_EVICT: (["--mode", "no-evict"], None),
    "block-2": (["--block", "2"], None),
    "steps-240": (resumed(240), "control"),
    "eviction-draws-4": (["--eviction-draws", "4"], None),
    "from-no-evict": (FROM_NO_EVICT, None),
    "from-no-evict-steps-240": (resumed(240), "from-no-evict"),
    "from-no-evict-block-2": ([*FROM_NO_EVICT, "--block", "2"], None),
    "from-no-evict-draws-4": ([*FROM_NO_EVICT, "--eviction-draws", "4"], None),
    "no-evict-240": (resumed(240), NO_EVICT),
    "steps-360": (resumed(360), "steps-240"),
    "no-evict-360": (resumed(360), "no-evict-240"),
    "from-no-evict-block-2-slow": ([*FROM_NO_EVICT, "--block", "2", "--stage-steps", "30"], None),
    "from-no-evict-group-64-draws-4": (
        [*FROM_NO_EVICT, "--group", "64", "--eviction-draws", "4"], None),
    "from-no-evict-group-64": ([*FROM_NO_EVICT, "--group", "64"], None),
    # the same flags from no-evict trained again (it parts from the first by float rounding)
    "from-no-evict-group-64-rerun": ([*FROM_NO_EVICT, "--group", "64"], None),
    # 120 more steps of the group-64 row (from the no-evict row's first run, as this one)
    "from-no-evict-group-64-steps-240": (resumed(240), "from-no-evict-group-64"),
    # the group-64 row's blocks sampled nearer the greedy top-K that evaluation keeps (τ 0.25 there)
    "from-no-evict-group-64-tau-0.125": (
        [*FROM_NO_EVICT, "--group", "64", "--eviction-temperature", "0.125"], None),
    # the group-64 claims' reference: the no-evict run's next 120 steps at a group of 64
    "no-evict-group-64": (group_64_reference(), None),
    # the same from the no-evict row's first run, the start of from-no-evict-group-64 (the row
    # above started from its second, trained again: logs/no-evict.rerun.txt), and 120 more steps
    "no-evict-group-64-first-start": (group_64_reference(), None),
    "no-evict-group-64-first-start-steps-240": (resumed(240), "no-evict-group-64-first-start"),
    **{f"no-evict-seed{k}": (["--mode", "no-evict", "--seed", str(k)], None) for k in (1, 2)},
    # the seeds of two rows, each after the no-evict run of its seed that it starts from
    **{f"from-no-evict-{row}-seed{k}": (
        [*from_no_evict(f"{NO_EVICT}-seed{k}"), *flags, "--seed", str(k)], None)
       for row, flags in (("steps-240", ["--steps", "240"]), ("group-64", ["--group", "64"]))
       for k in (1, 2)},
    # from-no-evict-group-64-steps-240 at seeds 1 and 2: 120 more steps of each seed's group-64 row
    **{f"from-no-evict-group-64-steps-240-seed{k}": (
        resumed(240), f"from-no-evict-group-64-seed{k}") for k in (1, 2)},
    **{f"no-evict-group-64-seed{k}": (group_64_reference(k), None) for k in (1, 2)},
    # the same from each seed's no-evict run as trained here, the start of
    # from-no-evict-group-64-seed{k} (the row above started from its second: logs/*.rerun.txt)
    **{f"no-evict-group-64-first-start-seed{k}": (group_64_reference(k), None) for k in (1, 2)},
    # each seed's group-64 reference trained as long as from-no-evict-group-64-steps-240-seed{k}
    **{f"no-evict-group-64-steps-240-seed{k}": (
        resumed(240), f"no-evict-group-64-first-start-seed{k}") for k in (1, 2)},
    # the 240-step group-64 row with one factor changed: a quarter of each step's groups (2 of 8)
    # roll out with the full cache (from the first start, as that row: an Intel Xeon retrains it
    # step for step)
    "from-no-evict-group-64-full-cache-groups-2": (
        [*FROM_NO_EVICT, "--group", "64", "--steps", "240", "--full-cache-groups", "2"], None),
    # the same at seeds 1 and 2, each from its seed's no-evict row (an Intel Xeon retrains both
    # step for step), against from-no-evict-group-64-steps-240-seed{k}
    **{f"from-no-evict-group-64-full-cache-groups-2-seed{k}": (
        [*from_no_evict(f"{NO_EVICT}-seed{k}"), "--group", "64", "--steps", "240",
         "--full-cache-groups", "2", "--seed", str(k)], None) for k in (1, 2)},
    # the seed-0 row with half of each step's groups (4 of 8) at the full cache: the dose; then
    # at seeds 1 and 2, against from-no-evict-group-64-full-cache-groups-2-seed{k}
    "from-no-evict-group-64-full-cache-groups-4": (
        [*FROM_NO_EVICT, "--group", "64", "--steps", "240", "--full-cache-groups", "4"], None),
    **{f"from-no-evict-group-64-full-cache-groups-4-seed{k}": (
        [*from_no_evict(f"{NO_EVICT}-seed{k}"), "--group", "64", "--steps", "240",
         "--full-cache-groups", "4", "--seed", str(k)], None) for k in (1, 2)},
    # between the doses: 3 of 8 groups, seed 0 (4 groups on test kept the own full cache and lost
    # NGC's share: results/full-cache-groups-4/)
    "from-no-evict-group-64-full-cache-groups-3": (
        [*FROM_NO_EVICT, "--group", "64", "--steps", "240", "--full-cache-groups", "3"], None),
    # the 4-group row trained on to 480 steps: as many evicting rollouts as the 240-step control
    "from-no-evict-group-64-full-cache-groups-4-steps-480": (
        resumed(480), "from-no-evict-group-64-full-cache-groups-4"),
    **{f"from-no-evict-group-64-full-cache-groups-4-steps-480-seed{k}": (
        resumed(480), f"from-no-evict-group-64-full-cache-groups-4-seed{k}") for k in (1, 2)},
    # the references trained as long: each seed's 240-step group-64 no-evict row on to 480 steps
    # (the 240-step rows' run directories: the claims' results/full-cache-groups-4/runs/no-evict*,
    # which printed these rows' 240 step lines)
    "no-evict-group-64-first-start-steps-480": (
        resumed(480), "no-evict-group-64-first-start-steps-240"),
    **{f"no-evict-group-64-steps-480-seed{k}": (
        resumed(480), f"no-evict-group-64-steps-240-seed{k}") for k in (1, 2)},
    # seed 0's start trained a third time, on an AMD EPYC (it parts from the first at step 15),
    # copied from reproduce.py's runs/start; then the claims' NGC run and reference from it (its
    # runs/ngc and runs/no-evict: 240 steps of 8 x 64 in one go); then the row above from it
    THIRD_START: (["--mode", "no-evict"], None),
    f"from-{THIRD_START}-group-64-steps-240": (THIRD_GROUP_64, None),
    f"{THIRD_START}-group-64-steps-240": (
        [*from_no_evict(THIRD_START, "no-evict"), "--group", "64", "--steps", "240"], None),
    f"from-{THIRD_START}-full-cache-groups-2": (
        [*THIRD_GROUP_64, "--full-cache-groups", "2"], None),
}


def run_dir(name):
    return os.path.join(HERE, "runs", name)


def last_step(name):
    path = os.path.join(run_dir(name), "log.jsonl")
    if not os.path.exists(path):
        return None
    return json.loads(open(path).read().splitlines()[-1])["step"] + 1


def steps_of(name):
    flags = ROWS[name][0]  # a row's --steps, else the control's
    return int(flags[flags.index("--steps") + 1]) if "--steps" in flags else 120


def train(name):
    flags, start = ROWS[name]
    if last_step(name) == steps_of(name):
        return
    if start and not os.path.exists(run_dir(name)):  # a copy of the run it continues
        train(start)
        shutil.copytree(run_dir(start), run_dir(name), ignore=shutil.ignore_patterns("lock"))
    if os.path.exists(run_dir(name)):
        argv = ["--resume", run_dir(name), *[f for f in flags if start]]
    else:
        argv = [*CONTROL, "--out", run_dir(name), *flags]
    log = open(os.path.join(HERE, "logs", f"{name}.txt"), "a")
    log.write(f"# python train.py {' '.join(argv)} --threads 1\n")
    log.flush()
    t0 = time.time()
    subprocess.run([sys.executable, "train.py", *argv, "--threads", "1"], cwd=ROOT, check=True,
                   stdout=log, stderr=subprocess.STDOUT)
    log.write(f"# {(time.time() - t0) / 60:.1f} min\n")


def score(name, rate=RATE):
    """The row's evaluation at ε = rate (the full cache once), added to evals.jsonl (each line an
    eval.py row with its screen row)."""
    if "bound" in evaluation(name, rate):
        return
    out = os.path.join(HERE, f"{name}.{os.getpid()}.jsonl.tmp")
    policies = ([] if evaluation(name) else ["none"]) + ["bound"]
    policies += ["ngc"] if not name.startswith(NO_EVICT) else []
    argv = ["--model", os.path.join(run_dir(name), "checkpoint"), "--split", "validation",
            "--policy", *policies, "--eviction-rate", str(rate), "--draws", str(DRAWS),
            "--samples", str(SAMPLES), "--problems", str(PROBLEMS), "--base-model",
            os.path.join(run_dir(NO_EVICT), "checkpoint"), "--out", out]
    with open(os.path.join(HERE, "logs", f"{name}.txt"), "a") as log:
        log.write(f"# OMP_NUM_THREADS=1 python scripts/eval.py {' '.join(argv)}\n")
        log.flush()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "scripts/eval.py", *argv], cwd=ROOT, check=True, env=env,
                       stdout=log, stderr=subprocess.STDOUT)
    rows = [{"row": name, **json.loads(line)} for line in open(out)]
    os.remove(out)
    write_whole(EVALS, "".join(json.dumps(r) + "\n" for r in read_evals() + rows))


def read_evals():
    return [json.loads(line) for line in open(EVALS)] if os.path.exists(EVALS) else []


def evaluation(name, rate=RATE):
    """{policy: eval.py row} of the row: its full cache, NGC and the bound at ε = rate."""
    return {r["policy"]: r for r in read_evals()
            if r["row"] == name and r["eviction_rate"] in (0.0, rate)}


def training_reward(name, last=20):
    """The mean reward of the row's last `last` steps, read from its console (logs/ROW.txt)."""
    lines = open(os.path.join(HERE, "logs", f"{name}.txt")).read().splitlines()
    steps = {int(m[1]): float(m[2]) for m in map(STEP_LINE.match, lines) if m}
    return sum(steps[k] for k in sorted(steps)[-last:]) / last


def write_whole(path, text):
    temporary = f"{path}.{os.getpid()}.tmp"  # two screens may write at once
    with open(temporary, "w") as f:
        f.write(text)
    os.replace(temporary, path)


def table(rate=RATE):
    """rows.md (at RATE, else rows-RATE.md): each scored row beside the no-evict row."""
    reference = evaluation(NO_EVICT).get("none")
    head = (f"| row | flags | last 20 steps' reward | full cache | NGC at ε = {rate:g} "
            "| NGC / no-evict full | NGC / own full | bound | NGC / bound |")
    lines = [HEADER.format(samples=SAMPLES, rate=rate, draws=DRAWS), head, "|---" * 9 + "|"]
    pct = lambda r: f"{100 * r['accuracy']:.1f} ± {100 * r['se']:.1f}"
    for name, (flags, start) in ROWS.items():
        e = evaluation(name, rate)
        if "bound" not in e:
            continue
        ngc, full, bound = e.get("ngc"), e["none"], e["bound"]
        share = lambda a, b: f"{100 * a['accuracy'] / b['accuracy']:.0f}%" if a and b else ""
        at = lambda r: f"{pct(r)} ({r['kv_reduction']:.2f}×)" if r else ""
        what = " ".join(os.path.relpath(f, ROOT) if f.startswith(ROOT) else f for f in flags)
        what += f" (resumes {start})" if start else ""
        lines.append(f"| {name} | {what} | {training_reward(name):.3f} | {pct(full)} | {at(ngc)} "
                     f"| {share(ngc, reference)} | {share(ngc, full)} | {at(bound)} "
                     f"| {share(ngc, bound)} |")
    write_whole(os.path.join(HERE, f"rows{suffix(rate)}.md"), "\n".join(lines + budgets()) + "\n")


def suffix(rate):
    """A file name's mark of a rate other than the screen's."""
    return "" if rate == RATE else f"-{rate:g}"


def budgets():
    """Lines giving ε* (§5.1's peak formula reaching 2.4×, as reproduce.py chooses the claims')
    on each scored group-64 no-evict reference's validation completions."""
    import reproduce
    lines = []
    for name in ROWS:
        full = evaluation(name).get("none")
        if name.startswith(f"{NO_EVICT}-group-64") and "-steps-" in name and full:
            rate = reproduce.budget_rate(full["full_cache_entries"], DELTA, BLOCK)
            lines.append(f"- {name}: ε* = {rate:g}")
    head = "\nε* on validation by the claims' rule (scripts/reproduce.py budget_rate):"
    return [head, *lines] if lines else []


def versus(pairs, rate=RATE):
    """versus/ROW-vs-CONTROL[-N-pairs][-RATE].md (of the first pair): each policy's pass@1 of the
    rows minus their controls in points, with a paired bootstrap's 95% interval over seeds (a pair
    each) and problems; where the controls have no NGC (no-evict rows), NGC's share of their full
    cache."""
    import claims
    rows, controls = zip(*(pair.split(":") for pair in pairs))
    head = (f"# {', '.join(rows)} against {', '.join(controls)} (written by screen.py --versus)\n"
            "\n| policy | rows | controls | rows − controls, points [95% paired interval] |\n"
            + "|---" * 4 + "|")
    lines = [head]
    labels = {"none": "full cache", "ngc": f"NGC at ε = {rate:g}", "bound": "bound"}
    stack = lambda names, policy: [evaluation(name, rate).get(policy) for name in names]
    seeds = lambda evals: {"accuracy": sum(e["accuracy"] for e in evals) / len(evals),
                           "rewards": [e["rewards"] for e in evals]}  # (seeds, problems, k)
    at = lambda evals: " ".join(f"{100 * e['accuracy']:.1f}" for e in evals)
    for policy, label in labels.items():
        mine, theirs = stack(rows, policy), stack(controls, policy)
        if None in mine + theirs:
            continue
        d, lo, hi = claims.difference(seeds(mine), seeds(theirs))
        lines.append(f"| {label} | {at(mine)} | {at(theirs)} | {d:+.1f} [{lo:+.1f}, {hi:+.1f}] |")
    ngc, full = stack(rows, "ngc"), stack(controls, "none")
    if None not in ngc and None in stack(controls, "ngc"):
        lines.append(f"\nNGC at ε = {rate:g} ({at(ngc)}) over the controls' full cache "
                     f"({at(full)}): {claims.share(seeds(ngc), seeds(full))} (95% paired interval)")
    os.makedirs(os.path.join(HERE, "versus"), exist_ok=True)
    several = f"-{len(pairs)}-pairs" if len(pairs) > 1 else ""
    path = os.path.join(HERE, "versus", f"{rows[0]}-vs-{controls[0]}{several}{suffix(rate)}.md")
    write_whole(path, "\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", nargs="*", help=f"of {', '.join(ROWS)} (default: all)")
    p.add_argument("--table", action="store_true", help="only rewrite rows.md")
    p.add_argument("--versus", nargs="+", metavar="ROW:CONTROL",
                   help="only write versus/ROW-vs-CONTROL[-N-pairs].md: rows against their "
                   "controls, a pair a seed")
    p.add_argument("--rate", type=float, default=RATE,
                   help=f"score NGC and the bound at this ε as well as at {RATE}, and compare "
                   "(--versus) or tabulate (--table: rows-RATE.md) there")
    args = p.parse_args()
    if not 0 < args.rate < 1:
        p.error(f"--rate is an eviction rate in (0, 1), not {args.rate:g}")
    if bad := [pair for pair in args.versus or [] if pair.count(":") != 1]:
        p.error(f"--versus takes ROW:CONTROL pairs, not {', '.join(bad)}")
    if args.versus and (args.rows or args.table):
        p.error("--versus only compares scored rows: give it alone")
    named = [n for pair in args.versus or [] for n in pair.split(":")] + args.rows
    if unknown := set(named) - set(ROWS):
        p.error(f"no row {', '.join(sorted(unknown))}: the rows are {', '.join(ROWS)}")
    if args.versus:
        controls = {pair.split(":")[1] for pair in args.versus}
        cache_only = lambda n: n in controls and n.startswith(NO_EVICT)  # its full cache compares
        scored = lambda n: "bound" in evaluation(n, args.rate) or cache_only(n) and evaluation(n)
        if unscored := [n for n in named if not scored(n)]:
            at_rate = "" if args.rate == RATE else f" --rate {args.rate:g}"
            p.error(f"not scored yet: {', '.join(unscored)}; run screen.py{at_rate} "
                    f"{' '.join(unscored)}")
        return versus(args.versus, args.rate)
    os.makedirs(os.path.join(HERE, "logs"), exist_ok=True)
    for name in [] if args.table else args.rows or ROWS:
        train(NO_EVICT)
        train(name)
        for rate in sorted({RATE, args.rate}):
            score(name, rate)
            table(rate)
    table(args.rate)


if __name__ == "__main__":
    main()
