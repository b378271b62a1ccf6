"""What the lab's Pallas kernels cost, counted from their block sizes: plain Python, no JAX.

The kernels (``kernels/pallas``) hand these counts to ``pl.CostEstimate`` so XLA schedules around them; the
estimators may read the same counts. Each function returns ``{"flops", "transcendentals", "bytes_accessed"}``
for one ``pallas_call`` and counts what its grid does:

* FLOPs: 2 per multiply-add of each matmul of a computed block pair; causal block pairs wholly above the diagonal
  are skipped by the kernel (``pl.when``) and not counted. Elementwise work (scaling, masking) is not counted.
* Transcendentals: each ``exp`` (and the ``log`` of the forward's logsumexp).
* Bytes: every block read or written from HBM. A block re-read at each step that needs it counts each time (K/V
  once per query block, and per query head of a GQA group); the kernels point skipped steps' index maps at a block
  already fetched, so skipped blocks are not counted. Consecutive steps reading the same block may share one fetch
  on a TPU (Pallas' pipeline skips the copy), so the bytes are an upper bound there.

Shapes use the Transformer's letters: ``b`` batch, ``t`` query length, ``s`` key length, ``n`` query heads,
``k`` KV heads, ``h`` head dimension; ``dtype_bytes`` is the size of an element of q, k, v and the outputs.
Softmax statistics (logsumexp, and the backward's row sums ``D``) are float32.
"""

from __future__ import annotations

F32 = 4  # bytes of a float32 softmax statistic
I32 = 4  # bytes of an int32 page-table entry or length


def _cost(flops: int, transcendentals: int, bytes_accessed: int) -> dict[str, int]:
    """The three counts as ``pl.CostEstimate`` takes them (keyword names and all)."""
    return {"flops": int(flops), "transcendentals": int(transcendentals), "bytes_accessed": int(bytes_accessed)}


def last_key_block(i: int, block_q: int, block_k: int) -> int:
    """The last key block a causal query block ``i`` sees (its last row ``i*block_q + block_q - 1``)."""
    return (i * block_q + block_q - 1) // block_k


def flash_pairs(t: int, s: int, block_q: int, block_k: int, causal: bool) -> int:
    """Block pairs (query block, key block) one head of one sequence computes: all of them, or under a causal
    mask (key ``j`` seen by query ``i`` when ``j <= i``) those with at least one unmasked element."""
    nq, nk = t // block_q, s // block_k
    if not causal:
        return nq * nk
    if t <= s:  # no query block reaches past the last key block: the sum in closed form (any length, at once)
        return nq + floor_sum(nq, block_k, block_q, block_q - 1)
    return sum(min(last_key_block(i, block_q, block_k), nk - 1) + 1 for i in range(nq))


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum((a*i + b) // m for i in range(n))`` for ``n, m >= 1`` and ``a, b >= 0``, in O(log) steps (the
    Euclid-like reduction of floor sums)."""
    total = 0
    while n > 0:
        total += (a // m) * n * (n - 1) // 2 + (b // m) * n
        a, b = a % m, b % m
        top = a * n + b
        if top < m:
            break
        n, b, m, a = top // m, top % m, a, m
    return total


def flash_cost(
    b: int, t: int, s: int, n: int, k: int, h: int, block_q: int, block_k: int, causal: bool, dtype_bytes: int
) -> dict[str, int]:
    """The forward kernel: per block pair ``q k^T`` and ``p v`` (``4*block_q*block_k*h`` FLOPs), ``exp`` of the
    scores and of each row's rescaling; one ``log`` per row. Reads q once per query block and K, V once per pair;
    writes o and the float32 logsumexp. Non-causal FLOPs are the dense ``4*b*n*t*s*h``."""
    pairs = b * n * flash_pairs(t, s, block_q, block_k, causal)
    flops = pairs * 4 * block_q * block_k * h
    trans = pairs * (block_q * block_k + block_q) + b * n * t
    qo = 2 * b * n * t * h * dtype_bytes
    kv = pairs * 2 * block_k * h * dtype_bytes
    return _cost(flops, trans, qo + kv + b * n * t * F32)


def flash_dq_cost(
    b: int, t: int, s: int, n: int, k: int, h: int, block_q: int, block_k: int, causal: bool, dtype_bytes: int
) -> dict[str, int]:
    """The backward's dq kernel: per block pair the scores again, ``dO v^T`` and ``ds k`` (``6*block_q*block_k*h``
    FLOPs) and the probabilities' ``exp``. Reads q, dO, logsumexp and ``D`` once per query block and K, V once
    per pair; writes dq."""
    pairs = b * n * flash_pairs(t, s, block_q, block_k, causal)
    per_row = b * n * t
    reads = 2 * per_row * h * dtype_bytes + 2 * per_row * F32 + pairs * 2 * block_k * h * dtype_bytes
    return _cost(pairs * 6 * block_q * block_k * h, pairs * block_q * block_k, reads + per_row * h * dtype_bytes)


def flash_dkv_cost(
    b: int, t: int, s: int, n: int, k: int, h: int, block_q: int, block_k: int, causal: bool, dtype_bytes: int
) -> dict[str, int]:
    """The backward's dk/dv kernel: per block pair (over every query head of the KV head's group) the scores
    again, ``p^T dO``, ``dO v^T`` and ``ds^T q`` (``8*block_q*block_k*h`` FLOPs) and the ``exp``. Reads K, V once
    per key block and q, dO, logsumexp and ``D`` once per pair; writes dk, dv."""
    pairs = b * n * flash_pairs(t, s, block_q, block_k, causal)
    kv = 2 * b * k * s * h * dtype_bytes
    per_pair = pairs * (2 * block_q * h * dtype_bytes + 2 * block_q * F32)
    return _cost(pairs * 8 * block_q * block_k * h, pairs * block_q * block_k, 2 * kv + per_pair)


def paged_decode_cost(
    b: int, n: int, k: int, h: int, pages_per_seq: int, page_size: int, dtype_bytes: int
) -> dict[str, int]:
    """The ragged paged decode kernel, bounded by full page tables (every sequence ``pages_per_seq * page_size``
    tokens long; the kernel skips pages past each length, so a ragged batch costs less): per token and query head
    ``q k^T`` and ``p v`` (``4*h`` FLOPs) and one ``exp``, one more ``exp`` per page and head for the rescaling.
    Reads q and each page of K and V once (all heads of a page at once), the page table and the lengths; writes o."""
    tokens = b * pages_per_seq * page_size
    flops = 4 * n * h * tokens
    trans = n * tokens + b * n * pages_per_seq
    pages = 2 * tokens * k * h * dtype_bytes
    return _cost(flops, trans, 2 * b * n * h * dtype_bytes + pages + I32 * (b * pages_per_seq + b))


__all__ = ["flash_cost", "flash_dkv_cost", "flash_dq_cost", "flash_pairs", "last_key_block", "paged_decode_cost"]
