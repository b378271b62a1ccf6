"""Files a reader may open while they are being written: each is written whole under a temporary name, then renamed."""

from __future__ import annotations

import _thread
import contextlib
import os


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file beside it and a rename: a reader, or a
    process writing the same file at the same time, sees the old file or one whole new one. The temporary file is
    removed when the write fails (the error is raised)."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{_thread.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


__all__ = ["write_atomic"]
