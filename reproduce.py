"""Reproduce the paper's Countdown comparisons (§5, Figures 3-6) on the shipped tiny model.

    python reproduce.py                 # everything, one seed, into results/back/
    python reproduce.py --seeds 3       # three seeds of every run: mean ± spread in every table (about 3 hours)
    python reproduce.py --jobs 2        # two training runs at a time, one CPU thread each
    python reproduce.py --limit         # and the limit study: three changes to the default recipe
    python reproduce.py --seeds 3 --train-args '--data-seed 0'   # every seed on the same problems
    python reproduce.py --seeds 3 --interoception-seeds 1 --jobs 2   # RESULTS §0's claims on tiny/

It trains six runs from tiny/ with its defaults (tiny/ngc.json), once per seed (`train.py --seed k`:
its own training and held-out problems, rollouts and evictions; with --data-seed fixed, only its
own rollouts and evictions, so the spread across seeds is training's alone), each only if
OUT/runs/<name>[-seed<k>] has not finished yet (a run directory saved with other settings than this
command's, say other --train-args, is refused before anything trains), then evaluates them with
eval.py on the held-out problems (OUT is --out: results/back, the shipped tiny/'s folder, unless
given; results/README.md says which folder holds which model):

    ngc                  the method                          train.py
    no-evict             the full-cache model                train.py --mode no-evict
    token-only           ablation: no eviction loss          train.py --mode token-only
    targeted-dropout     ablation: causal log-probs          train.py --mode targeted-dropout
    interoception        ε written into the prompt           train.py --interoception
    interoception-blind  its control: the same per-group ε,  train.py --interoception --blind-tag
                         the tag without the rate

and writes OUT/evals/<study>-seed<k>.jsonl (eval.py's rows), OUT/<study>.jsonl and .png
(over seeds: mean pass@1, its standard deviation across seeds, and one evaluation's standard
error over problems), OUT/ngc-vs-heuristics.png, OUT/claims.md and OUT/summary.md. Every
evaluation is the paper's (§5.1): pass@1 over --samples sampled completions per problem, evictions
greedy top-K, on the run's one held-out set (tiny/'s: the first 200 of the 278 of tiny's 500 held-out
problems whose search goes back, none of them trained or pretrained on):

    0. claims         the paper's Countdown claims beside this run's numbers and a goal for each
                      (claims.md); the starting model's full cache and untrained NGC scores
    1. baselines      on the no-evict model at ε = 0.5 (Figure 3): SnapKV, KeyDiff, KNorm,
                      StreamingLLM, random blocks, random-prompt, the two task rules (the
                      target's block, or the prompt's numbers too, then the newest), and the
                      oracle (the blocks the full cache's next δ tokens read most); NGC (greedy
                      top-K), the oracle, the rules and random on NGC's model; NGC with greedy
                      tokens (the second column)
    2. sweep          NGC and the baselines at stricter ε than training saw (0.5 -> 0.8)
    3. ablations      ngc vs token-only vs targeted-dropout at ε = 0.5, with their reward and
                      grad-norm curves (Figure 5)
    4. interoception  budget-aware NGC against its blind-tag control at the training ε (0.5), the
                      strictest tag the groups trained on (0.75) and a stricter one (0.8), plain NGC
                      beside (Figure 6); and the tag check: the interoception model at ε = 0.75 under
                      the tags 0.25 and blind (eval.py --tag): does it read the tag?
    6. layout shift   NGC, the untrained model and the baselines on prompt layouts never used in
                      training (eval.py --prompt tiny-shift-unseen for tiny/: the same length, so
                      rounds fire at the same tokens): does NGC keep what matters or where it sits?

With --limit it also trains the limit study's recipes (seed 0, OUT/limit/<name>) and writes
their evaluations during training, beside the default run's, as section 5 and OUT/limit.jsonl:

    steps120             twice as long                       train.py --steps 120
    lr1e-4               a learning rate 3.3x larger         train.py --lr 1e-4
    p8g16                8 prompts x 16 rollouts, not 16 x 8 train.py --prompts 8 --group 16

With --headline it trains only the default run and its token-only ablation, --seeds of each, and
writes headline.jsonl and headline.md: per seed, the full cache and NGC at ε = 0.5 before
training (train.py's step-0 evaluation) and after (eval.py on the final checkpoint), NGC's
accuracy as a fraction of the full cache's, and the mean and standard deviation over seeds.

With --diagnose it trains only the diagnosis runs (seed 0, OUT/runs/diag-<name>, and the default
run if absent) and writes OUT/diag/: each run's log.jsonl as <name>.log.jsonl; diagnosis.jsonl,
one row per run and evaluation during training with the training log's means since the previous
one (reward, fraction of groups whose advantages are all zero, gradient norm of each loss);
sampling-untrained.jsonl and sampling-ngc.jsonl, eval.py's greedy against Gumbel-sampled evictions
(ngc, ngc-sample) at ε = 0.5 on the untrained model and on the default run; survival.json (show.py --survival, 200 problems); diagnosis.md:

    ngc-120              the default recipe for 120 steps    train.py --steps 120
    mem-only             L_mem alone, 120 steps              train.py --mode mem-only --steps 120
    token-only           L_token alone, 120 steps            train.py --mode token-only --steps 120
    t09-k50              the paper's sampling, 60 steps      train.py --temperature 0.9 --top-k 50
    paper-optim          and the paper's AdamW, 250 steps    ... --lr 5e-6 --beta2 0.95 --adam-eps 1e-15
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

import countdown
import eval as evaluation
import rundir
import settings
import show
import train
from checkpoint import load_config
from cli import Exit, Interrupted, exits, have, make_output_dir, parser, pyplot
from files import recover_swap, save_figure, write_jsonl, write_text

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = {"ngc": [], "no-evict": ["--mode", "no-evict"], "token-only": ["--mode", "token-only"],
        "targeted-dropout": ["--mode", "targeted-dropout"], "interoception": ["--interoception"],
        "interoception-blind": ["--interoception", "--blind-tag"]}
HEURISTICS = ["snapkv", "keydiff", "knorm", "streamingllm"]
AGNOSTIC = HEURISTICS + ["random", "random-prompt"]  # the baselines that know nothing of the task
RULES = ["task-rule", "number-rule"]  # hand-written for Countdown's prompt: simple rules that could beat NGC
BASELINES = AGNOSTIC + RULES
SWEEP = [0.5, 0.6, 0.7, 0.8]  # with b=4, δ=24 on tiny/, ε=0.75 keeps the same blocks as 0.7 (rounding of K)
UNTRAINED = "untrained"  # the pseudo-run of studies that evaluate --model itself, before any training
STRONGEST = ["task-rule", "random", "keydiff"]  # the seed-0 sweeps' baselines (the strongest on tiny-slip/; on
# tiny/ KeyDiff is the strongest task-agnostic one, the task rule and random among the rest)
INTERO_SWEEP = [0.5, 0.75, 0.8]  # the training ε, the strictest tag the groups trained on, and a stricter one
TAG_CHECK = 0.75  # the tag check's ε: the strictest tag trained on (at 0.8 every policy solves under 1%)
ABLATIONS = ["token-only", "targeted-dropout", "interoception", "interoception-blind"]
LIMIT = {"steps120": ["--steps", "120", "--eval-every", "30"], "lr1e-4": ["--lr", "1e-4", "--eval-every", "20"],
         "p8g16": ["--prompts", "8", "--group", "16", "--eval-every", "30"]}


HEADLINE = ["ngc", "token-only"]
EVERY_30 = ["--eval-every", "30", "--term-grad-norms"]  # the diagnosis tables show both terms' gradient norms
DIAGNOSE = {"ngc-120": ["--steps", "120", *EVERY_30], "mem-only": ["--mode", "mem-only", "--steps", "120", *EVERY_30],
            "token-only": ["--mode", "token-only", "--steps", "120", *EVERY_30],
            "t09-k50": ["--temperature", "0.9", "--top-k", "50", *EVERY_30],
            "paper-optim": ["--lr", "5e-6", "--beta2", "0.95", "--adam-eps", "1e-15", "--temperature", "0.9",
                            "--top-k", "50", "--steps", "250", *EVERY_30]}


def run_name(name: str, seed: int) -> str:
    return name if seed == 0 else f"{name}-seed{seed}"


def seeded_runs(names, seeds: int) -> dict:
    """{dir under out: train.py flags} for each of RUNS' `names` at seeds 0..seeds-1."""
    return {os.path.join("runs", run_name(name, k)): RUNS[name] + ["--seed", str(k)]
            for k in range(seeds) for name in names}


