"""Test environment: 8 emulated CPU devices, set here before anything imports JAX.

The device count never comes from the environment of whoever runs the tests: any
``--xla_force_host_platform_device_count`` already in XLA_FLAGS is replaced.
"""

import os
import re
import tempfile

N_DEVICES = 8

_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count={N_DEVICES}".strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# A calibration the user ran in ./specs must not change what the catalog returns under test.
os.environ["SHARDLAB_SPECS_DIR"] = tempfile.mkdtemp(prefix="shardlab-specs-")
# One XLA compilation cache for the session, subprocesses included: the same small programs are compiled by
# several tests (the audit, the runs, the fault tests' processes), and XLA:CPU takes seconds for each.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="shardlab-xla-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def jax_devices():
    """The 8 emulated devices (imports JAX only for tests that ask)."""
    import jax

    devices = jax.devices()
    assert len(devices) == N_DEVICES, f"expected {N_DEVICES} emulated devices, got {len(devices)}"
    return devices
