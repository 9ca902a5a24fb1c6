"""backplan.codegen: plans to Numba source and compiled, cached kernels. Imports only ir.

Four rooms, each a job: render/ (a lowered plan to source), kernels/ (hand-written kernels, one
module per op family, with their emitters), build/ (compiling and the signed disk cache), run/
(calling a compiled plan). flags.py and jit.py are the compiler settings all of them share."""
