"""The lab's own Pallas kernels (TPU-style blocking; ``interpret=True`` runs them on any backend, the CPU included).

* :mod:`kernels.pallas.flash_attention`: blocked causal / non-causal grouped-query attention with an online
  softmax, forward and backward in Pallas (:func:`flash_attention`).
* :mod:`kernels.pallas.paged_decode`: one decode step of ragged paged attention over a page table
  (:func:`paged_decode`).

Their costs (``pl.CostEstimate``) are counted in :mod:`lab.core.pallas_cost`, which needs no JAX.
"""

from kernels.pallas.flash_attention import flash_attention
from kernels.pallas.paged_decode import paged_decode

__all__ = ["flash_attention", "paged_decode"]
