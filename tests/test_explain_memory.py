"""``shardlab explain memory``: the buffers live at the compiled program's peak, by role, beside the estimator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli

from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.run.experiment import load_experiment

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"


_run = run_cli


@pytest.fixture(scope="module")
def train():
    from lab.compile.memory import explain_memory

    plan = load_experiment(EXPERIMENTS / "train_fsdp_tp.toml").plan
    return plan, explain_memory(plan, get_chip("cpu"))


def _param_bytes_per_device(plan) -> int:
    """The Plan's parameters on one device: each array's shard under its sharding."""
    import jax
    import numpy as np

    from kernels.registry import build

    params = build(plan).abstract[0]
    return sum(
        int(np.prod(a.sharding.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(params)
    )


def test_the_buffers_at_the_peak_add_up_to_xla_s_memory_within_1_percent(train):
    _, result = train
    assert result.peak_bytes == pytest.approx(sum(b.bytes for b in result.buffers))
    assert abs(result.peak_bytes / result.xla_peak_bytes - 1) <= 0.01


def test_every_role_of_a_train_step_is_found_and_its_parameters_are_the_plan_s(train):
    plan, result = train
    roles = {b.role for b in result.buffers}
    assert {"parameter", "optimizer state", "gradient", "activation", "collective", "temporary"} <= roles
    assert result.by_role["parameter"]["xla"] == _param_bytes_per_device(plan)
    assert result.by_role["parameter"]["xla"] == result.by_role["parameter"]["estimated"]
    saved = [b for b in result.buffers if b.role == "activation"]
    assert any("/attention/" in b.scope and "model.py:" in b.source for b in saved)
    gathered = [b for b in result.buffers if b.role == "collective"]
    assert all(b.name.split(".")[0] in ("all-gather", "all-reduce", "reduce-scatter") for b in gathered)


def test_the_timeline_peaks_where_the_buffers_were_read(train):
    _, result = train
    live = sum(result.timeline.values())
    assert len(live) == result.schedule_length
    assert live.max() == pytest.approx(result.live_bytes)
    assert live[result.peak_position] == pytest.approx(result.live_bytes)
    free = [b for b in result.buffers if b.role == "heap free"]
    assert len(free) == 1 and result.peak_bytes == pytest.approx(result.live_bytes + free[0].bytes)
    assert not any(b.role == "fragmentation stat" for b in result.buffers)  # the host's temp is the heap itself


def test_the_json_has_the_fields_the_issue_names(train):
    _, result = train
    data = json.loads(json.dumps(result.to_dict()))
    assert {"peak_bytes", "xla_peak_bytes", "buffers", "by_role"} <= set(data)
    assert {"bytes", "role", "name", "source"} <= set(data["buffers"][0])
    assert all(set(v) == {"xla", "estimated"} for v in data["by_role"].values())
    assert data["by_role"]["total"]["xla"] == pytest.approx(data["peak_bytes"])
    assert data["live_bytes"] <= data["peak_bytes"] and data["heap"]["size"] > 0


def test_decode_from_the_command_line_with_its_timeline(tmp_path):
    png = tmp_path / "decode.png"
    code, out, err = _run(["explain", "memory", str(EXPERIMENTS / "decode_tp.toml"), "--png", str(png), "--json"])
    assert code == 0, err
    data = json.loads(out)
    assert abs(data["peak_bytes"] / data["xla_peak_bytes"] - 1) <= 0.01
    plan = load_experiment(EXPERIMENTS / "decode_tp.toml").plan
    assert data["by_role"]["parameter"]["xla"] == _param_bytes_per_device(plan)
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--target", "v9x:2x4"], "unknown TPU generation"),
        (["--target", "nope"], "not a TPU topology or GPU name"),
        (["--png", "timeline.txt"], "chart format"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2_before_compiling(argv, said):
    code, out, err = _run(["explain", "memory", str(EXPERIMENTS / "train_fsdp_tp.toml"), *argv])
    assert code == 2 and out == "" and said in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("path", [str(ROOT / "README.md"), str(ROOT / "missing.toml"), "train_step"])
def test_a_path_that_is_no_experiment_is_one_line_and_exit_2(path):
    code, _, err = _run(["explain", "memory", path])
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_a_program_xla_refuses_is_a_user_error(monkeypatch):
    import jax

    import kernels.registry
    from lab.compile.memory import compile_dumped

    class Refused:
        def lower(self, *args):
            return self

        def compile(self, **kw):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: the program needs 9 TiB\nmore detail")

    class Built:
        fn, abstract = Refused(), ()

    monkeypatch.setattr(kernels.registry, "build", lambda plan, mesh: Built())
    plan = load_experiment(EXPERIMENTS / "train_fsdp_tp.toml").plan
    with pytest.raises(UserError, match="XLA could not compile train_fsdp_tp on this host: RESOURCE_EXHAUSTED"):
        compile_dumped(plan, None, "/tmp")


@pytest.mark.slow
def test_a_program_cross_compiled_for_a_tpu_adds_up_to_xla_s_memory_within_1_percent():
    """train_fsdp_tp on v5e:2x4: 555 kB are live at the peak (the rest of the program sits in VMEM); the heap's
    free space and the fragmentation figure libtpu adds to temp_size_in_bytes make up the other 4.1 MB."""
    pytest.importorskip("libtpu")
    code, out, err = _run(
        [
            "explain",
            "memory",
            str(EXPERIMENTS / "train_fsdp_tp.toml"),
            "--target",
            "v5e:2x4",
            "--dtype",
            "bf16",
            "--json",
        ]
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["compiled_for"] == "v5e:2x4"
    assert sum(b["bytes"] for b in data["buffers"]) == pytest.approx(data["peak_bytes"])
    assert abs(data["peak_bytes"] / data["xla_peak_bytes"] - 1) <= 0.01
    heap = data["heap"]
    assert heap["alignment"] == 16384 and heap["size"] % 16384 == 0 and heap["counted"]
    mem = data["memory_analysis"]
    assert heap["size"] + heap["fragmentation"] == mem["temp_size_in_bytes"]  # libtpu's temp, to the byte
    held = mem["argument_size_in_bytes"] + mem["output_size_in_bytes"] - mem["alias_size_in_bytes"]
    assert data["live_bytes"] + data["by_role"]["heap free"]["xla"] == pytest.approx(held + heap["size"])
    assert data["other_memory_spaces"] > 0  # VMEM, SMEM and sync flags: beside HBM, not in memory_analysis


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "selective", "full"])
def test_the_estimator_is_within_10_percent_of_what_a_v5e_holds_for_llama3_8b_2_layers(tmp_path, remat):
    """Issue 37's bar: llama3_8b_train_2layer cross-compiled for v5e:2x4 holds (live buffers and the heap's free
    space at the peak) within 10% of the training estimator's memory per device, under each remat policy."""
    pytest.importorskip("libtpu")
    text = (EXPERIMENTS / "llama3_8b_train_2layer.toml").read_text()
    toml = tmp_path / f"llama_{remat}.toml"
    toml.write_text(text.replace('remat = "none"', f'remat = "{remat}"'))
    code, out, err = _run(["explain", "memory", str(toml), "--target", "v5e:2x4", "--json"])
    assert code == 0, err
    data = json.loads(out)
    assert data["held_bytes"] == pytest.approx(data["live_bytes"] + data["by_role"]["heap free"]["xla"])
    assert 0.9 <= data["held_over_estimated"] <= 1.1, data["by_role"]


