"""Rendering: a lowered plan (ir/lowering.py) becomes Numba source, a driver module and the
canonical loop kernels it calls. Nothing here compiles or runs anything."""
