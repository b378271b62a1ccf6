"""Test environment: 8 emulated CPU devices, set here before anything imports JAX.

The device count never comes from the environment of whoever runs the tests: any
``--xla_force_host_platform_device_count`` already in XLA_FLAGS is replaced.
"""

import gc
import os
import re
import tempfile

N_DEVICES = 8

_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
# The tests check what XLA emits (HLO after its passes) and what the programs compute, not how fast LLVM's code
# runs: without LLVM's optimisation of the generated loops, XLA:CPU compiles the suite's programs about 1.6x
# faster (the matmuls still call the same precompiled library). Subprocesses inherit it; a run that a test times
# is priced against a host calibration taken under the same flags. Give the flag yourself to override it.
if "--xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _jaxlib_minor() -> tuple[int, int] | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("jaxlib").split(".")[:2]
        return int(major), int(minor)
    except (PackageNotFoundError, ValueError):
        return None


# XLA:CPU's MLIR fusion emitters take most of a train step's compile: without them (the older emitters, scatters
# expanded first) a train step of the suite compiles about 3x faster (train_dp 3.3 s -> 1.1 s; the pipelines, whose
# time is sharding propagation, not at all) and the default suite takes 10% less, every test passing as before.
# The audits' collectives and their bytes do not change; XLA's whole-program cost analysis moves by under 0.2% in
# FLOPs and 2.5% in bytes accessed, the temporaries by under 1% (train_fsdp_tp, train_ep_dp_tp: the scatters). XLA
# aborts on a flag it does not know, so it goes only to the jaxlib it was measured with (0.10); give
# --xla_cpu_use_fusion_emitters yourself to override.
if "--xla_cpu_use_fusion_emitters" not in _flags and _jaxlib_minor() == (0, 10):
    _flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count={N_DEVICES}".strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# A calibration the user ran in ./specs must not change what the catalog returns under test.
os.environ["SHARDLAB_SPECS_DIR"] = tempfile.mkdtemp(prefix="shardlab-specs-")
# Each worker calibrates the host once, while the other workers run: keep that calibration (marked BUSY) rather
# than refuse it, as a user on an always-shared host may (tests of the refusal unset it).
os.environ["SHARDLAB_KEEP_BUSY_CALIBRATION"] = "1"
# One XLA compilation cache for the session, subprocesses included: the same small programs are compiled by
# several tests (the audit, the runs, the fault tests' processes), and XLA:CPU takes seconds for each.
# ./scripts/test keeps it between runs (in .venv); pytest on its own uses a new one each session.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="shardlab-xla-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


def _drop_truncated_entries(folder: str) -> None:
    """Delete cache entries a killed run left half-written. JAX writes an entry in place, never replaces one, and
    warns on every read of a bad one, so a test run interrupted mid-write would warn in every later run. JAX's
    entries are zlib streams here (zstd where zstandard is installed: those are left as they are)."""
    import zlib

    for entry in os.scandir(folder):
        if not entry.name.endswith("-cache") or not entry.is_file():
            continue
        with open(entry.path, "rb") as f:
            data = f.read()
        if data[:1] != b"\x78":  # not zlib
            continue
        try:
            zlib.decompress(data)
        except zlib.error:
            os.remove(entry.path)


# A test process lives for the whole suite and keeps JAX's caches of traced and compiled programs: Python's collector
# rescans all of it at every full collection. Collecting less often (a full collection after 100 of the middle
# generation, not 10; the youngest at 2,000 new objects, not 700) took test_transformer_pipeline, test_audit and
# test_transformer in one process from 8.9 s of collection (20 full ones) to 2.5 s (2) of 146 s, its peak memory
# 981 -> 929 MB (2026-12-02). Garbage is still collected; what the tests check does not depend on when.
gc.set_threshold(2000, 10, 100)


if "PYTEST_XDIST_WORKER" not in os.environ and os.path.isdir(os.environ["JAX_COMPILATION_CACHE_DIR"]):
    _drop_truncated_entries(os.environ["JAX_COMPILATION_CACHE_DIR"])  # once, before the workers start

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def jax_devices():
    """The 8 emulated devices (imports JAX only for tests that ask)."""
    import jax

    devices = jax.devices()
    assert len(devices) == N_DEVICES, f"expected {N_DEVICES} emulated devices, got {len(devices)}"
    return devices


@pytest.fixture
def pipeline_audit(jax_devices):
    """``check(path, permutes, permute_bytes, grad_bytes, flops)``: audit a pipeline experiment file on the cpu
    chip and hold it to hand-counted figures (both schedules' tests use it); returns the audit and its Plan."""

    def check(path, permutes, permute_bytes, grad_bytes, flops):
        from lab.compile.audit import audit_plan
        from lab.core.hardware import get_chip
        from lab.run.experiment import load_experiment

        exp = load_experiment(os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments", path))
        r = audit_plan(exp.plan, get_chip("cpu"))
        assert r.all_match and not r.unexpected, r.table()
        by_kind = {(e.kind, e.axes): e for e in r.entries}
        assert set(by_kind) == {("permute", ("pipe",)), ("all-reduce", ("data",)), ("all-reduce", ("data", "pipe"))}
        permute = by_kind[("permute", ("pipe",))]
        assert permute.predicted_bytes == permute_bytes and permute.compiled_bytes == permute_bytes, r.table()
        assert len(permute.instructions) == permutes  # one collective-permute per pass, forward and backward
        grads = by_kind[("all-reduce", ("data",))]
        assert grads.predicted_bytes == grads.compiled_bytes == grad_bytes
        assert by_kind[("all-reduce", ("data", "pipe"))].compiled_bytes == 4  # the float32 loss
        assert r.flops_compiled == flops and r.flops_predicted == flops
        return r, exp.plan

    return check