# ----- a synthesized dump: the reading and the heap rows by hand ------------------------------------------------

HLO = """HloModule jit_step, entry_computation_layout={(f32[32,32]{1,0})->(f32[32,32]{1,0})}

ENTRY %main (p0: f32[32,32]) -> (f32[32,32]) {
  %p0 = f32[32,32]{1,0} parameter(0), metadata={op_name="params['w']"}
  %fusion.1 = f32[64,32]{1,0} fusion(%p0), kind=kLoop, calls=%fused, metadata={op_name="jit(step)/concatenate"}
  %all-gather.2 = f32[32,32]{1,0} all-gather(%p0), dimensions={0}, metadata={op_name="jit(step)/all_gather"}
  %tuple.1 = (f32[64,32]{1,0}, f32[32,32]{1,0}) tuple(%fusion.1, %all-gather.2)
  %add.1 = f32[32,32]{1,0} add(%all-gather.2, %all-gather.2), metadata={op_name="jit(step)/add"}
  ROOT %tuple = (f32[32,32]{1,0}) tuple(%add.1)
}
"""
# The heap: a tuple index table in a 16 KiB slot of its own (placed before the heap simulation, as XLA:TPU does),
# fusion.1 (8 KiB) and the all-gather (4 KiB) placed by the simulator, add.1 sharing fusion.1's space once it is
# freed. Its size, 36864 B, rounds up to 49152 B (16 KiB alignment).
ASSIGNMENT = """BufferAssignment:
allocation 0: size 4096, parameter 0, shape |f32[32,32]| at ShapeIndex {}:
 value: <1 p0 @0> (size=4096,offset=0): f32[32,32]{1,0}
allocation 1: size 512, output shape is |(f32[32,32])|, maybe-live-out:
 value: <6 tuple @0> (size=512,offset=0): (f32[32,32]{1,0})
allocation 2: size 36864, preallocated-temp:
 value: <2 tuple.1 @0> (size=512,offset=0): (f32[64,32]{1,0}, f32[32,32]{1,0})
 value: <3 fusion.1 @0> (size=8192,offset=16384): f32[64,32]{1,0}
 value: <4 all-gather.2 @0> (size=4096,offset=32768): f32[32,32]{1,0}
 value: <5 add.1 @0> (size=4096,offset=16384): f32[32,32]{1,0}
allocation 3: size 65536, color 1, preallocated-temp:
 value: <7 copy.9 @0> (size=65536,offset=0): f32[128,128]{1,0:T(8,128)S(1)}
"""
LIVE_RANGES = """HloLiveRange (max 6):
  InstructionSequence:
    0:p0
    1:fusion.1
    2:all-gather.2
    3:tuple.1
    4:add.1
    5:tuple
  BufferLiveRange:
    p0{}:0-6
    fusion.1{}:1-3
    all-gather.2{}:2-4
    tuple.1{}:3-3
    add.1{}:4-5
    tuple{}:5-6
    copy.9{}:1-2
"""
ALLOC, FREE, SHARE = 0, 1, 2


