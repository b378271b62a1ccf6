"""The Transformer's arrays declared before they exist: shape and one logical name per dim. JAX-free.

The kernels add a dtype and an initializer to these declarations (``kernels/transformer/model.py``); the
Plan's checks and the estimators read the same shapes, so a layout that cannot place an array is refused
here, with the array, the dim and the mesh axes named, before anything is imported or compiled.

In the book's letters: B batch, T sequence, D d_model, N heads, K kv-heads, H head_dim, F d_ff, V vocab,
L layers, S max_seq_len. Layer weights are stacked on a leading ``layers`` dim (the scan over layers).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from lab.core.errors import UserError
from lab.core.models import ModelConfig
from lab.core.rules import ShardingRules

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any


@dataclass(frozen=True)
class ArraySpec:
    """An array by global shape and logical dims (``None`` or ``head_dim``: never sharded)."""

    shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.logical_axes):
            raise ValueError(f"shape {self.shape} and logical axes {self.logical_axes} differ in rank")

    def shards(self, rules: ShardingRules, mesh: Mapping[str, int]) -> int:
        return math.prod(mesh.get(a, 1) for name in self.logical_axes for a in rules.axes(name))


def param_specs(m: ModelConfig) -> dict[str, Any]:
    """Every parameter of the LLaMA-style model (``kernels.transformer``), nested like its pytree; a mixture of
    experts with leading dense layers stacks those apart (``dense_layers``, run first, their MLP ``dense_ff`` wide)."""
    D, V = m.d_model, m.vocab
    out = {"embed": ArraySpec((V, D), ("vocab", "embed"))}
    if m.is_moe and m.dense_layers:
        out["dense_layers"] = _layer_specs(m, m.dense_layers, _mlp_specs(m, m.dense_layers, m.dense_ff, dense=True))
    n = m.moe_layers if m.is_moe else m.layers
    out["layers"] = _layer_specs(m, n, _mlp_specs(m, n, m.d_ff, dense=not m.is_moe))
    return out | {"final_norm": ArraySpec((D,), ("embed",)), "unembed": ArraySpec((D, V), ("embed", "vocab"))}


def _layer_specs(m: ModelConfig, L: int, mlp: dict[str, ArraySpec]) -> dict[str, ArraySpec]:
    """``L`` stacked layers: attention, the norms and ``mlp``."""
    D, N, K, H = m.d_model, m.heads, m.kv_heads, m.head_dim
    return {
        "attn_norm": ArraySpec((L, D), ("layers", "embed")),
        "wq": ArraySpec((L, D, N, H), ("layers", "embed", "heads", "head_dim")),
        "wk": ArraySpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ArraySpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": ArraySpec((L, N, H, D), ("layers", "heads", "head_dim", "embed")),
        "mlp_norm": ArraySpec((L, D), ("layers", "embed")),
        **mlp,
    }


def _mlp_specs(m: ModelConfig, L: int, F: int, dense: bool) -> dict[str, ArraySpec]:
    """``L`` layers' MLP: a dense SwiGLU ``F`` wide, or (MoE) the router ``[D, E]``, the routed experts' SwiGLUs
    stacked on ``experts`` and the shared experts side by side as one SwiGLU of width ``S F``."""
    D, E = m.d_model, m.experts
    if dense:
        return {
            "w_gate": ArraySpec((L, D, F), ("layers", "embed", "ffw")),
            "w_up": ArraySpec((L, D, F), ("layers", "embed", "ffw")),
            "w_down": ArraySpec((L, F, D), ("layers", "ffw", "embed")),
        }
    out = {
        "router": ArraySpec((L, D, E), ("layers", "embed", None)),
        "w_gate": ArraySpec((L, E, D, F), ("layers", "experts", "embed", "ffw")),
        "w_up": ArraySpec((L, E, D, F), ("layers", "experts", "embed", "ffw")),
        "w_down": ArraySpec((L, E, F, D), ("layers", "experts", "ffw", "embed")),
    }
    if m.shared_experts:
        S = m.shared_experts * F
        out["shared_gate"] = ArraySpec((L, D, S), ("layers", "embed", "ffw"))
        out["shared_up"] = ArraySpec((L, D, S), ("layers", "embed", "ffw"))
        out["shared_down"] = ArraySpec((L, S, D), ("layers", "ffw", "embed"))
    return out


def activation_specs(m: ModelConfig, batch: int, seq: int, *, decode: bool = False) -> dict[str, ArraySpec]:
    """The activations the model pins (and its token input); in decode the residual is not split along T."""
    B, T = batch, seq
    return {
        "tokens": ArraySpec((B, T), ("batch", None)),
        "residual": ArraySpec((B, T, m.d_model), ("batch", None if decode else "sequence", "act_embed")),
        "q": ArraySpec((B, T, m.heads, m.head_dim), ("batch", None, "heads", "head_dim")),
        "kv": ArraySpec((B, T, m.kv_heads, m.head_dim), ("batch", None, "kv_heads", "head_dim")),
        "mlp_hidden": ArraySpec((B, T, m.d_ff), ("batch", None, "ffw")),
        "logits": ArraySpec((B, T, m.vocab), ("batch", None, "vocab")),
    }


def cache_specs(m: ModelConfig, batch: int) -> dict[str, ArraySpec]:
    """The KV cache: ``k`` and ``v`` of ``[layers, batch, max_seq, kv_heads, head_dim]``."""
    shape = (m.layers, batch, m.max_seq_len, m.kv_heads, m.head_dim)
    axes = ("layers", "batch", "kv_seq", "kv_heads", "head_dim")
    return {"k": ArraySpec(shape, axes), "v": ArraySpec(shape, axes)}


def named(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` for a nested dict, paths like ``layers/wq``."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from named(v, f"{prefix}/{k}" if prefix else k)
    else:
        yield prefix, tree


def check_dim(logical: str | None, size: int, rules: ShardingRules, mesh: Mapping[str, int], where: str) -> None:
    """One dim against the mesh axes the rules give it: the axes exist and their product divides it."""
    axes = rules.axes(logical)
    shown = ", ".join(f"{k}={v}" for k, v in mesh.items())
    for a in axes:
        if a not in mesh:
            raise UserError(f"sharding rules map {logical!r} to mesh axis {a!r}, which the mesh ({shown}) lacks")
    degree = math.prod(mesh[a] for a in axes)
    if size % degree:
        ax = f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {axes}"
        raise UserError(
            f"{logical}={size} ({where}) is not divisible by {ax} of size {degree} (mesh {shown}); "
            f"make {logical} a multiple of {degree} or choose other rules"
        )


def check_layout(tree: Any, rules: ShardingRules, mesh: Mapping[str, int]) -> None:
    """Refuse a layout: unknown mesh axes, one axis on two dims of an array, indivisible dims."""
    for name, spec in named(tree):
        rules.spec(spec.logical_axes, name)  # one mesh axis serving two dims of this array
        for logical, size in zip(spec.logical_axes, spec.shape, strict=True):
            check_dim(logical, size, rules, mesh, f"in {name}")


def check_transformer(
    m: ModelConfig,
    rules: ShardingRules,
    mesh: Mapping[str, int],
    *,
    batch: int | None = None,
    seq: int | None = None,
    decode: bool = False,
) -> None:
    """The model (and, given ``batch``/``seq``, its activations; with ``decode`` its KV cache) on the mesh.

    The model's own dims come first, in a fixed order (heads, kv_heads, ffw, vocab, embed, then batch and
    sequence), so the message names the dim a user would change; then every declared array, for conflicts.
    """
    dims = [("heads", m.heads), ("kv_heads", m.kv_heads), ("ffw", m.d_ff), ("vocab", m.vocab)]
    dims += [("embed", m.d_model), ("act_embed", m.d_model)]
    if batch is not None:
        dims.append(("batch", batch))
        if seq is not None:
            dims.append(("sequence", seq))
    for logical, size in dims:
        check_dim(logical, size, rules, mesh, "the model" if logical not in ("batch", "sequence") else "the input")
    check_layout(param_specs(m), rules, mesh)
    if batch is not None:
        check_layout(activation_specs(m, batch, seq or 1), rules, mesh)  # training, or the prefill
        if decode:  # one token at a time into the cache
            check_layout(activation_specs(m, batch, 1, decode=True), rules, mesh)
            check_layout(cache_specs(m, batch), rules, mesh)


def unsupported_features(m: ModelConfig) -> list[str]:
    """What the LLaMA-style kernel does not build (MoE, GeLU MLP, tied embeddings, ...), which would change its
    parameters and FLOPs; empty when the model can run as it is."""
    return [
        what
        for what, bad in (
            ("a two-matrix (non-gated) MLP", not m.gated_mlp),
            ("tied embeddings", m.tied_embeddings),
            ("learned positions", m.learned_positions),
            (f"norm={m.norm}", m.norm != "rmsnorm"),
            ("biases", m.biases),
            ("a parallel attention and MLP block", m.parallel_block),
            (f"a {m.sliding_window}-token sliding attention window", bool(m.window_layers)),
        )
        if bad
    ]


__all__ = [
    "ArraySpec",
    "activation_specs",
    "cache_specs",
    "check_dim",
    "check_layout",
    "check_transformer",
    "named",
    "param_specs",
    "unsupported_features",
]
