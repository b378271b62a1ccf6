"""Predicted truth, JAX-free: roofline, collectives, efficiency, matmuls, training, inference, planner."""
