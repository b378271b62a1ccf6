"""Which block sizes the lab's Pallas flash attention should run with on a TPU: a search keyed by the local shape.

For one chip's share of the attention (its sequences ``b`` and heads ``n``/``k`` after sharding, query length ``t``,
key length ``s``, head dimension ``h``), every ``(block_q, block_k)`` the kernel can tile (divisors of ``t`` and
``s`` that are multiples of 8, or the whole length: :mod:`kernels.pallas.flash_attention`) is priced by the roofline
of what its grid does (:mod:`lab.core.pallas_cost`: FLOPs at the chip's peak, HBM bytes at its bandwidth, the larger
of the two) plus a fixed cost per grid step; the pairs whose VMEM footprint exceeds the chip's VMEM are set aside and
the fastest of the rest is the choice. With ``backward`` the dq and dk/dv kernels are priced too (a train step).

The footprint is what the kernels hold in VMEM per grid step: each input and output block twice (Pallas' pipeline
double-buffers them), the float32 scratch once, and the float32 score-sized temporaries of the block's body, every
array padded to the TPU's tiles (the last dimension to 128 lanes, the second-to-last to 8 rows of 32-bit values, 16
of 16-bit, 32 of 8-bit). Mosaic compiles against a scoped VMEM limit that can be below the capacity; the lab's kernels
do not raise it, so the search takes the capacity as an upper bound unless given ``vmem_bytes``.

No JAX: plain Python over :mod:`lab.core.pallas_cost` and the hardware catalog.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.pallas_cost import F32, flash_cost, flash_dkv_cost, flash_dq_cost
from lab.core.units import canonical_dtype, dtype_bytes

MiB = 2**20
# VMEM per TensorCore, as JAX's own table gives it: jax 0.10.2, jax/_src/pallas/mosaic/tpu_info.py (TpuInfo
# .vmem_capacity_bytes, what pltpu.get_tpu_info() returns on the chip). The JAX software-pipelining guide
# (docs.jax.dev/en/latest/pallas/pipelining.html) gives 96 MB for a v5p instead; the table's 64 MiB is the smaller.
VMEM_BYTES = {"tpu-v4": 16 * MiB, "tpu-v5e": 128 * MiB, "tpu-v5p": 64 * MiB, "tpu-v6e": 128 * MiB}
VMEM_SOURCE = "jax 0.10.2 jax/_src/pallas/mosaic/tpu_info.py, vmem_capacity_bytes per TensorCore"
# The fixed cost of one grid step (the pipeline's DMA issue and wait, the step's scalar work), seconds. Grade C: an
# assumed sub-microsecond figure, not measured here (no TPU at hand); it is what makes many small blocks slower than
# fewer large ones when their rooflines are alike.
GRID_STEP_S = 0.35e-6
LANES = 128
SUBLANE = 8  # the kernel's tiling rule: a block is a multiple of 8 rows or the whole length
MAX_LENGTH = 2**24  # the longest T or S searched (16M positions on one chip): divisors are enumerated up to its root
SHOWN = 10  # pairs the JSON lists (fastest first); every fitting pair is in BlockSearch.fitting


@dataclass(frozen=True)
class BlockPrice:
    """One ``(block_q, block_k)`` priced: seconds, FLOPs and HBM bytes of the kernels, VMEM bytes at the peak step."""

    block_q: int
    block_k: int
    time_s: float
    compute_s: float
    memory_s: float
    overhead_s: float
    flops: float
    bytes: float
    grid_steps: int
    vmem_bytes: int


@dataclass(frozen=True)
class BlockSearch:
    """The result of :func:`search_blocks`: the best pair and every pair that fits, fastest first."""

    hardware: str
    shape: dict[str, int]
    dtype: str
    causal: bool
    backward: bool
    vmem_limit_bytes: int
    vmem_source: str
    best: BlockPrice
    fitting: tuple[BlockPrice, ...]
    too_large: int  # pairs the kernel could tile whose footprint exceeds the VMEM limit

    def to_dict(self) -> dict:
        d = asdict(self)
        d["best"], d["fitting"] = asdict(self.best), [asdict(p) for p in self.fitting[:SHOWN]]
        d["fitting_count"] = len(self.fitting)
        return d


def block_sizes(length: int) -> list[int]:
    """The blocks the kernel can tile over ``length``: its divisors that are multiples of 8, and the whole length."""
    small = [d for d in range(SUBLANE, math.isqrt(length) + 1, SUBLANE) if length % d == 0]
    large = [length // d for d in range(1, math.isqrt(length) + 1) if length % d == 0 and (length // d) % SUBLANE == 0]
    return sorted({*small, *large, length})


def _tile(rows: int, cols: int, nbytes: int) -> int:
    """Bytes of a ``(rows, cols)`` array of ``nbytes``-byte elements padded to the TPU's VMEM tiles."""
    sub = SUBLANE * max(1, 4 // nbytes)
    return math.ceil(rows / sub) * sub * math.ceil(cols / LANES) * LANES * nbytes


def vmem_footprint(block_q: int, block_k: int, h: int, nbytes: int, backward: bool = False) -> int:
    """VMEM bytes of the largest kernel's grid step (module docstring): the forward's q, k, v, o blocks and
    logsumexp double-buffered, its max, sum and accumulator, two float32 score blocks; the dq kernel adds dO and the
    row statistics and holds four score-sized temporaries; the dk/dv kernel the same with two accumulators."""
    q, kv = _tile(block_q, h, nbytes), _tile(block_k, h, nbytes)
    row_stat = _tile(block_q, 1, F32)
    scores = _tile(block_q, block_k, F32)
    forward = 2 * (2 * q + 2 * kv + row_stat) + 2 * row_stat + _tile(block_q, h, F32) + 2 * scores
    if not backward:
        return forward
    dq = 2 * (3 * q + 2 * kv + 2 * row_stat) + _tile(block_q, h, F32) + 4 * scores
    dkv = 2 * (2 * q + 4 * kv + 2 * row_stat) + 2 * _tile(block_k, h, F32) + 4 * scores
    return max(forward, dq, dkv)


def price_blocks(
    shape: dict[str, int], block_q: int, block_k: int, chip: Chip, dtype: str, causal: bool, backward: bool = False
) -> BlockPrice:
    """One pair's time on ``chip`` (module docstring): the roofline of each kernel plus its grid steps' cost."""
    b, t, s, n, k, h = (shape[x] for x in ("b", "t", "s", "n", "k", "h"))
    nbytes = max(1, int(dtype_bytes(dtype)))
    kernels = (flash_cost, flash_dq_cost, flash_dkv_cost) if backward else (flash_cost,)
    steps = b * n * (t // block_q) * (s // block_k)  # every kernel's grid has this many steps, skipped ones too
    peak = chip.flops(dtype)
    compute = memory = flops = nbytes_moved = 0.0
    time = 0.0
    for fn in kernels:
        c = fn(b, t, s, n, k, h, block_q, block_k, causal, nbytes)
        c_s, m_s = c["flops"] / peak, c["bytes_accessed"] / chip.hbm_bandwidth
        compute, memory, time = compute + c_s, memory + m_s, time + max(c_s, m_s)
        flops, nbytes_moved = flops + c["flops"], nbytes_moved + c["bytes_accessed"]
    overhead = len(kernels) * steps * GRID_STEP_S
    vmem = vmem_footprint(block_q, block_k, h, nbytes, backward)
    return BlockPrice(block_q, block_k, time + overhead, compute, memory, overhead, flops, nbytes_moved, steps, vmem)


def vmem_limit(chip: Chip) -> int:
    """The chip's VMEM per TensorCore from :data:`VMEM_BYTES`; a :class:`UserError` for a chip the table lacks."""
    if chip.kind != "tpu":
        raise UserError(
            f"{chip.name} is a {chip.kind}: the lab's Pallas flash attention lowers for TPUs (Mosaic); give a TPU, "
            f"e.g. --hardware v5e"
        )
    if chip.name not in VMEM_BYTES:
        known = ", ".join(c.removeprefix("tpu-") for c in VMEM_BYTES)
        raise UserError(f"no VMEM figure for {chip.name} in the lab's table; give one of {known}")
    return VMEM_BYTES[chip.name]


FLAGS = {"b": "--b", "t": "--t", "s": "--s", "n": "--heads", "k": "--kv-heads", "h": "--head-dim"}


def _check(shape: dict[str, int], causal: bool) -> None:
    if set(shape) != set(FLAGS):
        raise UserError(f"the shape needs exactly the keys {', '.join(FLAGS)}; got {', '.join(shape)}")
    for name, v in shape.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"{FLAGS[name]} must be a positive integer, got {v!r}")
    if shape["n"] % shape["k"]:
        raise UserError(
            f"--kv-heads {shape['k']} does not divide --heads {shape['n']}; grouped-query attention needs "
            "heads % kv_heads == 0"
        )
    for name in ("t", "s"):
        if shape[name] > MAX_LENGTH:
            raise UserError(
                f"{FLAGS[name]} {shape[name]} is past the search's reach: at most {MAX_LENGTH} positions on one chip "
                "(give the sharded length)"
            )
    if causal and shape["t"] != shape["s"]:
        raise UserError(f"causal attention needs --t == --s (query t sees keys s <= t); got {shape['t']}, {shape['s']}")


def search_blocks(
    shape: dict[str, int],
    chip: Chip,
    dtype: str = "bf16",
    *,
    causal: bool = True,
    backward: bool = False,
    vmem_bytes: int | None = None,
) -> BlockSearch:
    """The fastest ``(block_q, block_k)`` whose footprint fits VMEM, for the local ``shape`` (keys ``b, t, s, n, k,
    h``: sequences, query and key lengths, query and KV heads, head dimension on one chip). ``vmem_bytes`` replaces
    the chip's VMEM (a scoped limit, a what-if). A :class:`UserError` for a bad shape, a chip without a VMEM figure,
    or when not even the smallest pair fits."""
    dtype = canonical_dtype(dtype)
    _check(shape, causal)
    limit = vmem_limit(chip) if vmem_bytes is None else int(vmem_bytes)
    chip.flops(dtype)  # a dtype the chip has no peak for: one line, before the grid
    priced = [
        price_blocks(shape, bq, bk, chip, dtype, causal, backward)
        for bq in block_sizes(shape["t"])
        for bk in block_sizes(shape["s"])
    ]
    fitting = sorted((p for p in priced if p.vmem_bytes <= limit), key=_order)
    if not fitting:
        small = min(priced, key=lambda p: p.vmem_bytes)
        raise UserError(
            f"no block pair fits {limit / MiB:.3g} MiB of VMEM on {chip.name}: the smallest, {small.block_q} x "
            f"{small.block_k}, needs {small.vmem_bytes / MiB:.3g} MiB (a smaller --head-dim, or shard the heads)"
        )
    return BlockSearch(
        chip.name,
        dict(shape),
        dtype,
        causal,
        backward,
        limit,
        VMEM_SOURCE if vmem_bytes is None else "given",
        fitting[0],
        tuple(fitting),
        len(priced) - len(fitting),
    )


def _order(p: BlockPrice) -> tuple:
    """Fastest first; equal times: fewer grid steps, then the larger query block."""
    return (p.time_s, p.grid_steps, -p.block_q, -p.block_k)


__all__ = [
    "GRID_STEP_S",
    "MAX_LENGTH",
    "VMEM_BYTES",
    "BlockPrice",
    "BlockSearch",
    "block_sizes",
    "price_blocks",
    "search_blocks",
    "vmem_footprint",
    "vmem_limit",
]
