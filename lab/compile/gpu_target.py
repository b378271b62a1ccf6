"""Compiled truth for GPUs that are not here: ahead-of-time compilation for NVIDIA GPUs from a target configuration.

With JAX's CUDA plugin installed (``jax-cuda12-plugin``, no GPU and no CUDA libraries needed), XLA:GPU compiles for
devices it is only told about: a ``GpuTargetConfigProto`` in text form (the chip: compute capability, SMs, shared
memory, L2, HBM, clock and per-dtype unit rates) and a topology ``"SLICES x HOSTS x GPUS-PER-HOST"``::

    jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=TEXT, topology="1x1x8")

gives 8 compile-only devices; a program sharded over a mesh of them lowers and compiles with XLA:GPU's own passes
(its collective combiners, async ``all-reduce-start``/``-done`` pairs, Triton GEMM fusions). Nothing executes.
``memory_analysis()`` answers; ``cost_analysis()`` returns None (jaxlib 0.10.2), so the lab's HLO reading prices
the program. Measured on a 2-core host without a GPU: docs/validation/gpu_cross_compile.md.

The configurations below are XLA's own device descriptions (openxla/xla, Apache-2.0:
``xla/backends/gpu/target_config/specs/{h100_sxm,h200,b200,a100_sxm_80}.txtpb``), without two fields that
jaxlib 0.10.2's ``GpuDeviceInfoProto`` does not have (``name`` and ``collective_memory_granularity``: its text
parser refuses the whole configuration for either). :func:`target_config` renders one; a file of your own (a
``.txtpb``, for a GPU not listed) is read as it is.

On a host without a GPU the CUDA plugin's start-up check (``cuInit``) fails and JAX drops the plugin, unless
``JAX_PLATFORMS`` leaves CUDA out (``cpu``) or ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` is set: :func:`quiet_absent_gpu`
sets the second before JAX starts. JAX is imported only inside functions; a name is checked without starting it.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from lab.core.errors import UserError

# jax's own extra for "CUDA installed elsewhere": the plugin pinned to the installed jaxlib, without the 3.2 GB of
# nvidia-* wheels (compiling needs none of them); the runtime wheel (3.5 MB) only keeps the plugin from printing
# "Could not find cuda drivers" on every start. About 186 MB to download and 490 MB installed.
INSTALL = "pip install 'jax[cuda12-local]=={jax}' nvidia-cuda-runtime-cu12 (no GPU needed)"
_NAME = re.compile(r"([a-z][\w-]*?):(\d+)(?:x(\d+))?")


class _Enum(str):
    """A text-proto enum value: written bare (``ACCELERATED_FEATURES``), not quoted."""


def _rates(clock: float, table: dict[int, tuple[int, int]], special: dict[int, tuple[float, int, int]] | None = None):
    """``rate_infos`` map entries: XLA primitive type -> (clock GHz, units per SM, ops per clock)."""
    rows = {k: (clock, units, ops) for k, (units, ops) in table.items()} | (special or {})
    return [
        {"key": k, "value": {"clock_rate_ghz": c, "units_per_core": u, "ops_per_clock": o}}
        for k, (c, u, o) in sorted(rows.items())
    ]


# Hopper (sm_90a): H100 SXM and H200 share SMs, clocks and unit rates; they differ in HBM size and bandwidth.
_HOPPER_SCALAR = _rates(1.98, {4: (64, 1), 8: (64, 1), 10: (128, 2), 11: (128, 1), 12: (64, 1), 16: (128, 2)})
_HOPPER_MATRIX = _rates(
    1.8295201,
    {2: (4, 1024), 6: (4, 1024), 10: (4, 512), 11: (4, 256), 16: (4, 512)}
    | {k: (4, 1024) for k in (19, 20, 23, 24, 25, 28, 29, 33, 35, 36)},
    {12: (1.98, 4, 32)},
)
_BLACKWELL_SCALAR = _rates(1.965, {4: (64, 1), 8: (64, 1), 10: (128, 1), 11: (128, 1), 12: (64, 1), 16: (128, 1)})
_BLACKWELL_MATRIX = _rates(
    1.8353101,
    {2: (4, 2048), 6: (4, 2048), 10: (4, 1024), 11: (4, 512), 16: (4, 1024), 32: (4, 4096)}
    | {k: (4, 2048) for k in (19, 20, 23, 24, 25, 28, 29, 33, 35, 36)},
    {12: (1.965, 4, 16)},
)


def _device_info(
    *,
    cores: int,
    fpus: int,
    bandwidth: int,
    l2: int,
    clock: float,
    memory: int,
    smem_core: int,
    smem_optin: int,
    cc_major: int,
    feature: str,
    rest: dict,
) -> dict:
    """A ``gpu_device_info`` in the field order of XLA's spec files (common limits of every CUDA GPU since Volta)."""
    return {
        "threads_per_block_limit": 1024,
        "threads_per_warp": 32,
        "shared_memory_per_block": 49152,
        "shared_memory_per_core": smem_core,
        "threads_per_core_limit": 2048,
        "core_count": cores,
        "fpus_per_core": fpus,
        "block_dim_limit_x": 2147483647,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "memory_bandwidth": bandwidth,
        "l2_cache_size": l2,
        "clock_rate_ghz": clock,
        "device_memory_size": memory,
        "shared_memory_per_block_optin": smem_optin,
        "cuda_compute_capability": {"major": cc_major, "feature_extension": _Enum(feature)},
        "registers_per_core_limit": 65536,
        "registers_per_block_limit": 65536,
    } | rest


