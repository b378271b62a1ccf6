"""Sharding rules: which mesh axes split each logical dim of the Transformer's arrays. JAX-free.

A parallelism strategy is one :class:`ShardingRules` instance (:data:`PRESETS`); the kernels turn a rules
object into ``PartitionSpec``s and the estimators read the same object as parallel degrees
(:meth:`ShardingRules.degrees`), so the program that runs and the one that is priced cannot drift apart.

Which arrays each logical dim places (X = ``data``, Y = ``model`` in the presets):

===========  ==========================================================================================
field        arrays
===========  ==========================================================================================
batch        B of tokens, activations, logits and the KV cache (data parallelism)
sequence     T of the residual stream between blocks (Megatron sequence parallelism, on the TP axes)
embed        D of every *weight* and its optimizer state and gradient (FSDP / ZeRO-3)
act_embed    D of activations (normally replicated)
heads        N of Wq, Wo, q and the attention output (tensor parallelism)
kv_heads     K of Wk, Wv, k, v and the KV cache
ffw          F of the MLP weights and the MLP hidden activation
vocab        V of the embedding tables and the logits (vocab-parallel embedding and loss)
layers       L of the stacked layer weights: pipeline stages (GPipe over that one mesh axis)
experts      E of the routed experts' weights: expert parallelism (the axes must also split the batch)
context      T of every activation and of attention: context parallelism (K and V gathered for attention)
===========  ==========================================================================================

Optimizer state always follows its parameter (the moments of ``W[D_X, F_Y]`` are ``[D_X, F_Y]``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from lab.core.degrees import DEGREES
from lab.core.errors import UserError

Axes = str | tuple[str, ...] | None
Spec = tuple[str | tuple[str, ...] | None, ...]

# Mesh axes of the presets, named once (major to minor).
DATA = "data"
MODEL = "model"
MESH_AXES = (DATA, MODEL)

# Logical names that are never sharded, accepted for documentation.
UNSHARDED = ("head_dim", "kv_seq")
# Dims the JAX Transformer does not execute sharded (none now): layers over a mesh axis run as a GPipe pipeline,
# context over one as T split with K and V gathered for attention, experts as an all-to-all expert layer
# (kernels/transformer/).
NOT_EXECUTED: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShardingRules:
    """Which mesh axes each logical dim is split over (None: replicated). See the module docstring."""

    batch: Axes = None
    sequence: Axes = None
    embed: Axes = None
    act_embed: Axes = None
    heads: Axes = None
    kv_heads: Axes = None
    ffw: Axes = None
    vocab: Axes = None
    layers: Axes = None
    experts: Axes = None
    context: Axes = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list):
                v = tuple(v)
            if v == () or v == "":
                v = None
            ok = v is None or isinstance(v, str) or (isinstance(v, tuple) and all(isinstance(a, str) for a in v))
            if not ok:
                raise UserError(f"sharding rules: {f.name}={v!r} must be a mesh axis name, a list of them, or None")
            if isinstance(v, tuple) and len(set(v)) != len(v):
                raise UserError(f"sharding rules: {f.name} = {list(v)} names a mesh axis twice; name each axis once")
            if isinstance(v, tuple) and len(v) == 1:
                v = v[0]
            object.__setattr__(self, f.name, v)

    def axes(self, logical: str | None) -> tuple[str, ...]:
        """Mesh axes of one logical dim, as a tuple (empty when replicated)."""
        if logical is None or logical in UNSHARDED:
            return ()
        if logical not in FIELDS:
            raise UserError(f"unknown logical dim {logical!r}; valid: {', '.join(FIELDS + UNSHARDED)} (or None)")
        v = getattr(self, logical)
        return () if v is None else ((v,) if isinstance(v, str) else tuple(v))

    def spec(self, logical: tuple[str | None, ...], what: str = "an array") -> Spec:
        """The ``PartitionSpec`` entries of an array with these logical dims (wrap in ``jax.P``).

        Raises:
            UserError: one mesh axis would split two dims of the array (naming the axis and both dims).
        """
        used: dict[str, str] = {}
        out: list[str | tuple[str, ...] | None] = []
        for name in logical:
            axes = self.axes(name)
            for a in axes:
                if a in used:
                    raise UserError(
                        f"sharding rules map mesh axis {a!r} to both {used[a]!r} and {name!r} of {what} "
                        f"(logical dims {logical}); one mesh axis can split only one dim of an array"
                    )
                used[a] = name
            out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
        return tuple(out)

    def mesh_axes(self) -> set[str]:
        """Every mesh axis some logical dim uses."""
        return {a for f in FIELDS for a in self.axes(f)}

    def check_mesh(self, mesh: Mapping[str, int], where: str = "sharding rules") -> None:
        """Every axis the rules name exists in the mesh.

        Raises:
            UserError: naming the logical dim, the missing axis and the mesh's axes.
        """
        for f in FIELDS:
            for a in self.axes(f):
                if a not in mesh:
                    raise UserError(
                        f"{where}: {f} = {a!r} is not a mesh axis; the mesh has {', '.join(mesh)} "
                        f"(use one of those, or leave {f} out to replicate it)"
                    )

    def size(self, logical: str, mesh: Mapping[str, int]) -> int:
        """Shards of one logical dim: the product of its mesh axes' sizes."""
        return math.prod(mesh.get(a, 1) for a in self.axes(logical))

    def live(self, logical: str, mesh: Mapping[str, int]) -> tuple[str, ...]:
        """The axes of one logical dim that have more than one device (the ones that communicate)."""
        return tuple(a for a in self.axes(logical) if mesh.get(a, 1) > 1)

    def roles(self, mesh: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
        """Mesh axes of each parallelism the estimators know, from these rules (live axes only).

        ``tp`` splits heads (and with them kv_heads, ffw, vocab); ``fsdp`` shards the weights' D; ``dp`` is the
        rest of the batch axes (gradients all-reduced there); ``batch`` is every batch axis (the loss mean);
        ``pp``, ``ep`` and ``cp`` are the layers, experts and context axes; ``edp`` (with experts) the batch axes
        the experts do not use, over which the routed experts' gradients are summed.
        """
        fsdp = self.live("embed", mesh)
        return {
            "tp": self.live("heads", mesh),
            "sp": self.live("sequence", mesh),
            "fsdp": fsdp,
            "dp": tuple(a for a in self.live("batch", mesh) if a not in fsdp),
            "edp": tuple(a for a in self.live("batch", mesh) if a not in fsdp and a not in self.axes("experts"))
            if self.live("experts", mesh)
            else (),
            "batch": self.live("batch", mesh),
            "pp": self.live("layers", mesh),
            "ep": self.live("experts", mesh),
            "cp": self.live("context", mesh),
            "vocab": self.live("vocab", mesh),
        }

    def degrees(self, mesh: Mapping[str, int]) -> dict[str, int]:
        """Parallel degrees the estimators use (``dp, fsdp, tp, pp, cp, ep``) and ``sequence_parallel``."""
        r = self.roles(mesh)
        out = {k: math.prod(mesh[a] for a in r[k]) for k in DEGREES}
        return out | {"sequence_parallel": bool(r["sp"])}

    def to_dict(self) -> dict[str, list[str]]:
        return {f: list(self.axes(f)) for f in FIELDS if self.axes(f)}


FIELDS = tuple(f.name for f in dataclasses.fields(ShardingRules))

_TP = dict(heads=MODEL, kv_heads=MODEL, ffw=MODEL, vocab=MODEL)
PRESETS: dict[str, ShardingRules] = {
    "single": ShardingRules(),
    "dp": ShardingRules(batch=(DATA, MODEL)),
    "fsdp": ShardingRules(batch=(DATA, MODEL), embed=(DATA, MODEL)),  # ZeRO-3 over every device
    "tp": ShardingRules(batch=DATA, **_TP),  # Megatron: column-parallel in, row-parallel out
    "tp_sp": ShardingRules(batch=DATA, sequence=MODEL, **_TP),  # + the residual stream split along T
    "fsdp_tp": ShardingRules(batch=DATA, embed=DATA, **_TP),
}


def get_rules(name: str) -> ShardingRules:
    """A preset from :data:`PRESETS` by name."""
    if name not in PRESETS:
        raise UserError(f"unknown sharding rules {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[name]


def rules_from_table(table: Mapping[str, object], preset: str | None = None) -> ShardingRules:
    """Rules from a preset name plus per-dim overrides (``{"heads": "model", "batch": ["data", "model"]}``)."""
    base = get_rules(preset) if preset else ShardingRules()
    unknown = sorted(set(table) - set(FIELDS))
    if unknown:
        raise UserError(f"unknown logical dim {unknown[0]!r}; valid: {', '.join(FIELDS)}")
    return dataclasses.replace(base, **{k: v for k, v in table.items()})


__all__ = [
    "DATA",
    "FIELDS",
    "MESH_AXES",
    "MODEL",
    "NOT_EXECUTED",
    "PRESETS",
    "ShardingRules",
    "get_rules",
    "rules_from_table",
]
