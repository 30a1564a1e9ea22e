"""What every script's command line shares: the one error a script ends with, the signals that stop
it, optional extras, output paths. Library code raises, never exits: an `Error` is bad input or a
failure a user can act on, its message one line saying what to do; `exits` prints it as
`error: ...`, exit code 2. A stop signal raises `Interrupted` where the process is: one line and
exit code 128 + the signal."""
import argparse
import contextlib
import functools
import importlib
import importlib.util
import os
import re
import signal
import sys
import tempfile


class Error(ValueError):
    """Bad input, or a failure a user can act on: the script ends with 'error: <message>'."""


class FlagError(Error):
    """A flag a `parser` cannot take (reproduce.py names its --train-args in the message)."""


class Interrupted(BaseException):
    """A stop signal, raised where the process is (see exits); no `except Exception` takes it."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum, frame):
    raise Interrupted(signum)


# What a terminal (Ctrl-C, a closed window or ssh session) or a scheduler sends to stop a process:
# SIGTERM (SLURM, Kubernetes), SIGUSR1 (SLURM's --signal warning before its time limit), SIGXCPU (a
# CPU-time limit).
STOP_SIGNALS = tuple(getattr(signal, name)
                     for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGXCPU")
                     if hasattr(signal, name))
_stopping = []  # the handlers exits replaced, while a decorated main runs


ASCII = str.maketrans({  # how a console that cannot print a character spells it; any other: "?"
    "ε": "eps", "δ": "delta", "τ": "tau", "σ": "sigma", "ψ": "psi", "ρ": "rho", "α": "alpha",
    "β": "beta", "Δ": "Delta", "§": "S", "×": "x", "±": "+-", "≥": ">=", "≤": "<=", "→": "->",
    "·": "*", "−": "-", "–": "-", "—": "--", "∞": "inf", "½": "1/2", "⅓": "1/3"})


class Console:
    """sys.stdout or sys.stderr, whose writes go to /dev/null once its reader is gone (a closed
    terminal, a pipe whose reader quit): only the lines are lost. What its encoding cannot hold is
    written in ASCII's spellings."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        self.call("write", text)
        return len(text)

    def flush(self):
        self.call("flush")

    def call(self, name, *args):
        try:
            try:
                getattr(self.stream, name)(*args)
            except UnicodeEncodeError:
                getattr(self.stream, name)(*map(self.encodable, args))
        except (OSError, ValueError):  # EIO, EPIPE; ValueError: closed
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def encodable(self, text: str) -> str:
        encoding = getattr(self.stream, "encoding", None) or "ascii"
        return text.translate(ASCII).encode(encoding, "replace").decode(encoding)

    def __getattr__(self, name):  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)


def parser(doc: str | None = None, **kwargs) -> argparse.ArgumentParser:
    """An ArgumentParser whose errors are one line (a FlagError, no usage dump)."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(message):
        raise FlagError(message)
    p.error = error
    return p


def out_of_memory(e: BaseException) -> str | None:
    """What ran out, in a few words, if e is CUDA's, the CPU allocator's or Python's running out of
    memory; else None."""
    if type(e).__name__ == "OutOfMemoryError":  # torch's, for CUDA
        return f"OutOfMemoryError: {str(e).split('. ')[0][:160]}"
    if isinstance(e, MemoryError):
        return "MemoryError"
    cpu = (re.search(r"DefaultCPUAllocator: ([^.]*)", str(e)) if isinstance(e, RuntimeError)
           else None)
    return f"CPU: {cpu.group(1)}" if cpu else None


def exits(main=None, *, memory: str = "free memory or use a smaller model"):
    """A script's main: an Error, or running out of memory (the line then says `memory`), ends it
    with its line and exit code 2; a stop signal with one line and 128 + the signal, one ignored
    from the start (nohup) staying ignored; a console that goes away takes no more lines. A main
    called inside another (reproduce.py runs eval.main) leaves all this to the outer one."""
    if main is None:  # @exits(memory=...)
        return functools.partial(exits, memory=memory)

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        if _stopping:
            return main(*args, **kwargs)
        _stopping.append({s: signal.signal(s, raise_interrupted) for s in STOP_SIGNALS
                          if signal.getsignal(s) is not signal.SIG_IGN})
        streams, (sys.stdout, sys.stderr) = (sys.stdout, sys.stderr), (Console(sys.stdout),
                                                                       Console(sys.stderr))
        try:
            try:
                return main(*args, **kwargs)
            except (RuntimeError, MemoryError) as e:
                if not (what := out_of_memory(e)):
                    raise
                raise Error(f"out of memory ({what}); {memory}") from None
        except Error as e:
            print(f"error: {e}", file=sys.stderr)
            failed = SystemExit(f"error: {e}")
            failed.code = 2
            raise failed from None
        except Interrupted as e:
            print(f"\n{e}: stopped; no file is half-written", file=sys.stderr)
            sys.exit(128 + e.signum)
        finally:
            for s, handler in _stopping.pop().items():
                signal.signal(s, handler)
            sys.stdout, sys.stderr = streams
    return wrapped


@contextlib.contextmanager
def one_line_errors(*kinds):
    """A ValueError (or one of `kinds`) raised inside is an Error with its message."""
    try:
        yield
    except kinds or ValueError as e:
        raise Error(str(e)) from None


@contextlib.contextmanager
def writing():
    """An OSError inside (an output that cannot be written) is an Error naming the file."""
    try:
        yield
    except OSError as e:
        raise Error(f"could not write {e.filename} ({e.strerror})") from None


def at_least(n):
    """A rule: value -> True, or why it is wrong (after "--flag value")."""
    return lambda v: v >= n or f"must be at least {n}"


def positive(v):
    return v > 0 or "must be positive"


def check_values(args, rules: dict):
    """An Error for the first flag of args that breaks its rule ({name: rule}); None passes."""
    for name, rule in rules.items():
        value = getattr(args, name)
        if value is not None and rule(value) is not True:
            raise Error(f"--{name.replace('_', '-')} {value} {rule(value)}")


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def need(module: str, what: str, package: str | None = None):
    """Import an optional extra, or an Error saying what needs it and how to install it."""
    package = package or module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise Error(f"{what} needs {package}: pip install {package}") from None


def pyplot(what: str):
    """matplotlib.pyplot drawing to files (the Agg backend), or need()'s Error."""
    need("matplotlib", what).use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def check_output_file(path: str, flag: str):
    """An Error unless `path` (given with `flag`) opens for writing; a file created is removed
    (under torchrun each process checks, and another may have removed it first)."""
    if not str(path).strip():
        raise Error(f"{flag} is empty; give a file name")
    created = not os.path.exists(path)
    with writing():
        open(path, "a").close()
    if created:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def make_output_dir(path: str):
    """Create directory `path` and its parents, or an Error unless a file can be created in it."""
    if not str(path).strip():
        raise Error("the output directory is empty; give a directory name")
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise Error(f"cannot create the directory {path} or write into it ({e.strerror})") from None