def study_runs(seeds: int, ablation_seeds: int, interoception_seeds: int) -> dict:
    """The studies' runs: ngc and no-evict at `seeds` seeds, the two ablations at `ablation_seeds`,
    the interoception pair at `interoception_seeds` (0: none)."""
    return {**seeded_runs(["ngc", "no-evict"], seeds), **seeded_runs(ABLATIONS[:2], ablation_seeds),
            **seeded_runs(ABLATIONS[2:], interoception_seeds)}


def wall_time(t0) -> str:
    return f"Total wall time of this command {(time.time() - t0) / 60:.1f} min (runs already trained are not retrained)."


def finished(run_dir) -> bool:
    """Whether a run has finished: its checkpoint holds its last step and its log the final
    evaluation (a run stopped during that evaluation has saved its last step without it)."""
    checkpoint = os.path.join(run_dir, "checkpoint")
    if not os.path.exists(os.path.join(checkpoint, "trainer.pt")):
        return False
    run = settings.read_ngc_json(checkpoint)
    log = rundir.read_log(os.path.join(run_dir, "log.jsonl"))
    evaluated = not run["eval_every"] or any("eval" in r and r["step"] == run["steps"] for r in log)
    return evaluated and rundir.saved_step(run_dir) == run["steps"]


def threads_per_run(jobs: int) -> int:
    return max(1, (os.cpu_count() or 1) // jobs)


NOT_IN_TRAIN_ARGS = ("model", "out", "resume", "overwrite", "seed")  # reproduce.py sets these per run


def check_runs(out, model, runs, jobs, extra):
    """Before anything is created: the starting model, --train-args, and every run directory that
    holds a checkpoint already (finished or not), whose saved settings (its ngc.json) must be the
    ones train.py would run now; reusing or resuming a run made with other settings would report
    them as this command's. A one-line ValueError (or CheckpointError) says what differs and what to do."""
    load_config(model)  # a missing or foreign checkpoint
    task = settings.trained_task(model)
    if task not in (None, "countdown"):
        raise ValueError(f"--model {model} was trained on {task} (its ngc.json); reproduce.py's studies are "
                         f"Countdown's: start from a Countdown model such as tiny/")
    given = parse_train_args(extra)
    fixed = [f for f in NOT_IN_TRAIN_ARGS if getattr(given, f) not in (None, False)]
    if fixed:
        raise ValueError(f"--train-args cannot set --{fixed[0]}: reproduce.py chooses it for every run (give its own "
                         f"--model, --out or --seeds; to train every seed on the same problems, --data-seed)")
    if given.task not in (None, "countdown"):
        raise ValueError(f"--train-args sets --task {given.task}; reproduce.py's studies are Countdown's")
    for name, flags in runs.items():
        run_dir = os.path.join(out, name)
        argv = ["--model", model, "--out", run_dir, "--threads", str(threads_per_run(jobs)), *flags, *extra,
                "--overwrite"]  # a fresh run's settings; --overwrite only lets train.py's check pass here
        now = settings.saved(train.resolve(parse_train_args(argv)))  # bad values: train.py's one-line errors
        checkpoint = os.path.join(run_dir, "checkpoint")
        recover_swap(checkpoint)  # a save cut short by a crash: its whole copy back in place, as a resume would
        if not os.path.isdir(checkpoint):
            continue
        changed = [c for c in rundir.changed_settings(settings.read_ngc_json(checkpoint), now)
                   if not c.startswith("threads ")]  # threads change the bits, not the run
        if changed:
            raise ValueError(f"{run_dir} holds a run with other settings than this command asks for "
                             f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}); to keep it, give this "
                             f"command another --out; to train it again, delete {run_dir}")


