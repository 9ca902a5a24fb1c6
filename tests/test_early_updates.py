"""A compiled training step runs each parameter's optimizer update right after that parameter's
gradient is final (ir/update_order.py): the gradient buffer dies at once instead of waiting for
every other gradient, so the step's peak falls, with the same values, the peak explain predicts
measured to the byte, and no update ever moved ahead of a read of the old parameter it
overwrites."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.run.memory_check import checked_memory, count_held, measure
from backplan.ir.graph import Graph, Value
from backplan.ir.layout import storage_root
from backplan.ir.types import TensorType
from backplan.ir.update_order import updates_after_gradients
from backplan.report.wording import format_bytes
from backplan.runtime.backend import use_backend

DEPTH, WIDTH, BATCH = 4, 64, 8  # weights (16 KiB each) outweigh the activations: the gradients
# held until the end are most of the traced order's peak


def loss_fn(params, x):
    h = x
    for w, b in zip(params["ws"], params["bs"], strict=True):
        h = bp.tanh(h @ w + b)
    return bp.mean(h * h)


def parameters():
    rng = np.random.default_rng(3)
    ws = [(rng.standard_normal((WIDTH, WIDTH)) * 0.3).astype(np.float32) for _ in range(DEPTH)]
    bs = [(rng.standard_normal(WIDTH) * 0.1).astype(np.float32) for _ in range(DEPTH)]
    return {"ws": [bp.tensor(w) for w in ws], "bs": [bp.tensor(b) for b in bs]}


def batch():
    return bp.tensor(np.random.default_rng(0).standard_normal((BATCH, WIDTH)).astype(np.float32))


def train_step(opt):
    @bp.compile(donate_argnums=(0, 1))
    def step(params, state, x):
        loss, grads = bp.value_and_grad(loss_fn)(params, x)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    return step


def three_steps(opt, monkeypatch, early: str):
    """(every array after three steps, the third step's measured peak, its explain report)."""
    monkeypatch.setenv("BACKPLAN_EARLY_UPDATES", early)
    step = train_step(opt)
    params = parameters()
    state, x = opt.init(params), batch()
    for _ in range(2):
        params, state, loss = step(params, state, x)
    with measure() as measured:
        count_held([loss.numpy()])  # the loop: the second loss bound until the third returns
        params, state, loss = step(params, state, x)
    report = step.explain(params, state, x)

    arrays = [np.asarray(a) for a in bp.tree.leaves((params, state, loss))]
    return arrays, measured.peak, report


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_updates_after_their_gradients_lower_the_peak_measured_to_the_byte(backend, monkeypatch):
    """sgd on both backends, adam compiled: the moved order's peak is below the traced one's
    (on the reference interpreter, which allocates each new parameter when it is written, by
    the few bytes an update's temporaries free), and the checked mode measures it."""
    opts = [bp.optim.sgd(0.05)] + ([bp.optim.adam(1e-2)] if backend == "numba" else [])
    with use_backend(backend), checked_memory():
        for opt in opts:
            _, traced_measured, traced = three_steps(opt, monkeypatch, "0")
            _, early_measured, early = three_steps(opt, monkeypatch, "1")
            assert early.peak_bytes < traced.peak_bytes
            assert early_measured == early.peak.allocated_peak_bytes
            assert traced_measured == traced.peak.allocated_peak_bytes
            assert early.update_order.kept and traced.update_order is None
            assert early.update_order.traced == traced.call_peak_bytes  # one call's
            summary = " ".join(str(early).split())
            assert "Each optimizer update runs right after" in summary
            assert (
                f"peak {format_bytes(early.peak_bytes)} on the {backend} backend, against "
                f"{format_bytes(traced.peak_bytes)} with every update after every gradient"
            ) in summary
    if backend == "numba":  # adam: a gradient and two moments per weight, 16 KiB each
        assert traced.peak_bytes - early.peak_bytes >= 2 * WIDTH * WIDTH * 4


def test_adam_keeps_the_traced_order_where_moving_would_raise_the_peak(monkeypatch):
    """On the reference interpreter an early adam update allocates the new parameter and both
    moments while the backward still holds its activations: the traced order is kept, and
    explain says what moving would have held."""
    monkeypatch.setenv("BACKPLAN_EARLY_UPDATES", "1")
    opt = bp.optim.adam(1e-2)
    with use_backend("reference"):
        params = parameters()
        report = train_step(opt).explain(params, opt.init(params), batch())
    order = report.update_order
    assert not order.kept and order.early >= order.traced == report.call_peak_bytes
    assert report.peak_bytes == order.traced + 4  # the loop's: the last loss bound too
    assert "The optimizer updates run after every gradient, as traced" in " ".join(
        str(report).split()
    )


@pytest.mark.parametrize("opt", [bp.optim.adam(1e-2), bp.optim.sgd(0.05, momentum=0.9)])
def test_the_moved_order_gives_bitwise_the_same_values(opt, monkeypatch):
    """Every kernel computes what it did: the parameters, optimizer state and losses of three
    steps are bitwise those of the traced order (compiled kernels, the driver run as Python:
    a compiled driver lets LLVM optimise across kernels, which any change of plan rounds
    differently; the reference interpreter runs each node on its own)."""
    monkeypatch.setenv("BACKPLAN_DRIVER", "python")
    with use_backend("numba"):
        traced, _, _ = three_steps(opt, monkeypatch, "0")
        early, _, report = three_steps(opt, monkeypatch, "1")
    assert report.update_order.kept
    for new, old in zip(early, traced, strict=True):
        assert new.dtype == old.dtype and np.array_equal(new, old)


def test_no_update_overwrites_a_parameter_the_backward_still_reads(monkeypatch):
    """In the compiled step's order, each new parameter is written (into its old buffer, every
    output donated) only after the last kernel reading the old value, dX = dY @ W^T included."""
    monkeypatch.setenv("BACKPLAN_EARLY_UPDATES", "1")
    opt = bp.optim.adam(1e-2)
    with use_backend("numba"):
        params = parameters()
        plans = train_step(opt).trace(params, opt.init(params), batch()).program.plans
    assert plans.update_order.kept
    lowered = plans.lowered()
    graph = lowered.plan.graph
    n_params = 2 * DEPTH
    home = {n: k for k, kernel in enumerate(lowered.kernels) for n in kernel.all_nodes}
    assert len(lowered.donations) == len(graph.outputs) - 1  # all but the loss, in place
    for out, p in enumerate(graph.inputs[:n_params]):
        written = home[storage_root(graph.outputs[out])]
        reads = [
            home[n]
            for n in graph.nodes
            if any(storage_root(v) is p for v in n.inputs) and n in home
        ]
        assert max(reads) <= written  # the update's own loop reads it last


def _graph():
    """y = w * x; gw = y * x (w's gradient); gy = exp(y); gx = gy * w (reads the old w);
    w2 = w - gw (the update); outputs w2 and gx."""
    g = Graph()
    w, x = (g.add_input(TensorType("f32", (4,))) for _ in range(2))

    def node(op, *inputs):
        return Value(op, inputs, {}, TensorType("f32", (4,)))

    y = node("mul", w, x)
    gw = node("mul", y, x)
    gy = node("exp", y)
    gx = node("mul", gy, w)
    w2 = node("sub", w, gw)
    g.nodes, g.outputs = [y, gw, gy, gx, w2], [w2, gx]
    return g, y, gw, gx, w2


def test_an_update_never_moves_ahead_of_a_read_of_the_donated_old_value():
    g, y, gw, gx, w2 = _graph()
    free = updates_after_gradients(g, {y}, {gw, gx}, donated=())
    assert free.nodes.index(w2) == free.nodes.index(gw) + 1  # not donated: right after gw
    assert updates_after_gradients(g, {y}, {gw, gx}, donated=(0,)) is None  # waits for gx
    later = Value("exp", (gx,), {}, gx.type)  # more of the gradient part after the read
    g.nodes, g.outputs = [*g.nodes[:4], later, w2], [w2, later]
    moved = updates_after_gradients(g, {y}, {gw, later}, donated=(0,))
    assert moved.nodes == [*g.nodes[:4], w2, later]  # right after the read, not before it
