"""Random graphs of the registry's ops (each step one sample of tests/op_samples.py, called the
way users call it), run compiled by Numba and on the reference interpreter: the forward plan's
outputs, the compiled forward's backward and the joint plan (bp.value_and_grad) must agree,
values and gradients. Steps read earlier steps' values where the shapes fit, inputs take few
distinct values (ties for max, relu, abs, comparisons) and arrive strided or transposed
(non-contiguous), so the compiled paths meet what users pass. Kept small for CI: a few graphs
of a few ops, drivers run as Python (no driver compile; the kernels are compiled)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from op_samples import SAMPLES

import backplan as bp
from backplan.runtime.backend import use_backend

EXAMPLES = int(os.environ.get("BACKPLAN_HYPOTHESIS_GRAPH_EXAMPLES", "6"))
SLOW_OR_KEYED = ("random_", "conv2d", "attention")  # own tests; keys and big kernels
USABLE = [
    s
    for s in SAMPLES
    if s.public is not None and "f64" in s.dtypes and s.args and not s.op.startswith(SLOW_OR_KEYED)
]
REUSABLE_KINDS = ("normal", "distinct", "grid")  # any float value fits there
LAYOUTS = ("contiguous", "strided", "transposed")


@dataclass(frozen=True)
class Input:
    shape: tuple[int, ...]
    kind: str
    high: int
    layout: str

    @property
    def is_float(self) -> bool:
        return self.kind not in ("labels", "indices", "mask")


@dataclass
class Graph:
    inputs: list[Input]
    steps: list[tuple]  # (sample, operands): ("input", i) or ("value", j) each

    def __repr__(self) -> str:
        steps = [f"{s.id}{[f'{k[0]}{i}' for k, i in ops]}" for s, ops in self.steps]
        return f"Graph({self.inputs}, {steps})"


def _output_of(sample, shapes_and_kinds) -> np.ndarray:
    """The step's output for made-up inputs of the right kinds: its shape and dtype."""
    rng = np.random.default_rng(0)
    arrays = [
        _fresh(rng, Input(shape, kind, high, "contiguous"))
        for shape, kind, high in shapes_and_kinds
    ]
    return np.asarray(sample.oracle(*arrays, **sample.resolved_attrs("f64")))


@st.composite
def graphs(draw):
    inputs: list[Input] = []
    steps: list[tuple] = []
    floats: list[tuple[int, tuple]] = []  # (value index, shape) of float outputs so far
    for _ in range(draw(st.integers(1, 4))):
        sample = draw(st.sampled_from(USABLE))
        operands, described = [], []
        for arg in sample.args:
            same = [j for j, shape in floats if shape == arg.shape]
            if arg.kind in REUSABLE_KINDS and same and draw(st.booleans()):
                operands.append(("value", draw(st.sampled_from(same))))
            else:
                kind = (
                    "grid"
                    if arg.kind in ("normal", "distinct") and draw(st.booleans())
                    else arg.kind
                )
                inputs.append(Input(arg.shape, kind, arg.high, draw(st.sampled_from(LAYOUTS))))
                operands.append(("input", len(inputs) - 1))
            described.append((arg.shape, arg.kind, arg.high))
        out = _output_of(sample, described)
        if out.dtype.kind == "f":
            floats.append((len(steps), out.shape))
        steps.append((sample, operands))
    return Graph(inputs, steps)


def _fresh(rng, spec: Input) -> np.ndarray:
    from op_samples import Arg

    array = Arg(spec.shape, spec.kind, spec.high).make(rng, "f64")
    if spec.layout == "strided" and array.ndim:
        wide = np.zeros(array.shape[:-1] + (2 * array.shape[-1],), array.dtype)
        wide[..., ::2] = array
        return wide[..., ::2]
    if spec.layout == "transposed" and array.ndim >= 2:
        return np.ascontiguousarray(array.T).T
    return array


def run_graph(graph: Graph, xs) -> list:
    values = []
    for sample, operands in graph.steps:
        args = [xs[i] if where == "input" else values[i] for where, i in operands]
        values.append(sample.public(*args, **sample.resolved_attrs("f64")))
    return values


def weighted_loss(graph: Graph, weights: dict):
    def loss(*xs):
        values = run_graph(graph, xs)
        return sum(bp.sum(values[j] * w) for j, w in weights.items())

    return loss


def close(got, want, what: str, float32_inside: bool = False) -> None:
    """float32_inside: the graph casts to float32 (its astype to the other float), whose values
    go through codegen/kernels/mathlib.py's float32 functions, documented within 2.4 ulp of what
    NumPy rounds: float32 tolerance for every value they reach."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, what
    if want.dtype.kind != "f":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    scale = 1.0 + float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0))
    tolerance = 4 * float(np.finfo(np.float32).eps) if float32_inside else 1e-9
    np.testing.assert_allclose(
        got, want, rtol=tolerance, atol=tolerance * scale, equal_nan=True, err_msg=what
    )


def both_backends(call) -> dict:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BACKPLAN_DRIVER", "python")
        results = {}
        for backend in ("reference", "numba"):
            with use_backend(backend):
                results[backend] = call()
    return results


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@pytest.mark.filterwarnings("ignore::backplan.Float64PromotionWarning")  # float64 meant here
@given(graph=graphs(), seed=st.integers(0, 2**16))
def test_random_registry_graphs_compiled_equal_the_reference_interpreter(graph, seed):
    rng = np.random.default_rng(seed)
    arrays = [_fresh(rng, spec) for spec in graph.inputs]
    float32_inside = any(sample.op == "astype" for sample, _ in graph.steps)
    forward = bp.compile(lambda *xs: tuple(run_graph(graph, xs)))
    outputs = both_backends(lambda: [o.numpy() for o in forward(*arrays)])
    for k, (got, want) in enumerate(zip(outputs["numba"], outputs["reference"], strict=True)):
        close(got, want, f"forward output {k} of {graph}", float32_inside)

    weights = {
        j: bp.tensor(rng.standard_normal(np.shape(out)))
        for j, out in enumerate(outputs["reference"])
        if np.asarray(out).dtype.kind == "f"
    }
    wrt = tuple(i for i, spec in enumerate(graph.inputs) if spec.is_float)
    if not weights or not wrt:
        return
    loss = weighted_loss(graph, weights)
    joint = bp.value_and_grad(loss, argnums=wrt)
    compiled_loss = bp.compile(loss)

    def gradients():
        _, grads = joint(*arrays)
        tensors = [bp.from_dlpack(a) for a in arrays]  # shares memory: keeps the strides
        for i in wrt:
            tensors[i].requires_grad = True
        compiled_value = compiled_loss(*tensors)
        if compiled_value.requires_grad:  # no path from an input (stop_gradient, astype int):
            compiled_value.backward()  # backward() refuses, as torch; the gradients are zeros
        backward = [  # an input that reaches no float output gets no gradient: zeros
            np.zeros(arrays[i].shape) if tensors[i].grad is None else tensors[i].grad.numpy()
            for i in wrt
        ]
        return [compiled_value.numpy(), *(g.numpy() for g in grads), *backward]

    results = both_backends(gradients)
    reference = results["reference"]
    for k, (got, want) in enumerate(zip(results["numba"], reference, strict=True)):
        close(got, want, f"loss or gradient {k} of {graph}", float32_inside)
    for k, (joint_grad, backward_grad) in enumerate(
        zip(reference[1 : 1 + len(wrt)], reference[1 + len(wrt) :], strict=True)
    ):
        close(
            backward_grad,
            joint_grad,
            f"compiled backward vs joint plan, input {wrt[k]}",
            float32_inside,
        )
