"""One-factor screen: variants of a recipe trained from one seed, each beside its token-only run, in one table.

    python screen.py --out results/screen --variant shipped tiny --variant joint tiny --mem-norm joint \\
        --variant joint-x8 tiny --mem-norm joint --mem-weight 8 --variant slip0 models/slip0

A row is `--variant NAME MODEL_DIR [TRAIN_FLAGS ...]`: the words up to the next --variant are the train.py
flags that define it, the rest of the recipe is the model's ngc.json; screen.py's own flags come first.
Per variant, as child processes (consoles in OUT/runs/*.log, OUT/evals/*.log):

    runs/NAME-ngc          train.py --model MODEL_DIR TRAIN_FLAGS --term-grad-norms --eval-every STEPS
    runs/NAME-token-only   the same in --mode token-only, shared by variants that differ only in L_mem's
                           settings (--mem-norm, --mem-weight)
    evals/NAME-untrained   eval.py --policy task-rule random --eviction-rate 0.5 on MODEL_DIR, the run's
                           held-out problems and samples, shared by variants that evaluate alike

then OUT/screen.md and OUT/screen.jsonl, rewritten after each row: pass@1 (%) with the full cache and at
ε = 0.5, before → after (train.py's evaluations at step 0 and the last step, ± 1 SE over problems), the
same for token-only, the task rule and random untrained; over the ngc run's steps, the mean share of
groups with all-zero advantages, the mean ‖∇L_mem‖/‖∇L_token‖ (steps with ‖∇L_token‖ = 0 aside) and the
minutes of its training steps.

All checks come before any work. A rerun of the same command trains nothing twice: a run whose log holds
an evaluation at its last step is reused, an interrupted one resumed (train.py --resume), an evaluation
reused when its arguments are the same (evals/*.argv); a run directory holding a run with other
settings is refused. Ctrl-C lets the running child save its step, then exits 130.

--threads N is each child's: train.py's --threads, and OMP_NUM_THREADS for eval.py (default: torch's).
"""
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace

import rundir
import settings
import tasks
import train
from checkpoint import load_config
from cli import Exit, Interrupted, exits, make_output_dir, one_line_errors, parser
from files import recover_swap, write_jsonl, write_text

HERE = os.path.dirname(os.path.abspath(__file__))
RATE = 0.5  # the ε every row is compared at
L_MEM_ONLY = ("--mem-norm", "--mem-weight")  # settings only L_mem reads: a token-only run ignores them
SET_HERE = ("model", "out", "resume", "overwrite", "task", "mode", "eval_every", "term_grad_norms")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class Run:
    dir: str  # run directory
    argv: list[str]  # train.py's flags after --model/--out or --resume
    model: str
    steps: int
    saved: dict  # the settings it saves (ngc.json)


@dataclass
class Variant:
    name: str
    model: str
    flags: list[str]
    ngc: Run
    token_only: Run
    evals: str  # eval.py's rows of the untrained model
    eval_argv: list[str]


def split_variants(argv):
    """(screen's flags, [[NAME, MODEL_DIR, train flags...], ...]): argv cut at each --variant."""
    cuts = [i for i, a in enumerate(argv) if a == "--variant"]
    return argv[:cuts[0] if cuts else len(argv)], [argv[i + 1:j] for i, j in zip(cuts, cuts[1:] + [len(argv)])]


def resolve(model, flags, out) -> settings.Settings:
    """train.py's settings for a fresh run of flags in out (a ValueError for what train.py refuses)."""
    return train.resolve(train.parse_args(["--model", model, "--out", out, *flags, "--overwrite"]))


def check_flags(flags):
    fixed = [k for k in SET_HERE if getattr(train.parse_args(flags), k) not in (None, False)]
    if fixed:
        raise ValueError(f"--{fixed[0].replace('_', '-')} is the screen's to set")


