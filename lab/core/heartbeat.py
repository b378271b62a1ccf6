"""A progress line at least every few seconds while one long step runs (a compile, an audit, a calibration phase):
a newcomer watching a terminal sees the lab is working, and how long the step has taken so far.

JAX-free; a daemon thread that only calls ``say``, stopped when the block ends (however it ends).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

EVERY_S = 5.0  # at most this long without a line (issue 38: "a progress line at least every 5 s")


@contextlib.contextmanager
def still(say: Callable[[str], None] | None, what: str, every: float = EVERY_S) -> Iterator[None]:
    """While the block runs, ``say("still {what}: N s")`` every ``every`` seconds; nothing when ``say`` is None
    or the block ends sooner."""
    if say is None:
        yield
        return
    done = threading.Event()
    start = time.perf_counter()

    def beat() -> None:
        while not done.wait(every):
            say(f"still {what}: {time.perf_counter() - start:.0f} s")

    thread = threading.Thread(target=beat, name=f"shardlab-still-{what}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def to_terminal(prefix: str = "shardlab") -> Callable[[str], None] | None:
    """A ``say`` for commands whose stderr is otherwise only their errors (``audit``): lines on a terminal, none
    when stderr is a file or a pipe (logs and tests keep one line per error)."""
    if not sys.stderr.isatty():
        return None
    return lambda text: print(f"{prefix}: {text}", file=sys.stderr, flush=True)


__all__ = ["EVERY_S", "still", "to_terminal"]
