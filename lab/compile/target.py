"""Compiled truth for TPUs that are not here: ahead-of-time compilation for a named TPU topology.

With libtpu installed (the ``tpu`` extra; it installs on any Linux x86-64 host), JAX describes a TPU slice it
does not have (``jax.experimental.topologies.get_topology_desc("v5e:2x4", "tpu")``) and compiles for its
devices: the HLO is the TPU compiler's, with the collectives, fusions and memory plan a real v5e-8 would run.
Nothing executes, so there is no measured truth; the audit, XLA's ``memory_analysis()`` and its
``cost_analysis()`` (FLOPs, bytes and the compiler's own time estimate, ``optimal_seconds``) stand beside the
lab's predictions.

:func:`parse_target` checks a name without starting JAX (so a typo is refused at once); :func:`target_mesh`
builds the mesh of a Plan over the topology's devices. A GPU name (``h100:8``) is a
:class:`lab.compile.gpu_target.GpuTarget`, compiled by XLA:GPU through JAX's CUDA plugin the same way; every
``--target`` takes either.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
from dataclasses import dataclass

from lab.core.errors import UserError

# A topology name's generation -> the catalog chip that prices it. The names are libtpu's ("v5e:2x4"); the device
# kinds are what JAX reports for that generation's devices (checked when the topology is built).
GENERATIONS: dict[str, tuple[str, str]] = {
    "v4": ("tpu-v4", "TPU v4"),
    "v5e": ("tpu-v5e", "TPU v5 lite"),
    "v5p": ("tpu-v5p", "TPU v5"),
    "v6e": ("tpu-v6e", "TPU v6 lite"),
}
EXAMPLES = ("v5e:2x2", "v5e:2x4", "v5e:4x4", "v5p:2x2x1", "v5p:2x2x2", "v6e:2x4", "v6e:4x4")
INSTALL = "pip install -e '.[tpu]' (libtpu installs on any Linux x86-64 host; ./scripts/test installs it there)"
_NAME = re.compile(r"(v\w+?):(\d+(?:x\d+){1,2})")


@dataclass(frozen=True)
class Target:
    """A TPU topology to compile for: ``name`` as given (``v5e:2x4``), its generation, catalog chip and chips."""

    name: str
    generation: str
    chip: str
    device_kind: str
    chips: int
    backend = "tpu"  # the compiler (a GpuTarget's is "gpu")

    def to_dict(self) -> dict[str, object]:
        return {
            "topology": self.name,
            "generation": self.generation,
            "chip": self.chip,
            "device_kind": self.device_kind,
            "chips": self.chips,
        }


def parse_target(text: str):
    """``"v5e:2x4"`` -> a :class:`Target`, ``"h100:8"`` -> a :class:`lab.compile.gpu_target.GpuTarget`; a
    :class:`UserError` listing the known forms for anything else. Nothing imports JAX."""
    from lab.compile.gpu_target import GPUS, parse_gpu_target

    if text.strip().lower().split(":")[0] in GPUS:
        return parse_gpu_target(text)
    m = _NAME.fullmatch(text.strip().lower())
    known = f"known generations: {', '.join(GENERATIONS)}; e.g. {', '.join(EXAMPLES)}; or a GPU: {', '.join(GPUS)}"
    if not m:
        raise UserError(
            f"--target {text!r} is not a TPU topology or GPU name; give GENERATION:AxB[xC] or GPU:N, {known}"
        )
    gen, dims = m.group(1), m.group(2)
    if gen not in GENERATIONS:
        raise UserError(f"--target {text!r}: unknown TPU generation {gen!r}; {known}")
    chips = math.prod(int(d) for d in dims.split("x"))
    if chips == 0:
        raise UserError(f"--target {text!r} has no chips; {known}")
    chip, kind = GENERATIONS[gen]
    return Target(f"{gen}:{dims}", gen, chip, kind, chips)


def require_libtpu() -> None:
    """libtpu is importable, or a :class:`UserError` saying how to install it."""
    if importlib.util.find_spec("libtpu") is None:
        raise UserError(f"compiling for a TPU topology needs libtpu, which is not installed; {INSTALL}")


def require_compiler(target) -> None:
    """The target's compiler is installed (libtpu, or JAX's CUDA plugin), or a :class:`UserError` saying how to
    install it; for a GPU, the plugin told (before JAX starts) that no GPU is here."""
    if target.backend == "tpu":
        require_libtpu()
        return
    from lab.compile.gpu_target import quiet_absent_gpu, require_cuda_plugin

    require_cuda_plugin()
    quiet_absent_gpu()


def tpu_present() -> bool:
    """Whether this host has TPU chips (the device files libtpu opens)."""
    return any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0"))


def quiet_absent_tpu() -> None:
    """On a host without TPUs, tell libtpu so before JAX loads it: otherwise every start prints a screen of
    warnings about metadata servers and worker host names it cannot find. A TPU VM is left alone."""
    if tpu_present() or importlib.util.find_spec("libtpu") is None:
        return
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")  # any valid type: nothing runs on it
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # libtpu's one-process-per-host lockfile guards chips this host does not have: without this, a second
    # cross-compilation at the same time fails ("multi-process lockfile")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def topology_devices(target) -> list:
    """The devices of the topology (no TPU needed), checked against the generation's device kind; a GPU target's
    from :func:`lab.compile.gpu_target.topology_devices`."""
    if target.backend == "gpu":
        from lab.compile import gpu_target

        return gpu_target.topology_devices(target)
    require_libtpu()
    quiet_absent_tpu()
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(target.name, "tpu")
    except Exception as exc:  # libtpu's errors are runtime errors of several kinds; say what was asked
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"libtpu cannot describe the topology {target.name!r} ({first}); try one of {', '.join(EXAMPLES)}"
        ) from None
    devices = list(topo.devices)
    kind = devices[0].device_kind
    if kind != target.device_kind:
        raise UserError(f"{target.name}: libtpu describes {kind!r} devices, not {target.device_kind!r}")
    return devices


@contextlib.contextmanager
def uncached():
    """JAX's persistent compilation cache off for a cross-compilation: an executable for absent TPUs can be written
    but not loaded back (there is no TPU client), and reading it warns on every later compile of the program."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()  # JAX decides once per process whether the cache is used: ask it again, off
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        cc.reset_cache()  # and again, as it was, for what compiles next


