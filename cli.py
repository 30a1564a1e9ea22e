"""What every script's command line shares: errors in one line, the exit, optional extras, output paths.

Library code never ends the process: it raises. Every script's main is decorated with `exits`, the
one way a script ends early: an Exit raised anywhere below it (a bad flag through `parser`, a
ValueError inside `one_line_errors`, a failed child run) prints one line and exits with 2."""
import argparse
import contextlib
import functools
import importlib
import importlib.util
import os
import signal
import sys


def parser(doc: str | None = None, **kwargs) -> argparse.ArgumentParser:
    """An ArgumentParser whose errors are one line (no usage dump), with `doc` as its --help text."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    def error(message):
        raise FlagError(message)
    p.error = error
    return p


class FlagError(ValueError):
    """A flag a parser from `parser` cannot take. A ValueError: a script that parses another's flags
    (reproduce.py's --train-args) reads its message; `exits` ends a script with it as with an Exit."""


class Exit(Exception):
    """A script's end, raised by library code (which never calls sys.exit) and turned into the
    process's exit by `exits`. `status`: an exit code, or a one-line error (printed; exit code 2)."""

    def __init__(self, status: int | str):
        super().__init__(status)
        self.status = status


class Failed(SystemExit):
    """The SystemExit of a one-line error: exit code 2, str() the line (already printed)."""

    def __init__(self, line: str):
        super().__init__(2)
        self.line = line

    def __str__(self):
        return self.line


class Interrupted(BaseException):
    """SIGINT or SIGTERM, raised where the process is when it arrives (see exits); like
    KeyboardInterrupt, no `except Exception` takes it for an error."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum, frame):
    raise Interrupted(signum)


_stopping = []  # the handlers exits replaced, while a decorated main runs


def exits(main):
    """Decorate a script's main: an Exit raised inside it ends the process with its status (a line:
    printed, exit code 2), and SIGINT (Ctrl-C) or SIGTERM with one line and exit code 130 or 143. Files are written
    whole or not at all (files.py), so a signal leaves nothing half-written. A main called inside
    another (reproduce.py runs eval.main) leaves the signals to the outer one."""
    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        if _stopping:
            return main(*args, **kwargs)
        _stopping.append({s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)})
        try:
            return main(*args, **kwargs)
        except (Exit, FlagError) as e:
            status = e.status if isinstance(e, Exit) else f"error: {e}"
            if isinstance(status, str):
                print(status, file=sys.stderr)
                raise Failed(status) from None
            sys.exit(status)
        except Interrupted as e:
            print(f"\n{e}: stopped; no file is half-written", file=sys.stderr)
            sys.exit(128 + e.signum)
        finally:
            for s, handler in _stopping.pop().items():
                signal.signal(s, handler)
    return wrapped


@contextlib.contextmanager
def one_line_errors(*kinds):
    """A ValueError (a CheckpointError is one), or an exception of `kinds` if given, raised inside is an
    Exit 'error: <its message>': the one-line errors of bad flags and files."""
    try:
        yield
    except kinds or ValueError as e:
        raise Exit(f"error: {e}") from None


def at_least(n):
    """A rule for a flag's value: value -> True, or why it is wrong (after "--flag value")."""
    return lambda v: v >= n or f"must be at least {n}"


def positive(v):
    return v > 0 or "must be positive"


def check_values(args, rules: dict):
    """A one-line ValueError for the first of args' flags that breaks its rule ({name: rule}); a flag
    left unset (None) passes."""
    for name, rule in rules.items():
        value = getattr(args, name)
        if value is not None and rule(value) is not True:
            raise ValueError(f"--{name.replace('_', '-')} {value} {rule(value)}")


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def need(module: str, what: str, package: str | None = None):
    """Import an optional extra (matplotlib, pyarrow), or raise a one-line ValueError saying
    what needs it and how to install it."""
    package = package or module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{what} needs {package}: pip install {package}") from None


def pyplot(what: str):
    """matplotlib.pyplot drawing to files (the Agg backend), or need()'s one-line error."""
    need("matplotlib", what).use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def check_output_file(path: str, flag: str = "the output path"):
    """A one-line ValueError unless `path` (given with `flag`) can be written: a file name in a
    writable directory."""
    if not str(path).strip():
        raise ValueError(f"{flag} is empty; give a file name")
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory; give a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write {path}: " + (f"{folder} is not a directory" if os.path.exists(folder)
                                                     else "its directory does not exist"))
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"cannot write {path}: permission denied")


def make_output_dir(path: str):
    """Create directory `path` (and its parents), or a one-line ValueError saying why not."""
    if not str(path).strip():
        raise ValueError("the output directory is empty; give a directory name")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} is a file; give a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the directory {path} ({e.strerror})")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write into {path}: permission denied")