def check_comparable(model, c):
    """A ValueError for a run the screen cannot compare with the others and with eval.py's baselines."""
    rate = c.eval_rate or train.final_eviction_rate(c)
    if c.task != "countdown" or not c.eval_samples or rate != RATE:
        raise ValueError(f"the screen compares Countdown's pass@1 over sampled completions at ε = {RATE}; this run "
                         f"is {c.task}, eval_samples {c.eval_samples}, evaluated at ε = {rate:g} (add --eval-rate {RATE})")
    untrained = settings.run_defaults(model)  # what eval.py reads: its held-out problems must be the run's
    if tasks.data_seed(c) != tasks.data_seed(untrained):
        raise ValueError(f"it holds out other problems than eval.py evaluates {model} on (its ngc.json's seed and "
                         f"data seed); the baselines need the run's")


def eval_argv(model, c) -> list[str]:
    """eval.py's flags for the baselines on the untrained model: the run's held-out problems, samples and layout."""
    return ["--model", os.path.relpath(model), "--policy", "task-rule", "random", "--eviction-rate", str(RATE),
            "--problems", str(c.eval_problems), "--samples", str(c.eval_samples), "--prompt", c.prompt,
            "--delta", str(c.delta), "--block", str(c.block), "--window", str(c.window)] + (
            ["--difficulty", c.difficulty] if c.difficulty != settings.run_defaults(model).difficulty else [])


def check_run(run: Run):
    """A run directory that holds a checkpoint must hold this run (its ngc.json: the same settings)."""
    checkpoint = os.path.join(run.dir, "checkpoint")
    recover_swap(checkpoint)  # a save cut short by a crash: its whole copy back, as a resume would
    if not os.path.isdir(checkpoint):
        return
    changed = [c for c in rundir.changed_settings(settings.read_ngc_json(checkpoint), run.saved)
               if not c.startswith("threads ")]  # threads change the bits, not the run
    if changed:
        raise ValueError(f"{run.dir} holds a run with other settings ({', '.join(changed[:3])}); "
                         f"delete it to train it again, or give another --out")


def without_l_mem(flags):
    """flags without L_MEM_ONLY's and their values."""
    out, skip = [], False
    for f in flags:
        if not skip and f.split("=")[0] not in L_MEM_ONLY:
            out.append(f)
        skip = not skip and f in L_MEM_ONLY  # its value is the next word
    return out


def plan(out, specs, threads) -> list[Variant]:
    """Every variant's runs and evaluation, each checked; shared runs and evaluations are one object."""
    runs, evals, variants = {}, {}, []

    def run(name, model, flags, mode, c):  # the run, or the one with the same settings already planned
        d = os.path.join(out, "runs", f"{name}-{mode}")
        argv = [*flags, "--mode", mode, "--eval-every", str(c.steps)] + (["--term-grad-norms"] if mode == "ngc" else [])
        saved = settings.saved(resolve(model, argv, d))
        key = (os.path.abspath(model), *sorted(saved.items()))
        if mode == "ngc" and key in runs:
            raise ValueError(f"the same run as variant {os.path.basename(runs[key].dir).removesuffix('-ngc')}")
        return runs.setdefault(key, Run(d, argv, model, c.steps, saved))

    for spec in specs:
        if len(spec) < 2 or spec[1].startswith("--"):
            raise ValueError(f"--variant {' '.join(spec)}: give --variant NAME MODEL_DIR [TRAIN_FLAGS ...]")
        name, model, flags = spec[0], spec[1], spec[2:] + (["--threads", str(threads)] if threads else [])
        if not NAME.match(name) or name in [v.name for v in variants]:
            raise ValueError(f"variant name {name!r} " + ("is used twice" if NAME.match(name) else
                                                          "must be letters, digits, '.', '_' or '-'"))
        try:
            load_config(model)  # a CheckpointError for a missing or foreign directory
            check_flags(spec[2:])
            c = resolve(model, flags, os.path.join(out, "runs", f"{name}-ngc"))
            check_comparable(model, c)
            baselines = eval_argv(model, c)
            path = evals.setdefault(tuple(baselines), os.path.join(out, "evals", f"{name}-untrained.jsonl"))
            variants.append(Variant(name, model, spec[2:], run(name, model, flags, "ngc", c),
                                    run(name, model, without_l_mem(flags), "token-only", c), path, baselines))
        except ValueError as e:  # CheckpointError too
            raise ValueError(f"variant {name}: {e}") from None
    for r in runs.values():
        check_run(r)
    return variants