def parse_train_args(argv):
    """train.py's flags parsed, its one-line argparse errors as a ValueError naming --train-args."""
    try:
        return train.parse_args(argv)
    except SystemExit as e:
        raise ValueError(f"--train-args: {str(e.code).removeprefix('error: ')}") from None


def train_all(out, model, jobs, runs, extra):
    """Train the runs {dir under out: train.py flags} that have not finished, `jobs` at a time,
    each in a process group of its own, logging each to <out>/<dir>.log (appended: an interrupted
    run's earlier lines are kept). A run that saved a checkpoint is resumed (check_runs first:
    its settings are this command's). SIGINT/SIGTERM, or a failed run, stop the others: each
    saves its step, and the same command resumes them."""
    todo = [(name, flags) for name, flags in runs.items() if not finished(os.path.join(out, name))]
    threads = threads_per_run(jobs)
    running = []
    try:
        while todo or running:
            while todo and len(running) < jobs:
                name, flags = todo.pop(0)
                running.append(start_run(name, train_command(out, name, model, threads, flags, extra)))
            time.sleep(1)
            for item in [r for r in running if r[1].poll() is not None]:
                name, proc, log, t0 = item
                log.close()
                running.remove(item)
                status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}, see {log.name})"
                print(f"[{time.strftime('%H:%M:%S')}] {name} {status} in {(time.time() - t0) / 60:.1f} min", flush=True)
                if proc.returncode:
                    raise Exit(f"error: training run {name} failed; see {log.name}")
    except BaseException as e:
        stop_runs(running, e.signum if isinstance(e, Interrupted) else signal.SIGTERM)
        raise


def train_command(out, name, model, threads, flags, extra) -> list[str]:
    """train.py's command line for run `name`: a run that saved a checkpoint is resumed with the
    flags a resume accepts (its settings are its own), any other starts afresh."""
    run_dir = os.path.join(out, name)
    train_py = [sys.executable, os.path.join(HERE, "train.py")]
    if os.path.exists(os.path.join(run_dir, "checkpoint")):
        return train_py + ["--resume", run_dir, "--threads", str(threads)]
    return train_py + ["--model", model, "--out", run_dir, "--threads", str(threads), *flags, *extra, "--overwrite"]


