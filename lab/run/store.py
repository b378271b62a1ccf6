"""Run directories that lose nothing: unique names, staged writes, a completion marker, a lock per run.

* A run's name is a plain name inside ``--out`` (:func:`plain_name`); a directory is reserved with an atomic
  ``mkdir`` (:func:`reserve`), so two runs started at the same moment get two directories.
* Everything a run or sweep point writes goes to a hidden staging directory first (:func:`staging`); the
  marker :data:`MARKER` is written last, after the plots, and the directory is renamed into place
  (:func:`commit`). A point is done only when its directory exists with the marker: one interrupted between
  its report and its plots is not, and ``--resume`` runs it again.
* A sweep holds :class:`RunLock` while it writes (an exclusive ``flock`` on a file holding the owner's pid); a
  second ``--resume`` of the same run is refused while the owner lives; the kernel drops the lock of an owner that
  died (``kill -9``), and its staging directories are taken over.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from lab.core.errors import UserError
from lab.core.files import write_atomic
from lab.core.paths import check_folder

MARKER = ".complete"
LOCK = ".lock"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def plain_name(name: str, flag: str = "--run-id") -> str:
    """``name`` if it is one path component of letters, digits, ``.``, ``_`` and ``-`` (so it stays in --out)."""
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise UserError(
            f"{flag} {name!r} must be a plain name inside --out (letters, digits, '.', '_', '-'; no '/' or '..'), "
            "e.g. my-run"
        )
    return name


def check_out(base: Path) -> None:
    """``--out`` is, or can be made, a folder this process writes runs into; a one-line error otherwise. Checked
    before JAX starts or the host is calibrated, and nothing is created here (a refused run leaves no folder)."""
    check_folder(base, "--out", what="write runs there", hint="pass --out DIR")


def read_record(path: Path) -> dict:
    """A run's JSON record (``env.json``, ``sweep.json``); a damaged one is named, with what to do."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not valid JSON"
        raise UserError(
            f"{str(path)!r} is damaged ({why}): the run's record cannot be read; start the run again without "
            f"--resume (a new folder), or remove {str(path.parent)!r}"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"{str(path)!r} is damaged (not a JSON object); start the run again without --resume")
    return data


def is_complete(directory: Path) -> bool:
    """The run or point finished: its marker exists and its report parses."""
    if not (directory / MARKER).is_file():
        return False
    try:
        json.loads((directory / "report.json").read_text())
    except (OSError, ValueError):
        return False
    return True


def mark_complete(directory: Path) -> None:
    write_atomic(directory / MARKER, dt.datetime.now(dt.UTC).isoformat(timespec="seconds") + "\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _owner(name: str) -> int | None:
    m = re.search(r"\.pid(\d+)\.", name)
    return int(m.group(1)) if m else None


def staging(final: Path) -> Path:
    """A fresh hidden directory beside ``final`` to write into; stale ones of dead owners are removed first."""
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    for old in parent.glob(f".{final.name}.pid*.tmp"):
        owner = _owner(old.name)
        if owner is not None and not _alive(owner):
            shutil.rmtree(old, ignore_errors=True)
    tmp = parent / f".{final.name}.pid{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    return tmp


def commit(tmp: Path, final: Path) -> None:
    """Move a staged directory into place (atomic); a half-written one with the same name is replaced."""
    if final.exists() and not is_complete(final):
        shutil.rmtree(final)
    os.rename(tmp, final)


def discard(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def free_name(base: Path, name: str) -> str:
    """``name``, or ``name-<timestamp>[-k]`` when a run of that name exists already."""
    if not (base / name).exists():
        return name
    stamp = f"{name}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    k = 1
    candidate = stamp
    while (base / candidate).exists():
        k += 1
        candidate = f"{stamp}-{k}"
    return candidate


def reserve(base: Path, name: str) -> Path:
    """Create a run directory under ``base`` with a name nobody else has, atomically (``name``, or with a
    timestamp when it is taken; safe when two runs start at the same moment)."""
    base.mkdir(parents=True, exist_ok=True)
    for _ in range(1000):
        path = base / free_name(base, name)
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise UserError(f"cannot find a free run name like {name!r} under {str(base)!r}; pass --run-id")


class RunLock:
    """Exclusive ownership of a run directory while a process writes it (see the module docstring).

    An advisory ``flock`` on the run's lock file: the kernel releases it when its owner exits, however it exits
    (``kill -9`` included), so there is no stale lock to take over and no window in which two processes that both
    found one could each take it. The file holds the owner's pid (for the message) and is removed on release; a
    process that locked a file already removed sees it (another inode at the path) and locks the new one."""

    def __init__(self, run_dir: Path, wait: Callable[[str], None] | None = None):
        """``wait``: take turns (two resumes of one sweep): said once, then the lock is waited for; without it a
        held lock is refused at once."""
        self.path = run_dir / LOCK
        self._fd: int | None = None
        self._wait = wait

    def __enter__(self) -> RunLock:
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise UserError(f"cannot open the lock {str(self.path)!r}: {exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = self._holder()
                if self._wait is None:
                    os.close(fd)
                    raise UserError(
                        f"run {str(self.path.parent)!r} is being written by another shardlab (pid "
                        f"{owner or 'unknown'}); wait for it to finish, then --resume if anything is left"
                    ) from None
                self._wait(
                    f"run {str(self.path.parent)!r} is being written by another shardlab (pid {owner or 'unknown'}); "
                    "waiting for its turn to end (Ctrl-C stops waiting; nothing is written meanwhile)"
                )
                self._take_turn(fd)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the owner we raced with removed the file we locked: lock the one that is there now
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._fd = fd
            return self
        raise UserError(f"cannot take the lock {str(self.path)!r}; remove it if no shardlab is running")

    @staticmethod
    def _take_turn(fd: int) -> None:
        """Wait for the lock, a poll every half second (Ctrl-C still reaches Python between polls)."""
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                time.sleep(0.5)

    def _holder(self) -> int | None:
        try:
            return int(self.path.read_text().strip() or 0) or None
        except (OSError, ValueError):
            return None

    def __exit__(self, *exc) -> None:
        if self._fd is not None:  # removed while still held, then released: a process that opened it meanwhile
            with contextlib.suppress(FileNotFoundError):  # finds its file gone and locks the new one
                self.path.unlink()
            os.close(self._fd)
            self._fd = None


__all__ = [
    "LOCK",
    "MARKER",
    "RunLock",
    "check_out",
    "commit",
    "discard",
    "free_name",
    "is_complete",
    "mark_complete",
    "plain_name",
    "reserve",
    "staging",
    "write_atomic",
]
