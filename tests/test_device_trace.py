"""lab.measure.trace.parse on the checked-in GPU and TPU trace fixtures (tests/data/device_traces/).

The fixtures are SYNTHESIZED (no GPU or TPU was available): tests/data/device_traces/make_traces.py writes
them in the shape of the ``<host>.trace.json.gz`` that ``jax.profiler.trace`` leaves on XLA:GPU and XLA:TPU.
Every expected number below was worked out by hand from that script's constants (the arithmetic is in the
comments); none is read back from the code under test.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections import Counter

import pytest

from lab.core.errors import UserError
from lab.measure.trace import parse

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "device_traces")
GPU_LOGDIR = os.path.join(DATA, "gpu")
TPU_LOGDIR = os.path.join(DATA, "tpu")
GPU_RUN = os.path.join(GPU_LOGDIR, "plugins", "profile", "2025_01_02_03_04_05")
TPU_RUN = os.path.join(TPU_LOGDIR, "plugins", "profile", "2025_01_02_03_04_06")
GPU_FILE = os.path.join(GPU_RUN, "gpu-host.trace.json.gz")
TPU_FILE = os.path.join(TPU_RUN, "tpu-host.trace.json.gz")
US = 1e-6


def _load(path: str) -> dict:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def _generator():
    spec = importlib.util.spec_from_file_location("make_traces", os.path.join(DATA, "make_traces.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu():
    return parse(GPU_LOGDIR)


@pytest.fixture(scope="module")
def tpu():
    return parse(TPU_LOGDIR)


# ----- the fixture files ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [GPU_FILE, TPU_FILE])
def test_fixtures_are_small_labelled_synthesized_chrome_traces(path):
    assert os.path.getsize(path) < 8 * 1024
    doc = _load(path)
    assert doc["displayTimeUnit"] == "ns"
    assert doc["metadata"]["synthesized"].startswith("SYNTHESIZED trace, not a recording")
    phases = Counter(e["ph"] for e in doc["traceEvents"])
    assert set(phases) == {"M", "X"}
    names = {e["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert {"process_name", "thread_name"} <= names


def test_checked_in_fixtures_are_what_the_generator_writes(tmp_path):
    gen = _generator()
    written = gen.write(str(tmp_path))
    assert len(written) == 2
    for path in written:
        rel = os.path.relpath(path, tmp_path)
        assert _load(path) == _load(os.path.join(DATA, rel)), f"{rel} is stale: rerun make_traces.py"
    # Deterministic: the same constants give the same bytes (no time stamp in the gzip header).
    assert gen.encode(gen.gpu_trace()) == gen.encode(gen.gpu_trace())


def test_parse_takes_the_logdir_the_run_folder_or_the_file_alike(gpu, tpu):
    def key(tr):
        return [(e.name, e.device, e.step, e.start_us, e.dur_us) for e in tr.events]

    assert key(parse(GPU_RUN)) == key(parse(GPU_FILE)) == key(gpu)
    assert key(parse(TPU_RUN)) == key(parse(TPU_FILE)) == key(tpu)


# ----- GPU: 2 devices, kernels on Stream #13 named by their hlo_op arg -----------------------------------------


def test_gpu_backend_devices_and_steps(gpu):
    assert (gpu.backend, gpu.devices, gpu.steps) == ("gpu", 2, 3)
    # Host "step" annotations: 950, 820 and 835 us (GPU_STEP_DUR).
    assert gpu.step_times() == pytest.approx([950 * US, 820 * US, 835 * US])
    assert [(n, a) for n, a, _ in gpu.step_spans] == [(0, 100.0), (1, 1100.0), (2, 2100.0)]


def test_gpu_ops_are_the_kernels_hlo_ops_and_nothing_from_the_host(gpu):
    # Per device and step: 2 GEMM kernels + 1 fusion + 1 all-reduce = 4, over 2 devices x 3 steps = 24, plus the
    # convert.2 kernel once per device before step 0 = 26. The host-side launch events carry the same hlo_op
    # args (26 of them) and the MemcpyD2H kernels carry none: a parser counting either would find 52 or 32.
    assert len(gpu.events) == 26
    assert Counter(e.name for e in gpu.events) == {
        "custom-call.1": 12,
        "fusion.3": 6,
        "all-reduce.1": 6,
        "convert.2": 2,
    }
    assert {e.device for e in gpu.events} == {0, 1}
    assert all(e.wait_us == 0 and e.self_us == e.dur_us for e in gpu.events)
    for name in ("custom-call.1", "fusion.3", "all-reduce.1"):
        per_cell = Counter((e.step, e.device) for e in gpu.events if e.name == name)
        assert set(per_cell) == {(s, d) for s in range(3) for d in range(2)}, name


def test_gpu_per_op_medians(gpu):
    stats = gpu.per_op()
    assert list(stats) == ["convert.2", "custom-call.1", "fusion.3", "all-reduce.1"]  # order of first execution
    # Median over steps of the slowest device (GPU_* tables are [device][step]):
    #   custom-call.1 = GEMM + split-K: dev0 44, 42.5, 42.5; dev1 44, 41.5, 47 -> max 44, 42.5, 47 -> median 44
    #   fusion.3: dev0 12, 11, 13.5; dev1 12.5, 10.5, 11 -> max 12.5, 11, 13.5 -> median 12.5
    #   all-reduce.1: dev0 80, 95, 70; dev1 60, 90, 100 -> max 80, 95, 100 -> median 95
    #   convert.2 ran outside every step (one "step" of its own): max(3, 3.5) = 3.5
    expected = {"custom-call.1": 44.0, "fusion.3": 12.5, "all-reduce.1": 95.0, "convert.2": 3.5}
    for name, us in expected.items():
        assert stats[name].median_s == pytest.approx(us * US), name
        assert stats[name].median_self_s == pytest.approx(us * US), name
        assert stats[name].median_wait_s == 0.0, name
        assert stats[name].devices == 2, name
    assert stats["custom-call.1"].spread == pytest.approx(47 / 42.5)
    assert stats["fusion.3"].spread == pytest.approx(13.5 / 11)
    assert stats["all-reduce.1"].spread == pytest.approx(100 / 80)
    assert (stats["custom-call.1"].count, stats["fusion.3"].count, stats["all-reduce.1"].count) == (12, 6, 6)


def test_gpu_an_op_of_two_kernels_is_their_sum(gpu):
    # Step 2 on device 1: the GEMM kernel lasts 42 us, its split-K reduction 5 us.
    cell = sorted(e.dur_us for e in gpu.events if e.name == "custom-call.1" and (e.step, e.device) == (2, 1))
    assert cell == [5.0, 42.0]
    # Counting only the GEMM kernel would give a median of max(40, 41), max(38, 37.5), max(39, 42) -> 41 us.
    assert gpu.per_op()["custom-call.1"].median_s == pytest.approx(44 * US)


def test_gpu_collective_time_includes_its_wait(gpu):
    # No rendezvous events on a device plane: the NCCL kernel's whole duration is self time.
    ar = sorted((e.step, e.device, e.dur_us, e.self_us, e.wait_us) for e in gpu.events if e.name == "all-reduce.1")
    assert ar == [
        (0, 0, 80.0, 80.0, 0.0),
        (0, 1, 60.0, 60.0, 0.0),
        (1, 0, 95.0, 95.0, 0.0),
        (1, 1, 90.0, 90.0, 0.0),
        (2, 0, 70.0, 70.0, 0.0),
        (2, 1, 100.0, 100.0, 0.0),
    ]
    # Step 1, device 0: launched 30 us into the step, after the GEMM (38), split-K (4.5) and fusion (11) kernels,
    # each followed by a 2 us gap: 1100 + 30 + 38 + 2 + 4.5 + 2 + 11 + 2 = 1189.5.
    (start,) = [e.start_us for e in gpu.events if e.name == "all-reduce.1" and (e.step, e.device) == (1, 0)]
    assert start == 1189.5


def test_gpu_a_program_outside_the_steps_and_the_module_filter(gpu):
    convert = [e for e in gpu.events if e.name == "convert.2"]
    assert sorted((e.device, e.step, e.start_us, e.dur_us) for e in convert) == [(0, -1, 20.0, 3.0), (1, -1, 20.0, 3.5)]
    only_step = parse(GPU_LOGDIR, module="jit_train_step")
    assert len(only_step.events) == 24 and "convert.2" not in only_step.per_op()
    assert {e.name for e in parse(GPU_LOGDIR, module="jit_convert_element_type").events} == {"convert.2"}
    picked = parse(GPU_LOGDIR, {"fusion.3"})
    assert [e.name for e in picked.events] == ["fusion.3"] * 6
    with pytest.raises(UserError, match="no device events"):
        parse(GPU_LOGDIR, module="jit_no_such_module")


# ----- TPU: 4 devices, the XLA Ops line only -------------------------------------------------------------------


def test_tpu_backend_devices_and_steps(tpu):
    assert (tpu.backend, tpu.devices, tpu.steps) == ("tpu", 4, 3)
    # The host's annotations (400, 310, 305 us). The devices' own "Steps" lines carry step_num args too, but span
    # module start to next module start (240..740, 740..1240 us): taking them would stretch steps 0 and 1 to
    # 540 and 540 us.
    assert tpu.step_times() == pytest.approx([400 * US, 310 * US, 305 * US])
    assert [(n, a) for n, a, _ in tpu.step_spans] == [(0, 200.0), (1, 700.0), (2, 1200.0)]


def test_tpu_ops_come_from_the_xla_ops_line_only(tpu):
    # Per device and step: fusion.1, fusion.7 twice, all-reduce.1 = 4 ops; x 4 devices x 3 steps = 48. The
    # "XLA Modules" line (jit_train_step(42)) and the "Steps" line add 24 more events a parser must not take.
    assert len(tpu.events) == 48
    assert Counter(e.name for e in tpu.events) == {"fusion.1": 12, "fusion.7": 24, "all-reduce.1": 12}
    assert Counter((e.step, e.device) for e in tpu.events) == {(s, d): 4 for s in range(3) for d in range(4)}
    assert all(e.wait_us == 0 for e in tpu.events)


def test_tpu_per_op_medians(tpu):
    stats = tpu.per_op()
    assert list(stats) == ["fusion.1", "fusion.7", "all-reduce.1"]
    # fusion.1 (TPU_FUSION1[device][step]): max per step 22, 23, 24 -> median 23
    # fusion.7, twice per step: (5 + 0.5 d + s) + 3, slowest device d=3 -> 9.5, 10.5, 11.5 -> median 10.5
    # all-reduce.1 (TPU_ALLREDUCE): max per step 30, 33, 35 -> median 33
    expected = {"fusion.1": (23.0, 24 / 22), "fusion.7": (10.5, 11.5 / 9.5), "all-reduce.1": (33.0, 35 / 30)}
    for name, (us, spread) in expected.items():
        assert stats[name].median_s == pytest.approx(us * US), name
        assert stats[name].median_self_s == pytest.approx(us * US), name
        assert stats[name].median_wait_s == 0.0, name
        assert stats[name].spread == pytest.approx(spread), name
        assert stats[name].devices == 4, name
    assert (stats["fusion.1"].count, stats["fusion.7"].count, stats["all-reduce.1"].count) == (12, 24, 12)


def test_tpu_an_op_run_twice_in_a_step_is_summed(tpu):
    # Device 3, step 0: 5 + 1.5 + 0 = 6.5 us, then 3 us.
    cell = sorted(e.dur_us for e in tpu.events if e.name == "fusion.7" and (e.step, e.device) == (0, 3))
    assert cell == [3.0, 6.5]
    # One execution alone would make the median at most 7.5 us (the longest first execution: d=3, s=2).
    assert tpu.per_op()["fusion.7"].median_s == pytest.approx(10.5 * US)