class DoesNotFit(UserError):
    """The TPU compiler refused a program that does not fit the chip's HBM; ``need_bytes`` is what it said the
    program's temporaries alone need (a lower bound on what one device would hold)."""

    def __init__(self, message: str, need_bytes: float):
        super().__init__(message)
        self.need_bytes = need_bytes


# libtpu's refusal: "... the total memory required for HLO temporaries (7.50T) exceeds available HBM (95.74G)."
_SIZE = r"\((\d+(?:\.\d+)?)([KMGT]?)\)"
_OUT_OF_HBM = re.compile(rf"HLO temporaries {_SIZE} exceeds available HBM {_SIZE}")
_BINARY = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def compile_for(built, target):
    """``built``'s program compiled from its abstract arguments; for a TPU ``target`` without the persistent cache.
    A program the TPU compiler finds too large for the chip's HBM is :class:`DoesNotFit` (a user's error: the
    sizes or the layout), not a crash."""
    if target is None:
        return built.fn.lower(*built.abstract).compile()
    import jax

    # Pallas asks the default device which TPU it lowers a kernel for: one of the target's
    device = next(
        (a.sharding.mesh.devices.flat[0] for a in jax.tree.leaves(built.abstract) if hasattr(a.sharding, "mesh")),
        None,
    )
    default = jax.default_device(device) if device is not None else contextlib.nullcontext()
    with uncached(), default:
        try:
            return built.fn.lower(*built.abstract).compile()
        except Exception as exc:  # jax's runtime error type moved between versions; its message is stable
            found = _OUT_OF_HBM.search(str(exc))
            if "RESOURCE_EXHAUSTED" not in str(exc) or found is None or target.backend != "tpu":
                if type(exc).__name__ != "JaxRuntimeError":
                    raise
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise UserError(f"XLA could not compile the program for {target.name}: {first[:300]}") from None
            need = float(found[1]) * _BINARY[found[2]]
            have = float(found[3]) * _BINARY[found[4]]
            raise DoesNotFit(
                f"the TPU compiler ({target.name}) refused the program: its temporaries alone need "
                f"{need / 2**30:,.4g} GiB of the {have / 2**30:,.4g} GiB of HBM; shrink the sizes or shard more",
                need,
            ) from None


def for_target(plan, target=None):
    """The Plan as the TPU compiler builds it, for its estimate. The compiler adds the partial input gradients
    of Q, K and V (and of gate and up) before one AllReduce each (XLA's all-reduce reassociation), as if the
    projections were fused, where XLA:CPU reduces each apart; it moves the cast of fp32 weights to the compute
    dtype ahead of FSDP's gathers (``cast_first``), and under recomputation it keeps the gathered norm scales.
    XLA:GPU (a GPU ``target``) does the same, except that it gathers the output table in fp32 and casts after
    (train_fsdp_tp on h100:8: 10,080 B gathered outside the layer loop, the two tables in fp32)."""
    import dataclasses

    if not plan.is_transformer:
        return plan
    options = dataclasses.replace(plan.options, fused_projections=True, cast_first=True, regather_norms=False)
    if target is not None and target.backend == "gpu":
        options = dataclasses.replace(options, cast_first_out_table=False)
    return dataclasses.replace(plan, options=options)


def target_mesh(plan_shape: dict[str, int], target: Target, devices: list | None = None):
    """A mesh shaped as the Plan says over the topology's devices (all of them: a mesh is the whole slice)."""
    import jax
    import numpy as np
    from jax.experimental import mesh_utils

    devices = devices if devices is not None else topology_devices(target)
    need = math.prod(plan_shape.values())
    if need != len(devices):
        shown = ",".join(f"{k}={v}" for k, v in plan_shape.items())
        raise UserError(
            f"the mesh {shown} has {need} devices and the topology {target.name} has {len(devices)}; give a mesh "
            f"of {len(devices)} devices (--mesh) or a topology of {need} chips"
        )
    shape = tuple(plan_shape.values())
    try:  # the ICI-aware layout (axes laid along the torus); any order where the topology does not allow it
        grid = mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.array(devices).reshape(shape)
    return jax.sharding.Mesh(grid, tuple(plan_shape))


__all__ = [
    "EXAMPLES",
    "GENERATIONS",
    "DoesNotFit",
    "Target",
    "compile_for",
    "for_target",
    "parse_target",
    "quiet_absent_tpu",
    "require_compiler",
    "require_libtpu",
    "target_mesh",
]
