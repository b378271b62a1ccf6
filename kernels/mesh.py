"""Meshes and shardings from the lab's notation.

The analytic side describes arrays as ``ShardedArray`` (the book's ``A[I_X, J_Y]``); this module turns
that into real ``NamedSharding`` objects on a device mesh, so predicted and executed programs are
driven by the same description.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding

from lab.core.errors import UserError, keep_terminations
from lab.core.notation import ShardedArray


def make_mesh(axes: Mapping[str, int], *, explicit: bool = False, slow: tuple[str, ...] = ()) -> jax.sharding.Mesh:
    """A mesh over the first ``prod(axes)`` devices, axes named and sized as given (major first).

    Args:
        axes: ordered mapping of axis name to size, e.g. ``{"X": 2, "Y": 4}``.
        explicit: use ``AxisType.Explicit`` axes, so that ambiguous communication fails loudly.
        slow: axes that cross the slow link (DCN, scale-out). With several processes they are laid over the
            process boundaries (``mesh_utils.create_hybrid_device_mesh`` with a process as the granule), so the
            fast axes stay inside each process's devices.
    """
    need = math.prod(axes.values())
    have = jax.device_count()
    keep_terminations()  # the backend has started (libtpu took SIGTERM): the lab's handler back, if a command runs
    if need > have:
        raise UserError(
            f"mesh {','.join(f'{k}={v}' for k, v in axes.items())} needs {need} devices but "
            f"{have} are available; shrink the mesh or emulate more with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need}"
        )
    kind = AxisType.Explicit if explicit else AxisType.Auto
    names, sizes = tuple(axes.keys()), tuple(axes.values())
    if jax.process_count() > 1 and slow:
        return jax.sharding.Mesh(_hybrid(names, sizes, slow), names, axis_types=(kind,) * len(axes))
    return jax.make_mesh(sizes, names, axis_types=(kind,) * len(axes), devices=jax.devices()[:need])


def _hybrid(names: tuple[str, ...], sizes: tuple[int, ...], slow: tuple[str, ...]) -> np.ndarray:
    """Devices laid out with the slow axes across processes and the fast ones inside each."""
    from jax.experimental import mesh_utils

    dcn = tuple(s if n in slow else 1 for n, s in zip(names, sizes, strict=True))
    ici = tuple(1 if n in slow else s for n, s in zip(names, sizes, strict=True))
    if math.prod(dcn) != jax.process_count():
        raise UserError(
            f"the slow axes {', '.join(slow)} span {math.prod(dcn)} devices but there are {jax.process_count()} "
            "processes; make the slow axes' sizes multiply to the process count (one process per slice or host)"
        )
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, jax.devices(), process_is_granule=True)


def sharding_for(arr: ShardedArray, mesh: jax.sharding.Mesh) -> NamedSharding:
    """``NamedSharding`` for an array in the book's notation (unreduced axes are not placements)."""
    arr.check(dict(mesh.shape))
    return NamedSharding(mesh, arr.with_axes({}, unreduced=()).to_partition_spec())


def place_zeros(arr: ShardedArray, sizes: Mapping[str, int], mesh: jax.sharding.Mesh, dtype=np.float32) -> jax.Array:
    """A zero array of the global shape, laid out on the mesh as ``arr`` says."""
    shape = tuple(sizes[d] for d in arr.dim_names)
    return jax.device_put(np.zeros(shape, dtype), sharding_for(arr, mesh))