def _nvidia(cc: str, memory: int, cores: int, clock: float, mem_clock_khz: int, l2: int, pcie: int, units) -> dict:
    """The fields after the register limits in XLA's H100/H200/B200 files: unit rates, thread limits, identity."""
    scalar, matrix = units
    return {
        "scalar_unit_description": {"rate_infos": scalar},
        "matrix_unit_description": {"rate_infos": matrix},
        "thread_dim_limit_x": 1024,
        "thread_dim_limit_y": 1024,
        "thread_dim_limit_z": 64,
        "device_vendor": "NVIDIA Corporation",
        "platform_version": f"Compute Capability {cc}",
        "model_str": (
            f"sm_{cc} with {memory}B RAM, {cores} cores, {round(clock * 1e6)}KHz clock, {mem_clock_khz}KHz mem clock, "
            f"{l2}B L2$"
        ),
        "device_address_bits": 64,
        "pcie_bandwidth": pcie,
        "ecc_enabled": True,
        "driver_version": "13.0.0",
        "runtime_version": "12.8.0",
        "compile_time_toolkit_version": "12.8.0",
        "dnn_version": "9.10.0",
        "cub_version": "3.1.2",
        "device_interconnect_info": {"active_links": 18},
    }


_H100_MEM, _H200_MEM, _B200_MEM, _A100_MEM = 84942979072, 151397597184, 191514411008, 85100068864
_HOPPER_L2, _B200_L2 = 52428800, 132644864
_HOPPER = (_HOPPER_SCALAR, _HOPPER_MATRIX)


@dataclass(frozen=True)
class GpuSpec:
    """One GPU XLA can be told about: the catalog chip that prices it, the device kind JAX reports for it (the
    configuration's ``device_description_str``) and the spec file it was taken from."""

    chip: str
    device_kind: str
    source: str
    device_info: dict
    dnn: tuple[int, ...]

    def text(self) -> str:
        """The ``GpuTargetConfigProto`` in text form."""
        dnn = dict(zip(("major", "minor", "patch"), self.dnn, strict=False))
        return _render(
            {
                "gpu_device_info": self.device_info,
                "platform_name": "CUDA",
                "dnn_version_info": dnn,
                "device_description_str": self.device_kind,
            }
        )


