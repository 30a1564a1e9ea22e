"""Reproduce the paper's Countdown comparisons (§5, Figures 3-6) on the shipped tiny model.

    python scripts/reproduce.py                 # everything, one seed, into results/deep/
    python scripts/reproduce.py --seeds 3       # three seeds of every run: mean ± spread in every
                                                # table (about 3 hours)
    python scripts/reproduce.py --jobs 2        # two training runs at a time, one CPU thread each
    python scripts/reproduce.py --seeds 3 --train-args '--data-seed 0'
                                                # every seed on the same problems
    python scripts/reproduce.py --seeds 3 --jobs 2 --start-steps 120 --start-args '--group 16' \\
        --train-args '--group 64 --steps 240 --eval-every 0'
                                                # RESULTS §0's recipe: 120 no-evict steps of
                                                # 8 x 16 per seed, then every run 240 of 8 x 64
                                                # (--ablation-seeds 1 --no-interoception: 3 h)
    python scripts/reproduce.py ... --ngc-args '--full-cache-groups 4'
                                                # the same with half of NGC's and the ablations'
                                                # groups at the full cache (RESULTS §0.1)

It trains RUNS from --model into OUT/runs/ (each unless finished; with --start-steps from each
seed's no-evict start), scores them with eval.py on the test split (OUT/evals/) and writes
claims.md, summary.md, curve.md, the figures, forgets.html and each study's OUT/<study>.jsonl:
the baselines and bounds (Figure 3), the curve over ε, the ablations (Figure 5), interoception
(Figure 6), unseen prompt layouts. Every study is measured at ε*, where §5.1's peak formula gives
a 2.4× reduction on the no-evict model's full-cache completions (OUT/budget.json), each peak-KV
reduction against the same seed's no-evict model's full cache (§5.1's c_base).
"""
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time

# the repository root first
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import countdown
import ngc
import train
from evaluation import baselines
from lib import rundir, settings
from lib.checkpoint import from_pretrained
from lib.cli import (Error, FlagError, Interrupted, at_least, check_values, exits, have,
                     make_output_dir, one_line_errors, parser, pyplot)
from lib.files import recover_swap, save_figure, write_jsonl, write_text
import eval as eval_script  # scripts/, beside this file
import show
from claims import BASELINES, RULES, TAG_CHECK, TESTABLE, cell, claims_markdown, table, testable

# each names its mode: a start
RUNS = {"ngc": ["--mode", "ngc"], "no-evict": ["--mode", "no-evict"],
        "token-only": ["--mode", "token-only"], "targeted-dropout": ["--mode", "targeted-dropout"],
        "interoception": ["--mode", "ngc", "--interoception"],
        "interoception-blind": ["--mode", "ngc", "--interoception", "--blind-tag"]}
ABLATED = ("ngc", "token-only", "targeted-dropout")  # the runs --ngc-args reach (Figure 5)
START = "start"  # --start-steps: each seed's no-evict run that the seed's other runs start from
CURVE = [0.5, 0.6, 0.7, 0.8, 0.9]  # the curve's rates by default (--curve), with ε* among them
TARGET = 2.4  # the paper's peak-KV reduction on Countdown (§5.2: 50% a round, "2.4x")
STRONGEST = ["keydiff", "snapkv"]  # the strongest task-agnostic baselines on tiny/ (results/deep)
UNTRAINED = "untrained"  # the pseudo-run of studies that evaluate --model itself, untrained
NOT_IN_TRAIN_ARGS = ("model", "out", "resume", "overwrite", "seed")  # reproduce.py sets them
STOP_WAIT = 300  # seconds a stopped train.py may take to save its step


def report(text: str) -> str:
    line = f"[{time.strftime('%H:%M:%S')}] {text}"
    print(line, flush=True)
    return line


# Training: the runs, their checks, one train.py process each
def run_name(name: str, seed: int) -> str:
    return name if seed == 0 else f"{name}-seed{seed}"


