"""The programs the lab can build and run, described without JAX.

Each :class:`ProgramSpec` says what a program needs (its size names, the mesh axes it looks up by name, a
model and sharding rules) so that an experiment is validated before anything is imported or compiled; the
kernel registry (``kernels/registry.py``) attaches a builder to every name here, and the estimators
(``lab/predict/program/estimate.py``) price every name here. Three families:

* **kernels**: the book's sharded matmuls (``A[I_X, J] * B[J, K_Y]``), collective matmuls, the Megatron MLP
  block: dims ``I, J, K`` (``B, D, F`` for the block) over mesh axes ``X`` and ``Y``;
* **collectives**: one collective over ``axes`` of any mesh, ``N`` elements per device;
* **attention**: ring attention, ``q, k, v [B, T, H, D]`` with T over mesh axis ``context`` (B over ``data``);
* **moe**: a mixture-of-experts MLP, ``x [T, D]`` with T over ``data`` x ``expert`` and E experts over ``expert``;
* **pipeline**: a stack of L residual MLP blocks in stages over mesh axis ``pipe`` (B over ``data``), a GPipe train
  step over M microbatches;
* **transformer**: the LLaMA-style model's train step, greedy decode and paged serving step, placed by sharding
  rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral

from lab.core.errors import UserError

MLP_NOTATION = "In[B_X, D] * Win[D, F_Y] -> H[B_X, F_Y]; H[B_X, F_Y] * Wout[F_Y, D] -> Out[B_X, D]"
ATTENTION_AXES = ("data", "context")  # ring attention: B over data, T over context
MOE_AXES = ("data", "expert")  # the MoE MLP: T over data x expert, the experts over expert
# The MoE MLP's routing options. A Plan's [options] configure the Transformer only (a kernel takes none), so the
# Plan cannot carry them: they are fixed here, where the kernel (kernels/moe.py) and its estimate both read them.
MOE_TOPK = 2  # experts per token
MOE_CAPACITY_FACTOR = 1.25  # slots per expert per device: ceil(topk * tokens per device * factor / E)
PIPELINE_AXES = ("data", "pipe")  # the pipelined MLP: B over data, its layers' stages over pipe


@dataclass(frozen=True)
class ProgramSpec:
    """One buildable program.

    Attributes:
        name: registry key, e.g. ``sharded_matmul_case3_scatter`` or ``train_step``.
        family: ``sharded_matmul``, ``collective_matmul``, ``collective``, ``block`` or ``transformer``.
        description: one line.
        dims: the size names it needs (``("I", "J", "K")``; collectives ``("N",)``).
        notation: the book notation (with output) for matmul kernels and the block, else None.
        mesh_axes: axes it looks up by name; a missing one is added with size 1. None: any axes.
        explicit: built on an explicit-axes mesh (``*_named`` kernels).
    """

    name: str
    family: str
    description: str
    dims: tuple[str, ...]
    notation: str | None = None
    mesh_axes: tuple[str, ...] | None = None
    explicit: bool = False

    @property
    def needs_model(self) -> bool:
        return self.family == "transformer"


def _matmul(name: str, family: str, notation: str, description: str, explicit: bool = False) -> ProgramSpec:
    return ProgramSpec(name, family, description, ("I", "J", "K"), notation, ("X", "Y"), explicit)


_SPECS: tuple[ProgramSpec, ...] = (
    _matmul(
        "sharded_matmul_case1",
        "sharded_matmul",
        "A[I_X, J] * B[J, K_Y] -> C[I_X, K_Y]",
        "case 1, shard_map: no contracting dim sharded, no communication",
    ),
    _matmul(
        "sharded_matmul_case2",
        "sharded_matmul",
        "A[I, J_X] * B[J, K] -> C[I, K]",
        "case 2, shard_map: AllGather_X A, then a local matmul",
    ),
    _matmul(
        "sharded_matmul_case3",
        "sharded_matmul",
        "A[I, J_X] * B[J_X, K] -> C[I, K]",
        "case 3, shard_map: local matmul, then AllReduce_X",
    ),
    _matmul(
        "sharded_matmul_case3_scatter",
        "sharded_matmul",
        "A[I, J_X] * B[J_X, K] -> C[I, K_X]",
        "case 3, shard_map: local matmul, then ReduceScatter_X onto K",
    ),
    _matmul(
        "sharded_matmul_case4",
        "sharded_matmul",
        "A[I_X, J] * B[J, K_X] -> C[I, K_X]",
        "case 4, shard_map: AllGather_X A, then a local matmul",
    ),
    _matmul(
        "sharded_matmul_case1_named",
        "sharded_matmul",
        "A[I_X, J] * B[J, K_Y] -> C[I_X, K_Y]",
        "case 1, explicit-mode NamedSharding: the type rule gives C[I_X, K_Y]",
        True,
    ),
    _matmul(
        "sharded_matmul_case2_named",
        "sharded_matmul",
        "A[I, J_X] * B[J, K] -> C[I, K]",
        "case 2, explicit-mode NamedSharding: XLA chooses the communication",
        True,
    ),
    _matmul(
        "sharded_matmul_case3_named",
        "sharded_matmul",
        "A[I, J_X] * B[J_X, K] -> C[I, K]",
        "case 3, explicit-mode NamedSharding: out_sharding=C[I, K] (AllReduce)",
        True,
    ),
    _matmul(
        "sharded_matmul_case3_scatter_named",
        "sharded_matmul",
        "A[I, J_X] * B[J_X, K] -> C[I, K_X]",
        "case 3, explicit-mode NamedSharding: out_sharding=C[I, K_X] (ReduceScatter)",
        True,
    ),
    _matmul(
        "sharded_matmul_case4_named",
        "sharded_matmul",
        "A[I_X, J] * B[J, K_X] -> C[I, K_X]",
        "case 4, explicit-mode NamedSharding: reshard A to A[I, J], then multiply",
        True,
    ),
    _matmul(
        "collective_matmul_allgather",
        "collective_matmul",
        "A[I_X, J_Y] * W[J, K_Y] -> Out[I_X, K_Y]",
        "AllGather_Y of the lhs overlapped with the matmul: Y-1 ppermute ring steps",
    ),
    _matmul(
        "collective_matmul_allgather_bidir",
        "collective_matmul",
        "A[I_X, J_Y] * W[J, K_Y] -> Out[I_X, K_Y]",
        "AllGather_Y-matmul, chunks both ways round the ring: Y//2 steps",
    ),
    _matmul(
        "matmul_allgather_blocking",
        "collective_matmul",
        "A[I_X, J_Y] * W[J, K_Y] -> Out[I_X, K_Y]",
        "AllGather_Y of the lhs, then one matmul (the blocking baseline)",
    ),
    _matmul(
        "collective_matmul_reducescatter",
        "collective_matmul",
        "A[I, J_Y] * W[J_Y, K] -> Out[I, K_Y]",
        "matmul overlapped with ReduceScatter_Y: partial sums ppermuted round the ring, Y-1 steps",
    ),
    _matmul(
        "collective_matmul_reducescatter_bidir",
        "collective_matmul",
        "A[I, J_Y] * W[J_Y, K] -> Out[I, K_Y]",
        "matmul-ReduceScatter_Y, partial sums both ways round the ring: Y//2 steps",
    ),
    _matmul(
        "matmul_reducescatter_blocking",
        "collective_matmul",
        "A[I, J_Y] * W[J_Y, K] -> Out[I, K_Y]",
        "local matmul, then ReduceScatter_Y (the blocking baseline)",
    ),
    ProgramSpec("collective_all_gather", "collective", "AllGather over the axes: [N] per device in, [G*N] out", ("N",)),
    ProgramSpec(
        "collective_reduce_scatter",
        "collective",
        "ReduceScatter over the axes: [N] per device in, [N/G] out",
        ("N",),
    ),
    ProgramSpec(
        "collective_all_reduce", "collective", "AllReduce (psum) over the axes: [N] per device in, [N] out", ("N",)
    ),
    ProgramSpec(
        "collective_all_to_all",
        "collective",
        "AllToAll over the axes: [N] per device in, [N] out, N/G to each member",
        ("N",),
    ),
    ProgramSpec(
        "collective_permute", "collective", "ring shift by one over the axes: [N] per device in, [N] out", ("N",)
    ),
    ProgramSpec(
        "tp_mlp",
        "block",
        "Megatron MLP block: column-parallel up, GeLU, row-parallel down, AllReduce_Y",
        ("B", "D", "F"),
        MLP_NOTATION,
        ("X", "Y"),
    ),
    ProgramSpec(
        "ring_attention",
        "attention",
        "causal ring attention: q stays, K and V blocks ppermuted round the context ring, c-1 steps, online softmax",
        ("B", "T", "H", "D"),
        None,
        ATTENTION_AXES,
    ),
    ProgramSpec(
        "moe_mlp",
        "moe",
        "mixture-of-experts SwiGLU MLP, top-2 of E experts over the expert axis: AllToAll dispatch and combine",
        ("T", "D", "F", "E"),
        None,
        MOE_AXES,
    ),
    ProgramSpec(
        "moe_shared_mlp",
        "moe",
        "the MoE MLP with S shared experts every token goes through (DeepSeekMoE): top-2 of E routed over the "
        "expert axis by AllToAll, the shared ones replicated",
        ("T", "D", "F", "E", "S"),
        None,
        MOE_AXES,
    ),
    ProgramSpec(
        "pipeline_mlp",
        "pipeline",
        "GPipe train step of L residual MLP blocks in stages over the pipe axis, M microbatches passed by ppermute",
        ("B", "D", "F", "L", "M"),
        None,
        PIPELINE_AXES,
    ),
    ProgramSpec(
        "pipeline_circular",
        "pipeline",
        "circular (interleaved) pipeline train step: L residual MLP blocks in pipe x V chunks, each microbatch "
        "going round the stages V times",
        ("B", "D", "F", "L", "M", "V"),
        None,
        PIPELINE_AXES,
    ),
    ProgramSpec(
        "train_step",
        "transformer",
        "the Transformer's training step: forward, backward and one AdamW update",
        ("batch", "seq"),
    ),
    ProgramSpec(
        "user_model",
        "user",
        "the user's flax nnx Module (an entry point), its parameters placed by the rules: one SGD train step",
        (),
    ),
    ProgramSpec(
        "decode",
        "transformer",
        "the Transformer's greedy generation: prefill the prompt, then one token per step from the KV cache",
        ("batch", "prompt_len", "steps"),
    ),
    ProgramSpec(
        "serve",
        "transformer",
        "the Transformer serving requests under load: one step of token slots over a paged KV cache (profiled), "
        "then the continuous-batching scheduler's load ([serve])",
        ("pages", "page_size", "max_seqs", "token_budget"),
    ),
)

PROGRAMS: dict[str, ProgramSpec] = {s.name: s for s in _SPECS}


def get_program(name: str) -> ProgramSpec:
    """The program ``name``; a :class:`UserError` listing the valid names otherwise."""
    try:
        return PROGRAMS[name]
    except KeyError:
        raise UserError(f"unknown kernel {name!r}; valid: {', '.join(PROGRAMS)}") from None


def complete_mesh(spec: ProgramSpec, mesh: dict[str, int]) -> dict[str, int]:
    """The mesh with every axis the program looks up by name (a missing one gets size 1, in the spec's order)."""
    if spec.mesh_axes is None:
        return dict(mesh)
    out = dict(mesh)
    for a in spec.mesh_axes:
        out.setdefault(a, 1)
    return out


def check_attention_sizes(name: str, mesh: dict[str, int], sizes: dict[str, int]) -> None:
    """Ring attention's sizes: positive integers, T divisible by the ``context`` axis, B by ``data``.

    Raises:
        UserError: naming the dim, its size, the axis and a size that would divide.
    """
    _positive(name, sizes, ("B", "T", "H", "D"))
    for dim, axis in (("B", ATTENTION_AXES[0]), ("T", ATTENTION_AXES[1])):
        _divides(name, dim, sizes[dim], mesh.get(axis, 1), f"mesh axis {axis}")


def moe_capacity(tokens: int, experts: int, topk: int = MOE_TOPK, factor: float = MOE_CAPACITY_FACTOR) -> int:
    """Slots per expert in one device's send buffer: ``ceil(topk * tokens * factor / experts)`` (exact arithmetic,
    so a product that is whole is not rounded up by a float's last bit)."""
    from fractions import Fraction  # here: importing it costs an analytic command about a millisecond at start-up

    return math.ceil(Fraction(topk * tokens) * Fraction(str(factor)) / experts)


def check_moe_sizes(name: str, mesh: dict[str, int], sizes: dict[str, int]) -> None:
    """The MoE MLP's sizes: positive integers, E divisible by the ``expert`` axis, T by ``data`` x ``expert``.

    Raises:
        UserError: naming the dim, its size, the axes and a size that would divide.
    """
    _positive(name, sizes, ("T", "D", "F", "E", *(("S",) if "S" in sizes else ())))
    data, expert = (mesh.get(a, 1) for a in MOE_AXES)
    _divides(name, "E", sizes["E"], expert, "mesh axis expert")
    _divides(name, "T", sizes["T"], data * expert, "mesh axes data x expert")


def _positive(name: str, sizes: dict[str, int], dims: tuple[str, ...]) -> None:
    for dim in dims:
        v = sizes.get(dim)
        if isinstance(v, bool) or not isinstance(v, Integral) or v <= 0:
            raise UserError(f"{name}: dim {dim}={v!r} must be a positive integer")


def _divides(name: str, dim: str, v: int, n: int, over: str) -> None:
    """``v`` is a multiple of the ``n`` devices of ``over``, or a UserError naming both and a size that divides."""
    if v % n:
        raise UserError(
            f"{name}: dim {dim}={v} does not divide over {over} ({n} devices); "
            f"use a multiple of {n}, e.g. {dim}={max(n, v // n * n)}"
        )


def _even_split(layers: int, stages: int) -> tuple[int, ...]:
    """``layers`` over ``stages`` as evenly as they go, the larger stages first."""
    return tuple(layers // stages + (i < layers % stages) for i in range(stages))


def pipeline_split(name: str, layers: int, stages: int, split: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The layers each pipeline stage holds: ``split`` when given (checked), else ``L / p`` each.

    The Plan carries no stage split yet, so a Plan's program always takes the even split; an unequal one (e.g.
    ``(1, 2, 2, 1)``) is given to the kernel directly (``kernels.pipeline``).

    Raises:
        UserError: L not divisible by p without a split; a split of the wrong length, of a non-positive entry, or
            not adding up to L (each naming the value and a valid alternative).
    """
    even = _even_split(layers, stages)
    hint = f"split={even}" if layers >= stages else f"L={stages}"
    if split is None:
        if layers % stages:
            raise UserError(
                f"{name}: dim L={layers} layers do not divide over mesh axis pipe ({stages} stages); use a multiple "
                f"of {stages}, e.g. L={max(stages, layers // stages * stages)}, or give an unequal split, e.g. {hint}"
            )
        return even
    split = tuple(split)
    if len(split) != stages:
        raise UserError(
            f"{name}: split {split} has {len(split)} stages, but mesh axis pipe has {stages}; give one layer count "
            f"per stage, e.g. {hint}"
        )
    if any(isinstance(n, bool) or not isinstance(n, Integral) or n <= 0 for n in split):
        raise UserError(f"{name}: split {split}: every stage holds a positive number of layers, e.g. {hint}")
    if sum(split) != layers:
        raise UserError(f"{name}: split {split} adds up to {sum(split)} layers, not L={layers}; e.g. {hint}")
    return split


def check_pipeline_sizes(
    name: str, mesh: dict[str, int], sizes: dict[str, int], split: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """The pipelined MLP's sizes: positive integers, the layers split over ``pipe`` (:func:`pipeline_split`), B over
    ``data`` x M (each device's batch cut into M microbatches). Returns the split.

    Raises:
        UserError: naming the dim or split, its value and one that would do.
    """
    _positive(name, sizes, ("B", "D", "F", "L", "M"))
    data, pipe = (mesh.get(a, 1) for a in PIPELINE_AXES)
    out = pipeline_split(name, sizes["L"], pipe, split)
    b, n = sizes["B"], data * sizes["M"]
    if b % n:
        raise UserError(
            f"{name}: dim B={b} does not divide into mesh axis data x M microbatches ({data} x {sizes['M']} = {n}); "
            f"use a multiple of {n}, e.g. B={max(n, b // n * n)}"
        )
    return out


def check_circular_sizes(name: str, mesh: dict[str, int], sizes: dict[str, int]) -> None:
    """The circular pipeline's sizes: those of :func:`check_pipeline_sizes`, at least two stages, L in p x V chunks
    and M a multiple of p (microbatches go round the ring in groups of p, Megatron's condition for interleaving).

    Raises:
        UserError: naming the dim, its value and one that would do.
    """
    _positive(name, sizes, ("B", "D", "F", "L", "M", "V"))
    p, v = mesh.get(PIPELINE_AXES[1], 1), sizes["V"]
    if p < 2:
        raise UserError(f"{name}: mesh axis pipe={p}; a circular pipeline needs at least 2 stages, e.g. pipe = 2")
    if sizes["L"] % (p * v):
        raise UserError(
            f"{name}: dim L={sizes['L']} layers do not cut into pipe x V = {p} x {v} chunks; use a multiple of "
            f"{p * v}, e.g. L={max(p * v, sizes['L'] // (p * v) * p * v)}"
        )
    if sizes["M"] % p:
        raise UserError(
            f"{name}: dim M={sizes['M']} microbatches is not a multiple of mesh axis pipe ({p} stages); the "
            f"microbatches go round in groups of {p}, e.g. M={max(p, sizes['M'] // p * p)}"
        )
    check_pipeline_sizes(name, mesh, {k: sizes[k] for k in ("B", "D", "F", "M")} | {"L": sizes["L"] // v})


__all__ = [
    "ATTENTION_AXES",
    "MLP_NOTATION",
    "MOE_AXES",
    "MOE_CAPACITY_FACTOR",
    "MOE_TOPK",
    "PIPELINE_AXES",
    "PROGRAMS",
    "ProgramSpec",
    "check_attention_sizes",
    "check_circular_sizes",
    "check_moe_sizes",
    "check_pipeline_sizes",
    "complete_mesh",
    "get_program",
    "moe_capacity",
    "pipeline_split",
]
