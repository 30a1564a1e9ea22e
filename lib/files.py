"""Output files that are whole or absent: each write goes to a temporary name of its own beside the
file, then one rename, so a crash can leave a stray `.tmp`, never half of a file, and two writers
of one file each land whole. A new file gets the user's umask's mode; a file or directory replaced
keeps its permissions."""
import contextlib
import ctypes
import errno
import json
import os
import secrets
import shutil
from pathlib import Path

LIBC = ctypes.CDLL(None, use_errno=True)  # renameat2, where the C library has it


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
    import matplotlib.pyplot as plt  # a caller with a figure has it
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
    # the directory's own mode (""), then that of each file it replaces
    for name in [""] + [n for n in os.listdir(tmp) if os.path.exists(os.path.join(final, n))]:
        shutil.copymode(os.path.join(final, name), os.path.join(tmp, name))
    if exchange(tmp, final):  # <dir>/: the new copy at once; <dir>.tmp/: the old one
        os.replace(tmp, old)
    else:
        os.replace(final, old)
        os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def exchange(path: str, other: str) -> bool:
    """Swap the two names in one step (Linux's renameat2 with RENAME_EXCHANGE); False where the
    system cannot, and nothing changed."""
    renameat2, at_cwd, rename_exchange = getattr(LIBC, "renameat2", None), -100, 2
    if renameat2 and not renameat2(at_cwd, os.fsencode(path), at_cwd, os.fsencode(other),
                                   rename_exchange):
        return True
    if not renameat2 or ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
        return False  # not on this system or disk
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), path)


def recover_swap(final: str, finish: bool = True):
    """Finish (the new copy in place) or else undo (the previous one) a swap that a crash or a
    failure cut short, leaving `final` (if any) and nothing else."""
    tmp, old = final + ".tmp", final + ".old"
    if not os.path.exists(final) and os.path.exists(old):  # cut between the two renames:
        os.replace(tmp if finish and os.path.exists(tmp) else old, final)  # tmp/: whole, newer
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
