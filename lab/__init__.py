"""shardlab: predicted, compiled and measured truths about one sharded JAX program.

The analytic modules (``hardware``, ``roofline``, ``collectives``, ``notation``, ``sharded_matmul``)
import numpy at most, so predictions answer without starting JAX. JAX is imported only by
``kernels`` and, later, by compilation and measurement.
"""

__version__ = "0.1.0"