def start_run(name, cmd):
    """train.py's process for run `name` (command cmd), in a process group of its own, its console
    appended to <run dir>.log."""
    run_dir = cmd[cmd.index("--resume" if "--resume" in cmd else "--out") + 1]
    os.makedirs(run_dir, exist_ok=True)
    line = f"[{time.strftime('%H:%M:%S')}] start {name}: {' '.join(cmd[1:])}"
    print(line, flush=True)
    log = open(run_dir + ".log", "a")
    log.write(line + "\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return name, proc, log, time.time()


def stop_runs(running, signum):
    """Send signum to each running train.py's process group and wait for it to save and end
    (SIGKILL after STOP_WAIT seconds); a second signal meanwhile waits for this to finish."""
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
            print(f"[{time.strftime('%H:%M:%S')}] {name} stopped (exit {proc.returncode}, see {log.name})", flush=True)


STOP_WAIT = 300  # seconds a stopped train.py may take to save its step


def eval_study(out, study, run, policies, rates, seed, problems=None, extra=(), model=None):
    """eval.py on the final checkpoint of one run and seed (pass@1 at the run's eval_samples unless
    extra says otherwise), or on `model` for the run UNTRAINED; returns its rows, marked with both."""
    path = os.path.join(out, "evals", f"{study}-seed{seed}.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    name = run_name(run, seed)
    checkpoint = model if run == UNTRAINED else os.path.join(out, "runs", name, "checkpoint")
    argv = ["--model", checkpoint, "--policy", *policies, "--batch-size", "250",
            "--eviction-rate", *map(str, rates), "--out", path, *extra] + (["--problems", str(problems)] if problems else [])
    if not evaluated(path, argv):
        print(f"[{time.strftime('%H:%M:%S')}] eval {study}: {name} {' '.join(policies)} at ε {rates}", flush=True)
        evaluation.main(argv)
        write_text(path + ".argv", " ".join(argv) + "\n")
    with open(path) as f:
        return [dict(json.loads(line), run=run, seed=seed) for line in f]


def evaluated(path, argv) -> bool:
    """Whether path holds eval.py's rows for exactly these arguments (path.argv says which), written
    after the run's checkpoint: an evaluation reproduce.py can reuse."""
    checkpoint = os.path.join(argv[1], "model.safetensors")
    if not (os.path.exists(path) and os.path.exists(path + ".argv") and os.path.exists(checkpoint)):
        return False
    with open(path + ".argv") as f:
        same = f.read().split() == argv
    return same and os.path.getmtime(path) > os.path.getmtime(checkpoint)


def over_seeds(rows):
    """One row per (run, policy, ε): the means over seeds, the accuracy's standard deviation across
    seeds (accuracy_sd, 0 for one seed) and the mean standard error of one evaluation
    (accuracy_se: eval.error_bar, 1 SE over problems)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["run"], r["policy"], r["eviction_rate"]), []).append(r)
    out = []
    for (run, policy, rate), rs in groups.items():
        acc = [r["accuracy"] for r in rs]
        mean = {k: statistics.fmean(r[k] for r in rs) for k in ("accuracy", "length", "rounds", "kv_reduction")}
        se = statistics.fmean(evaluation.error_bar(r) for r in rs)  # each row one evaluation: its SE
        out.append(dict(run=run, policy=policy, eviction_rate=rate, problems=rs[0]["problems"],
                        samples=rs[0]["samples"], seeds=len(rs), **mean,
                        accuracy_sd=statistics.stdev(acc) if len(acc) > 1 else 0.0, accuracy_se=se))
    return out


def limit_dir(recipe: str) -> str:
    """A limit-study recipe's run directory under --out; "default" is the seed-0 ngc run."""
    return os.path.join("runs", "ngc") if recipe == "default" else os.path.join("limit", recipe)


def limit_rows(out):
    """The held-out evaluations that train.py --eval-every logged during the default run and the
    limit study's runs: one row per run and step (ε = the final training ε, greedy)."""
    rows = []
    for name, flags in {"default": [], **LIMIT}.items():
        run_dir = os.path.join(out, limit_dir(name))
        problems = settings.read_ngc_json(os.path.join(run_dir, "checkpoint"))["eval_problems"]
        evals = [s for s in rundir.read_log(os.path.join(run_dir, "log.jsonl")) if "eval" in s]
        rows += [dict(recipe=name, flags=" ".join(flags), step=s["step"], problems=problems, samples=1,
                      accuracy=s["eval"]["acc"], accuracy_full=s["eval"]["acc_full"],
                      kv_reduction=s["eval"]["kv_reduction"]) for s in evals]
    return rows


def limit_markdown(rows) -> str:
    lines = ["| recipe | train.py flags | step | full cache | ε = 0.5 | SE | peak-KV reduction |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['recipe']} | `{r['flags']}` | {r['step']} | {r['accuracy_full']:.1%} | "
                     f"{r['accuracy']:.1%} | {100 * evaluation.error_bar(r):.1f} | {r['kv_reduction']:.2f}x |")
    return "\n".join(lines)


def diagnosis_rows(out):
    """One row per diagnosis run and evaluation during training, with the means of the training
    log's steps since the previous evaluation (none for the evaluation before step 0)."""
    rows = []
    for name, flags in DIAGNOSE.items():
        log = rundir.read_log(os.path.join(out, "runs", f"diag-{name}", "log.jsonl"))
        steps, last = [s for s in log if "reward" in s], 0
        for e in (s for s in log if "eval" in s):
            window = [s for s in steps if last <= s["step"] < e["step"]]
            mean = lambda key: (statistics.fmean(s[key] for s in window)
                                if window and all(s.get(key) is not None for s in window) else None)
            rows.append(dict(run=name, flags=" ".join(flags), step=e["step"], accuracy_full=e["eval"]["acc_full"],
                             accuracy=e["eval"]["acc"], kv_reduction=e["eval"]["kv_reduction"],
                             length=e["eval"]["length"], rounds=e["eval"]["rounds"], steps_since=len(window),
                             **{k: mean(k) for k in ("reward", "zero_adv_groups", "grad_norm_token", "grad_norm_mem")}))
            last = e["step"]
    return rows


def diagnosis_markdown(rows, sampling) -> str:
    f = lambda x, spec: "–" if x is None else format(x, spec)
    lines = ["| run | train.py flags | step | full cache | ε = 0.5 | peak-KV reduction | reward | all-zero groups "
             "| ‖∇L_token‖ | ‖∇L_mem‖ |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | `{r['flags']}` | {r['step']} | {r['accuracy_full']:.1%} | {r['accuracy']:.1%} | "
              f"{r['kv_reduction']:.2f}x | {f(r['reward'], '.3f')} | {f(r['zero_adv_groups'], '.2f')} | "
              f"{f(r['grad_norm_token'], '.3f')} | {f(r['grad_norm_mem'], '.3f')} |" for r in rows]
    lines += ["", "| model | policy | ε | accuracy | length | rounds | peak-KV reduction |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['policy']} | {r['eviction_rate']} | {r['accuracy']:.1%} | {r['length']:.0f} | "
              f"{r['rounds']:.2f} | {r['kv_reduction']:.2f}x |" for r in sampling]
    return "\n".join(lines)


def diagnose_runs() -> dict:
    return {os.path.join("runs", "ngc"): [], **{os.path.join("runs", f"diag-{name}"): flags
                                                for name, flags in DIAGNOSE.items()}}


def diagnose(out, model, jobs, extra):
    """--diagnose: train the diagnosis runs and write OUT/diag/ (see the docstring)."""
    t0, diag = time.time(), os.path.join(out, "diag")
    train_all(out, model, jobs, diagnose_runs(), extra)
    os.makedirs(diag, exist_ok=True)
    for name in DIAGNOSE:
        with open(os.path.join(out, "runs", f"diag-{name}", "log.jsonl")) as f:
            write_text(os.path.join(diag, f"{name}.log.jsonl"), f.read())
    rows = diagnosis_rows(out)
    write_jsonl(os.path.join(diag, "diagnosis.jsonl"), rows)
    sampling = []
    for run, checkpoint in [("untrained", model), ("ngc", os.path.join(out, "runs", "ngc", "checkpoint"))]:
        path = os.path.join(diag, f"sampling-{run}.jsonl")
        evaluation.main(["--model", checkpoint, "--policy", *(["none"] if run == "ngc" else []), "ngc", "ngc-sample",
                         "--eviction-rate", "0.5", "--out", path])
        with open(path) as f:
            sampling += [dict(json.loads(line), run=run) for line in f]
    show.main(["--model", os.path.join(out, "runs", "ngc", "checkpoint"), "--before", model, "--problems", "200",
               "--survival", os.path.join(diag, "survival.json")])
    write_text(os.path.join(diag, "diagnosis.md"),
               f"# Diagnosis runs (seed 0)\n\n{diagnosis_markdown(rows, sampling)}\n\n{wall_time(t0)}\n")
    print(f"wrote {diag}/")


def headline_rows(out, seeds, problems=None):
    """--headline: per run and seed, train.py's evaluation before step 0 (its log) and eval.py's
    of the final checkpoint, full cache and NGC (greedy top-K) at ε = 0.5."""
    rows = []
    for k in range(seeds):
        for name in HEADLINE:
            log = rundir.read_log(os.path.join(out, "runs", run_name(name, k), "log.jsonl"))
            before = next((s["eval"] for s in log if "eval" in s and s["step"] == 0), {})  # {}: --eval-every 0
            full, ngc = eval_study(out, f"headline-{name}", name, ["none", "ngc"], [0.5], k, problems)
            rows.append(dict(run=name, seed=k, problems=ngc["problems"], full_before=before.get("acc_full"),
                             full_after=full["accuracy"], before=before.get("acc"), after=ngc["accuracy"],
                             kv_before=before.get("kv_reduction"), kv_after=ngc["kv_reduction"],
                             of_full=ngc["accuracy"] / full["accuracy"] if full["accuracy"] else None,
                             length=ngc["length"], rounds=ngc["rounds"]))
    return rows


def headline_markdown(rows) -> str:
    """The headline table; "–" where a number is not there (no evaluation before training, a full
    cache that solves nothing)."""
    f = lambda x, spec: "–" if x is None else format(x, spec)
    cells = lambda r: (f"{f(r['full_before'], '.1%')} → {f(r['full_after'], '.1%')} | {f(r['before'], '.1%')} → "
                       f"{f(r['after'], '.1%')} | {f(r['of_full'], '.0%')} | {f(r['kv_before'], '.2f')}x → "
                       f"{f(r['kv_after'], '.2f')}x")
    lines = ["| run | seed | full cache, before → after | ε = 0.5, before → after | ε = 0.5 / full cache "
             "| peak-KV reduction, before → after |", "|---|---|---|---|---|---|"]
    for name in HEADLINE:
        mine = [r for r in rows if r["run"] == name]
        lines += [f"| {name} | {r['seed']} | {cells(r)} |" for r in mine]
        if len(mine) > 1:
            mean = {key: over_rows(mine, key, statistics.fmean) for key in mine[0] if key not in ("run", "seed")}
            sd = {key: over_rows(mine, key, statistics.stdev) for key in mean}
            points = lambda key: f(sd[key] and 100 * sd[key], ".1f")
            lines.append(f"| {name} | mean | {cells(mean)} |")
            lines.append(f"| {name} | sd | {points('full_before')} → {points('full_after')} | {points('before')} → "
                         f"{points('after')} | {f(sd['of_full'], '.0%')} | |")
    return "\n".join(lines)


def over_rows(rows, key, how):
    """how (a mean, a spread) of the rows' values of key; None where a row has none."""
    values = [r[key] for r in rows]
    return None if None in values else how(values)


def headline(out, model, seeds, jobs, extra, problems=None):
    """--headline: the default run and its token-only ablation over seeds (see the docstring)."""
    t0 = time.time()
    train_all(out, model, jobs, seeded_runs(HEADLINE, seeds), extra)
    rows = headline_rows(out, seeds, problems)
    write_jsonl(os.path.join(out, "headline.jsonl"), rows)
    write_text(os.path.join(out, "headline.md"), f"# The default run from {os.path.relpath(model)}, seeds 0..{seeds - 1}"
               f"\n\n{headline_markdown(rows)}\n\n{wall_time(t0)}\n")
    print(f"wrote {os.path.join(out, 'headline.md')}")


def curves(out, names, seeds, path):
    """Reward and grad-norm curves per step of the given runs, means over seeds (Figure 5)."""
    plt = pyplot("plots")
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name in names:
        logs = []
        for k in range(seeds):
            log = rundir.read_log(os.path.join(out, "runs", run_name(name, k), "log.jsonl"))
            logs.append({s["step"]: s for s in log if "reward" in s})
        x = sorted(set.intersection(*(set(log) for log in logs)))
        axes[0].plot(x, smooth([statistics.fmean(log[i]["reward"] for log in logs) for i in x]), label=name)
        for ax, key in ((axes[1], "grad_norm_token"), (axes[2], "grad_norm_mem")):  # null: not measured that step
            pts = [(i, statistics.fmean(log[i][key] for log in logs)) for i in x
                   if all(log[i].get(key) is not None for log in logs)]
            if pts:
                ax.plot(*zip(*pts), label=name)
    for ax, title in zip(axes, [f"reward (moving mean of 5{f', mean of {seeds} seeds' if seeds > 1 else ''})",
                                "grad norm of L_token", "grad norm of L_mem"]):
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def accuracy_vs_rate(curves_by_label, path):
    """Accuracy against ε, one line per label (Figure 6); error bars as in eval.error_bar."""
    plt = pyplot("plots")
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for label, rows in curves_by_label.items():
        pts = sorted((r["eviction_rate"], r["accuracy"], evaluation.error_bar(r)) for r in rows)
        ax.errorbar(*list(zip(*pts))[:2], yerr=[p[2] for p in pts], marker="o", capsize=3, label=label)
    ax.set_xlabel("eviction rate ε")
    ax.set_ylabel("held-out pass@1")
    ax.set_title(evaluation.error_bar_note(next(iter(curves_by_label.values()))), fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def smooth(xs, n=5):
    return [sum(xs[max(0, i - n + 1): i + 1]) / len(xs[max(0, i - n + 1): i + 1]) for i in range(len(xs))]


def markdown(rows) -> str:
    """pass@1 as mean ± standard deviation across seeds (one seed: no ±), then one evaluation's
    1 SE over problems (the mean over seeds)."""
    lines = ["| run | policy | ε | pass@1 | SE | length | rounds | peak-KV reduction |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spread = f" ± {100 * r['accuracy_sd']:.1f}" if r["seeds"] > 1 else ""
        lines.append(f"| {r['run']} | {r['policy']} | {r['eviction_rate']:g} | {r['accuracy']:.1%}{spread} | "
                     f"{100 * r['accuracy_se']:.1f} | {r['length']:.0f} | {r['rounds']:.2f} | {r['kv_reduction']:.2f}x |")
    return "\n".join(lines)


def claims_markdown(studies) -> str:
    """The paper's Countdown claims (§5.2-5.3, the numbers its text states) beside this run's, each
    with a goal: pass@1 means over seeds, ± their standard deviation across seeds where there are
    several; "met" says whether this run reaches the goal."""
    def at(study, policy, rate=0.5):
        return next(r for r in studies[study] if r["policy"] == policy and r["eviction_rate"] == rate)

    def cell(r):
        return f"{r['accuracy']:.1%}" + (f" ± {100 * r['accuracy_sd']:.1f}" if r["seeds"] > 1 else "")

    def ratio(a, b):
        return a["accuracy"] / max(b["accuracy"], 1e-9)

    before, trained = at("untrained", "none", 0.0), at("baselines", "none", 0.0)
    ngc, full, greedy = at("ngc", "ngc"), at("ngc", "none", 0.0), at("greedy", "ngc")
    both = studies["baselines"] + studies["ngc"]  # each baseline on the no-evict model and on NGC's own
    best, rule = best_of(both, AGNOSTIC), best_of(both, RULES)
    own_best, oracle = best_of(studies["ngc"], BASELINES), at("ngc", "oracle")
    gap = (ngc["accuracy"] - own_best["accuracy"]) / max(oracle["accuracy"] - own_best["accuracy"], 1e-9)
    token, dropout = at("token-only", "ngc"), at("targeted-dropout", "ngc")
    tried = sorted({r["eviction_rate"] for r in studies["sweep-baselines"]})
    margin = {e: at("sweep", "ngc", e)["accuracy"] - max(r["accuracy"] for r in studies["sweep-baselines"]
                                                          if r["eviction_rate"] == e) for e in tried}
    rows = [("the model learns to reason", "R1 near 0 → trained",
             "full cache before training ≤ 75%; no-evict training adds ≥ 15 points",
             f"full cache before training {cell(before)}, after no-evict training {cell(trained)} "
             f"({100 * (trained['accuracy'] - before['accuracy']):+.1f} points)",
             before["accuracy"] <= 0.75 and trained["accuracy"] - before["accuracy"] >= 0.15),
            ("NGC keeps the reasoning under a smaller peak cache", "49.6% at 2.4×",
             "NGC at ε = 0.5 ≥ 70% of the no-evict model's full cache, at ≥ 2×",
             f"{cell(ngc)} at {ngc['kv_reduction']:.2f}× ({ratio(ngc, trained):.0%} of {cell(trained)}; untrained "
             f"{cell(at('untrained', 'ngc'))}); greedy tokens {cell(greedy)}",
             ratio(ngc, trained) >= 0.7 and ngc["kv_reduction"] >= 2),
            ("training NGC keeps the full cache's reasoning", "(not stated)",
             "NGC's own full cache at least the starting model's",
             f"{cell(full)} against {cell(before)} before training", full["accuracy"] >= before["accuracy"]),
            ("NGC beats every baseline", "2.3× the next best (49.6% vs 21.2%)",
             "≥ 2× the best task-agnostic baseline (heuristics, random, random-prompt) on either model",
             f"best {best['policy']} {cell(best)} on {model_of(best)}: NGC is {ratio(ngc, best):.1f}× it; "
             f"on NGC's own model the best baseline is {own_best['policy']} {cell(own_best)}, and NGC closes "
             f"{gap:.0%} of the gap from it to the oracle there ({cell(oracle)})", ratio(ngc, best) >= 2),
            ("NGC beats a hand-written rule", "(no such baseline)",
             "above the best task rule (task-rule, number-rule) on either model by more than 2 SE",
             f"best {rule['policy']} {cell(rule)} on {model_of(rule)}: NGC "
             f"{100 * (ngc['accuracy'] - rule['accuracy']):+.1f} points (2 SE = {100 * two_se(ngc, rule):.1f})",
             ngc["accuracy"] - rule["accuracy"] > two_se(ngc, rule)),
            ("the token policy learns to write for eviction", "token-only 35.7% (72% of NGC)",
             "token-only below NGC and ≥ 3× targeted dropout",
             f"token-only {cell(token)}: {ratio(token, ngc):.0%} of NGC, {ratio(token, dropout):.1f}× targeted dropout",
             token["accuracy"] < ngc["accuracy"] and ratio(token, dropout) >= 3),
            ("off-policy training fails", "targeted dropout 2.5%", "targeted dropout far below token-only (≤ ⅓ of it)",
             f"targeted dropout {cell(dropout)}", ratio(dropout, token) <= 1 / 3),
            interoception_claim(studies, at, cell),
            ("NGC generalises to unseen rates", "pareto-dominates the baselines", "above every baseline at every ε tried",
             "NGC's margin over the best baseline: " + ", ".join(f"ε = {e:g} {100 * m:+.1f} points"
                                                                  for e, m in margin.items()),
             all(m > 0 for m in margin.values())),
            layout_claim(studies, at, cell, ratio(ngc, full))]
    met = {True: "yes", False: "**no**", None: "-"}
    return "\n".join(["| claim | paper (§5.2-5.3) | goal | here, pass@1 | met |", "|---|---|---|---|---|"]
                     + [f"| {a} | {b} | {g} | {c} | {met[m]} |" for a, b, g, c, m in rows])


def best_of(rows, policies):
    """The row of the strongest of these policies among rows."""
    return max((r for r in rows if r["policy"] in policies), key=lambda r: r["accuracy"])


def model_of(row) -> str:
    return "the no-evict model" if row["run"] == "no-evict" else "NGC's own model"


def two_se(a, b) -> float:
    """2 SE of the difference of two evaluations' pass@1 (each one evaluation's SE over problems)."""
    return 2 * (a["accuracy_se"] ** 2 + b["accuracy_se"] ** 2) ** 0.5


def layout_claim(studies, at, cell, kept):
    """The layout row: NGC on prompt layouts never trained on (of the training prompts' length, so
    rounds fire at the same tokens), as a fraction of the full cache there (kept: the same fraction
    on the training layouts), and against the untrained model's NGC scores there."""
    claim, paper, goal = ("what NGC keeps, not where it sits", "(R1's prompts vary)",
                          "on layouts never trained on, NGC at ε = 0.5 keeps ≥ 70% of the full cache there, "
                          "above the untrained model's score there")
    if "shifted-ngc" not in studies:
        return claim, paper, goal, "not measured (the model's prompt has one layout)", None
    s_ngc, s_full, s_before = at("shifted-ngc", "ngc"), at("shifted-ngc", "none", 0.0), at("shifted-untrained", "ngc")
    s_best = best_of(studies["shifted-baselines"], BASELINES)
    share = s_ngc["accuracy"] / max(s_full["accuracy"], 1e-9)
    return (claim, paper, goal, f"NGC {cell(s_ngc)} of a full cache's {cell(s_full)} ({share:.0%}; training layouts "
            f"{kept:.0%}); untrained {cell(s_before)}; best baseline there {s_best['policy']} {cell(s_best)}",
            share >= 0.7 and s_ngc["accuracy"] > s_before["accuracy"])


def interoception_claim(studies, at, cell):
    """The interoception row: the tagged model against its blind control at the strictest ε, and
    the tag check (the same model and ε under other tags)."""
    claim, paper, goal = ("interoception helps beyond the training budgets", "+8-13 points",
                          "≥ +5 points over the blind control at a stricter ε, beyond 2 SE")
    if "interoception" not in studies:
        return claim, paper, goal, "not measured (--no-interoception)", None
    e = INTERO_SWEEP[-1]
    tagged, blind = at("interoception", "ngc", e), at("interoception-blind", "ngc", e)
    lift = tagged["accuracy"] - blind["accuracy"]
    same = [at("interoception", "ngc", TAG_CHECK)] + [at(f"tag-{t}", "ngc", TAG_CHECK) for t in ("0.25", "blind")]
    reads = ", ".join(f"tag {t} {cell(r)} (length {r['length']:.0f})" for t, r in zip([f"{TAG_CHECK:g}", "0.25", "-"], same))
    return (claim, paper, goal, f"ε = {e:g}: {cell(tagged)} vs blind {cell(blind)} ({100 * lift:+.1f} points, "
            f"2 SE = {100 * two_se(tagged, blind):.1f}); the same model at ε = {TAG_CHECK:g} under three tags: {reads}",
            lift >= 0.05 and lift > two_se(tagged, blind))


@exits  # a training run that fails ends the script with one line
def main(argv=None):
    try:
        run_studies(argv)
    except Interrupted as e:
        again = shlex.join(["python", "reproduce.py", *(sys.argv[1:] if argv is None else argv)])
        print(f"{e}: stopped; finished runs and evaluations are kept and interrupted runs saved their step: "
              f"run the same command to continue ({again})", file=sys.stderr)
        raise Exit(128 + e.signum)


def run_studies(argv=None):
    """The studies of the module docstring (main adds what SIGINT and SIGTERM do)."""
    p = parser(__doc__)
    p.add_argument("--out", default=os.path.join("results", "back"),
                   help="directory for runs/, *.jsonl, *.png and summary.md (default: results/back, tiny/'s)")
    p.add_argument("--model", default=os.path.join(HERE, "tiny"), help="the starting checkpoint (default: tiny/)")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 of every run (default 1)")
    p.add_argument("--jobs", type=int, default=1, help="training runs at a time (CPU threads are shared out)")
    p.add_argument("--train-args", default="", help="extra train.py flags for every run, e.g. '--steps 60'")
    p.add_argument("--no-interoception", action="store_true", help="leave out the interoception runs and section 4 "
                   "(the two slowest runs)")
    p.add_argument("--ablation-seeds", type=int, help="seeds of the ablation runs (default: --seeds)")
    p.add_argument("--interoception-seeds", type=int, help="seeds of the interoception pair (default: "
                   "--ablation-seeds)")
    p.add_argument("--samples", type=int, default=2, help="sampled completions per problem for pass@1 (default 2, "
                   "for the CPU's budget; eval.py's default is the run's 4)")
    p.add_argument("--problems", type=int, help="held-out problems per evaluation (default: the run's eval_problems, "
                   "the first 200 of tiny/'s 278)")
    p.add_argument("--limit", action="store_true", help="also train the limit study's recipes (seed 0) and tabulate "
                                                         "their evaluations during training")
    p.add_argument("--headline", action="store_true", help="train only the default run and token-only, "
                                                            "--seeds of each, and write headline.md")
    p.add_argument("--diagnose", action="store_true", help="train only the diagnosis runs (seed 0) and write "
                                                            "diag/ under --out")
    args = p.parse_args(argv)
    args.ablation_seeds = args.ablation_seeds or args.seeds
    args.interoception_seeds = args.interoception_seeds or args.ablation_seeds
    for flag in ("jobs", "seeds", "ablation_seeds", "interoception_seeds", "problems", "samples"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            sys.exit(f"error: --{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    extra = args.train_args.split()
    if args.diagnose:
        runs = diagnose_runs()
    elif args.headline:
        runs = seeded_runs(HEADLINE, args.seeds)
    else:
        runs = study_runs(args.seeds, args.ablation_seeds, 0 if args.no_interoception else args.interoception_seeds)
        if args.limit:
            runs.update({limit_dir(name): flags for name, flags in LIMIT.items()})
    try:
        check_runs(args.out, args.model, runs, args.jobs, extra)
        make_output_dir(args.out)
    except ValueError as e:  # CheckpointError too
        sys.exit(f"error: {e}")
    if args.diagnose:
        return diagnose(args.out, args.model, args.jobs, extra)
    if args.headline:
        return headline(args.out, args.model, args.seeds, args.jobs, extra, args.problems)
    t0 = time.time()
    train_all(args.out, args.model, args.jobs, runs, extra)
    sections = []

    samples = ["--samples", str(args.samples)]

    def study(name, title, run, policies, rates, extra=(), seeds=args.seeds):
        rows = over_seeds([r for k in range(seeds) for r in eval_study(args.out, name, run, policies, rates, k,
                                                                        args.problems, [*samples, *extra],
                                                                        args.model)])
        sections.append(f"## {title}\n\n{markdown(rows)}\n")
        path = os.path.join(args.out, name)
        write_jsonl(path + ".jsonl", rows)
        if have("matplotlib"):
            evaluation.plot(rows, path + ".png")
        return rows

    studies = {}
    studies["untrained"] = study("untrained", "0. Before training: the starting model's full cache, and NGC's scores "
                                 "untrained", UNTRAINED, ["none", "ngc"], [0.5], seeds=1)
    studies["baselines"] = study("baselines", "1. The baselines at ε = 0.5 on the no-evict model (the paper's "
                                 "heuristics, random, random-prompt, the task rule) and the oracle", "no-evict",
                                 ["none", *BASELINES, "oracle"], [0.5])
    studies["ngc"] = study("baselines-ngc", "1. NGC on its own model, with the oracle and the strongest simple "
                           "baselines there", "ngc", ["none", "ngc", "oracle", *RULES, "random"], [0.5])
    studies["greedy"] = study("greedy", "1. Greedy tokens (the second column): NGC on its model", "ngc",
                              ["none", "ngc"], [0.5], ["--samples", "0"])
    sweep = study("sweep", "2. Stricter ε than training saw: NGC (seed 0)", "ngc", ["ngc"], SWEEP, seeds=1)
    heuristics = study("sweep-heuristics", "2. Stricter ε: the strongest baselines on the no-evict model (seed 0)",
                       "no-evict", STRONGEST, SWEEP[1::2], seeds=1)
    if have("matplotlib"):  # Figure 3 (right): trained NGC against the baselines, full cache as the line
        evaluation.plot(studies["baselines"][:1] + sweep + heuristics, os.path.join(args.out, "ngc-vs-heuristics.png"))
    studies["sweep"], studies["sweep-baselines"] = sweep, heuristics
    few = args.ablation_seeds
    for run in ["token-only", "targeted-dropout"]:
        studies[run] = study(f"ablation-{run}", f"3. Ablation: {run}", run, ["none", "ngc"], [0.5], seeds=few)
    if have("matplotlib"):
        curves(args.out, ["ngc", "token-only", "targeted-dropout"], few, os.path.join(args.out, "ablations.png"))
    if not args.no_interoception:
        plain = study("interoception-ngc", "4. Plain NGC at the interoception rates", "ngc", ["ngc"], INTERO_SWEEP,
                      seeds=args.interoception_seeds)
        intero = study("interoception", "4. Budget-aware interoception across ε", "interoception", ["ngc"],
                       INTERO_SWEEP, seeds=args.interoception_seeds)
        blind = study("interoception-blind", "4. Its control: the same per-group ε, the tag without the rate",
                      "interoception-blind", ["ngc"], INTERO_SWEEP, seeds=args.interoception_seeds)
        studies["interoception"], studies["interoception-blind"] = intero, blind
        for tag in ("0.25", "blind"):  # does the model read the tag? The same ε, another tag
            studies[f"tag-{tag}"] = study(f"tag-{tag}", f"4. The interoception model at ε = {TAG_CHECK:g} with the "
                                          f"tag {tag}", "interoception", ["ngc"], [TAG_CHECK], ["--tag", tag], seeds=args.interoception_seeds)
        if have("matplotlib"):
            accuracy_vs_rate({"NGC": plain, "NGC + interoception": intero, "NGC + blind tag (control)": blind},
                             os.path.join(args.out, "interoception-vs-ngc.png"))
    unseen = countdown.SHIFTED.get(settings.run_defaults(args.model).prompt)  # None: a prompt of one layout
    if unseen:
        studies["shifted-ngc"] = study("shifted-ngc", f"6. Prompt layouts never used in training ({unseen}): NGC",
                                       "ngc", ["none", "ngc"], [0.5], ["--prompt", unseen])
        studies["shifted-untrained"] = study("shifted-untrained", "6. The same layouts: the starting model",
                                             UNTRAINED, ["none", "ngc"], [0.5], ["--prompt", unseen], seeds=1)
        studies["shifted-baselines"] = study("shifted-baselines", "6. The same layouts: the strongest baselines on "
                                             "the no-evict model (seed 0)", "no-evict",
                                             ["none", *STRONGEST, "oracle"], [0.5], ["--prompt", unseen], seeds=1)
    claims = claims_markdown(studies)
    write_text(os.path.join(args.out, "claims.md"), f"# The paper's Countdown claims on {os.path.relpath(args.model)}"
               f" ({args.seeds} seeds)\n\n{claims}\n")
    sections.insert(0, f"## 0. The paper's claims\n\n{claims}\n")
    if args.limit:
        rows = limit_rows(args.out)
        sections.append(f"## 5. How far can NGC go? The limit study (seed 0, evaluations during training)\n\n"
                        f"{limit_markdown(rows)}\n")
        write_jsonl(os.path.join(args.out, "limit.jsonl"), rows)
    print(f"[{time.strftime('%H:%M:%S')}] show: what ngc forgets", flush=True)
    forgets = os.path.join(args.out, "forgets")
    show.main(["--model", os.path.join(args.out, "runs", "ngc", "checkpoint"), "--before", args.model,
               "--out", forgets + ".html"] + (["--png", forgets + ".png"] if have("matplotlib") else []))
    summary = os.path.join(args.out, "summary.md")
    seeds = f"seeds 0..{args.seeds - 1}, accuracy as mean ± standard deviation across seeds; " if args.seeds > 1 else ""
    k = studies["ngc"][0]["samples"]
    write_text(summary, f"# Reproduction on {os.path.relpath(args.model)}\n\n({seeds}pass@1 over {k} sampled "
               f"completions per problem unless a section says greedy, evictions greedy top-K, "
               f"{studies['ngc'][0]['problems']} held-out problems; SE: one evaluation's standard error over "
               f"problems, in points)\n\n" + "\n".join(sections)
               + f"\n![what ngc forgets](forgets.png)\n\n{wall_time(t0)}\n")
    print(f"wrote {summary}")


if __name__ == "__main__":
    main()
