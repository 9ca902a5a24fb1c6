"""Importing this package registers every op."""

from . import conv, creation, elementwise, linalg, nn, random, reductions, shape_ops  # noqa: F401
