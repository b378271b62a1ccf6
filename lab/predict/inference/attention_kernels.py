"""The inference estimator's attention FLOPs where the Plan names the lab's Pallas kernels (``attention =
"pallas"``): counted as the kernels compute them (:mod:`lab.core.pallas_cost`), per chip, all layers.

* The prefill runs the flash kernel, causal, over the prompt: its block pairs, the pairs wholly above the diagonal
  skipped (``flash_cost``; one block per prompt computes the whole square, as the einsum does).
* A decode step runs the ragged paged decode kernel over the cache read as pages of ``block_k`` positions
  (clipped to the cache): the kernel's cost estimate counts every page of each sequence's table
  (``paged_decode_cost``), the whole allocated cache, which is what the program reads.

The kernel sees each chip's own sequences and heads; the FLOPs are linear in both, so the whole batch's count over
the chips is each chip's.
"""

from __future__ import annotations

from lab.core.pallas_cost import flash_cost, paged_decode_cost
from lab.core.units import dtype_bytes

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:  # the config is lab.predict.inference.estimate.InferConfig, which imports this module
    from typing import Any as InferConfig


def _bytes(cfg: InferConfig) -> int:
    """An element's bytes for the cost functions' byte counts (their FLOPs, all this module reads, do not use it)."""
    return max(1, int(dtype_bytes(cfg.kv)))


def prefill_attention_flops(cfg: InferConfig) -> float:
    """The flash kernel's FLOPs over every layer of the prefill of ``prefill_len`` tokens, per chip."""
    m, p = cfg.model, cfg.prefill_len or 0
    if not p:
        return 0.0
    bq, bk = cfg.pallas_blocks  # type: ignore[misc]
    bq, bk = min(bq, p), min(bk, p)
    one = flash_cost(cfg.batch, p, p, m.heads, m.kv_heads, m.head_dim, bq, bk, True, _bytes(cfg))
    return m.layers * one["flops"] / cfg.chips


def decode_attention_flops(cfg: InferConfig, context: int) -> float:
    """The paged decode kernel's FLOPs over every layer of one decode step at ``context`` positions of cache (whole
    pages of ``block_k`` positions), per chip."""
    m = cfg.model
    page = min(cfg.pallas_blocks[1], context)  # type: ignore[index]
    pages = -(-context // page)
    one = paged_decode_cost(cfg.batch, m.heads, m.kv_heads, m.head_dim, pages, page, _bytes(cfg))
    return m.layers * one["flops"] / cfg.chips


__all__ = ["decode_attention_flops", "prefill_attention_flops"]
