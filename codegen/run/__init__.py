"""Running: a compiled plan behind one call (arguments checked, workspaces per thread, donation),
and the calls a driver running as Python makes into address kernels."""
