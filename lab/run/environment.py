"""Where a run happens: the devices (emulated host devices before JAX starts), the backend's chip, and the
record of versions, flags and device kinds each run keeps. One copy of each, for every command that runs JAX."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from lab.core.errors import UserError
from lab.core.hardware import Chip, default_catalog, specs_dir

# The device kinds JAX reports (the CUDA device name on GPUs, libtpu's name on TPUs), lower-cased, to the catalog
# chip: matched whole, never by substring, so an H100 PCIe is not priced as an SXM part nor an A100 40GB as 80GB.
DEVICE_KIND_TO_CHIP = {
    "nvidia h100 80gb hbm3": "h100",
    "nvidia h100 sxm5 80gb": "h100",
    "nvidia h100": "h100",
    "nvidia h100 pcie": "h100-pcie",
    "nvidia h200": "h200",
    "nvidia b200": "b200",
    "nvidia a100-sxm4-80gb": "a100-80gb",
    "nvidia a100-sxm4-40gb": "a100-40gb",
    "tpu v3": "tpu-v3",
    "tpu v4": "tpu-v4",
    "tpu v5 lite": "tpu-v5e",
    "tpu v5e": "tpu-v5e",
    "tpu v5": "tpu-v5p",
    "tpu v5p": "tpu-v5p",
    "tpu v6 lite": "tpu-v6e",
    "tpu v6e": "tpu-v6e",
}
# Kinds whose name leaves the part open: told apart by the memory JAX reports (bytes_limit is a little under the
# HBM size, so the split is between the two sizes).
BY_MEMORY = {"nvidia a100": (60e9, "a100-40gb", "a100-80gb")}


def chip_for_device(device_kind: str, memory_bytes: float | None = None) -> str:
    """The catalog chip of a device kind (and its memory where the kind does not settle it); a
    :class:`UserError` naming the kind and ``--hardware`` for a kind the catalog does not have."""
    kind = " ".join(device_kind.lower().split())
    if kind in DEVICE_KIND_TO_CHIP:
        return DEVICE_KIND_TO_CHIP[kind]
    for prefix, (split, small, large) in BY_MEMORY.items():
        if kind.startswith(prefix) and "pcie" not in kind and memory_bytes:
            return small if memory_bytes < split else large
    raise UserError(
        f"device kind {device_kind!r} is not in the catalog (it has "
        f"{', '.join(sorted(set(DEVICE_KIND_TO_CHIP.values())))}); price with the closest one (--hardware NAME, or "
        'hardware = "NAME" in the experiment), add it with --hardware-file, or calibrate it (`shardlab calibrate`)'
    )


class Progress:
    """One line per phase on stderr with the elapsed time (``quiet`` turns it off)."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


MAX_EMULATED = 4096  # host devices one process emulates; a larger mesh needs real devices (a pod, a cluster)


def ensure_devices(n: int, *, exact: bool = False) -> None:
    """Emulate at least ``n`` (and at least 8) host devices when JAX has not started yet and the user set no
    count; ``exact`` emulates exactly ``n`` (``--devices N``). A count already in ``XLA_FLAGS`` is the user's."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags and n <= MAX_EMULATED:  # more: real devices only
        count = n if exact else max(8, n)
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def resolve_hardware(
    name: str,
    backend: str,
    device_kind: str,
    hardware_file: str | None,
    progress: Callable[[str], None],
    mesh: dict[str, int],
    alone: bool = True,
    device_memory: float | None = None,
) -> Chip:
    """``calibrated`` (default): this backend's calibration (calibrating the host first on CPU when none
    exists and this process runs ``alone``); otherwise a catalog name."""
    catalog = default_catalog(hardware_file)
    if name != "calibrated":
        return catalog.get(name)
    spec = specs_dir() / f"{backend}.json"
    if backend == "cpu":
        chip = catalog.get("cpu")
        if chip.calibrated:
            return chip
        if not alone:  # several processes would calibrate one host at once, each measuring the others' load
            raise UserError(
                f"no calibration for this host in {spec}; calibrate it once, alone (`shardlab calibrate --quick`; "
                "`shardlab launch` does it for you), or price with a catalog chip (--hardware NAME)"
            )
        from lab.measure.calibrate import calibrate, check_writable, write_spec

        check_writable()  # before the calibration, not after it
        progress(f"no calibration for this host in {spec}: calibrating first (quick)")

        cal = calibrate(mesh, quick=True, progress=progress, force=True)  # marked, with a warning, if the host is busy
        path = write_spec(cal)
        progress(f"wrote {path}")
        return default_catalog(hardware_file).get("cpu")
    if spec.is_file():
        from lab.core.hardware import load_hardware_file

        return load_hardware_file(spec, catalog)[0]
    chip_name = chip_for_device(device_kind, device_memory)
    progress(f"no calibration for {backend}; pricing with the catalog's {chip_name} (device kind {device_kind!r})")
    return catalog.get(chip_name)


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]  # the checkout: lab/run/environment.py
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    import jax
    import jaxlib

    devs = jax.devices()
    versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version()}
    # The installed distributions' versions, without importing them (importing the profile plugin costs 0.3 s).
    for module, dist in (
        ("libtpu", "libtpu"),
        ("xprof", "xprof"),
        ("tensorboard_plugin_profile", "tensorboard-plugin-profile"),
    ):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[module] = metadata.version(dist)
    return {
        "versions": versions,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "backend": devs[0].platform,
        "device_kind": devs[0].device_kind,
        "device_memory_bytes": _device_memory(devs[0]),
        "device_count": len(devs),
        "host": platform.node(),
        "lab_commit": _git_commit(),
        "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def _device_memory(device) -> float | None:
    """The memory JAX may use on one device (``bytes_limit``); None where the backend does not say (CPU)."""
    try:
        stats = device.memory_stats() or {}
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    limit = stats.get("bytes_limit")
    return float(limit) if limit else None


def process_age_s() -> float | None:
    """Seconds since this process started (its interpreter start included), from ``/proc``; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def require_devices(mesh: dict[str, int]) -> None:
    """The mesh's devices exist (after :func:`ensure_devices`), or a one-line error saying how to get them."""
    import jax

    need = 1
    for v in mesh.values():
        need *= v
    if jax.device_count() < need:
        shown = ",".join(f"{k}={v}" for k, v in mesh.items())
        if jax.default_backend() == "cpu" and need > MAX_EMULATED:
            raise UserError(
                f"mesh {shown} needs {need} devices, more than the {MAX_EMULATED} a host can emulate; run it on that "
                "many accelerators, or give a smaller mesh"
            )
        raise UserError(
            f"mesh {shown} needs {need} devices but {jax.device_count()} are available; on a host set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need}"
        )


__all__ = [
    "DEVICE_KIND_TO_CHIP",
    "Progress",
    "chip_for_device",
    "ensure_devices",
    "environment",
    "require_devices",
    "resolve_hardware",
]