def _proto(fields: list[tuple[int, int | bytes]]) -> bytes:
    """Protobuf wire format: varints and length-delimited fields (a zero varint left out, as protobuf does)."""

    def varint(n: int) -> bytes:
        out = b""
        while True:
            out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
            n >>= 7
            if not n:
                return out

    out = b""
    for number, value in fields:
        if isinstance(value, bytes):
            out += varint(number << 3 | 2) + varint(len(value)) + value
        elif value:
            out += varint(number << 3) + varint(value)
    return out


def _hlo_proto(sizes: dict[int, int], events: list[tuple[int, int]], allocation: int) -> bytes:
    """An ``HloProto`` holding only a buffer assignment: its logical buffers and one heap simulator trace."""
    buffers = [(1, _proto([(1, i), (2, n)])) for i, n in sizes.items()]
    trace = _proto([*((1, _proto([(1, k), (2, b)])) for k, b in events), (2, 1), (3, allocation)])
    return _proto([(3, _proto([*buffers, (4, trace)]))])


@pytest.fixture()
def tpu_dump(tmp_path):
    stem = tmp_path / "module_0000.jit_step.cl_1"
    Path(f"{stem}.after_optimizations-buffer-assignment.txt").write_text(ASSIGNMENT)
    Path(f"{stem}.after_optimizations-live-range.txt").write_text(LIVE_RANGES)
    Path(f"{stem}.flagfile").write_text("--xla_foo=1\n--xla_jf_program_hbm_alignment_in_kib=16\n")
    events = [(ALLOC, 3), (ALLOC, 4), (FREE, 3), (SHARE, 5), (FREE, 4), (FREE, 5)]
    Path(f"{stem}.after_optimizations.hlo.pb").write_bytes(_hlo_proto({3: 8192, 4: 4096, 5: 4096}, events, 2))
    return tmp_path


def _read(folder, tpu: bool):
    from lab.compile.hlo import parse_module
    from lab.compile.memory import read_peak
    from lab.compile.memory_dump import read_dump, read_flag, read_heap_traces
    from lab.compile.memory_heap import read_heap

    allocations, ranges = read_dump(folder)
    alignment = int(read_flag(folder, "xla_jf_program_hbm_alignment_in_kib") or 0) * 1024 if tpu else 1
    heap = read_heap(allocations, read_heap_traces(folder), alignment, tpu=tpu)
    return heap, read_peak(allocations, ranges, parse_module(HLO), heap)


