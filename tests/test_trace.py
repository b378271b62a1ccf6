"""Recording and parsing profiler traces on 8 emulated CPU devices: files, op names, devices, steps, waits.

Two real traces are recorded once per module (a sharded matmul that ends in an AllReduce over X, and an
AllReduce over all 8 devices); assertions are about structure, never about how long anything took. Synthetic
Chrome traces check the GPU/TPU device-plane rules and the rendezvous arithmetic exactly.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections import Counter

import pytest

from lab.compile.hlo import collectives, parse_module
from lab.core.errors import UserError
from lab.measure.profile import record
from lab.measure.trace import OpEvent, Trace, TraceFiles, parse

REPEATS = 3
EPS_US = 1e-6
KERNELS = {
    "matmul": ("sharded_matmul_case3", {"I": 64, "J": 128, "K": 64}),  # local matmul, then AllReduce_X
    "allreduce": ("collective_all_reduce", {"N": 4096}),  # AllReduce over X and Y: one group of 8
}


class Recorded:
    def __init__(self, files: TraceFiles, hlo_text: str):
        self.files = files
        self.module = parse_module(hlo_text)
        self.module_name = re.match(r"HloModule (\S+?),", hlo_text).group(1)
        self.names = {i.name for instrs in self.module.computations.values() for i in instrs}
        self.entry = {i.name: i for i in self.module.computations[self.module.entry]}
        self.trace = parse(files, self.names)


@pytest.fixture(scope="module")
def recorded(jax_devices, tmp_path_factory) -> dict[str, Recorded]:
    from kernels.mesh import make_mesh
    from kernels.registry import get_kernel

    mesh = make_mesh({"X": 2, "Y": 4})
    out = {}
    for key, (kernel, sizes) in KERNELS.items():
        built = get_kernel(kernel).build(mesh, sizes)
        hlo_text = built.fn.lower(*built.args).compile().as_text()
        files = record(built.fn, built.args, tmp_path_factory.mktemp(key), warmup=1, repeats=REPEATS)
        out[key] = Recorded(files, hlo_text)
    return out


def _compute_ops(rec: Recorded) -> set[str]:
    """Entry instructions that do work on every device: fusions, dots and collectives."""
    return {n for n, i in rec.entry.items() if i.opcode in ("fusion", "dot", "convolution") or "all-" in i.opcode}


# ----- files ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", list(KERNELS))
def test_logdir_has_what_tensorboard_and_perfetto_read(recorded, key):
    files = recorded[key].files
    assert os.path.dirname(files.run_dir) == os.path.join(files.logdir, "plugins", "profile")
    assert files.xplane is not None and files.xplane.endswith(".xplane.pb")
    assert os.path.dirname(files.xplane) == files.run_dir and os.path.getsize(files.xplane) > 0
    assert files.perfetto == os.path.join(files.run_dir, "perfetto_trace.json.gz")
    with gzip.open(files.perfetto) as f:
        doc = json.load(f)
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    (source,) = glob.glob(os.path.join(files.run_dir, "*.trace.json.gz"))  # the JSON the Perfetto copy is made from
    with gzip.open(source) as f:
        whole = json.load(f)
    assert "metadata" in whole and "metadata" not in doc
    assert doc == {k: v for k, v in whole.items() if k != "metadata"}  # the same events, nothing else changed


@pytest.mark.parametrize(
    ("text", "rest"),
    [
        # XLA's layout, the events last: cut out of the text, only the small members ahead of it decoded
        ('{"displayTimeUnit":"ns","metadata":{"highres-ticks":true},"traceEvents":[{"ph":"X"},{}]}',
         '{"displayTimeUnit":"ns","traceEvents":[{"ph":"X"},{}]}'),
        (' { "metadata" : {"x": [1, {"y": "}"}]} , "traceEvents" : [] } ', ' { "traceEvents" : [] } '),
        ('{"a":"x","metadata":{"h":1}}', '{"a":"x"}'),  # the last member: its comma goes too
        # the events ahead of it, or no such member: decoded and encoded whole
        ('{"traceEvents":[{"a":1}],"metadata":{"h":1}}', '{"traceEvents": [{"a": 1}]}'),
        ('{"a":1}', '{"a": 1}'),
        ('{"metadata":{}}', "{}"),
    ],
)  # fmt: skip
def test_the_perfetto_copy_cuts_the_metadata_member_out(text, rest):
    from lab.measure.profile import without_member

    assert without_member(text, "metadata") == rest


# ----- events --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", list(KERNELS))
def test_events_name_hlo_instructions_on_all_devices_and_steps(recorded, key):
    rec = recorded[key]
    tr = rec.trace
    assert tr.backend == "cpu"
    assert tr.steps == REPEATS
    assert tr.devices == 8
    seen = {e.name for e in tr.events}
    assert seen <= rec.names
    # Every fusion/dot/collective of the entry computation ran once per device per step. XLA:CPU runs each
    # emulated device's program as its own thunk sequence (on whichever client thread is free), so even a
    # per-device op shows up once for each of the 8 devices, tagged by the device_ordinal arg.
    wanted = _compute_ops(rec)
    assert wanted and wanted <= seen
    for name in wanted:
        cells = Counter((e.step, e.device) for e in tr.events if e.name == name)
        assert set(cells) == {(s, d) for s in range(REPEATS) for d in range(8)}, name
        assert set(cells.values()) == {1}, name
    for e in tr.events:
        assert e.dur_us >= 0 and e.self_us >= 0 and e.wait_us >= 0
        assert e.self_us + e.wait_us <= e.dur_us + EPS_US
        assert 0 <= e.step < REPEATS


def test_matmul_trace_has_the_dot_fusion_and_the_all_reduce(recorded):
    rec = recorded["matmul"]
    seen = {e.name for e in rec.trace.events}
    all_reduces = [c.name for c in collectives(rec.module) if c.kind == "all-reduce"]
    assert all_reduces and set(all_reduces) <= seen
    dot_fusions = [
        n
        for n, i in rec.entry.items()
        if i.opcode == "dot"
        or (i.opcode == "fusion" and any(x.opcode == "dot" for x in rec.module.computations[i.attr("calls")[1:]]))
    ]
    assert dot_fusions and set(dot_fusions) <= seen


def test_collective_wait_is_separated_and_compute_has_none(recorded):
    tr = recorded["matmul"].trace
    entry = recorded["matmul"].entry
    coll = [e for e in tr.events if "all-" in entry[e.name].opcode]
    compute = [e for e in tr.events if entry[e.name].opcode == "fusion"]
    # Every rank waits at the AllReduce's rendezvous (a Rendezvous event nested in the op); fusions never do.
    assert coll and sum(e.wait_us for e in coll) > 0
    assert compute and all(e.wait_us == 0 and e.self_us == e.dur_us for e in compute)


@pytest.mark.parametrize("key", list(KERNELS))
def test_per_op_and_step_times(recorded, key):
    tr = recorded[key].trace
    stats = tr.per_op()
    assert set(stats) == {e.name for e in tr.events}
    for name, s in stats.items():
        evs = [e for e in tr.events if e.name == name]
        assert s.name == name
        assert s.count == len(evs)
        assert s.devices == len({e.device for e in evs}) == 8
        assert 0 <= s.median_self_s <= s.median_s + 1e-12
        assert 0 <= s.median_wait_s <= s.median_s + 1e-12
    times = tr.step_times()
    assert len(times) == REPEATS and all(t > 0 for t in times)
    assert [n for n, _, _ in tr.step_spans] == list(range(REPEATS))


def test_parse_accepts_logdir_run_dir_and_files_alike(recorded):
    rec = recorded["allreduce"]
    key = [(e.name, e.device, e.step) for e in rec.trace.events]
    json_file = glob.glob(os.path.join(rec.files.run_dir, "*.trace.json.gz"))[0]
    for source in (rec.files.logdir, rec.files.run_dir, rec.files.perfetto, json_file):
        assert [(e.name, e.device, e.step) for e in parse(source, rec.names).events] == key
    # The .xplane.pb (read through jax.profiler.ProfileData) holds the same events as the JSON.
    from_xplane = parse(rec.files.xplane, rec.names)
    assert Counter((e.name, e.device, e.step) for e in from_xplane.events) == Counter(key)
    assert from_xplane.steps == REPEATS


def test_module_filter(recorded):
    rec = recorded["matmul"]
    assert parse(rec.files, module=rec.module_name).events == parse(rec.files).events
    with pytest.raises(UserError, match="no device events"):
        parse(rec.files, module="jit_no_such_module")
    with pytest.raises(UserError, match="no device events named by the given HLO instructions"):
        parse(rec.files, {"no-such-instruction.1"})


def test_record_twice_into_one_logdir_and_without_warmup(jax_devices, tmp_path):
    import jax
    import jax.numpy as jnp

    fn = jax.jit(lambda x: jnp.sin(x) * 2)
    x = jnp.ones((8, 8))
    first = record(fn, (x,), tmp_path, warmup=0, repeats=1)
    second = record(fn, (x,), tmp_path, repeats=2)  # back to back: still its own run folder
    assert first.run_dir != second.run_dir
    assert (parse(first).steps, parse(second).steps) == (1, 2)
    assert parse(tmp_path).steps == 2  # a logdir means its newest run
    assert {e.name for e in parse(first).events} == {e.name for e in parse(second).events}


# ----- errors --------------------------------------------------------------------------------------------------


def test_unwritable_logdir_raises_user_error(jax_devices, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    logdir = blocker / "logs"
    with pytest.raises(UserError, match=re.escape(str(logdir))):
        record(lambda: None, (), logdir)


def test_bad_counts_raise_user_error(tmp_path):
    with pytest.raises(UserError, match="repeats"):
        record(lambda: None, (), tmp_path, repeats=0)
    with pytest.raises(UserError, match="warmup"):
        record(lambda: None, (), tmp_path, warmup=-1)


@pytest.mark.parametrize(
    ("filename", "data"),
    [
        ("empty.trace.json.gz", b""),
        ("garbage.trace.json.gz", b"\x1f\x8b not really gzip"),
        ("garbage.json", b"{not json"),
        ("events.json", b'{"traceEvents": []}'),
        ("no_ops.json", b'{"traceEvents": [{"ph": "X", "pid": 1, "tid": 1, "name": "step", "ts": 0, "dur": 5}]}'),
        ("list.json", b"[1, 2, 3]"),
    ],
)
def test_unusable_json_raises_user_error(tmp_path, filename, data):
    path = tmp_path / filename
    path.write_bytes(data)
    with pytest.raises(UserError, match="no device events"):
        parse(str(path))


@pytest.mark.parametrize("data", [b"", b"\x00\x01garbage\xff"])
def test_unusable_xplane_raises_user_error(jax_devices, tmp_path, data):
    path = tmp_path / "host.xplane.pb"
    path.write_bytes(data)
    with pytest.raises(UserError):
        parse(path)


def test_missing_or_empty_paths_raise_user_error(tmp_path):
    with pytest.raises(UserError, match="no trace at"):
        parse(tmp_path / "nowhere")
    with pytest.raises(UserError, match="no device events"):
        parse(tmp_path)


# ----- synthetic traces: the arithmetic and the GPU/TPU rules ----------------------------------------------------


def _doc(processes: dict[int, str], threads: dict[tuple[int, int], str], events: list[dict]) -> dict:
    meta = [{"ph": "M", "pid": p, "name": "process_name", "args": {"name": n}} for p, n in processes.items()]
    meta += [
        {"ph": "M", "pid": p, "tid": t, "name": "thread_name", "args": {"name": n}} for (p, t), n in threads.items()
    ]
    return {"displayTimeUnit": "ns", "traceEvents": meta + [{"ph": "X", **e} for e in events]}


def _write(tmp_path, doc) -> str:
    path = tmp_path / "host.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return str(path)


def _steps(pid: int, tid: int, n: int, length: float = 100.0) -> list[dict]:
    return [
        {"pid": pid, "tid": tid, "name": "step", "ts": i * length, "dur": length - 1, "args": {"step_num": str(i)}}
        for i in range(n)
    ]


def test_rendezvous_wait_less_the_leaders_callback(tmp_path):
    op = {"device_ordinal": "3", "hlo_op": "all-reduce.1", "hlo_module": "jit_f", "run_id": "7"}
    doc = _doc(
        {701: "/host:CPU"},
        {(701, 1): "python", (701, 2): "tf_XLAPjRtCpuClient/1"},
        [
            *_steps(701, 1, 1),
            {"pid": 701, "tid": 1, "name": "Execute", "ts": 1, "dur": 5, "args": {"run_id": "7"}},
            {"pid": 701, "tid": 2, "name": "all-reduce.1", "ts": 10, "dur": 80, "args": op},
            {"pid": 701, "tid": 2, "name": "Rendezvous", "ts": 12, "dur": 40},
            {"pid": 701, "tid": 2, "name": "Wait: pending_threads=1/2", "ts": 13, "dur": 20},
            {"pid": 701, "tid": 2, "name": "InvokeRendezvous", "ts": 40, "dur": 10},
            {"pid": 701, "tid": 2, "name": "Wait: pending_threads=1/2", "ts": 200, "dur": 10},  # after the op
            {"pid": 701, "tid": 2, "name": "end: all-reduce.1", "ts": 90, "dur": 0},
            {"pid": 701, "tid": 3, "name": "Rendezvous", "ts": 10, "dur": 80},  # another thread: not this op's
        ],
    )
    tr = parse(_write(tmp_path, doc))
    assert tr.events == (OpEvent("all-reduce.1", 3, 0, 10.0, 80.0, 50.0, 30.0),)
    assert tr.per_op()["all-reduce.1"].median_wait_s == pytest.approx(30e-6)


def test_numeric_args_read_as_their_text(tmp_path):
    """Chrome traces from other writers may give args as numbers, even one key as a number here and text there; they
    read as the text JAX writes, so an op's run_id still finds the step its launch ran in (the reader keeps a trace's
    own dict only when every value is text already)."""

    def doc(step, device, launch_run, op_run):
        return _doc(
            {701: "/host:CPU"},
            {(701, 1): "python", (701, 2): "worker"},
            [
                {"pid": 701, "tid": 1, "name": "step", "ts": 0, "dur": 99, "args": {"step_num": step}},
                {"pid": 701, "tid": 1, "name": "Execute", "ts": 1, "dur": 5, "args": {"run_id": launch_run}},
                {
                    "pid": 701,
                    "tid": 2,
                    "name": "fusion.2",
                    "ts": 150,  # after the step's span: only its run_id places it in step 0
                    "dur": 20,
                    "args": {"hlo_op": "fusion.2", "device_ordinal": device, "run_id": op_run},
                },
            ],
        )

    (tmp_path / "text").mkdir()
    (tmp_path / "numbers").mkdir()
    as_text = parse(_write(tmp_path / "text", doc("0", "5", "7", "7")))
    as_numbers = parse(_write(tmp_path / "numbers", doc(0, 5, 7, "7")))
    assert as_numbers.events == as_text.events == (OpEvent("fusion.2", 5, 0, 150.0, 20.0, 20.0, 0.0),)


def test_tpu_device_planes_use_the_xla_ops_line(tmp_path):
    threads = {(701, 1): "python"}
    events = _steps(701, 1, 2)
    for dev in range(2):
        pid = 1 + dev
        threads |= {(pid, 1): "XLA Modules", (pid, 2): "XLA Ops", (pid, 3): "Steps"}
        for step in range(2):
            t0 = step * 100 + 10
            events += [
                {"pid": pid, "tid": 1, "name": "jit_f(1)", "ts": t0, "dur": 50},
                {"pid": pid, "tid": 2, "name": "fusion.3", "ts": t0, "dur": 20, "args": {"long_name": "%fusion.3 = f"}},
                {"pid": pid, "tid": 2, "name": "all-reduce.1", "ts": t0 + 20, "dur": 30},
                {"pid": pid, "tid": 3, "name": str(step), "ts": t0, "dur": 50, "args": {"step_num": str(step)}},
            ]
    events.append({"pid": 701, "tid": 1, "name": "fusion.3", "ts": 5, "dur": 1, "args": {"hlo_op": "fusion.3"}})
    doc = _doc({701: "/host:CPU", 1: "/device:TPU:0", 2: "/device:TPU:1"}, threads, events)
    tr = parse(_write(tmp_path, doc), {"fusion.3", "all-reduce.1"})
    assert (tr.backend, tr.devices, tr.steps) == ("tpu", 2, 2)
    assert len(tr.events) == 8  # the host-side fusion.3 is not counted next to the device's
    assert Counter((e.device, e.step) for e in tr.events) == {(d, s): 2 for d in range(2) for s in range(2)}
    assert all(e.wait_us == 0 for e in tr.events)
    assert set(tr.per_op()) == {"fusion.3", "all-reduce.1"}


def test_gpu_device_planes_use_kernels_hlo_op(tmp_path):
    threads = {(701, 1): "python", (701, 2): "host thunks", (1, 7): "Stream #7(Compute)", (1, 9): "Stream #9(Nccl)"}
    events = [
        *_steps(701, 1, 1),
        {"pid": 701, "tid": 2, "name": "fusion.3", "ts": 5, "dur": 1, "args": {"hlo_op": "fusion.3"}},
        {"pid": 1, "tid": 7, "name": "gemm_kernel", "ts": 10, "dur": 5, "args": {"hlo_op": "fusion.3"}},
        {"pid": 1, "tid": 7, "name": "splitk_reduce", "ts": 15, "dur": 2, "args": {"hlo_op": "fusion.3"}},
        {
            "pid": 1,
            "tid": 9,
            "name": "ncclDevKernel_AllReduce",
            "ts": 20,
            "dur": 30,
            "args": {"hlo_op": "all-reduce.1"},
        },
        {"pid": 1, "tid": 7, "name": "MemcpyD2H", "ts": 60, "dur": 3},
    ]
    tr = parse(_write(tmp_path, _doc({701: "/host:CPU", 1: "/device:GPU:0"}, threads, events)))
    assert (tr.backend, tr.devices, tr.steps) == ("gpu", 1, 1)
    assert [(e.name, e.device, e.step) for e in tr.events] == [("fusion.3", 0, 0)] * 2 + [("all-reduce.1", 0, 0)]
    stats = tr.per_op()
    assert stats["fusion.3"].count == 2 and stats["fusion.3"].median_s == pytest.approx(7e-6)  # kernels summed


def test_trace_without_steps_counts_everything_once(tmp_path):
    doc = _doc(
        {701: "/host:CPU"},
        {(701, 2): "worker"},
        [
            {"pid": 701, "tid": 2, "name": "dot.2", "ts": t, "dur": 4, "args": {"hlo_op": "dot.2", "device_ordinal": d}}
            for t, d in ((0, "0"), (1, "1"), (10, "0"))
        ],
    )
    tr = parse(_write(tmp_path, doc))
    assert (tr.steps, tr.devices, tr.step_times()) == (0, 2, [])
    assert all(e.step == -1 for e in tr.events)
    assert tr.per_op()["dot.2"].median_s == pytest.approx(8e-6)  # device 0 ran it twice: 8 us is the slowest device
    assert isinstance(tr, Trace)


def test_the_perfetto_copy_gets_a_track_per_emulated_device(tmp_path):
    """XLA:CPU's threads are not devices: the copy gains one 'device N' track per device, with that device's ops at
    the trace's own times; a device backend's copy is left as it was."""
    from lab.measure.profile import DEVICES_PROCESS, add_device_tracks
    from lab.measure.trace import OpEvent

    path = tmp_path / "perfetto_trace.json.gz"
    original = {"displayTimeUnit": "ns", "traceEvents": [{"ph": "X", "pid": 1, "tid": 7, "ts": 10.0, "dur": 5.0}]}
    path.write_bytes(gzip.compress(json.dumps(original).encode()))
    events = [OpEvent("fusion.1", d, 0, 100.0 + d, 20.0, 18.0, 2.0) for d in (0, 1)] + [
        OpEvent("dot.2", 1, 1, 200.0, 30.0, 30.0, 0.0)
    ]
    assert not add_device_tracks(str(path), events, "gpu")
    assert json.loads(gzip.decompress(path.read_bytes())) == original
    assert add_device_tracks(str(path), events, "cpu")
    doc = json.loads(gzip.decompress(path.read_bytes()))
    added = doc["traceEvents"][1:]
    assert doc["traceEvents"][0] == original["traceEvents"][0]
    names = {e["tid"]: e["args"]["name"] for e in added if e.get("name") == "thread_name"}
    assert names == {0: "device 0", 1: "device 1"}
    assert [e["args"]["name"] for e in added if e.get("name") == "process_name"] == [DEVICES_PROCESS]
    slices = [(e["tid"], e["name"], e["ts"], e["dur"]) for e in added if e["ph"] == "X"]
    assert slices == [(0, "fusion.1", 100.0, 20.0), (1, "fusion.1", 101.0, 20.0), (1, "dot.2", 200.0, 30.0)]
