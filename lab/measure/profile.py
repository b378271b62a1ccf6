"""Record a ``jax.profiler`` trace of a program: compiled and warmed up outside it, annotated steps inside it.

:func:`record` leaves JAX's run folder (``<logdir>/plugins/profile/<run>/``: the ``.xplane.pb`` TensorBoard's
profile plugin reads and the Chrome trace) and beside it ``perfetto_trace.json.gz``, the copy ui.perfetto.dev
opens. :mod:`lab.measure.trace` reads it back (its docstring says how ops and steps appear). Importing this module
imports no JAX; :func:`record` does.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence

from lab.core.errors import UserError
from lab.core.files import write_atomic
from lab.measure.trace import STEP_NAME, TraceFiles, open_text, run_dirs


def _writable_dir(logdir: str) -> None:
    """Create ``logdir`` and prove a file can be written in it; a UserError naming the path otherwise."""
    try:
        os.makedirs(logdir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=logdir, prefix=".shardlab-probe-"):
            pass
    except OSError as e:
        raise UserError(f"cannot write the profile to logdir {logdir!r}: {e.strerror or e}") from None


_SPACE = re.compile(r"\s*")


def without_member(text: str, key: str) -> str:
    """The JSON object ``text`` less its top-level member ``key``. The members ahead of ``key`` are decoded one by
    one to find it and it is cut out of the text; a ``traceEvents`` member ahead of it (too large to decode just to
    skip it) or text laid out otherwise makes it decode and encode the whole object instead."""
    dec, at = json.JSONDecoder(), _SPACE.match(text).end()
    if text.startswith("{", at):
        at = _SPACE.match(text, at + 1).end()
        while text.startswith('"', at):
            start = at
            name, at = dec.raw_decode(text, at)
            at = _SPACE.match(text, at).end()
            if not text.startswith(":", at) or (name == "traceEvents" and key != name):
                break
            _, at = dec.raw_decode(text, _SPACE.match(text, at + 1).end())
            at = _SPACE.match(text, at).end()
            if name == key:
                if text.startswith(",", at):  # a member follows: cut up to it
                    return text[:start] + text[_SPACE.match(text, at + 1).end() :]
                head = text[:start].rstrip()  # the last member: its comma goes with it
                return (head[:-1] if head.endswith(",") else head) + text[at:]
            if not text.startswith(",", at):
                break
            at = _SPACE.match(text, at + 1).end()
    doc = json.loads(text)
    doc.pop(key, None)
    return json.dumps(doc)


def _write_perfetto(run_dir: str) -> None:
    """``perfetto_trace.json.gz`` beside the run's ``<host>.trace.json.gz``: that Chrome trace less its
    ``metadata`` member, which ui.perfetto.dev refuses (what ``start_trace(create_perfetto_trace=True)`` writes).
    JAX decodes the whole JSON, encodes it again and compresses it at zlib's slowest level: 1.0 s of train_dp's
    2.7 s profile on a 2-core host. Here the member is cut out of the text and zlib runs at its fastest (0.1 s).
    Nothing is written where there is not exactly one such trace (the parse then reads the others)."""
    found = glob.glob(os.path.join(run_dir, "*.trace.json.gz"))
    if len(found) != 1:
        return
    with contextlib.suppress(OSError, ValueError):  # a convenience copy (and UnicodeDecodeError a ValueError)
        text = without_member(open_text(found[0]), "metadata")
        write_atomic(os.path.join(run_dir, "perfetto_trace.json.gz"), gzip.compress(text.encode("utf-8"), 1))


DEVICES_PID = 1_000_000  # the Perfetto copy's added process: far above the host's process ids in a JAX trace
DEVICES_PROCESS = "emulated devices (shardlab: each device's ops)"


def add_device_tracks(perfetto: str | None, events: Sequence, backend: str) -> bool:
    """On emulated devices, add to the Perfetto copy one track per device (``device N`` under
    :data:`DEVICES_PROCESS`) holding that device's op events: XLA:CPU runs them on host threads named
    ``tf_XLAEigen/<hash>``, and one device's program hops threads, so no thread stands for a device. The events
    (``lab.measure.trace.OpEvent``) keep the trace's own times. The copy is left as it is on a device backend,
    without events, or when its text does not end in its ``traceEvents`` list. Returns whether tracks were added."""
    if backend != "cpu" or not perfetto or not events:
        return False
    with contextlib.suppress(OSError, ValueError):
        text = open_text(perfetto).rstrip()
        if not text.endswith("]}"):
            return False
        devices = sorted({e.device for e in events if e.device >= 0})
        added = [{"ph": "M", "pid": DEVICES_PID, "name": "process_name", "args": {"name": DEVICES_PROCESS}}]
        for d in devices:
            added.append(
                {"ph": "M", "pid": DEVICES_PID, "tid": d, "name": "thread_name", "args": {"name": f"device {d}"}}
            )
            added.append(
                {"ph": "M", "pid": DEVICES_PID, "tid": d, "name": "thread_sort_index", "args": {"sort_index": d}}
            )
        added += [
            {
                "ph": "X",
                "pid": DEVICES_PID,
                "tid": e.device,
                "ts": e.start_us,
                "dur": e.dur_us,
                "name": e.name,
                "args": {"step": e.step, "wait_us": e.wait_us},
            }
            for e in events
            if e.device >= 0
        ]
        body = json.dumps(added, separators=(",", ":"))[1:-1]
        joined = text[:-2] + ("," if not text[:-2].rstrip().endswith("[") else "") + body + "]}"
        write_atomic(perfetto, gzip.compress(joined.encode("utf-8"), 1))
        return True
    return False


def _files_in(logdir: str, run_dir: str) -> TraceFiles:
    perfetto = os.path.join(run_dir, "perfetto_trace.json.gz")
    xplanes = sorted(glob.glob(os.path.join(run_dir, "*.xplane.pb")))
    return TraceFiles(
        logdir=logdir,
        run_dir=run_dir,
        perfetto=perfetto if os.path.isfile(perfetto) else None,
        xplane=xplanes[0] if xplanes else None,
    )


def record(fn: Callable, args: Sequence, logdir: str | os.PathLike, *, warmup: int = 1, repeats: int = 3) -> TraceFiles:
    """Profile ``fn(*args)``: compile and warm up outside the trace, then ``repeats`` annotated steps inside it.

    Each step is ``jax.block_until_ready(fn(*args))`` inside ``StepTraceAnnotation("step", step_num=i)``, all
    between ``jax.profiler.start_trace(logdir)`` and ``stop_trace()`` (what ``jax.profiler.trace`` does; split
    here so that a failure to write the trace is told from one in ``fn``), then the Perfetto copy of the trace.
    Recording again into the same logdir within a second of the last run waits out that second, since JAX
    names run folders by the second and would overwrite the earlier files.

    Args:
        fn: usually a jitted function.
        args: its positional arguments (already placed on devices).
        logdir: created if missing; JAX adds ``plugins/profile/<run>/`` under it.
        warmup: untraced calls first (with 0, a jitted ``fn`` is still compiled ahead of the trace).
        repeats: traced steps, at least 1.

    Raises:
        UserError: bad counts, or ``logdir`` cannot be created or written.
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise UserError(f"warmup={warmup!r} must be an integer >= 0")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise UserError(f"repeats={repeats!r} must be an integer >= 1")
    logdir = os.path.abspath(os.fspath(logdir))
    _writable_dir(logdir)

    import jax

    args = tuple(args)
    if warmup == 0 and hasattr(fn, "lower"):
        fn.lower(*args).compile()
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))

    before = {d: os.path.getmtime(d) for d in run_dirs(logdir)}
    # JAX names the run folder by the second the trace stops in: a second profile stopping within the same
    # second as the last one would overwrite its files, so wait until that second is over.
    if before:
        wait = max(before.values()) + 1.05 - time.time()
        if wait > 0:
            time.sleep(min(wait, 1.05))
    jax.profiler.start_trace(logdir)  # the Perfetto copy is written below, faster than JAX writes it
    try:
        for i in range(repeats):
            with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
                jax.block_until_ready(fn(*args))
    except BaseException:
        with contextlib.suppress(Exception):
            jax.profiler.stop_trace()
        raise
    try:
        jax.profiler.stop_trace()
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"the profiler could not write its trace under {logdir!r}: {e}") from e

    runs = run_dirs(logdir)
    fresh = [d for d in runs if d not in before] or runs
    if not fresh:
        raise UserError(f"the profiler wrote no run folder under {os.path.join(logdir, 'plugins', 'profile')!r}")
    run_dir = max(fresh, key=os.path.getmtime)
    _write_perfetto(run_dir)
    return _files_in(logdir, run_dir)


__all__ = ["DEVICES_PROCESS", "add_device_tracks", "record", "without_member"]
