"""JAX code that runs on a mesh. Everything here imports JAX; the analytic side (``lab``) does not."""