def study_runs(seeds: int, ablation_seeds: int, interoception_seeds: int, start_steps=0,
               steps=None, start_args=(), ngc_args=()) -> dict:
    """{dir under out: train.py flags} of each study's runs (0 seeds: none); ngc's and its
    ablations' flags end with ngc_args before the seed; with start_steps, each seed's runs train
    `steps` from a no-evict run of those (its flags end with start_args)."""
    groups = [(["ngc", "no-evict"], seeds), (["token-only", "targeted-dropout"], ablation_seeds),
              (["interoception", "interoception-blind"], interoception_seeds)]
    own = lambda name: [*RUNS[name], *(ngc_args if name in ABLATED else [])]
    runs = {os.path.join("runs", run_name(name, k)): [*own(name), "--seed", str(k)]
            for names, n in groups for k in range(n) for name in names}
    if not start_steps:
        return runs
    start = lambda seed: os.path.join("runs", run_name(START, int(seed)))
    first = {start(k): [*RUNS["no-evict"], "--seed", str(k), "--steps", str(start_steps),
                        *start_args] for k in range(seeds)}
    # each run's flags end with its seed
    return first | {name: ["--model", os.path.join(start(flags[-1]), "checkpoint"),
                           "--steps", str(steps), *flags] for name, flags in runs.items()}


def start_of(flags) -> str | None:  # the run directory (under out) a run starts from
    return os.path.dirname(flags[1]) if flags[:1] == ["--model"] else None


def finished(run_dir) -> bool:  # its last step saved, its final evaluation (if any) logged
    checkpoint = os.path.join(run_dir, "checkpoint")
    if not os.path.exists(os.path.join(checkpoint, "trainer.pt")):
        return False
    run, log = (settings.read_ngc_json(checkpoint),
                rundir.read_log(os.path.join(run_dir, "log.jsonl")))
    logged = not run["eval_every"] or any("eval" in r and r["step"] == run["steps"] for r in log)
    return logged and rundir.saved_step(run_dir) == run["steps"]


