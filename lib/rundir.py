"""A run directory: log.jsonl (a record per step and per evaluation) and checkpoint/ (a Hugging
Face model directory, ngc.json and trainer.pt), replaced by a swap. A signal stops a run between
an update and the next, so a resume takes exactly the steps an uninterrupted run would. One process
trains there, holding a flock on `lock` that ends with the process.
"""
import contextlib
import fcntl
import json
import math
import os
import pickle
import re
import shutil
import signal
import sys
import traceback
from pathlib import Path

import torch
from tqdm import tqdm

from lib import distributed, settings
from lib.checkpoint import save_pretrained, save_tokenizer
from lib.cli import STOP_SIGNALS, Error, Interrupted, out_of_memory
from lib.files import recover_swap, swap_in, write_json, write_jsonl

RUN_FILES = ("log.jsonl", "checkpoint", "checkpoint.tmp", "checkpoint.old")
LOCK = "lock"  # not a file of the run: --overwrite keeps it
_held = {}  # run directory (real path) -> the open file that holds its lock


def lock(out: str, check_only: bool = False):
    """Take out's lock (writing this process's id into it); check_only: an Error if it is held."""
    key, path = os.path.realpath(out), os.path.join(out, LOCK)
    if key in _held or (check_only and not os.path.lexists(path)):
        return
    try:
        fd = os.open(path, os.O_RDWR | (0 if check_only else os.O_CREAT), 0o644)
        fcntl.flock(fd, (fcntl.LOCK_SH if check_only else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = Path(path).read_text().strip()  # its id, written just after it took the lock
        raise Error(f"{out} is in use: {'process ' + holder if holder else 'another process'} is "
                    f"training there (it holds {path}); wait for it to end or stop it, or choose "
                    f"another --out") from None
    except OSError as e:
        raise Error(f"cannot open the run directory's lock {path} ({e.strerror}); it must be a "
                    f"file this user can write: fix its permissions or remove it") from None
    if check_only:
        return os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[key] = fd


def check_run_dir(out: str, resume: bool, overwrite: bool):
    """Errors before anything is written: a new run never writes over another run (unless
    --overwrite), nor among files not a run's, nor where another process trains."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise Error(f"--out {out} is a file; the run directory must be a directory")
    if not os.path.isdir(out):
        return
    lock(out, check_only=True)
    names = set() if resume or overwrite else set(os.listdir(out))
    if {"checkpoint", "checkpoint.old"} & names:
        raise Error(f"{out} already holds a run; continue it with --resume {out}, choose another "
                    f"--out, or pass --overwrite to start afresh there")
    if others := sorted(names - {LOCK, *RUN_FILES}):
        raise Error(f"{out} holds files that are not a run's ({', '.join(others[:3])}); choose "
                    f"another --out")


def prepare(out: str, resumed: dict | None, recorded: dict) -> list[dict]:
    """Create the run directory and take its lock; a resume keeps (and returns) the log records
    before its checkpoint's step and prints the settings it changes, a new run removes the files of
    an earlier one."""
    log = os.path.join(out, "log.jsonl")
    earlier = [r for r in read_log(log) if r["step"] < resumed["step"]] if resumed else []
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise Error(f"cannot create the run directory {out} ({e.strerror}); "
                    f"choose another --out") from None
    lock(out)
    for name in RUN_FILES if resumed is None else ():
        path = os.path.join(out, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.path.exists(path) and os.remove(path)
    write_jsonl(log, earlier)  # the later steps will run again
    saved = {**resumed["session"], **resumed["config"]} if resumed else {}
    if changed := changed_settings(saved, recorded):
        tqdm.write(f"note: resuming at step {resumed['step']} with changed settings: "
                   f"{', '.join(changed)}")
    return earlier


def changed_settings(saved: dict, now: dict) -> list[str]:
    """'name old → new' for each setting a resume changes, of those the run recorded."""
    return [f"{k} {saved[k]} → {now[k]}" for k in saved if k in now and now[k] != saved[k]]


# ---- The checkpoint ------------------------------------------------------------------------------
class Diverged(Exception):
    """A non-finite loss, gradient or weight: the run stops and no checkpoint holds it."""


class SaveFailed(Exception):
    """A checkpoint that could not be written, whatever raised; the previous one is kept."""


def save_checkpoint(run_dir, model, opt, tokenizer, source_dir, step: int, settings: dict,
                    session: dict | None = None):
    """Write checkpoint/ for the state after `step` steps, by a swap. Every process calls this
    (FSDP gathers the shards); process 0 writes, never weights that are not finite."""
    model_state, opt_state = distributed.full_state(model, opt)
    if distributed.rank_and_world()[0] != 0:
        return
    if not all(bool(torch.isfinite(t).all())
               for t in model_state.values() if t.is_floating_point()):
        raise Diverged(f"the weights after step {step} are not finite")
    final = os.path.join(run_dir, "checkpoint")
    tmp = final + ".tmp"
    trainer = {"step": step, "optimizer": opt_state, "config": settings, "session": session or {}}
    writes = {"the earlier save's leftovers": lambda: recover_swap(final),
              "config.json and model.safetensors": lambda: save_pretrained(model, tmp, model_state),
              "the tokenizer files": lambda: save_tokenizer(tokenizer, tmp, model.config,
                                                            source_dir),
              "ngc.json": lambda: write_json(os.path.join(tmp, "ngc.json"), settings),
              "trainer.pt": lambda: torch.save(trainer, os.path.join(tmp, "trainer.pt")),
              "the swap into checkpoint/": lambda: swap_in(final)}
    for what, write in writes.items():
        try:
            write()
        except Exception as e:  # a kill runs no handler: the next recover_swap finishes its swap
            with contextlib.suppress(OSError):
                recover_swap(final, finish=False)
            free = f"; {shutil.disk_usage(run_dir).free / 2 ** 20:.0f} MiB free on that disk" \
                if os.path.isdir(run_dir) else ""
            raise SaveFailed(f"could not save step {step}: writing {what} in {tmp} failed "
                             f"({type(e).__name__}: {first_line(e, 200)}){free}") from e


def first_line(e: BaseException, most: int) -> str:
    return (str(e).strip().splitlines() or [""])[0][:most]


def load_trainer_state(run_dir) -> dict:
    """The step, optimizer state, settings and session saved in run_dir."""
    recover_swap(os.path.join(run_dir, "checkpoint"))
    path = os.path.join(run_dir, "checkpoint", "trainer.pt")
    if not os.path.exists(path):
        raise Error(f"nothing to resume in {run_dir!r}: it has no checkpoint/trainer.pt (a run "
                    f"that never saved starts again by its own command)")
    try:  # weights_only: a state is data; a pickle that would run code is refused, never run
        saved = torch.load(path, weights_only=True)
        trainer = {"session": {}, **saved}
        trainer = {k: trainer[k] for k in ("step", "optimizer", "config", "session")}
    except pickle.UnpicklingError:
        raise Error(f"{path} holds more than tensors and numbers (its pickle would run code); "
                    f"refusing to load it: resume only runs you trust, or start again") from None
    except Exception as e:  # another user's file, a truncated or foreign one
        raise Error(f"{path} is unreadable ({type(e).__name__}: {first_line(e, 200)}); it must be "
                    f"a trainer state this code wrote, readable by this user") from None
    return {**trainer, "config": settings.check_saved(trainer["config"], path)}


def saved_step(run_dir) -> int | None:  # None: no checkpoint, or not readable
    try:
        return torch.load(os.path.join(run_dir, "checkpoint", "trainer.pt"), weights_only=True,
                          mmap=True)["step"]
    except Exception:
        return None


def json_safe(value):
    """NaN and ±inf are not JSON: they are written as null."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_log(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")


def read_log(path) -> list[dict]:
    """The records of log.jsonl; a last line cut short by a crash is dropped."""
    try:
        lines = Path(path).read_bytes().splitlines()
    except FileNotFoundError:
        return []
    except OSError as e:  # another user's file, a directory
        raise Error(f"cannot read {path} ({e.strerror})") from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)  # bytes: a line that is not UTF-8 is a ValueError too
        except ValueError:
            if number == len(lines):
                print(f"note: dropping the unfinished last line of {path}")
                break
            record = None
        if not (isinstance(record, dict) and type(record.get("step")) is int
                and isinstance(record.get("eval", {}), dict)):
            raise Error(f'{path} line {number} is not a record (a JSON object with an integer '
                        f'"step", any "eval" an object); repair or remove that line')
        records.append(record)
    return records