_SPECS = "xla/backends/gpu/target_config/specs/"
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        "h100",
        "NVIDIA H100 80GB HBM3",
        _SPECS + "h100_sxm.txtpb",
        _device_info(
            cores=132, fpus=128, bandwidth=3352320000000, l2=_HOPPER_L2, clock=1.98, memory=_H100_MEM,
            smem_core=233472, smem_optin=232448, cc_major=9, feature="ACCELERATED_FEATURES",
            rest=_nvidia("9.0a", _H100_MEM, 132, 1.98, 2619000, _HOPPER_L2, 34359738368, _HOPPER),
        ),
        (8, 9, 4),
    ),
    "h200": GpuSpec(
        "h200",
        "NVIDIA H200 141GB HBM3e",
        _SPECS + "h200.txtpb",
        _device_info(
            cores=132, fpus=128, bandwidth=4800000000000, l2=_HOPPER_L2, clock=1.98, memory=_H200_MEM,
            smem_core=233472, smem_optin=232448, cc_major=9, feature="ACCELERATED_FEATURES",
            rest=_nvidia("9.0a", _H200_MEM, 132, 1.98, 3750000, _HOPPER_L2, 34359738368, _HOPPER),
        ),
        (9, 10, 0),
    ),
    "b200": GpuSpec(
        "b200",
        "NVIDIA B200",
        _SPECS + "b200.txtpb",
        _device_info(
            cores=148, fpus=128, bandwidth=7672320000000, l2=_B200_L2, clock=1.965, memory=_B200_MEM,
            smem_core=233472, smem_optin=232448, cc_major=10, feature="ACCELERATED_FEATURES",
            rest=_nvidia(
                "10.0a", _B200_MEM, 148, 1.965, 3996000, _B200_L2, 68719476736, (_BLACKWELL_SCALAR, _BLACKWELL_MATRIX)
            ),
        ),
        (9, 7),
    ),
    "a100": GpuSpec(
        "a100-80gb",
        "NVIDIA A100-SXM4-80GB",
        _SPECS + "a100_sxm_80.txtpb",
        _device_info(
            cores=108, fpus=64, bandwidth=2039040000000, l2=41943040, clock=1.41, memory=_A100_MEM,
            smem_core=167936, smem_optin=166912, cc_major=8, feature="NONE",
            rest={"dnn_version": "8.9.4", "thread_dim_limit_x": 1024, "thread_dim_limit_y": 1024,
                  "thread_dim_limit_z": 64},
        ),
        (8, 9, 4),
    ),
}  # fmt: skip


def _render(message: dict, indent: int = 0) -> str:
    """A message as protobuf text format: nested dicts are messages, lists repeated fields."""
    pad = "  " * indent
    lines = []
    for name, value in message.items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, dict):
                lines.append(f"{pad}{name} {{\n{_render(v, indent + 1)}{pad}}}\n")
            else:
                lines.append(f"{pad}{name}: {_scalar(v)}\n")
    return "".join(lines)


