"""Importing this package registers every op."""

from . import creation, elementwise, linalg, nn, reductions, shape_ops  # noqa: F401