def child(cmd, log_path):
    """Run cmd (its output appended to log_path) in its own session, so that Ctrl-C reaches it once,
    from here: a train.py child then saves its step before it ends. A failure is an Exit."""
    short = lambda a: os.path.relpath(a) if os.path.isabs(a) and not os.path.relpath(a).startswith("..") else a
    print(f"[{time.strftime('%H:%M:%S')}] {' '.join(map(short, cmd[1:]))}", flush=True)
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait()
        except Interrupted as e:  # the child saves its step, then this ends
            proc.send_signal(e.signum)
            proc.wait()
            raise
    if code:
        raise Exit(f"error: {os.path.basename(cmd[1])} failed (exit {code}); see {log_path}")


def finished(run: Run) -> bool:
    """Whether the run's log holds an evaluation after its last step."""
    return any("eval" in r and r["step"] == run.steps for r in rundir.read_log(os.path.join(run.dir, "log.jsonl")))


def train_run(run: Run):
    if finished(run):
        print(f"reused {run.dir}", flush=True)
        return
    saved = os.path.isdir(os.path.join(run.dir, "checkpoint"))  # else it never saved: start afresh
    where = ["--resume", run.dir] if saved else ["--model", run.model, "--out", run.dir, "--overwrite"]
    os.makedirs(os.path.dirname(run.dir), exist_ok=True)
    child([sys.executable, os.path.join(HERE, "train.py"), *where, *run.argv], run.dir + ".log")


def evaluate(v: Variant) -> dict:
    """eval.py's rows of the untrained model by policy, reused when its arguments are the same."""
    argv = [*v.eval_argv, "--out", v.evals]
    if not (os.path.exists(v.evals) and os.path.exists(v.evals + ".argv")
            and open(v.evals + ".argv").read().split("\n")[:-1] == argv):
        os.makedirs(os.path.dirname(v.evals), exist_ok=True)
        child([sys.executable, os.path.join(HERE, "eval.py"), *argv], v.evals[:-len(".jsonl")] + ".log")
        write_text(v.evals + ".argv", "\n".join(argv) + "\n")
    else:
        print(f"reused {v.evals}", flush=True)
    with open(v.evals) as f:
        return {r["policy"]: r for r in map(json.loads, f)}


def before_after(run: Run) -> dict:
    """pass@1 with the full cache and at ε (± 1 SE), at step 0 and the last step, from the run's log."""
    evals = {r["step"]: r["eval"] for r in rundir.read_log(os.path.join(run.dir, "log.jsonl")) if "eval" in r}
    return {f"{k}_{when}{se}": evals[step][key + se] for k, key in (("full", "pass1_full"), ("eps", "pass1"))
            for when, step in (("before", 0), ("after", run.steps)) for se in ("", "_se")}


