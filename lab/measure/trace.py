"""Read a ``jax.profiler`` trace back as per-op, per-device durations (:func:`lab.measure.profile.record` writes one).

**What is written.** ``jax.profiler.start_trace(logdir)`` and ``stop_trace()`` leave one run folder,
``<logdir>/plugins/profile/<YYYY_MM_DD_HH_MM_SS>/``, holding ``<host>.xplane.pb`` (the XSpace protobuf that
TensorBoard's profile plugin / xprof reads) and ``<host>.trace.json.gz`` (the same events in Chrome trace format);
:func:`lab.measure.profile.record` adds ``perfetto_trace.json.gz`` (that JSON without its ``metadata`` key, for
ui.perfetto.dev: what JAX's ``create_perfetto_trace=True`` writes, in a tenth of the time).

**How ops appear.** In the Chrome trace every complete event (``"ph": "X"``) has a ``pid`` (a process: one
XSpace plane, named by a ``process_name`` metadata event) and a ``tid`` (a thread: one line of that plane).
``ts`` and ``dur`` are microseconds from the start of the profile.

* XLA:CPU runs every device of a process in the one ``/host:CPU`` process. Each HLO instruction that becomes
  a thunk is an event named after the instruction (``ynn_fusion``, ``psum_invariant.7``, ``dot.2``) with
  args ``hlo_op`` (the name again), ``hlo_module`` (``jit_body``), ``device_ordinal`` and ``run_id``; they run
  on ``tf_XLAPjRtCpuClient/...`` threads, and one device's program may hop threads between steps (even
  within a step, after a collective). Zero-length ``end: <name>`` markers follow each thunk; they are skipped.
* A collective's wait for its peers is a ``Rendezvous`` event nested inside the op on the same thread, with
  ``Wait: pending_threads=k/n`` children while peers arrive, ``Wait for rendezvous callback`` while the last
  arrival runs the callback, and ``InvokeRendezvous`` on the thread that is that last arrival. The wait of
  an op is the part of it covered by ``Rendezvous``/``Wait...`` events, less ``InvokeRendezvous`` (that
  thread is working, not waiting). XLA:CPU's in-process collectives also wait for every peer to finish its
  share *after* the rendezvous, and that second barrier is not traced: it stays in ``self_us``.
* GPU and TPU backends add one process per device plane, ``/device:GPU:0`` or ``/device:TPU:0`` (the number is
  the device-plane index, used as ``device``). On TPU the ops are the events of its ``XLA Ops`` thread, named
  by HLO instruction; on GPU they are kernel events on ``Stream #...`` threads whose ``hlo_op`` arg names the
  instruction (several kernels of one instruction are several events). When device planes hold ops, host
  events are ignored, so the host-side launch of an op is not counted twice. No rendezvous events are nested
  there, so ``wait_us`` is 0 and a collective's time includes its wait for peers.

**Steps.** :func:`lab.measure.profile.record` wraps each repeat in
``jax.profiler.StepTraceAnnotation("step", step_num=i)``; any host event with a ``step_num`` arg marks a step. An
op belongs to the step whose dispatch (a host event with the op's ``run_id`` on the annotating thread) lies inside
it, else to the step its start lies in, else -1.

The Chrome-trace JSON is read with the standard library, so :func:`parse` needs no JAX and no
``tensorboard-plugin-profile``/``xprof``. Only a run folder without any JSON trace falls back to the
``.xplane.pb``, read with ``jax.profiler.ProfileData`` (JAX imported then).
"""
# Over 500 lines on purpose: reading a trace end to end (the run folder, the xplane, the CPU events, the per-op joins),
# with the format's quirks documented once.

from __future__ import annotations

import bisect
import glob
import gzip
import json
import logging
import os
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter

from lab.core.errors import UserError

# The profile plugin (xprof), when installed, logs at INFO on import that TensorFlow is absent; the lab
# never uses TensorFlow, so that line is noise on every run.
logging.getLogger("tensorboard.plugins.profile").addFilter(
    lambda record: "tensorflow is not available" not in record.getMessage()
)

