"""Output files that are whole or absent: each write goes to `<path>.tmp`, then a rename, so a crash or a
full disk can leave a stray `<path>.tmp` behind, never half of `<path>`. A file or directory replaced keeps
its permissions (a run directory made readable to a group stays so, whatever the writer's umask)."""
import contextlib
import json
import os
import shutil
from pathlib import Path


def write_atomic(path: str, write):
    """write(tmp) writes the file at the temporary name tmp; it replaces `path` once complete."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        if os.path.exists(path):
            shutil.copymode(path, tmp)
    except BaseException:
        if os.path.isfile(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def write_text(path: str, text: str):
    write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_json(path: str, obj, indent=1):
    write_text(path, json.dumps(obj, indent=indent))


def write_jsonl(path: str, rows):
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def save_figure(fig, path: str, dpi: int):
    """A matplotlib figure as PNG; the figure is closed."""
    import matplotlib.pyplot as plt  # only a caller with a figure gets here: matplotlib is installed
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    plt.close(fig)


# A directory (a checkpoint) is replaced by a swap that keeps a complete copy at every instant:
#   write <dir>.tmp/ → rename <dir>/ to <dir>.old/ → rename <dir>.tmp/ to <dir>/ → delete <dir>.old/


def swap_in(final: str):
    tmp, old = final + ".tmp", final + ".old"
    if os.path.exists(final):
        for name in [""] + [n for n in os.listdir(tmp) if os.path.exists(os.path.join(final, n))]:
            shutil.copymode(os.path.join(final, name), os.path.join(tmp, name))  # "": the directory's own
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def abandon_swap(final: str):
    """Undo a swap that failed part way: the previous `final` back in place, `final`.tmp deleted. Best
    effort: what it cannot undo, recover_swap puts right later."""
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