def threads_per_run(jobs: int) -> int:
    return max(1, (os.cpu_count() or 1) // jobs)


def parse_train_args(model, extra, flag="--train-args", fixed=NOT_IN_TRAIN_ARGS):
    """`flag`'s train.py flags as train.py parses them, once --model is a Countdown checkpoint, or
    a one-line ValueError."""
    from_pretrained(model)  # a missing or foreign checkpoint, weights that are not finite
    settings.run_defaults(model, "countdown")
    try:
        given = train.parse_args(extra)
    except FlagError as e:
        raise ValueError(f"{flag}: {e}") from None
    if fixed := [f for f in fixed if getattr(given, f) not in (None, False)]:
        raise ValueError(f"{flag} cannot set --{fixed[0]}: reproduce.py chooses it for "
                         f"every run (give its own --model, --out or --seeds; to train every "
                         f"seed on the same problems, --data-seed)")
    if given.task not in (None, "countdown"):
        raise ValueError(f"{flag} sets --task {given.task}; "
                         f"reproduce.py's studies are Countdown's")
    return given


def check_runs(out, model, runs, extra):
    """Before anything is created: train.py's one-line errors for each run's settings, or one for a
    run directory whose saved settings are not those train.py would run now."""
    for name, flags in runs.items():
        run_dir, checkpoint = os.path.join(out, name), os.path.join(out, name, "checkpoint")
        # a run whose start has not finished is checked on --model, the start's own recipe
        unstarted = start_of(flags) and not finished(os.path.join(out, start_of(flags)))
        argv = train_command(out, name, model, 1, flags[2:] if unstarted else flags, extra,
                             resume=False)[2:]  # after python and train.py
        unread = ("threads", "eval_problems", *(["model"] if unstarted else []))
        now = {k: v for k, v in settings.saved(train.resolve(train.parse_args(argv))).items()
               if k not in unread}
        recover_swap(checkpoint)  # a save cut short by a crash: its whole copy back, as on resume
        if os.path.isdir(checkpoint) and (
                changed := rundir.changed_settings(settings.read_ngc_json(checkpoint), now)):
            raise ValueError(f"{run_dir} holds a run with other settings than this command asks "
                             f"for ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''})"
                             f"; to keep it, give this command another --out; to train it again, "
                             f"delete {run_dir}")


def train_all(out, model, jobs, runs, extra):
    """Train the unfinished runs, `jobs` at a time, each in a process group of its own, its console
    appended to <out>/<dir>.log; a signal or a failed run stops the others, each saving its step."""
    todo = [(name, flags) for name, flags in runs.items() if not finished(os.path.join(out, name))]
    ready = lambda flags: not start_of(flags) or finished(os.path.join(out, start_of(flags)))
    running = []
    try:
        while todo or running:
            for name, flags in [run for run in todo if ready(run[1])][:jobs - len(running)]:
                todo.remove((name, flags))
                cmd = train_command(out, name, model, threads_per_run(jobs), flags, extra)
                os.makedirs(os.path.join(out, name), exist_ok=True)
                log = open(os.path.join(out, name) + ".log", "a")
                print(report(f"start {name}: {' '.join(cmd[1:])}"), file=log, flush=True)
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                running.append((name, proc, log, time.time()))
            time.sleep(1)
            for run in [r for r in running if r[1].poll() is not None]:
                running.remove(run)
                name, proc, log, t0 = run
                log.close()
                status = f"FAILED (exit {proc.returncode}, see {log.name})"
                report(f"{name} {status if proc.returncode else 'done'} in "
                    f"{(time.time() - t0) / 60:.1f} min")
                if proc.returncode:
                    raise Error(f"training run {name} failed; see {log.name}")
    except BaseException as e:
        stop_runs(running, e.signum if isinstance(e, Interrupted) else signal.SIGTERM)
        raise


def train_command(out, name, model, threads, flags, extra, resume=True) -> list[str]:
    """train.py's command line: a resume if the run saved a checkpoint, else afresh from `model` or
    the run's start, the run's own flags after --train-args'."""
    run_dir = os.path.join(out, name)
    if resume and os.path.exists(os.path.join(run_dir, "checkpoint")):
        argv = ["--resume", run_dir, "--threads", str(threads)]
    else:
        if start := start_of(flags):
            model, flags = os.path.join(out, start, "checkpoint"), flags[2:]
        argv = ["--model", model, "--out", run_dir, "--threads", str(threads), *extra, *flags,
                "--overwrite"]
    return [sys.executable, os.path.join(settings.HERE, "train.py"), *argv]


def stop_runs(running, signum):
    """Signal each train.py's process group; wait for each to save its step (else SIGKILL)."""
    with rundir.signals_held():
        for _, proc, _, _ in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)
        for name, proc, log, _ in running:
            try:
                proc.wait(STOP_WAIT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
            report(f"{name} stopped (exit {proc.returncode}, see {log.name})")


# Evaluation: eval.py on each final checkpoint, its rows over seeds, their table
def checkpoint_of(args, run, seed) -> str:
    return (args.model if run == UNTRAINED
            else os.path.join(args.out, "runs", run_name(run, seed), "checkpoint"))


def evaluate(args, name, run, policies, rates, flags, seeds) -> list:
    rows = over_seeds([r for seed in range(seeds)
                       for r in eval_seed(args, name, run, policies, rates, flags, seed)])
    write_jsonl(os.path.join(args.out, name + ".jsonl"), rows)
    if have("matplotlib"):
        eval_script.plot(rows, os.path.join(args.out, name + ".png"))
    return rows


def eval_seed(args, name, run, policies, rates, flags, seed) -> list:
    """eval.py's rows of the run at one seed against the same seed's no-evict model (reused where
    `evaluated`); the untrained rows under that model's settings (--train-args')."""
    os.makedirs(os.path.join(args.out, "evals"), exist_ok=True)
    path = os.path.join(args.out, "evals", f"{name}-seed{seed}.jsonl")
    model, base = checkpoint_of(args, run, seed), checkpoint_of(args, "no-evict", seed)
    argv = ["--model", model, "--policy", *policies, "--batch-size", "250",
            "--eviction-rate", *map(str, rates), "--out", path, "--samples", str(args.samples),
            *flags]
    argv += ["--base-model", base] if base != model else []
    argv += ["--run-settings", base] if run == UNTRAINED else []  # the runs' problems, cap, prompt
    argv += ["--problems", str(args.problems)] if args.problems else []
    if not evaluated(path, argv, [model, base]):
        report(f"eval {name}: {run_name(run, seed)} {' '.join(policies)} at ε {rates}")
        eval_script.main(argv)
        write_text(path + ".argv", " ".join(argv) + "\n")
    with open(path) as f:
        return [dict(json.loads(line), run=run, seed=seed) for line in f]


def peak_reduction(entries, rate, delta, block) -> float:
    """§5.1's peak formula: the mean over problems of p + c (`entries`, the full cache's per layer)
    over peak(p, c, ε, δ), that of a policy keeping K whole blocks a round (ngc.cache_bound)."""
    return statistics.fmean(n / ngc.cache_bound(delta, block, rate, round(n)) for n in entries)


def budget_rate(entries, delta, block, target=TARGET) -> float:
    """ε*: the mildest rate (steps of 0.01) whose peak_reduction reaches `target`, else the
    largest's."""
    rates = [k / 100 for k in range(1, 100)]
    reductions = [peak_reduction(entries, rate, delta, block) for rate in rates]
    return next((rate for rate, r in zip(rates, reductions) if r >= target),
                rates[reductions.index(max(reductions))])


def budget(args) -> float:
    """ε* on the seed-0 no-evict model's full-cache completions, into OUT/budget.json."""
    full = eval_seed(args, "reference", "no-evict", ["none"], [0.5], [], 0)[0]
    recipe = settings.run_defaults(checkpoint_of(args, "no-evict", 0))
    rate = budget_rate(full["full_cache_entries"], recipe.delta, recipe.block)
    reduction = peak_reduction(full["full_cache_entries"], rate, recipe.delta, recipe.block)
    write_text(os.path.join(args.out, "budget.json"), json.dumps({
        "rate": rate, "target": TARGET, "formula_reduction": reduction, "delta": recipe.delta,
        "block": recipe.block, "reference_length": full["length"], "reference":
        "the no-evict model's full cache (seed 0), evals/reference-seed0.jsonl"}, indent=1) + "\n")
    short = reduction < TARGET and f" (the most these completions allow; the target is {TARGET:g}x)"
    report(f"budget: ε* = {rate:g}, {reduction:.2f}x by §5.1's peak formula on no-evict's "
        f"completions{short or ''}")
    return rate


def evaluated(path, argv, models) -> bool:
    """Whether path holds eval.py's rows for argv (path.argv), written after the models' weights."""
    weights = [os.path.join(m, "model.safetensors") for m in models]
    if not all(map(os.path.exists, [path, path + ".argv", *weights])):
        return False
    with open(path + ".argv") as f:
        return f.read().split() == argv and all(os.path.getmtime(path) > os.path.getmtime(w)
                                                for w in weights)


def over_seeds(rows):
    """A row per (run, policy, ε): means over seeds, accuracy_sd across them, accuracy_se, each
    seed's rewards (seeds, problems, samples) for claims.py's intervals."""
    groups = {}
    for r in rows:
        groups.setdefault((r["run"], r["policy"], r["eviction_rate"]), []).append(r)
    means = ("accuracy", "length", "rounds", "kv_reduction", "base_length", "draw_accuracy")
    return [dict(run=run, policy=policy, eviction_rate=rate, problems=rs[0]["problems"],
                 samples=rs[0]["samples"], seeds=len(rs),
                 **{k: statistics.fmean(r[k] for r in rs) for k in means
                    if all(k in r for r in rs)},
                 accuracy_sd=statistics.stdev(r["accuracy"] for r in rs) if len(rs) > 1 else 0.0,
                 accuracy_se=statistics.fmean(eval_script.error_bar(r) for r in rs),
                 **({"rewards": [r["rewards"] for r in rs]}
                    if all("rewards" in r for r in rs) else {}))
            for (run, policy, rate), rs in groups.items()]


def markdown(rows) -> str:
    return table(["run", "policy", "ε", "pass@1", "SE", "length", "no-evict length", "rounds",
                  "peak-KV reduction"],
                 [(r["run"], r["policy"], f"{r['eviction_rate']:g}", cell(r),
                   f"{100 * r['accuracy_se']:.1f}", f"{r['length']:.0f}",
                   f"{r['base_length']:.0f}" if "base_length" in r else "-", f"{r['rounds']:.2f}",
                   f"{r['kv_reduction']:.2f}x") for r in rows])


def curve_markdown(rows, bound) -> str:
    """A line per (model, policy), a column per ε; the first marks where `bound`'s rows are
    testable."""
    lines = {}
    for r in rows:
        if r["policy"] != "none":
            lines.setdefault((r["run"], r["policy"]), {})[r["eviction_rate"]] = (
                f"{cell(r)} ({r['kv_reduction']:.2f}×)")
    rates = sorted({e for line in lines.values() for e in line})
    mark = {r["eviction_rate"]: "testable" if testable(r) else f"untestable ({r['accuracy']:.0%})"
            for r in bound}
    return table(["model", "policy", *(f"ε = {e:g}" for e in rates)],
                 [("", f"hindsight bound on NGC's model ≥ {TESTABLE:.0%}?", *map(mark.get, rates))]
                 + [(run, policy, *(line.get(e, "-") for e in rates))
                    for (run, policy), line in lines.items()])


# Figures 5 and 6 (Figure 3's are eval.plot's)
def curves(out, names, seeds, path):
    """Figure 5: each run's reward, a moving mean of 5 steps of the mean over seeds."""
    fig, ax = pyplot("plots").subplots(figsize=(5.5, 3.6))
    for name in names:
        paths = [os.path.join(out, "runs", run_name(name, k), "log.jsonl") for k in range(seeds)]
        if missing := [p for p in paths if not os.path.exists(p)]:  # no mean over fewer seeds
            raise FileNotFoundError(f"no log {missing[0]} to draw Figure 5 from")
        logs = [{s["step"]: s for s in rundir.read_log(p) if "reward" in s} for p in paths]
        steps = sorted(set.intersection(*(set(log) for log in logs)))
        reward = [statistics.fmean(log[i]["reward"] for log in logs) for i in steps]
        ax.plot(steps, [sum(reward[max(0, i - 4): i + 1]) / min(i + 1, 5)
                        for i in range(len(steps))], label=name)
    ax.set(title=f"reward (moving mean of 5{f', mean of {seeds} seeds' if seeds > 1 else ''})",
           xlabel="step")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def figures(out, studies, ablation_seeds):
    """Figures 3 (right), 5 and 6: curve.png, ablations.png, interoception-vs-ngc.png."""
    curve = [dict(r, label=f"{r['policy']} ({'NGC' if r['run'] == 'ngc' else r['run']})")
             for r in studies["baselines"][:1] + studies["curve"] + studies["curve-bound"]
             + studies["curve-baselines"]]
    eval_script.plot(curve, os.path.join(out, "curve.png"))
    if "ablation-token-only" in studies:
        curves(out, ["ngc", "token-only", "targeted-dropout"], ablation_seeds,
               os.path.join(out, "ablations.png"))
    if "interoception" not in studies:
        return
    fig, ax = pyplot("plots").subplots(figsize=(5.5, 4))
    for label, study in [("NGC", "interoception-ngc"), ("NGC + interoception", "interoception"),
                         ("NGC + blind tag (control)", "interoception-blind")]:
        pts = sorted((r["eviction_rate"], r["accuracy"], eval_script.error_bar(r))
                     for r in studies[study])
        ax.errorbar(*zip(*pts), marker="o", capsize=3, label=label)  # x, y, yerr
    ax.set(xlabel="eviction rate ε", ylabel="held-out pass@1")
    ax.set_title(eval_script.error_bar_note(studies["interoception-ngc"]), fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, os.path.join(out, "interoception-vs-ngc.png"), dpi=120)


# The command: train, evaluate each study, write the tables and figures
def studies_of(args, budget, below, beyond) -> list[tuple]:
    """(name, run, policies, ε, eval.py flags, seeds, title) of each study, on the test split;
    below: the rate just under ε*; beyond: the curve's rates stricter than interoception's."""
    full, few, pair = args.seeds, args.ablation_seeds, args.interoception_seeds
    both, bounds, greedy = ["none", "ngc"], ["oracle", "bound", "luck"], ["--samples", "0"]
    curve = sorted({*args.curve, budget})
    draws, half = (["--draws", str(n)] for n in (args.draws, max(1, args.draws // 2)))
    on_ngc = f"on NGC's model ({half[1]} draws, seed 0"
    plan = [("untrained", UNTRAINED, both, [budget], [], 1,
             "0. Before training: the starting model's full cache, and NGC's scores untrained"),
            ("baselines", "no-evict", ["none", *BASELINES, *bounds], [budget], draws, full,
             f"1. The baselines at ε* = {budget:g} on the no-evict model (the paper's heuristics, "
             "random, random-prompt, the task rules), the oracle, the hindsight bound and its luck "
             "control"),
            ("baselines-ngc", "ngc", ["none", "ngc", *BASELINES, *bounds], [budget], draws, full,
             "1. NGC on its own model, with every baseline, the oracle and the bound there"),
            ("below", "ngc", ["ngc"], [below], [], full, f"1. NGC at ε = {below:g}, just under ε* "
             "(whole blocks: the reduction jumps between the two)"),
            ("greedy", "ngc", both, [budget], greedy, 1,
             "1. Greedy tokens: NGC on its model (seed 0)"),
            ("greedy-no-evict", "no-evict", ["none", "bound"], [budget], [*greedy, *draws], 1,
             "1. Greedy tokens: the no-evict model's full cache and the bound on it (seed 0)"),
            ("curve", "ngc", ["ngc", "oracle"], curve, [], 1,
             "2. The curve over ε: NGC and the oracle on NGC's model (seed 0)"),
            ("curve-bound", "ngc", ["bound"], curve, half, 1, "2. The curve over ε: the hindsight "
             f"bound {on_ngc}; a rate is testable where it solves 20%)"),
            ("curve-luck", "ngc", ["luck"], curve, half, 1,
             f"2. The curve over ε: the bound's luck control {on_ngc})"),
            ("curve-greedy", "ngc", ["none", "ngc", "bound", "luck"], curve, [*greedy, *half], 1,
             f"2. The curve over ε with greedy tokens: NGC, the bound and its luck control "
             f"{on_ngc})"),
            ("curve-baselines", "no-evict", [*STRONGEST, *RULES], curve, [], 1, "2. The curve over "
             "ε: the strongest task-agnostic baselines and the task rules on the no-evict model "
             "(seed 0)")]
    plan += [(f"ablation-{run}", run, both, [budget], [], few, f"3. Ablation: {run}")
             for run in ("token-only", "targeted-dropout") if not args.no_ablations]
    if not args.no_interoception:
        intero = sorted({budget, *beyond, TAG_CHECK})  # the tag check compares with its row
        plan += [("interoception-ngc", "ngc", ["ngc"], intero, [], pair,
                  "4. Plain NGC at the interoception rates"),
                 ("interoception", "interoception", ["ngc"], intero, [], pair,
                  "4. Budget-aware interoception across ε"),
                 ("interoception-blind", "interoception-blind", ["ngc"], intero, [], pair,
                  "4. Its control: the same per-group ε, the tag without the rate")]
        # does the model read the tag? The same ε, another tag
        plan += [(f"tag-{tag}", "interoception", ["ngc"], [TAG_CHECK], ["--tag", tag], pair,
                  f"4. The interoception model at ε = {TAG_CHECK:g} with the tag {tag}")
                 for tag in ("0.25", "blind")]
    # none where the prompt has one layout
    if unseen := countdown.SHIFTED.get(settings.run_defaults(args.model).prompt):
        shifted, same = ["--prompt", unseen], "6. The same layouts:"
        plan += [("shifted-ngc", "ngc", [*both, "oracle"], [budget], shifted, full,
                  f"6. Prompt layouts never used in training ({unseen}): NGC and the oracle"),
                 ("shifted-no-evict", "no-evict", ["none"], [budget], shifted, full, f"{same} the "
                  "no-evict model's full cache, every share's denominator there"),
                 ("shifted-untrained", UNTRAINED, both, [budget], shifted, 1,
                  f"{same} the starting model"),
                 ("shifted-baselines", "no-evict", ["none", *STRONGEST, *RULES], [budget], shifted,
                  1, f"{same} the strongest baselines on the no-evict model (seed 0)")]
    return plan


def run_studies(args):
    """Train the runs, evaluate each study, write claims.md, show.py's forgets and summary.md."""
    extra, start_args, ngc_args = (args.train_args.split(), args.start_args.split(),
                                   args.ngc_args.split())
    with one_line_errors():
        steps = parse_train_args(args.model, extra).steps or settings.run_defaults(args.model).steps
        if start_args and not args.start_steps:
            raise ValueError("--start-args sets the start runs' flags: give --start-steps too")
        if start_args:
            parse_train_args(args.model, start_args, "--start-args",
                             (*NOT_IN_TRAIN_ARGS, "mode", "steps"))
        if ngc_args:
            parse_train_args(args.model, ngc_args, "--ngc-args", (*NOT_IN_TRAIN_ARGS, "mode"))
        runs = study_runs(args.seeds, 0 if args.no_ablations else args.ablation_seeds,
                          0 if args.no_interoception else args.interoception_seeds,
                          args.start_steps, steps, start_args, ngc_args)
        check_runs(args.out, args.model, runs, extra)
        make_output_dir(args.out)
    t0 = time.time()
    train_all(args.out, args.model, args.jobs, runs, extra)
    rate = budget(args)
    # the ngc run's ε; the rates the interoception run trained on, at the end
    trained = train.final_eviction_rate(settings.run_defaults(checkpoint_of(args, "ngc", 0)))
    training_rates = not args.no_interoception and list(settings.run_defaults(
        checkpoint_of(args, "interoception", 0)).interoception_rates)
    beyond = [e for e in args.curve if e > max(training_rates or [1.0]) + 1e-9]
    below = round(rate - 0.01, 2)  # budget_rate's step
    plan = studies_of(args, rate, below, beyond)
    studies = {name: evaluate(args, name, *study) for name, *study, _ in plan}
    if have("matplotlib"):
        figures(args.out, studies, args.ablation_seeds)
    claims = claims_markdown(studies, rate, trained, below, training_rates)
    write_text(os.path.join(args.out, "claims.md"),
               f"# The paper's Countdown claims on {os.path.relpath(args.model)}"
               f" ({args.seeds} seed{'s' if args.seeds > 1 else ''})\n\n{claims}\n")
    report("show: what ngc forgets")
    forgets = os.path.join(args.out, "forgets")
    show.main(["--model", os.path.join(args.out, "runs", "ngc", "checkpoint"),
               "--before", args.model, "--out", forgets + ".html"]
              + (["--png", forgets + ".png"] if have("matplotlib") else []))
    write_summary(args, studies, plan, claims, (time.time() - t0) / 60)


def write_summary(args, studies, plan, claims, minutes):
    """curve.md, and summary.md: the claims, the curve, every study's table."""
    curve = curve_markdown(studies["curve"] + studies["curve-bound"] + studies["curve-luck"]
                           + studies["curve-baselines"], studies["curve-bound"])
    greedy = curve_markdown(studies["curve-greedy"], studies["curve-bound"])
    curve += f"\n\nWith greedy tokens (one completion per problem):\n\n{greedy}"
    write_text(os.path.join(args.out, "curve.md"),
               f"# pass@1 (peak-KV reduction) over ε\n\n{curve}\n")
    sections = [f"## 2. The curve over ε (curve.md)\n\n{curve}\n"]
    sections += [f"## {title}\n\n{markdown(studies[name])}\n" for name, *_, title in plan]
    row, summary = studies["baselines-ngc"][0], os.path.join(args.out, "summary.md")  # how measured
    seeds = (f"seeds 0..{args.seeds - 1}, accuracy as mean ± standard deviation across seeds; "
             if args.seeds > 1 else "")
    write_text(summary, f"# Reproduction on {os.path.relpath(args.model)}\n\n({seeds}pass@1 over "
               f"{row['samples']} sampled completions per problem unless a section says greedy, "
               f"evictions greedy top-K, {row['problems']} test problems; SE: one evaluation's "
               f"standard error over problems, in points)"
               f"\n\n## 0. The paper's claims\n\n{claims}\n\n" + "\n".join(sections)
               + f"\n![what ngc forgets](forgets.png)\n\nTotal wall time of this command "
               f"{minutes:.1f} min (runs already trained are not retrained).\n")
    print(f"wrote {summary}")


def parse_args(argv):
    cli = parser(__doc__)
    cli.add_argument("--out", default=os.path.join("results", "deep"),
                     help="output directory (default results/deep)")
    settings.add_flags(cli, None, ["model"], {"model": "the starting checkpoint (default: tiny/)"})
    cli.add_argument("--train-args", default="",
                     help="extra train.py flags for every run, e.g. '--steps 60'")
    cli.add_argument("--start-args", default="", help="with --start-steps, train.py flags of the "
                     "start runs alone, after --train-args', e.g. '--group 16'")
    cli.add_argument("--ngc-args", default="", help="train.py flags of the ngc runs and the "
                     "ablations alone (not no-evict's or interoception's), after --train-args', "
                     "e.g. '--full-cache-groups 4'")
    counts = [  # whole numbers: (flag, default, help)
        ("seeds", 1, "seeds 0..N-1 of every run (default 1)"),
        ("jobs", 1, "training runs at a time (CPU threads are shared out)"),
        ("start-steps", 0, "N: first a no-evict run of N steps per seed (runs/start), then "
         "every run of the seed from its checkpoint (default 0: from --model)"),
        ("ablation-seeds", None, "seeds of the ablation runs (default: --seeds)"),
        ("interoception-seeds", None, "seeds of the interoception pair (default: ablation's)"),
        ("samples", 2, "sampled completions per problem for pass@1 (default 2)"),
        ("draws", baselines.DRAWS, f"the hindsight bound's eviction draws at ε* (default "
         f"{baselines.DRAWS}; over the curve half as many)"),
        ("problems", None, "test problems per evaluation (default: the run's eval_problems, "
         "all if none)")]
    for flag, default, text in counts:
        cli.add_argument(f"--{flag}", type=int, default=default, help=text)
    cli.add_argument("--curve", type=float, nargs="+", default=CURVE, metavar="ε", help="the "
                     f"curve's eviction rates (default {' '.join(map(str, CURVE))}; ε* is added)")
    for flag, runs, part in (("interoception", "interoception", 4), ("ablations", "ablation", 3)):
        cli.add_argument(f"--no-{flag}", action="store_true",
                         help=f"leave out the {runs} runs (section {part})")
    args = cli.parse_args(argv)
    args.model = settings.COUNTDOWN.model if args.model is None else args.model
    args.ablation_seeds = args.ablation_seeds or args.seeds
    args.interoception_seeds = args.interoception_seeds or args.ablation_seeds
    with one_line_errors():
        check_values(args, {flag.replace("-", "_"): at_least(0 if flag == "start-steps" else 1)
                            for flag, *_ in counts})
        within = lambda n: n <= args.seeds or (f"is more than --seeds {args.seeds}: the studies "
                                               "compare these runs with ngc's")
        check_values(args, dict.fromkeys(["ablation_seeds", "interoception_seeds"], within))
        if bad := [e for e in args.curve if not 0 < e < 1]:
            raise ValueError(f"--curve {bad[0]:g}: an eviction rate lies between 0 and 1")
    return args


@exits  # a training run that fails ends the script with one line
def main(argv=None):
    try:
        run_studies(parse_args(argv))
    except Interrupted as e:
        again = shlex.join(["python", "scripts/reproduce.py",
                            *(sys.argv[1:] if argv is None else argv)])
        print(f"{e}: stopped; finished runs and evaluations are kept and interrupted runs saved "
              f"their step: run the same command to continue ({again})", file=sys.stderr)
        raise SystemExit(128 + e.signum) from None


if __name__ == "__main__":
    main()