STEP_NAME = "step"
_DEVICE_PLANE = re.compile(r"^/device:([A-Z][A-Z0-9]*):(\d+)$")
_WAIT = re.compile(r"^(?:Rendezvous$|Wait: |Wait for rendezvous)")
_INVOKE = "InvokeRendezvous"
_XLA_OPS_LINE = "XLA Ops"
_STR = frozenset((str,))


@dataclass(frozen=True)
class TraceFiles:
    """Where one recorded profile lies: the logdir given, its run folder and the files in it."""

    logdir: str
    run_dir: str
    perfetto: str | None  # perfetto_trace.json.gz (Chrome trace JSON)
    xplane: str | None  # <host>.xplane.pb (what TensorBoard / xprof read)


@dataclass(frozen=True)
class OpEvent:
    """One execution of one HLO instruction on one device.

    Attributes:
        name: the HLO instruction name as in the optimized HLO text (``psum_invariant.7``, ``fusion.3``).
        device: device ordinal on CPU (the JAX device id of the emulated device), device-plane index on GPU/TPU;
            -1 when unknown.
        step: the annotated step it ran in (the ``step_num``), -1 outside every step.
        start_us: start, microseconds from the start of the profile.
        dur_us: duration, microseconds.
        self_us: ``dur_us - wait_us``.
        wait_us: time inside the op spent waiting for peers at a rendezvous (0 where the trace shows none).
    """

    name: str
    device: int
    step: int
    start_us: float
    dur_us: float
    self_us: float
    wait_us: float


@dataclass(frozen=True)
class OpStats:
    """One HLO instruction over a trace, in seconds.

    ``median_s`` is the median over steps of the slowest device's time in the op during that step (summed over
    the op's executions in the step, e.g. inside a loop); ``median_self_s`` and ``median_wait_s`` take the same
    statistic of self and wait time, each on its own slowest device. ``spread`` is the largest of those per-step
    self times over the smallest (None with one step: not measurable): how far one trace's repeats of the op
    disagree. ``count`` is the number of events (all steps, all devices); ``devices`` the number of distinct
    devices that ran it.
    """

    name: str
    median_s: float
    median_self_s: float
    median_wait_s: float
    count: int
    devices: int
    spread: float | None = None


@dataclass(frozen=True)
class Trace:
    """Op events of one profile.

    Attributes:
        backend: ``cpu`` (ops from host threads) or the device-plane kind in lower case (``gpu``, ``tpu``).
        devices: distinct devices among the events.
        steps: annotated steps found.
        events: op events, ordered by start time.
        step_spans: ``(step_num, start_us, dur_us)`` of each annotated step, by step number.
    """

    backend: str
    devices: int
    steps: int
    events: tuple[OpEvent, ...]
    step_spans: tuple[tuple[int, float, float], ...] = field(default=())

    def per_op(self) -> dict[str, OpStats]:
        """Statistics per HLO instruction name, in order of first execution.

        Events outside every step count only for an op that has no event inside one (a trace without
        annotations is then one step).
        """
        by_name: dict[str, list[OpEvent]] = {}
        for ev in sorted(self.events, key=lambda e: e.start_us):
            by_name.setdefault(ev.name, []).append(ev)
        out: dict[str, OpStats] = {}
        for name, evs in by_name.items():
            stepped = [e for e in evs if e.step >= 0] or evs
            cells: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
            for e in stepped:
                cell = cells[(e.step, e.device)]
                cell[0] += e.dur_us
                cell[1] += e.self_us
                cell[2] += e.wait_us
            worst: dict[int, list[float]] = {}
            for (step, _), (dur, own, wait) in cells.items():
                w = worst.setdefault(step, [0.0, 0.0, 0.0])
                w[0], w[1], w[2] = max(w[0], dur), max(w[1], own), max(w[2], wait)
            rows = list(worst.values())
            own = [r[1] for r in rows]
            out[name] = OpStats(
                name=name,
                median_s=statistics.median(r[0] for r in rows) * 1e-6,
                median_self_s=statistics.median(own) * 1e-6,
                median_wait_s=statistics.median(r[2] for r in rows) * 1e-6,
                count=len(evs),
                devices=len({e.device for e in evs}),
                spread=(max(own) / min(own) if min(own) > 0 else 1.0) if len(own) > 1 else None,
            )
        return out

    def step_times(self) -> list[float]:
        """Wall time of each annotated step, seconds, by step number."""
        return [dur * 1e-6 for _, _, dur in self.step_spans]


