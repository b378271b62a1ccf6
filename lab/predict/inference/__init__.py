"""Serving's estimate: ``estimate`` (prefill and decode latency, KV cache, the smallest topology, throughput under
continuous batching) and ``ops`` (the same terms as named ops, for a Plan's decode program)."""
