"""The benchmark harness: backplan against NumPy, PyTorch and JAX on the same work."""
