"""A run directory: log.jsonl and checkpoint/, kept whole through crashes, signals and resumes.

checkpoint/ is a Hugging Face model directory plus ngc.json (the run's settings) and trainer.pt
(the step and the optimizer state). It is replaced by a swap (files.swap_in) that leaves a
complete checkpoint at every instant. log.jsonl holds one JSON object per line: a record per
optimizer step and one per held-out evaluation. SIGINT and SIGTERM stop the run between an
update and the next, never between an update and its record, so a resume continues with
exactly the steps an uninterrupted run would have taken.

The training loop runs inside guard(): a signal, a diverging run or a failed save ends it in
RunStopped, carrying the one line and the exit code the script ends with (cli.exits).
"""
import contextlib
import json
import math
import os
import shutil
import signal

import torch
from tqdm import tqdm

import distributed
from checkpoint import CheckpointError, save_pretrained, save_tokenizer
from cli import Exit
from files import recover_swap, swap_in, write_json, write_jsonl

RUN_FILES = ("log.jsonl", "checkpoint", "checkpoint.tmp", "checkpoint.old")


def check_run_dir(out: str, resume: bool, overwrite: bool):
    """A new run never writes into a directory that holds another run, unless --overwrite; a run
    directory that cannot be created or written is a one-line error before anything starts."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file; the run directory must be a directory")
    if not resume and os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ValueError(f"{out} already holds a run; continue it with --resume {out}, choose another --out, "
                         f"or pass --overwrite to start afresh there")
    parent = out if os.path.isdir(out) else os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot create or write the run directory {out}: {parent} is not a writable directory")


def prepare(out: str, overwrite: bool, step: int, saved_settings: dict | None, settings: dict) -> list[dict]:
    """Create the run directory (with --overwrite, remove the earlier run's files first) and keep
    the log records of the steps before `step`; they are returned. A resume (saved_settings: the
    run's own) prints the settings it changes. A log line that is not JSON raises CheckpointError."""
    if overwrite:
        for name in RUN_FILES:
            path = os.path.join(out, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.path.exists(path) and os.remove(path)
    os.makedirs(out, exist_ok=True)
    kept = keep_log_before(os.path.join(out, "log.jsonl"), step)
    changed = changed_settings(saved_settings or {}, settings)
    if changed:
        tqdm.write(f"note: resuming at step {step} with changed settings: {', '.join(changed)}")
    return kept


def resume_from(run_dir: str, out: str | None, state: dict | None = None):
    """(settings, checkpoint directory, run directory) of the run saved in run_dir."""
    if out and os.path.abspath(out) != os.path.abspath(run_dir):
        raise ValueError(f"--resume continues in {run_dir} itself; drop --out {out} "
                         f"(or copy the run directory there and resume that)")
    return (state or load_trainer_state(run_dir))["config"], os.path.join(run_dir, "checkpoint"), run_dir


# ---------------------------------------------------------------------------------------
# The checkpoint


class Diverged(Exception):
    """A non-finite loss, gradient or weight: the run stops and no checkpoint holds it."""


def save_checkpoint(run_dir, model, opt, tokenizer, source_dir, step: int, settings: dict):
    """Write checkpoint/ for the state after `step` optimizer steps, by a swap. Every process
    calls this (FSDP gathers the shards); the first one writes. Weights that are not finite are
    never written (Diverged), so the checkpoint on disk stays the last finite one."""
    model_state, opt_state = distributed.full_state(model, opt)
    if distributed.rank_and_world()[0] != 0:
        return
    if not all(bool(torch.isfinite(t).all()) for t in model_state.values() if t.is_floating_point()):
        raise Diverged(f"the weights after step {step} are not finite")
    final = os.path.join(run_dir, "checkpoint")
    tmp = final + ".tmp"
    recover_swap(final)
    save_pretrained(model, tmp, model_state)
    save_tokenizer(tokenizer, tmp, model.config, source_dir)
    write_json(os.path.join(tmp, "ngc.json"), settings)
    torch.save({"step": step, "optimizer": opt_state, "config": settings}, os.path.join(tmp, "trainer.pt"))
    swap_in(final)


def load_trainer_state(run_dir) -> dict:
    """The step, optimizer state and settings of the run saved in run_dir (finishing or undoing
    a checkpoint swap that a crash interrupted)."""
    recover_swap(os.path.join(run_dir, "checkpoint"))
    path = os.path.join(run_dir, "checkpoint", "trainer.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"nothing to resume in {run_dir!r}: it has no checkpoint/trainer.pt")
    try:
        state = torch.load(path, weights_only=False)
        return {k: state[k] for k in ("step", "optimizer", "config")}
    except Exception as e:  # a truncated or foreign file
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                              f"it is not a trainer state this code wrote")


def changed_settings(saved: dict, now: dict) -> list[str]:
    """'name old → new' for each setting a resume changes."""
    return [f"{k} {saved[k]} → {now[k]}" for k in saved if k in now and now[k] != saved[k]]


# ---------------------------------------------------------------------------------------
# The log: one JSON object per line, every step record with the keys train.step_gradients gives it


def json_safe(value):
    """NaN and ±inf are not JSON: they are written as null."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_log(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")


def read_log(path) -> list[dict]:
    """The records of log.jsonl; a last line cut short by a crash is dropped, any other bad line is an error."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().splitlines()
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                print(f"note: dropping the unfinished last line of {path}")
                break
            raise CheckpointError(f"{path} line {i + 1} is not JSON; repair or remove that line")
    return records


def keep_log_before(path, step) -> list[dict]:
    """On resume, keep the log records of the steps before `step` (later ones will run again);
    they are returned."""
    kept = [r for r in read_log(path) if r["step"] < step]
    write_jsonl(path, kept)
    return kept


# ---------------------------------------------------------------------------------------
# SIGINT and SIGTERM: stop at once and save, but never between an update and its record


class Interrupted(Exception):
    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_held():
    """SIGINT/SIGTERM that arrive inside the block are delivered when it ends."""
    if not hasattr(signal, "pthread_sigmask"):  # not on Windows
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT/SIGTERM raise Interrupted inside the block."""
    previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------------------------------
# The run guard: a run that cannot go on ends with one line and an exit code, its checkpoint kept


class RunStopped(Exit):
    """The run stopped before its last step; `status` is the script's exit (cli.Exit)."""


class Run:
    """A run's progress as its guard sees it: `step`, the optimizer steps taken; `saved`, the step
    of the newest checkpoint on disk (None: none yet); write(step) saves the state after `step`."""

    def __init__(self, out: str, write, saved: int | None = None):
        self.out, self.write, self.saved = out, write, saved
        self.step = 0 if saved is None else saved

    def save(self):
        self.write(self.step)
        self.saved = self.step

    def try_save(self):
        """A periodic save that fails (disk full, ...) keeps the previous checkpoint and training goes on."""
        try:
            self.save()
        except OSError as e:
            tqdm.write(f"warning: could not save step {self.step} ({e}); the previous checkpoint is kept")


def check_finite(values: dict):
    """Diverged unless every value (None: not measured) is finite."""
    checked = {k: v for k, v in values.items() if v is not None}
    if not all(map(math.isfinite, checked.values())):
        raise Diverged(", ".join(f"{k} {v:.4g}" for k, v in checked.items()))


@contextlib.contextmanager
def guard(run: Run, lr: float, fsdp: bool, say=tqdm.write):
    """The training loop of `run` runs inside; what stops it ends in RunStopped. SIGINT/SIGTERM
    (Interrupted): the state after run.step steps is saved (not under --fsdp) and the exit code is
    128 + signum. Diverged, and an OSError of a save: a one-line error (exit code 1) that says
    which checkpoint is kept. say prints (the first process's tqdm.write)."""
    with stop_on_signals():
        try:
            yield run
        except Interrupted as e:
            if fsdp:  # saving is a collective, and the processes may be inside different ones now
                say(f"\n{e}: with --fsdp a signal does not save; resume from the last periodic checkpoint")
                raise RunStopped(128 + e.signum)
            with signals_held():
                run.try_save()
            say(f"\n{e}: saved step {run.step} to {run.out}/checkpoint; continue with --resume {run.out}")
            raise RunStopped(128 + e.signum)
        except Diverged as e:
            kept = f"the checkpoint of step {run.saved} is kept" if run.saved is not None else "no checkpoint was written"
            raise RunStopped(f"error: training diverged at step {run.step + 1} ({e}); {kept} in {run.out}; "
                             f"lower --lr (now {lr:g})")
        except OSError as e:
            raise RunStopped(f"error: could not save the checkpoint in {run.out} ({e}); the previous one, if any, is kept")
