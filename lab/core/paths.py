"""Every path a command will write, checked before any work starts: one place, one wording.

A command's output flags say what they are (:func:`lab.cli.args.out_path`, ``chart_path``, ``folder_path``); the
command line checks each one given (:func:`check_outputs` in :mod:`lab.cli.main`) before the command runs, so a
bad path costs nothing: no plan searched, no program compiled, no host calibrated. A path is refused when

* a component is longer than the file system allows (:data:`NAME_MAX` bytes) or the whole is (:data:`PATH_MAX`);
* its nearest existing folder is a file, or not writable;
* it names a folder where a file is written, or a file where a folder is (``--out``);
* it names a file that is there and that the lab did not write (:func:`written_by_lab`), unless ``--overwrite``:
  a user's experiment file, chart or HLO dump is never replaced without a word.

Nothing is created here; a refused command leaves nothing behind. JAX-free, and cheap to import.
"""

from __future__ import annotations

import os
from pathlib import Path

from lab.core.errors import UserError

NAME_MAX = 255  # bytes in one path component (Linux ext4/xfs/btrfs, macOS APFS)
PATH_MAX = 4096  # bytes in a whole path (Linux)
# What the lab writes into the files it makes, so that it may replace them again: a chart's metadata and a saved
# plan's first line say MARK; a calibrated spec says it was measured by shardlab calibrate, or is "calibrated".
MARK = "written by shardlab"
_MARKS = (MARK.encode(), b"by shardlab calibrate", b'"calibrated": true')
_SNIFF = 4096  # bytes read to find the mark: a PNG's text chunks and a TOML or JSON file's first lines


def check_names(path: str | Path, flag: str) -> None:
    """Each component, and the whole path, fits the file system's limits."""
    text = os.fsencode(str(path))
    if len(text) > PATH_MAX:
        raise UserError(f"{flag}: the path is {len(text)} bytes long, more than the {PATH_MAX} a path may have")
    for part in Path(str(path)).parts:
        n = len(os.fsencode(part))
        if n > NAME_MAX:
            raise UserError(
                f"{flag}: {part[:40]!r}... is {n} bytes long, more than the {NAME_MAX} one name in a path may "
                "have; give a shorter name"
            )


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def check_folder(
    path: str | Path,
    flag: str,
    what: str = "write into it",
    hint: str = "give a folder you can write",
    shown: str | Path | None = None,
) -> None:
    """``path`` is a folder, or can be made one, that this process can write into (``shown``, the value the user
    gave, is what the refusal names; default ``path``)."""
    check_names(path, flag)
    base = Path(path)
    probe = _nearest_existing(base)
    if probe == base and not base.is_dir() and shown is None:
        why = "it is a file"
    elif not probe.is_dir():
        why = f"{str(probe)!r} is a file"
    elif not os.access(probe, os.W_OK | os.X_OK):
        why = f"{str(probe)!r} is not writable"
    else:
        return
    raise UserError(f"{flag} {str(shown or base)!r}: cannot {what} ({why}); {hint}")


def written_by_lab(path: Path) -> bool:
    """The file carries the lab's mark in its first bytes: a chart's PNG ``Software`` text, the comment that heads
    a saved plan, a calibrated spec's ``source``, a run's report."""
    try:
        with path.open("rb") as f:
            head = f.read(_SNIFF)
    except OSError:
        return False
    return any(m in head for m in _MARKS)


def chart_metadata(path: str | Path) -> dict[str, str]:
    """``savefig(metadata=...)`` that marks a chart as the lab's, in the key its format keeps (none for the raster
    formats Pillow writes: such a chart is replaced only with ``--overwrite``)."""
    suffix = Path(path).suffix.lower()
    if suffix == ".png":
        return {"Software": MARK}
    return {"Creator": MARK} if suffix in (".svg", ".pdf", ".eps", ".ps") else {}


def check_file(path: str | Path, flag: str, *, force: bool = False) -> None:
    """``path`` can be written as a file: its folder can be made and written, it is not a folder, and if it is
    there the lab wrote it (or ``force``, the command's ``--overwrite``, says replace it)."""
    check_names(path, flag)
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {str(p)!r} is a folder; give a file name in it, e.g. {flag} {p / 'NAME'}")
    if p.exists() and not p.is_file():
        raise UserError(f"{flag} {str(p)!r} is not a regular file (a device, pipe or socket); give a file name")
    if p.exists() and not force and not written_by_lab(p):
        raise UserError(
            f"{flag} {str(p)!r} exists and shardlab did not write it; pass --overwrite to replace it, or give "
            "another name"
        )
    parent = p.parent if str(p.parent) else Path(".")
    check_folder(parent, flag, what="write it", hint="give a path in a folder you can write", shown=p)


def runnable(tool: str) -> str:
    """How to call ``tool`` (``tensorboard``, ``shardlab``) as printed for the user: its bare name when the user's
    shell finds this environment's copy on its PATH (``SHARDLAB_CALLER_PATH``, the PATH before ``scripts/`` put
    ``.venv/bin`` first, else PATH), else its path beside this Python (``.venv/bin/tensorboard``, relative to the
    working folder when it lies under it), so that a printed command runs as printed."""
    import shutil
    import sys

    here = Path(sys.executable).parent / tool
    found = shutil.which(tool, path=os.environ.get("SHARDLAB_CALLER_PATH", os.environ.get("PATH")))
    if not here.exists() or (found and Path(found).resolve() == here.resolve()):
        return tool
    try:
        return str(here.relative_to(Path.cwd()))
    except ValueError:
        return str(here)


__all__ = [
    "MARK",
    "NAME_MAX",
    "PATH_MAX",
    "chart_metadata",
    "check_file",
    "check_folder",
    "check_names",
    "runnable",
    "written_by_lab",
]
