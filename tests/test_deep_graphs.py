"""Deep graphs: a chain of elementwise ops fuses into loops of bounded size (ir/fusion.py
MAX_LOOP_NODES, MAX_LOOP_READS), so that no loop kernel's native entry exceeds ctypes' 1024
arguments (a 1,100-op chain crashed at its first call) and compile time grows linearly with the
chain, not faster (one 1,100-op loop took 213 s to compile)."""

import re

import numpy as np

import backplan as bp
from backplan.codegen.render.emit import generate
from backplan.ir.fusion import MAX_LOOP_NODES, group_kernels
from backplan.ir.lowering import lower
from backplan.runtime.backend import use_backend

CTYPES_MAX_ARGUMENTS = 1024
DEPTH = 1100


def chain(x):
    for i in range(DEPTH):
        x = bp.sin(x) * 1.0001 if i % 2 else x * 0.999 + 0.001
    return x.sum()


def test_a_deep_chain_fuses_into_loops_of_bounded_size_and_arguments():
    x = bp.tensor(np.linspace(0.0, 1.0, 16))
    plan = bp.value_and_grad(chain).trace(x).plan
    loops = [k for k in group_kernels(plan.graph) if k.kind == "loop"]
    assert len(loops) > DEPTH * 3 // MAX_LOOP_NODES  # the forward and backward are split
    for loop in loops:
        assert len(loop.nodes) + len(loop.reductions) <= MAX_LOOP_NODES
    source = generate(lower(plan, ()))
    for kernel in source.loop_kernels:
        for parameters in re.findall(r"^def \w+\((.*)\):", kernel.source, re.M):
            assert parameters.count(",") + 1 + 2 < CTYPES_MAX_ARGUMENTS  # + result, exception


def test_a_deep_chain_runs_compiled_with_the_driver_as_python(monkeypatch):
    """The driver run as Python calls each loop's native entry through ctypes: at 1,100 ops
    this raised ArgumentError (too many arguments (1111), maximum is 1024)."""
    monkeypatch.setenv("BACKPLAN_DRIVER", "python")
    x0 = np.linspace(0.0, 1.0, 16)
    eager_x = bp.tensor(x0, requires_grad=True)
    expected = chain(eager_x)
    expected.backward()
    with use_backend("numba"):
        x = bp.tensor(x0, requires_grad=True)
        loss = bp.compile(chain)(x)
        loss.backward()
    np.testing.assert_allclose(loss.item(), expected.item(), rtol=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), eager_x.grad.numpy(), rtol=1e-10, atol=1e-14)
