"""Output files that are whole or absent: each write goes to a temporary name of its own beside the
file (`<path>.<pid>-<random>.tmp`), then one rename, so a crash or a full disk can leave a stray
`.tmp` behind, never half of `<path>`, and two writers of one file each land whole (the last wins).
A new file gets the mode the user's umask gives; a file or directory replaced keeps its permissions
(a run directory made readable to a group stays so, whatever the writer's umask)."""
import contextlib
import ctypes
import errno
import functools
import json
import os
import secrets
import shutil
from pathlib import Path


def write_atomic(path: str, write):
    """write(tmp) writes the file at the temporary name tmp; it replaces `path` once complete."""
    tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        write(tmp)
        if os.path.exists(path):
            shutil.copymode(path, tmp)
        else:  # some writers (safetensors) create their file private, whatever the umask
            os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def current_umask() -> int:
    mask = os.umask(0o022)  # the one way to read it is to set it: set it back at once
    os.umask(mask)
    return mask


def write_text(path: str, text: str):
    write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_json(path: str, obj, indent=1):
    write_text(path, json.dumps(obj, indent=indent))


def write_jsonl(path: str, rows):
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def save_figure(fig, path: str, dpi: int):
    """A matplotlib figure as PNG; the figure is closed."""
    # only a caller with a figure gets here: matplotlib is installed
    import matplotlib.pyplot as plt
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    plt.close(fig)


# A directory (a checkpoint) is replaced by a swap that keeps a complete copy at every instant:
#   write <dir>.tmp/ → exchange the names <dir>.tmp/ and <dir>/ in one step → rename
#   <dir>.tmp/ (now the old one) to <dir>.old/ → delete <dir>.old/. Where the kernel cannot
#   exchange two names, <dir>/ is renamed to <dir>.old/ and <dir>.tmp/ to <dir>/: a reader
#   between the two renames finds no <dir>/.


def swap_in(final: str):
    tmp, old = final + ".tmp", final + ".old"
    if not os.path.exists(final):
        os.replace(tmp, final)
        return
    for name in [""] + [n for n in os.listdir(tmp) if os.path.exists(os.path.join(final, n))]:
        # "": the directory's own
        shutil.copymode(os.path.join(final, name), os.path.join(tmp, name))
    if exchange(tmp, final):  # <dir>/: the new copy at once; <dir>.tmp/: the old one
        os.replace(tmp, old)
    else:
        os.replace(final, old)
        os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def exchange(a: str, b: str) -> bool:
    """Swap the names a and b in one step (Linux's renameat2 with RENAME_EXCHANGE); False where the
    system cannot, and nothing changed."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    at_cwd, rename_exchange = -100, 2
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), rename_exchange) == 0:
        return True
    # not on this system or disk
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), a)


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def abandon_swap(final: str):
    """Undo a swap that failed part way: the previous `final` back in place, `final`.tmp deleted.
    Best effort: what it cannot undo, recover_swap puts right later."""
    with contextlib.suppress(OSError):
        if not os.path.exists(final) and os.path.exists(final + ".old"):
            os.replace(final + ".old", final)
    shutil.rmtree(final + ".tmp", ignore_errors=True)


def recover_swap(final: str):
    """Finish or undo a swap that a crash interrupted, leaving `final` (if any) and nothing else."""
    tmp, old = final + ".tmp", final + ".old"
    if not os.path.exists(final) and os.path.exists(old):  # killed between the two renames:
        os.replace(tmp if os.path.exists(tmp) else old, final)  # <dir>.tmp/ is complete and newer
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
