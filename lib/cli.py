"""What every script's command line shares: errors in one line, the exit, optional extras, output paths.

Library code never ends the process: it raises. A script's main, decorated with `exits`, turns a FlagError
(a bad flag) or an Exit raised below it (a ValueError inside `one_line_errors`, a failed child run) into one
line and exit 2."""
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
    """A flag `parser` cannot take; a ValueError, so that reproduce.py can read train.py's message."""


class Exit(Exception):
    """A script's end, raised by library code; `status` is an exit code or a one-line error (exit code 2)."""

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
    """SIGINT or SIGTERM, raised where the process is (see exits); no `except Exception` takes it."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum, frame):
    raise Interrupted(signum)


_stopping = []  # the handlers exits replaced, while a decorated main runs


def exits(main):
    """A script's main: an Exit inside ends the process with its status, SIGINT or SIGTERM with one line
    and exit code 130 or 143 (files.py writes files whole, so nothing is half-written). A main called
    inside another (reproduce.py runs eval.main) leaves the signals to the outer one."""
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
    """A ValueError (or one of `kinds`) raised inside is an Exit 'error: <its message>'."""
    try:
        yield
    except kinds or ValueError as e:
        raise Exit(f"error: {e}") from None


@contextlib.contextmanager
def writing():
    """An OSError inside (an output that cannot be written) is an Exit naming the file."""
    try:
        yield
    except OSError as e:
        raise Exit(f"error: could not write {e.filename} ({e.strerror})") from None


def at_least(n):
    """A rule for a flag's value: value -> True, or why it is wrong (after "--flag value")."""
    return lambda v: v >= n or f"must be at least {n}"


def positive(v):
    return v > 0 or "must be positive"


def check_values(args, rules: dict):
    """A one-line ValueError for the first flag of args that breaks its rule ({name: rule}); None passes."""
    for name, rule in rules.items():
        value = getattr(args, name)
        if value is not None and rule(value) is not True:
            raise ValueError(f"--{name.replace('_', '-')} {value} {rule(value)}")


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def need(module: str, what: str, package: str | None = None):
    """Import an optional extra, or a one-line ValueError saying what needs it and how to install it."""
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
    """A one-line ValueError unless `path` (given with `flag`) is a file name in a writable directory."""
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
