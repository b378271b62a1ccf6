"""The lab's vocabulary, JAX-free: the Plan, hardware, models, units, notation, errors."""
