"""Which attention the Transformer runs (the Plan's ``attention`` option) and its block sizes: plain Python, no JAX.

* ``xla``: the plain einsum softmax of ``kernels/transformer/model.py`` (XLA fuses what it can);
* ``pallas``: the lab's Pallas flash attention (``kernels/pallas/flash_attention.py``) for the train step and the
  prefill, the lab's paged decode kernel (``kernels/pallas/paged_decode.py``, the contiguous cache read as pages
  of ``block_k`` positions) for each decode step; Mosaic on a TPU, interpreted on the CPU;
* ``splash``: JAX's shipped TPU kernel (``jax.experimental.pallas.ops.tpu.splash_attention``), TPU only;
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, GPU only.

The kernels run inside ``jax.shard_map`` over the rules' batch and heads axes, so each device sees whole
sequences of its own heads. Block sizes larger than the sequence are clipped to it (:meth:`Attention.blocks`); the
clipped sizes must divide it. What the backend cannot run is refused when the program is built
(:func:`check_backend`), what the Plan cannot express when it is validated (:func:`check_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.core.errors import UserError

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

IMPLEMENTATIONS = ("xla", "pallas", "splash", "cudnn")
# The kernels whose work is counted block pair by block pair (lab.core.pallas_cost): the lab's flash and paged
# decode kernels, and splash, whose forward, dq and dk/dv kernels compute the same matmuls per pair (its decode
# steps are the lab's paged kernel). cudnn's blocks are its own: priced as dense flash attention.
BLOCK_KERNELS = ("pallas", "splash")
DEFAULT_BLOCK = 128
SUBLANE = 8  # a Pallas TPU block's rows: a multiple of this or the whole sequence (kernels/pallas/flash_attention.py)


@dataclass(frozen=True)
class Attention:
    """The attention implementation and its query/key block sizes (before clipping to a sequence)."""

    impl: str = "xla"
    block_q: int = DEFAULT_BLOCK
    block_k: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.impl not in IMPLEMENTATIONS:
            raise UserError(f"attention = {self.impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
        for name in ("block_q", "block_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"attention_{name} = {v!r} must be a positive integer, e.g. {DEFAULT_BLOCK}")

    @property
    def fused(self) -> bool:
        """A kernel, not the einsum softmax."""
        return self.impl != "xla"

    def blocks(self, t: int, s: int | None = None) -> tuple[int, int]:
        """``(block_q, block_k)`` for a query length ``t`` and key length ``s`` (default ``t``), each clipped to
        its length; a :class:`UserError` naming a divisor when one does not divide it."""
        s = t if s is None else s
        out = []
        for name, block, length in (("attention_block_q", self.block_q, t), ("attention_block_k", self.block_k, s)):
            b = min(block, length)
            if length % b:
                divisors = [d for d in (128, 64, 32, 16, 8) if length % d == 0]
                hint = f"e.g. {divisors[0]}" if divisors else f"e.g. {length}"
                raise UserError(
                    f"{name} = {block} does not divide the sequence length {length}; give a divisor, {hint}"
                )
            if b % SUBLANE and b != length:
                raise UserError(f"{name} = {block} cannot be tiled: give a multiple of {SUBLANE} that divides {length}")
            out.append(b)
        return out[0], out[1]


def from_options(options: Any) -> Attention:
    """The :class:`Attention` of a Plan's :class:`lab.core.plan.Options`."""
    return Attention(options.attention, options.attention_block_q, options.attention_block_k)


def check_plan(plan: Any) -> None:
    """What the Transformer runs with a kernel: no pipeline or context axes (they split the sequence or run
    inside a ``shard_map`` of their own), KV heads on the same axes as the query heads (each device's query heads
    read its own KV heads), block sizes that divide the sequences. A :class:`UserError` naming the value."""
    att = from_options(plan.options)
    if not att.fused:
        return
    rules, m = plan.rules, plan.model
    for dim in ("layers", "context"):
        if rules.live(dim, plan.shape):
            raise UserError(
                f'attention = "{att.impl}" with [rules] {dim} on mesh axes: the lab runs the attention kernels '
                f'without pipeline or context parallelism; leave {dim} out, or use attention = "xla"'
            )
    heads, kv = rules.live("heads", plan.shape), rules.live("kv_heads", plan.shape)
    if tuple(heads) != tuple(kv):
        raise UserError(
            f'attention = "{att.impl}": [rules] kv_heads = {list(kv)} and heads = {list(heads)} must name the same '
            "mesh axes (each device's query heads read its own KV heads); "
            f"kv_heads={m.kv_heads} must divide over them"
        )
    if plan.program == "train_step":
        att.blocks(plan.sizes["seq"])
    elif plan.program == "decode":
        att.blocks(plan.sizes["prompt_len"])
        att.blocks(1, m.max_seq_len)  # the decode kernel's pages: block_k positions of the cache each
    elif plan.program == "serve":
        raise UserError(f'attention = "{att.impl}": serve runs the paged engine\'s own attention; leave attention out')


def check_backend(impl: str, platform: str) -> None:
    """Refuse, in one line, a kernel the devices' ``platform`` (``cpu``, ``gpu``/``cuda``/``rocm``, ``tpu``) cannot
    run: splash needs a TPU (or a TPU target to compile for), cudnn a GPU, the lab's Pallas kernel a TPU or the
    CPU (interpreted)."""
    gpu = platform in ("gpu", "cuda", "rocm")
    if impl == "splash" and platform != "tpu":
        raise UserError(
            f'attention = "splash" is JAX\'s TPU kernel and the devices are {platform}; compile it for a TPU '
            '(--target v5e:2x4) or use attention = "pallas" (interpreted on the CPU)'
        )
    if impl == "cudnn" and not gpu:
        raise UserError(
            f'attention = "cudnn" needs an NVIDIA GPU and the devices are {platform}; use attention = "pallas" '
            '(or "splash" on a TPU)'
        )
    if impl == "pallas" and gpu:
        raise UserError(
            'attention = "pallas": the lab\'s flash kernel lowers for TPUs (Mosaic) or runs interpreted on the CPU, '
            'not for GPUs; use attention = "cudnn"'
        )


__all__ = [
    "BLOCK_KERNELS",
    "DEFAULT_BLOCK",
    "IMPLEMENTATIONS",
    "Attention",
    "check_backend",
    "check_plan",
    "from_options",
]