@contextlib.contextmanager
def signals_held():
    """Stop signals that arrive inside the block are delivered when it ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def check_finite(values: dict):  # None: not measured
    checked = {k: v for k, v in values.items() if v is not None}
    if not all(map(math.isfinite, checked.values())):
        raise Diverged(", ".join(f"{k} {v:.4g}" for k, v in checked.items()))


class Run:
    """`step`: the optimizer steps taken; `saved`: the step of the checkpoint on disk (None: none);
    write(step) saves the state after `step`."""

    def __init__(self, out: str, write, saved: int | None = None):
        self.out, self.write, self.saved = out, write, saved
        self.step = 0 if saved is None else saved

    def save(self):
        with signals_held():  # never cut short
            self.write(self.step)
        self.saved = self.step

    def try_save(self) -> bool:
        try:
            self.save()
            return True
        except SaveFailed as e:
            tqdm.write(f"warning: {e}; {self.kept_note()}; training goes on")
            return False

    def kept_note(self) -> str:
        return (f"the checkpoint of step {self.saved} is kept in {self.out}/checkpoint"
                if self.saved is not None else "no checkpoint was written")

    def go_on(self) -> str:
        return (f"continue with --resume {self.out}" if self.saved is not None
                else "run the same command again")


def stopped(run: Run, fsdp: bool) -> str:
    """Process 0 saves the state after run.step (not under --fsdp: its save is a collective the
    processes may not all reach); the line says what is saved or kept."""
    rank, world = distributed.rank_and_world()
    if rank:
        later = f" (process 0, if alive, saves step {run.step})" if run.step != run.saved else ""
        return f"process {rank} of {world} stopped; {run.kept_note()}{later}"
    if fsdp:
        return f"with --fsdp a stop does not save; {run.kept_note()}"
    try:
        return (f"saved step {run.step} to {run.out}/checkpoint" if run.try_save() else
                f"step {run.step} is not saved; {run.kept_note()}")
    except Diverged as d:  # weights that are not finite are never saved
        return f"step {run.step} is not saved ({d}); {run.kept_note()}"


@contextlib.contextmanager
def guard(run: Run, lr: float, fsdp: bool):
    """The training loop, under cli.exits. A signal saves (stopped) and exits with 128 + signum in
    one line per process; out of memory and a lost peer save too, then are an Error, as are
    divergence and a failed save or write, saying which checkpoint is kept."""
    try:
        yield run
    except Interrupted as e:
        line = f"{e}: {stopped(run, fsdp)}; {run.go_on()}"
        if distributed.rank_and_world()[0] == 0:
            tqdm.write(f"\n{line}")
        else:
            print(line, file=sys.stderr)
        raise SystemExit(128 + e.signum) from None
    except (RuntimeError, MemoryError) as e:
        if what := out_of_memory(e):
            traceback.clear_frames(e.__traceback__)  # the failed step's tensors go before the save
            raise Error(f"out of memory in step {run.step + 1} ({what}); {stopped(run, fsdp)}; "
                        f"lower --micro-batch (or --group, --max-new-tokens), then "
                        f"{run.go_on()}") from None
        if not distributed.peer_lost(e):
            raise
        signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))  # the launcher's SIGTERM: held
        raise Error(f"a process of this run is gone ({short_error(e)}); {stopped(run, fsdp)}; "
                    f"{run.go_on()} (on as many processes)") from None
    except Diverged as e:
        raise Error(f"training diverged at step {run.step + 1} ({e}); {run.kept_note()}; "
                    f"lower --lr (now {lr:g})") from None
    except (SaveFailed, OSError) as e:  # a checkpoint, or the log
        what = e if isinstance(e, SaveFailed) else f"could not write in {run.out} ({e})"
        raise Error(f"{what}; {run.kept_note()}; make room (or fix the cause), then "
                    f"{run.go_on()}") from None
    finally:  # let go of the lock
        if (fd := _held.pop(os.path.realpath(run.out), None)) is not None:
            os.close(fd)


def short_error(e: BaseException) -> str:  # its first sentence, less "[pair.cc:534] "
    text = re.sub(r"^\[[^\]]*\] ", "", first_line(e, 10 ** 6))
    return f"{type(e).__name__}: {text.split('. ')[0][:160]}"