def test_a_synthesized_tpu_dump_adds_up_role_by_role_with_the_heap_s_free_space_and_libtpu_s_figure(tpu_dump):
    from lab.compile.memory import by_role

    heap, reading = _read(tpu_dump, tpu=True)
    # heap 36864 B rounded up to 16 KiB: 49152; no-fragmentation peak: the simulator's 8192 + 4096 live together
    # (add.1 shares fusion.1's space: it adds nothing) and the table's 512 B held throughout: 12800
    assert (heap.size, heap.alignment, heap.no_fragmentation_peak) == (49152, 16384, 12800)
    assert heap.fragmentation == 49152 - 12800
    assert reading.peak_position == 3  # fusion.1, the all-gather and the table live together
    got = {r: v["xla"] for r, v in by_role(list(reading.buffers), {}).items()}
    assert got == {
        "parameter": 4096,
        "output": 512,
        "temporary": 8192 + 512,  # fusion.1 and the tuple index table
        "collective": 4096,
        "heap free": 49152 - 12800,  # the rounded heap less what is live at position 3
        "fragmentation stat": 49152 - 12800,
    }
    # every row: arguments + outputs + libtpu's temp (the heap and its figure), what memory_analysis() would say
    assert sum(got.values()) == 4096 + 512 + 49152 + (49152 - 12800)
    assert reading.live_bytes == 4096 + 512 + 12800
    assert {b.name: b.role for b in reading.buffers}["params['w']"] == "parameter"


def test_the_estimate_is_held_to_the_live_buffers_and_the_heap_s_free_space_not_the_fragmentation(tpu_dump):
    """What the device holds at the peak (live + heap free) is what the estimate is judged against; the figure
    libtpu counts a second time is shown beside it, not added."""
    from lab.compile.memory import MemoryExplanation, by_role

    heap, reading = _read(tpu_dump, tpu=True)
    held = 4096 + 512 + 12800 + (49152 - 12800)  # live, then the heap's free space
    est = held / 1.05  # the estimator 5% under what is held
    roles = by_role(list(reading.buffers), {"params": 4096, "activations": est - 4096, "total": est})
    total = sum(b.bytes for b in reading.buffers)
    explained = MemoryExplanation(
        total,
        total,
        3,
        5,
        reading.buffers,
        roles,
        {},
        heap=heap,
        live_bytes=reading.live_bytes,
        target="synth",
        mesh={"x": 2},
        backend="tpu",
        compiled_for="v5e:2x4",
    )
    d = explained.to_dict()
    assert d["held_bytes"] == held and d["estimated_bytes"] == pytest.approx(est)
    assert d["held_over_estimated"] == pytest.approx(1.05)
    line = explained._against_estimate()
    assert "1.05x" in line and "(within 10%)" in line and f"is {total / est:.2f}x" in line


def test_the_same_dump_on_the_host_has_no_fragmentation_row_and_an_unrounded_heap(tpu_dump):
    heap, reading = _read(tpu_dump, tpu=False)
    assert (heap.size, heap.fragmentation) == (36864, None)
    rows = {b.role: b.bytes for b in reading.buffers if b.role in ("heap free", "fragmentation stat")}
    assert rows == {"heap free": 36864 - 12800}


def test_a_tpu_heap_of_only_tuple_tables_and_scalars_is_not_counted():
    from lab.compile.memory_dump import parse_buffer_assignment
    from lab.compile.memory_heap import read_heap

    text = """BufferAssignment:
allocation 0: size 16896, preallocated-temp:
 value: <2 tuple.1 @0> (size=512,offset=0): (f32[64,32]{1,0}, f32[32,32]{1,0})
 value: <3 add.7 @0> (size=512,offset=16384): s32[]{:T(128)}
"""
    heap = read_heap(parse_buffer_assignment(text), {}, 16384, tpu=True)
    assert (heap.counted, heap.size, heap.fragmentation) == (False, 0.0, None)
    rank1 = text + " value: <4 dynamic-slice.1 @0> (size=512,offset=16384): s32[1]{0:T(128)}\n"
    assert read_heap(parse_buffer_assignment(rank1), {}, 16384, tpu=True).size == 32768


def test_the_no_fragmentation_peak_counts_what_the_simulator_allocates_not_what_shares_it():
    """a (100 B) allocated, b placed in a's space, b freed, c (50 B) allocated, then a and c freed: 150 B at most
    (counting b's share and free too would give 200, counting only its free 100)."""
    from lab.compile.memory_dump import Allocation, HeapTrace, Value
    from lab.compile.memory_heap import no_fragmentation_peak

    heap = Allocation(0, 256, "temp", values=tuple(Value(n, s, 0, "f32[25]", i) for i, n, s in [(1, "a", 100)]))
    trace = HeapTrace(0, ((ALLOC, 1), (SHARE, 2), (FREE, 2), (ALLOC, 3), (FREE, 1), (FREE, 3)), {1: 100, 2: 100, 3: 50})
    assert no_fragmentation_peak(heap, trace) == 150
