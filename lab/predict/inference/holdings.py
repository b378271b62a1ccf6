"""What one chip of a serving replica holds: its share of the weights and of the KV cache.

A replica is ``tp x ep`` chips. Tensor parallelism splits each dense weight over ``tp`` (Megatron's column and row
splits) and experts over ``tp x ep``, except what the serving programs keep whole on every rank:

* **MLA's latent down-projections** (``q_a_proj`` and ``kv_a_proj_with_mqa`` of DeepSeek's attention: ``D x
  q_lora_rank`` and ``D x (kv_lora_rank + rope_head_dim)``), ``ReplicatedLinear`` in vLLM's and SGLang's DeepSeek
  models: the latent they make is shared by every head, so it is not split.
* **Everything of the attention under data-parallel attention** (``attention_dp``: SGLang's
  ``--enable-dp-attention``): each rank runs attention for its own requests with the whole attention weights, and the
  MLP or MoE stays tensor-parallel over the group (docs.sglang.io, "Data Parallelism Attention").

The KV cache of a replica's sequences is split over its ``tp`` ranks by KV heads, then by sequence (the book's
``KV[2, B_Z, S, K_Y, H]``: past the KV head count the batch is sharded too, costing two AllToAlls per attention
layer). MLA's cache is one latent vector per token with no heads to split: under tensor parallelism every rank keeps
the whole cache of every sequence ("duplicated KV cache across all GPUs", the same SGLang page); under data-parallel
attention each rank keeps only its own requests' cache.
"""

from __future__ import annotations

from lab.core.models import ModelConfig
from lab.core.units import dtype_bytes


def split_params(m: ModelConfig) -> tuple[float, float]:
    """(dense parameters, expert parameters)."""
    return m.params - m.expert_params_total, float(m.expert_params_total)


def replicated_params(m: ModelConfig, attention_dp: bool = False) -> float:
    """Dense parameters every rank of a tensor-parallel group holds whole (module docstring)."""
    if attention_dp:
        return float(m.attention_params_per_layer * m.layers)
    if not m.is_mla:
        return 0.0
    return float(m.layers * m.d_model * (m.q_lora_rank + m.kv_lora_rank + m.rope_head_dim))


def weight_bytes_per_chip(
    m: ModelConfig, tp: int, ep: int, weights: str, attention_dp: bool = False, experts_read: float = 1.0
) -> float:
    """One chip's weights (``experts_read``: the share of its experts a step reads, 1 for what it holds)."""
    dense, experts = split_params(m)
    whole = replicated_params(m, attention_dp)
    return (whole + (dense - whole) / tp + experts / (tp * ep) * experts_read) * dtype_bytes(weights)


def kv_shards(m: ModelConfig, tp: int, batch: float, attention_dp: bool = False) -> float:
    """Ways a replica's KV cache is split over its tp chips (module docstring): by KV heads, then by sequence; MLA's
    not at all under tensor parallelism; by request under data-parallel attention."""
    if attention_dp:
        return min(tp, max(batch, 1.0))
    if m.is_mla:
        return 1.0
    return min(tp, m.kv_heads * max(batch, 1.0))


def pool_split(m: ModelConfig, tp: int, attention_dp: bool = False) -> int:
    """Ways a paged KV pool splits one token's cache over a replica's tp ranks (``infer serve``): by KV heads, MLA's
    not at all, the whole group's under data-parallel attention (each rank's pages its own requests')."""
    if attention_dp:
        return tp
    return min(tp, 1 if m.is_mla else m.kv_heads)


def kv_bytes_per_sequence(m: ModelConfig, context: int, kv: str) -> float:
    """One sequence's cache at ``context`` tokens (a windowed layer's last ``sliding_window`` only)."""
    return m.kv_bytes(context, kv)


__all__ = [
    "kv_bytes_per_sequence",
    "kv_shards",
    "pool_split",
    "replicated_params",
    "split_params",
    "weight_bytes_per_chip",
]
