"""Write the two SYNTHESIZED device-trace fixtures of tests/test_device_trace.py (deterministic).

No GPU or TPU was available where these fixtures were made, so they are not recordings: this script builds
Chrome-trace JSON shaped after what ``jax.profiler.trace`` writes as ``<host>.trace.json.gz`` on XLA:GPU and
XLA:TPU (the layout ``lab/measure/trace.py`` documents), with every duration taken from the constants below.
The expected values in tests/test_device_trace.py were worked out by hand from these constants.

Run from the repository root to rewrite the checked-in files (or into another folder with ``--out``)::

    .venv/bin/python tests/data/device_traces/make_traces.py [--out DIR]

Output (under DIR, by default the folder of this script)::

    gpu/plugins/profile/2025_01_02_03_04_05/gpu-host.trace.json.gz
    tpu/plugins/profile/2025_01_02_03_04_06/tpu-host.trace.json.gz

Each file is gzip with mtime 0 and no file name in its header, so the same constants give the same JSON.
All times are microseconds (Chrome trace ``ts``/``dur``); every duration is a multiple of 0.5 us, so sums and
medians are exact in binary floating point.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
HOST_PID = 701  # the /host:CPU plane, as jax's CPU traces number it
PYTHON_TID = 100  # the python thread that carries the StepTraceAnnotation("step") events
STEPS = 3

SYNTHESIZED = (
    "SYNTHESIZED trace, not a recording: no {kind} was available, so tests/data/device_traces/make_traces.py "
    "wrote this file in the shape of the trace.json.gz that jax.profiler.trace writes on XLA:{kind}. "
    "Every duration is a made-up constant of that script (microseconds), chosen so that the per-op medians "
    "in tests/test_device_trace.py can be worked out by hand; none of them is a measured time."
)

# ----- GPU: 2 devices, kernels on "Stream #13(Compute)" with hlo_op / hlo_module args -------------------------------

GPU_RUN = "2025_01_02_03_04_05"
GPU_HOST = "gpu-host"
GPU_MODULE = "jit_train_step"
GPU_DEVICES = 2
GPU_STEP_START = [100.0, 1100.0, 2100.0]  # host "step" events: start (us)
GPU_STEP_DUR = [950.0, 820.0, 835.0]  # ... and duration (us): step_times() = these * 1e-6
GPU_LAUNCH = 30.0  # the first kernel of a step starts this long after the step's start
GPU_GAP = 2.0  # idle time between two kernels on a stream
# Kernel durations (us), [device][step]. custom-call.1 is a cuBLAS GEMM of two kernels: the GEMM and its split-K
# reduction; fusion.3 a loop fusion (one kernel); all-reduce.1 one NCCL kernel.
GPU_GEMM = [[40.0, 38.0, 39.0], [41.0, 37.5, 42.0]]
GPU_SPLITK = [[4.0, 4.5, 3.5], [3.0, 4.0, 5.0]]
GPU_FUSION = [[12.0, 11.0, 13.5], [12.5, 10.5, 11.0]]
GPU_ALLREDUCE = [[80.0, 95.0, 70.0], [60.0, 90.0, 100.0]]
GPU_MEMCPY = 6.0  # a device-to-host copy after the all-reduce, on its own stream, with no hlo_op: not an op
# A second, tiny program (another HLO module) ran once on each device before step 0: outside every step.
GPU_CONVERT_MODULE = "jit_convert_element_type"
GPU_CONVERT_TS = 20.0
GPU_CONVERT = [3.0, 3.5]  # [device]
GPU_KERNELS = {  # hlo_op -> kernel names, in stream order
    "custom-call.1": (
        "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel",
        "splitKreduce_kernel",
    ),
    "fusion.3": ("loop_add_fusion",),
    "all-reduce.1": ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",),
}

# ----- TPU: 4 devices, ops on the "XLA Ops" line, "XLA Modules" and "Steps" lines beside it -------------------------

TPU_RUN = "2025_01_02_03_04_06"
TPU_HOST = "tpu-host"
TPU_MODULE = "jit_train_step"
TPU_DEVICES = 4
TPU_STEP_START = [200.0, 700.0, 1200.0]
TPU_STEP_DUR = [400.0, 310.0, 305.0]
TPU_LAUNCH = 40.0  # the module starts this long after the step's start
TPU_GAP = 1.0
# Op durations (us), [device][step]. fusion.7 runs twice per step (a loop body): its first execution lasts
# 5 + 0.5 * device + step, its second TPU_FUSION7_SECOND.
TPU_FUSION1 = [[20.0, 21.0, 19.0], [22.0, 20.0, 20.0], [20.0, 23.0, 19.5], [21.0, 20.0, 24.0]]
TPU_FUSION7_SECOND = 3.0
TPU_ALLREDUCE = [[30.0, 31.0, 29.0], [30.0, 33.0, 29.0], [28.0, 31.0, 35.0], [30.0, 30.0, 29.0]]
TPU_CATEGORY = {"fusion.1": "convolution fusion", "fusion.7": "loop fusion", "all-reduce.1": "all-reduce"}


def tpu_fusion7_first(device: int, step: int) -> float:
    return 5.0 + 0.5 * device + step


# ----- building ----------------------------------------------------------------------------------------------------


def _meta(pid: int, name: str, tid: int | None = None, sort: int | None = None) -> list[dict]:
    """process_name / thread_name metadata (with the sort-index companion jax writes)."""
    if tid is None:
        return [
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}},
            {
                "ph": "M",
                "pid": pid,
                "name": "process_sort_index",
                "args": {"sort_index": pid if sort is None else sort},
            },
        ]
    return [
        {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}},
        {"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}},
    ]


def _x(pid: int, tid: int, name: str, ts: float, dur: float, args: dict | None = None) -> dict:
    ev = {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}
    if args:
        ev["args"] = args
    return ev


def _host(step_start: list[float], step_dur: list[float], program: str) -> list[dict]:
    """The python thread: one "step" annotation per step, with the jitted call nested in it."""
    events = _meta(HOST_PID, "/host:CPU") + _meta(HOST_PID, "python", PYTHON_TID)
    for s in range(STEPS):
        t0 = step_start[s]
        events.append(_x(HOST_PID, PYTHON_TID, "step", t0, step_dur[s], {"step_num": str(s)}))
        events.append(_x(HOST_PID, PYTHON_TID, f"PjitFunction({program})", t0 + 2.0, 20.0))
    return events


def gpu_trace() -> dict:
    launch_tid = 200  # host thread on which XLA:GPU launches the thunks (annotated with the HLO op)
    events = _host(GPU_STEP_START, GPU_STEP_DUR, "train_step") + _meta(HOST_PID, "xla_gpu_launch", launch_tid)
    correlation = 1000
    for d in range(GPU_DEVICES):
        pid = 1 + d
        events += _meta(pid, f"/device:GPU:{d}")
        events += _meta(pid, "Stream #13(Compute)", 13) + _meta(pid, "Stream #14(MemcpyD2H)", 14)

    def kernel(d: int, name: str, ts: float, dur: float, op: str, module: str) -> None:
        nonlocal correlation
        correlation += 1
        args = {"correlation_id": str(correlation), "device_id": str(d), "stream_id": "13"}
        args |= {"hlo_op": op, "hlo_module": module}
        events.append(_x(1 + d, 13, name, ts, dur, args))
        # The host-side launch, annotated with the same op: must not be counted next to the kernel.
        events.append(_x(HOST_PID, launch_tid, op, ts - 8.0, 1.5, {"hlo_op": op, "hlo_module": module}))

    for d in range(GPU_DEVICES):
        kernel(d, "convert_element_type", GPU_CONVERT_TS, GPU_CONVERT[d], "convert.2", GPU_CONVERT_MODULE)
    for s in range(STEPS):
        for d in range(GPU_DEVICES):
            t = GPU_STEP_START[s] + GPU_LAUNCH
            durs = {
                "custom-call.1": (GPU_GEMM[d][s], GPU_SPLITK[d][s]),
                "fusion.3": (GPU_FUSION[d][s],),
                "all-reduce.1": (GPU_ALLREDUCE[d][s],),
            }
            for op, names in GPU_KERNELS.items():
                for name, dur in zip(names, durs[op], strict=True):
                    kernel(d, name, t, dur, op, GPU_MODULE)
                    t += dur + GPU_GAP
            events.append(_x(1 + d, 14, "MemcpyD2H", t, GPU_MEMCPY, {"device_id": str(d), "stream_id": "14"}))
    return {
        "displayTimeUnit": "ns",
        "metadata": {"highres-ticks": True, "synthesized": SYNTHESIZED.format(kind="GPU")},
        "traceEvents": events,
    }


def tpu_trace() -> dict:
    events = _host(TPU_STEP_START, TPU_STEP_DUR, "train_step")
    for d in range(TPU_DEVICES):
        pid = 1 + d
        events += _meta(pid, f"/device:TPU:{d}")
        events += _meta(pid, "Steps", 1) + _meta(pid, "XLA Modules", 2) + _meta(pid, "XLA Ops", 3)
    for s in range(STEPS):
        for d in range(TPU_DEVICES):
            pid = 1 + d
            t0 = t = TPU_STEP_START[s] + TPU_LAUNCH
            ops = [
                ("fusion.1", TPU_FUSION1[d][s]),
                ("fusion.7", tpu_fusion7_first(d, s)),
                ("fusion.7", TPU_FUSION7_SECOND),
                ("all-reduce.1", TPU_ALLREDUCE[d][s]),
            ]
            for op, dur in ops:
                args = {"long_name": f"%{op} = f32[1024,1024] ...", "hlo_category": TPU_CATEGORY[op]}
                events.append(_x(pid, 3, op, t, dur, args))
                t += dur + TPU_GAP
            # The module around the ops, and the device's own step marker: neither is an op, and the device's
            # step (from this module's start to the next one's, or to this module's end after the last) is not
            # the host's annotated step: it runs past the host's step 0 and 1.
            events.append(_x(pid, 2, f"{TPU_MODULE}(42)", t0, t - t0, {"run_id": str(100 + s)}))
            end = TPU_STEP_START[s + 1] + TPU_LAUNCH if s + 1 < STEPS else t
            events.append(_x(pid, 1, str(s), t0, end - t0, {"step_num": str(s)}))
    return {
        "displayTimeUnit": "ns",
        "metadata": {"highres-ticks": True, "synthesized": SYNTHESIZED.format(kind="TPU")},
        "traceEvents": events,
    }


FIXTURES = {  # relative path -> builder
    os.path.join("gpu", "plugins", "profile", GPU_RUN, f"{GPU_HOST}.trace.json.gz"): gpu_trace,
    os.path.join("tpu", "plugins", "profile", TPU_RUN, f"{TPU_HOST}.trace.json.gz"): tpu_trace,
}


def encode(doc: dict) -> bytes:
    """The gzip bytes of one trace: compact JSON, gzip header without a time stamp or a file name."""
    return gzip.compress(json.dumps(doc, separators=(",", ":")).encode("utf-8"), compresslevel=9, mtime=0)


def write(out: str = HERE) -> list[str]:
    """Write every fixture under ``out``; return the paths written."""
    paths = []
    for rel, build in FIXTURES.items():
        path = os.path.join(out, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(encode(build()))
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=HERE, help="folder to write gpu/ and tpu/ under (default: beside this file)")
    for path in write(parser.parse_args().out):
        print(f"{os.path.getsize(path):6d} bytes  {path}")


if __name__ == "__main__":
    main()
