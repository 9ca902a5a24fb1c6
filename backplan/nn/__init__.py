"""bp.nn: helpers for building models (parameter initialisers in bp.nn.init)."""

from backplan.nn import init

__all__ = ["init"]