def _scalar(v) -> str:
    if isinstance(v, _Enum):
        return str(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


@dataclass(frozen=True)
class GpuTarget:
    """GPUs to compile for: ``name`` as given (``h100:8``), the catalog chip, the device kind, the GPUs in all and
    the topology string XLA takes (slices x hosts x GPUs per host). ``config`` is the path of a configuration of
    one's own, when not one of :data:`GPUS`."""

    name: str
    gpu: str
    chip: str
    device_kind: str
    chips: int
    hosts: int = 1
    config: str | None = None
    backend = "gpu"  # the compiler (a TPU Target's is "tpu")

    @property
    def topology(self) -> str:
        return f"1x{self.hosts}x{self.chips // self.hosts}"

    def to_dict(self) -> dict[str, object]:
        return {
            "topology": self.name,
            "gpu": self.gpu,
            "chip": self.chip,
            "device_kind": self.device_kind,
            "chips": self.chips,
            "hosts": self.hosts,
        }


def parse_gpu_target(text: str) -> GpuTarget:
    """``"h100:8"`` (8 GPUs on one host) or ``"h100:2x8"`` (2 hosts of 8) -> a :class:`GpuTarget`; a
    :class:`UserError` listing the known GPUs for anything else. Nothing imports JAX."""
    m = _NAME.fullmatch(text.strip().lower())
    known = f"known GPUs: {', '.join(GPUS)}; e.g. h100:8, h200:8, b200:2x8"
    if not m:
        raise UserError(f"--target {text!r} is not a GPU target; give GPU:N or GPU:HOSTSxN, {known}")
    gpu = m.group(1)
    if gpu not in GPUS:
        raise UserError(f"--target {text!r}: unknown GPU {gpu!r}; {known}")
    hosts, per_host = (int(m.group(2)), int(m.group(3))) if m.group(3) else (1, int(m.group(2)))
    if hosts * per_host == 0:
        raise UserError(f"--target {text!r} has no GPUs; {known}")
    spec = GPUS[gpu]
    name = f"{gpu}:{hosts}x{per_host}" if m.group(3) else f"{gpu}:{per_host}"
    return GpuTarget(name, gpu, spec.chip, spec.device_kind, hosts * per_host, hosts)


def target_config(gpu: str) -> str:
    """The ``GpuTargetConfigProto`` text of a GPU of :data:`GPUS` (``"h100"``), or of a ``.txtpb`` file's path."""
    if gpu in GPUS:
        return GPUS[gpu].text()
    path = Path(gpu)
    if path.is_file():
        return path.read_text()
    raise UserError(f"no GPU target configuration {gpu!r}: give one of {', '.join(GPUS)} or a .txtpb file's path")


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA 12 plugin (the XLA:GPU compiler) is importable."""
    try:  # find_spec of a submodule imports its parent, and raises when the parent is missing too
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


def require_cuda_plugin() -> None:
    """The CUDA plugin is importable, or a :class:`UserError` saying how to install it."""
    if not cuda_plugin_installed():
        from importlib.metadata import PackageNotFoundError, version

        try:
            jax = version("jax")
        except PackageNotFoundError:
            jax = "VERSION"
        how = INSTALL.format(jax=jax)
        raise UserError(f"compiling for GPUs that are not here needs JAX's CUDA plugin, not installed; {how}")


def gpu_present() -> bool:
    """Whether this host has an NVIDIA driver loaded (the device files CUDA opens)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


def quiet_absent_gpu() -> None:
    """On a host without a GPU, let the CUDA plugin register without its start-up check (``cuInit`` fails there
    and JAX would drop the plugin with a traceback on stderr). A host with a GPU is left alone. Call it before
    JAX starts; with ``JAX_PLATFORMS=cpu`` the check is skipped anyway."""
    if not gpu_present():
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def topology_devices(target: GpuTarget) -> list:
    """The target's compile-only devices (no GPU needed), checked against the configuration's device kind."""
    require_cuda_plugin()
    quiet_absent_gpu()
    from jax.experimental import topologies

    text = target_config(target.config or target.gpu)
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology=target.topology)
    except NotImplementedError as exc:  # the plugin did not register: its start-up check failed
        raise UserError(
            f"JAX has no CUDA plugin to describe {target.name} ({exc}); set JAX_PLATFORMS=cpu or "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 on a host without a GPU"
        ) from None
    except Exception as exc:  # XLA's parser says only that it failed; the field it refused goes to stderr
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"XLA cannot describe {target.name} ({first})") from None
    devices = list(topo.devices)
    if len(devices) != target.chips:
        raise UserError(f"{target.name}: XLA describes {len(devices)} devices, not {target.chips}")
    kind = devices[0].device_kind
    if target.config is None and kind != target.device_kind:
        raise UserError(f"{target.name}: XLA describes {kind!r} devices, not {target.device_kind!r}")
    return devices


__all__ = [
    "GPUS",
    "INSTALL",
    "GpuSpec",
    "GpuTarget",
    "cuda_plugin_installed",
    "gpu_present",
    "parse_gpu_target",
    "quiet_absent_gpu",
    "require_cuda_plugin",
    "target_config",
    "topology_devices",
]
