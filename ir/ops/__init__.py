"""Importing this package registers every op."""

from . import (  # noqa: F401
    attention,
    conv,
    creation,
    elementwise,
    linalg,
    nn,
    random,
    reductions,
    shape_ops,
)