# ----- run folders -------------------------------------------------------------------------------------------------


def run_dirs(logdir: str) -> list[str]:
    """The run folders JAX's profiler has written under ``logdir``."""
    return [d for d in glob.glob(os.path.join(logdir, "plugins", "profile", "*")) if os.path.isdir(d)]


# ----- reading -----------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Raw:
    """One complete event from either file format."""

    process: str  # plane / process name, e.g. "/host:CPU", "/device:GPU:0"
    thread: str  # line / thread name
    key: tuple  # identifies the thread (line) across the whole profile
    name: str
    start: float  # us
    dur: float  # us
    args: dict[str, str]


def open_text(path: str) -> str:
    """A trace file's text, gunzipped when it is compressed."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data.decode("utf-8")


def _read_json(path: str, tag: int = 0) -> list[_Raw]:
    """Complete events of a Chrome-trace JSON file (``.json`` or ``.json.gz``)."""
    try:
        doc = json.loads(open_text(path))
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"cannot read trace file {path!r} as Chrome-trace JSON: {e}") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise UserError(f"trace file {path!r} has no traceEvents list")
    processes: dict[object, str] = {}
    threads: dict[tuple, str] = {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "M" and isinstance(e.get("args"), dict):
            if e.get("name") == "process_name":
                processes[e.get("pid")] = str(e["args"].get("name", ""))
            elif e.get("name") == "thread_name":
                threads[(e.get("pid"), e.get("tid"))] = str(e["args"].get("name", ""))
    out = []
    append = out.append
    for e in events:  # tens of thousands a trace: each lookup and conversion made once, and only where needed
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        try:
            start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        pid, tid = e.get("pid"), e.get("tid")
        args = e.get("args")
        if not isinstance(args, dict):
            args = {}
        elif not _STR.issuperset(map(type, args.values())):  # a JSON object's keys are strings already
            args = {str(k): str(v) for k, v in args.items()}
        process, thread, name = processes.get(pid), threads.get((pid, tid)), e.get("name", "")
        append(
            _Raw(
                str(pid) if process is None else process,
                str(tid) if thread is None else thread,
                (tag, pid, tid),
                name if type(name) is str else str(name),
                start,
                dur,
                args,
            )
        )
    return out


def _read_xplane(path: str, tag: int = 0) -> list[_Raw]:
    """Events of an ``.xplane.pb``, through ``jax.profiler.ProfileData`` (imports JAX)."""
    try:
        from jax.profiler import ProfileData
    except ImportError:
        raise UserError(f"reading {path!r} needs JAX (jax.profiler.ProfileData); give the trace JSON instead") from None
    try:
        space = ProfileData.from_file(path)
        out = []
        for p, plane in enumerate(space.planes):
            for i, line in enumerate(plane.lines):
                for ev in line.events:
                    args: dict[str, str] = {}
                    for k, v in ev.stats:
                        args.setdefault(str(k), str(v))
                    out.append(
                        _Raw(
                            process=plane.name,
                            thread=line.name,
                            key=(tag, p, i),
                            name=ev.name,
                            start=ev.start_ns * 1e-3,
                            dur=ev.duration_ns * 1e-3,
                            args=args,
                        )
                    )
    except (RuntimeError, ValueError, OSError) as e:
        raise UserError(f"cannot read trace file {path!r} as an XSpace protobuf: {e}") from None
    return out


def _sources(files: TraceFiles | str | os.PathLike) -> list[list[str]]:
    """Groups of files to try in order; each group is one profile (several hosts' files)."""
    if isinstance(files, TraceFiles):
        groups = [[files.perfetto]] if files.perfetto else []
        groups += _run_sources(files.run_dir) + ([[files.xplane]] if files.xplane else [])
        return [g for i, g in enumerate(groups) if g not in groups[:i]]
    path = os.path.abspath(os.fspath(files))
    if os.path.isfile(path):
        return [[path]]
    if not os.path.isdir(path):
        raise UserError(f"no trace at {path!r}: give a logdir, a run folder or a trace file")
    runs = run_dirs(path)
    if runs:
        return _run_sources(max(runs, key=os.path.getmtime))
    return _run_sources(path)


def _run_sources(run_dir: str) -> list[list[str]]:
    out = []
    jsons = sorted(glob.glob(os.path.join(run_dir, "*.trace.json.gz")))
    if jsons:
        out.append(jsons)
    perfetto = os.path.join(run_dir, "perfetto_trace.json.gz")
    if os.path.isfile(perfetto):
        out.append([perfetto])
    xplanes = sorted(glob.glob(os.path.join(run_dir, "*.xplane.pb")))
    if xplanes:
        out.append(xplanes)
    return out


def _read(path: str, tag: int) -> list[_Raw]:
    if path.endswith(".pb"):
        return _read_xplane(path, tag)
    return _read_json(path, tag)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _minus(keep: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted ``keep`` less disjoint sorted ``cut``."""
    out = []
    for a, b in keep:
        pieces = [(a, b)]
        for c, d in cut:
            if d <= a or c >= b:
                continue
            nxt = []
            for x, y in pieces:
                if c > x:
                    nxt.append((x, min(c, y)))
                if d < y:
                    nxt.append((max(d, x), y))
            pieces = [(x, y) for x, y in nxt if y > x]
        out.extend(pieces)
    return out


def _covered(intervals: list[tuple[float, float]], starts: list[float], a: float, b: float) -> float:
    """Length of ``[a, b]`` covered by disjoint sorted ``intervals`` (``starts`` their left ends)."""
    total = 0.0
    i = max(bisect.bisect_right(starts, a) - 1, 0)
    while i < len(intervals) and intervals[i][0] < b:
        lo, hi = max(intervals[i][0], a), min(intervals[i][1], b)
        if hi > lo:
            total += hi - lo
        i += 1
    return total


def _int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value is not None else None
    except ValueError:
        return None


def _op_name(raw: _Raw) -> str:
    name = raw.args.get("hlo_op") or raw.name
    name = name.strip().lstrip("%")
    return name.split(" ", 1)[0]


def _select_ops(raws: list[_Raw]) -> tuple[str, list[tuple[_Raw, str, int]]]:
    """The backend and the op events as (event, HLO name, device)."""
    device_planes: dict[str, tuple[str, int]] = {}
    for r in raws:
        if r.process not in device_planes:
            m = _DEVICE_PLANE.match(r.process)
            if m:
                device_planes[r.process] = (m.group(1).lower(), int(m.group(2)))
    ops: list[tuple[_Raw, str, int]] = []
    kinds = set()
    xla_ops_planes = {r.process for r in raws if r.process in device_planes and r.thread == _XLA_OPS_LINE}
    for r in raws:
        if r.process not in device_planes:
            continue
        if r.process in xla_ops_planes:
            if r.thread != _XLA_OPS_LINE:
                continue
        elif "hlo_op" not in r.args:
            continue
        kind, index = device_planes[r.process]
        kinds.add(kind)
        ops.append((r, _op_name(r), index))
    if ops:
        return ("/".join(sorted(kinds)), ops)
    for r in raws:
        if "hlo_op" in r.args and not r.name.startswith("end: "):
            dev = _int(r.args.get("device_ordinal"))
            ops.append((r, _op_name(r), -1 if dev is None else dev))
    return ("cpu", ops)


def _steps(raws: list[_Raw]) -> tuple[dict[int, tuple[float, float]], dict[str, int], set[tuple]]:
    """Step spans by step number, run_id -> step, and the threads that carry the annotations."""
    spans: dict[int, tuple[float, float]] = {}
    threads: set[tuple] = set()
    for r in raws:
        if "step_num" in r.args and not _DEVICE_PLANE.match(r.process):
            n = _int(r.args["step_num"])
            if n is None:
                continue
            threads.add(r.key)
            a, b = r.start, r.start + r.dur
            if n in spans:
                a, b = min(a, spans[n][0]), max(b, spans[n][1])
            spans[n] = (a, b)
    runs: dict[str, int] = {}
    for r in raws:
        if r.key in threads and "run_id" in r.args and "step_num" not in r.args:
            step = _step_at(spans, r.start)
            if step >= 0:
                runs.setdefault(r.args["run_id"], step)
    return spans, runs, threads


def _step_at(spans: dict[int, tuple[float, float]], t: float) -> int:
    for n, (a, b) in spans.items():
        if a <= t <= b:
            return n
    return -1


def _build(raws: list[_Raw], hlo_names: set[str] | None, module: str | None) -> Trace:
    backend, ops = _select_ops(raws)
    if hlo_names is not None:
        ops = [o for o in ops if o[1] in hlo_names]
    if module is not None:
        ops = [o for o in ops if o[0].args.get("hlo_module", module) == module]
    spans, runs, _ = _steps(raws)

    by_thread: dict[tuple, list[_Raw]] = defaultdict(list)
    for r in raws:
        by_thread[r.key].append(r)
    waits: dict[tuple, tuple[list[tuple[float, float]], list[float]]] = {}
    for key in {o[0].key for o in ops}:
        evs = by_thread[key]
        w = _union((r.start, r.start + r.dur) for r in evs if _WAIT.match(r.name))
        if w:
            w = _minus(w, _union((r.start, r.start + r.dur) for r in evs if r.name == _INVOKE))
        waits[key] = (w, [a for a, _ in w])

    events = []
    for r, name, device in ops:
        step = runs.get(r.args.get("run_id", ""), -1) if runs else -1
        if step < 0:
            step = _step_at(spans, r.start)
        intervals, starts = waits[r.key]
        wait = min(_covered(intervals, starts, r.start, r.start + r.dur), r.dur) if intervals else 0.0
        events.append(OpEvent(name, device, step, r.start, r.dur, r.dur - wait, wait))
    events.sort(key=attrgetter("start_us", "device"))
    return Trace(
        backend=backend,
        devices=len({e.device for e in events if e.device >= 0}),
        steps=len(spans),
        events=tuple(events),
        step_spans=tuple((n, a, b - a) for n, (a, b) in sorted(spans.items())),
    )


def parse(
    files: TraceFiles | str | os.PathLike, hlo_names: set[str] | None = None, *, module: str | None = None
) -> Trace:
    """Read a recorded profile into op events.

    Args:
        files: what :func:`record` returned, a logdir (its newest run), a run folder, or one trace file
            (``*.trace.json.gz``, ``perfetto_trace.json.gz``, ``*.json``, ``*.xplane.pb``).
        hlo_names: keep only events named by one of these HLO instructions (e.g. the names in
            ``lab.compile.hlo.parse_module(compiled.as_text())``).
        module: keep only events of this HLO module (``jit_body``; the ``HloModule`` name of the HLO text)
            where the trace says which module an event belongs to.

    Raises:
        UserError: the files cannot be read, or hold no op events (after the filters).
    """
    groups = _sources(files)
    problems = []
    for group in groups:
        try:
            raws = [r for tag, path in enumerate(group) for r in _read(path, tag)]
        except UserError as e:
            problems.append(str(e))
            continue
        trace = _build(raws, hlo_names, module)
        if trace.events:
            return trace
    where = files.run_dir if isinstance(files, TraceFiles) else os.fspath(files)
    detail = f" ({'; '.join(problems)})" if problems else ""
    wanted = " named by the given HLO instructions" if hlo_names is not None else ""
    raise UserError(
        f"the profiler recorded no device events{wanted} in {where!r}{detail}; "
        "record with lab.measure.profile.record (or jax.profiler.trace) around calls that run the program"
    )


__all__ = ["STEP_NAME", "OpEvent", "OpStats", "Trace", "TraceFiles", "open_text", "parse", "run_dirs"]
