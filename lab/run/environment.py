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

from lab.core import limits
from lab.core.devices import DEVICE_KIND_TO_CHIP, chip_for_device, spec_name
from lab.core.errors import UserError, keep_terminations
from lab.core.hardware import Chip, default_catalog, specs_dir


class Progress:
    """One line per phase on stderr with the elapsed time (``quiet`` turns it off)."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def point(self, i: int, n: int, label: str, started: float, done: int) -> None:
        """Point ``i`` of ``n`` starts: how far the sweep is, its elapsed time and (once a point has finished here)
        the time left at this run's pace; a bar on a terminal, a plain line otherwise. Always on stderr."""
        if self.quiet:
            return
        elapsed = time.perf_counter() - started
        left = f", about {elapsed / done * (n - i + 1):.0f} s left" if done else ""
        line = f"point {i} of {n} ({label}): {elapsed:.0f} s elapsed{left}"
        if sys.stderr.isatty():
            width = 20
            filled = round(width * (i - 1) / n)
            line = f"[{'#' * filled}{'.' * (width - filled)}] " + line
        self(line)


# A host that is always shared (a CI runner; the test suite, whose parallel workers load each other) may keep an
# automatic calibration taken while busy: set to 1. The spec is then marked BUSY wherever it prices a run.
KEEP_BUSY_ENV = "SHARDLAB_KEEP_BUSY_CALIBRATION"
MAX_EMULATED = limits.MAX_EMULATED  # host devices one program spans on XLA:CPU (lab.core.limits: measured)


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
        from lab.measure.calibrate import HostBusy, calibrate, check_writable, write_spec

        check_writable()  # before the calibration, not after it
        progress(f"no calibration for this host in {spec}: calibrating first (quick)")
        keep_busy = os.environ.get(KEEP_BUSY_ENV, "") not in ("", "0")
        try:  # a busy host's figures would price every later run too slow: refused, never saved or used
            cal = calibrate(mesh, quick=True, progress=progress, force=keep_busy)  # forced: marked BUSY where used
        except HostBusy as exc:
            raise UserError(
                f"{exc.what}; the automatic calibration was not kept: run `shardlab calibrate` when the host is "
                "idle, or price with a catalog chip (--hardware NAME)"
            ) from None
        path = write_spec(cal)
        progress(f"wrote {path}")
        return default_catalog(hardware_file).get("cpu")
    for path in (specs_dir() / spec_name(backend, device_kind), spec):  # this device kind's, then the backend's
        if path.is_file():
            from lab.core.hardware import load_hardware_file

            progress(f"pricing with the calibration in {path}")
            return load_hardware_file(path, catalog)[0]
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
    keep_terminations()  # the backend has started (libtpu took SIGTERM): the lab's handler back
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