def row(v: Variant) -> dict:
    """The variant's row (screen.jsonl): flags, pass@1 before/after of both runs, baselines, diagnostics."""
    steps = [r for r in rundir.read_log(os.path.join(v.ngc.dir, "log.jsonl")) if "reward" in r]
    ratios = [s["grad_norm_mem"] / s["grad_norm_token"] for s in steps if s["grad_norm_mem"] is not None
              and s["grad_norm_token"]]
    base = evaluate(v)
    return {"variant": v.name, "model": v.model, "flags": " ".join(v.flags), "ngc_run": v.ngc.dir,
            "token_only_run": v.token_only.dir, "problems": base["random"]["problems"],
            "samples": base["random"]["samples"], **before_after(v.ngc),
            **{f"token_only_{k}": x for k, x in before_after(v.token_only).items()},
            **{f"{p.replace('-', '_')}{se}": base[p][k] for p in ("task-rule", "random")
               for se, k in (("", "accuracy"), ("_se", "se"))},
            "zero_adv_groups": statistics.fmean(s["zero_adv_groups"] for s in steps),
            "grad_ratio": statistics.fmean(ratios) if ratios else None,
            "minutes": sum(s["step_time"] for s in steps) / 60}


def markdown(rows) -> str:
    pct = lambda x: f"{100 * x:.1f}"
    arrow = lambda r, k: f"{pct(r[k + '_before'])} → {pct(r[k + '_after'])} ± {pct(r[k + '_after_se'])}"
    lines = [f"pass@1 (%) over {rows[0]['problems']} held-out problems x {rows[0]['samples']} samples, one seed; "
             f"before → after training ± 1 SE (after); baselines ± 1 SE.", "",
             "| variant | model | train.py flags | full cache | ε = 0.5 | token-only: full cache | token-only: ε = 0.5 "
             "| task rule | random | zero-adv groups | ‖∇L_mem‖/‖∇L_token‖ | train min |", "|" + "---|" * 12]
    flags = lambda r: f"`{r['flags']}`" if r["flags"] else "the recipe"
    for r in rows:
        ratio = "–" if r["grad_ratio"] is None else f"{r['grad_ratio']:.2f}"
        lines.append(f"| {r['variant']} | {r['model']} | {flags(r)} | {arrow(r, 'full')} | {arrow(r, 'eps')} | "
                     f"{arrow(r, 'token_only_full')} | {arrow(r, 'token_only_eps')} | {pct(r['task_rule'])} ± "
                     f"{pct(r['task_rule_se'])} | {pct(r['random'])} ± {pct(r['random_se'])} | "
                     f"{r['zero_adv_groups']:.2f} | {ratio} | {r['minutes']:.1f} |")
    return "\n".join(lines) + "\n"


@exits
def main(argv=None):
    own, specs = split_variants(sys.argv[1:] if argv is None else argv)
    p = parser(__doc__)
    p.add_argument("--out", default=os.path.join("results", "screen"), help="directory for runs/, evals/, "
                   "screen.md and screen.jsonl (default: results/screen)")
    settings.add_flags(p, None, ["threads"], {"threads": "CPU threads of each child, train.py and eval.py "
                                                         "(default: torch's)"})
    p.add_argument("--variant", metavar="NAME MODEL_DIR [TRAIN_FLAGS ...]", help="a row (see above); repeat it")
    args = p.parse_args(own)
    try:
        with one_line_errors():
            if not specs:
                raise ValueError("give at least one --variant NAME MODEL_DIR [TRAIN_FLAGS ...]")
            settings.check(replace(settings.COUNTDOWN, threads=args.threads))  # --threads
            variants = plan(args.out, specs, args.threads)
            make_output_dir(args.out)
        if args.threads:
            os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the children's, eval.py's too (it has no --threads)
        rows = []
        for v in variants:
            train_run(v.ngc)
            train_run(v.token_only)
            rows.append(row(v))
            write_jsonl(os.path.join(args.out, "screen.jsonl"), rows)
            write_text(os.path.join(args.out, "screen.md"), f"# One-factor screen\n\n{markdown(rows)}")
    except Interrupted as e:
        print("interrupted: finished runs are kept, a run in progress saved its step; the same command continues",
              file=sys.stderr)
        raise Exit(128 + e.signum) from None
    print(f"wrote {os.path.join(args.out, 'screen.md')}")


if __name__ == "__main__":
    main()
