"""A compiled call whose differentiated inputs are all leaves keeps the leaves themselves as its
region's edges (runtime/region.py LeafEdges) and makes Edge objects only when something reads
them; a joint step hands its gradients to those leaves without making any."""

import threading

import numpy as np

import backplan as bp
from backplan.runtime.joint_step import CALLS_TO_LEARN, JointRegion
from backplan.runtime.region import Edge, LeafEdges

X = np.linspace(-1.0, 1.0, 20, dtype=np.float32).reshape(4, 5)
W = np.linspace(0.5, -0.5, 15, dtype=np.float32).reshape(5, 3)


def loss(w, b, x):
    return bp.tanh(x @ w + b).sum()


def test_leaf_inputs_become_edges_in_plan_order_when_read():
    w, b = bp.tensor(W, requires_grad=True), bp.tensor(np.ones(3, np.float32), requires_grad=True)
    region = bp.compile(loss)(w, b, X).grad_fn
    assert type(region._edges) is LeafEdges
    edges = region.input_edges
    assert [type(e) for e in edges] == [Edge, Edge]
    assert edges[0].leaf is w and edges[1].leaf is b
    assert all(e.region is None for e in edges)
    assert region.input_edges is edges  # made once


def test_an_input_from_another_region_keeps_edge_objects():
    w = bp.tensor(W, requires_grad=True)
    b = bp.tensor(np.ones(3, np.float32), requires_grad=True) * 2.0  # not a leaf
    out = bp.compile(loss)(w, b, X)
    edges = out.grad_fn._edges
    assert type(edges) is list and edges[1].region is b.grad_fn and edges[0].leaf is w
    out.backward()
    np.testing.assert_allclose(w.grad.numpy(), X.T @ (1 - np.tanh(X @ W + 2.0) ** 2), rtol=1e-5)


def test_a_joint_call_whose_edges_were_read_still_hands_its_gradients_over():
    step = bp.compile(loss)
    w, b = bp.tensor(W, requires_grad=True), bp.tensor(np.ones(3, np.float32), requires_grad=True)
    for _ in range(CALLS_TO_LEARN):
        w.grad = b.grad = None
        step(w, b, X).backward()
    w.grad = b.grad = None
    out = step(w, b, X)
    assert isinstance(out.grad_fn, JointRegion)
    assert out.grad_fn.input_edges[0].leaf is w  # Edge objects now, as a report would make
    out.backward()
    assert out.grad_fn.freed
    d = 1 - np.tanh(X @ W + 1.0) ** 2
    np.testing.assert_allclose(w.grad.numpy(), X.T @ d, rtol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), d.sum(0), rtol=1e-5)


def test_two_threads_reading_edges_first_see_equal_lists():
    w, b = bp.tensor(W, requires_grad=True), bp.tensor(np.ones(3, np.float32), requires_grad=True)
    region = bp.compile(loss)(w, b, X).grad_fn
    seen, start = [], threading.Barrier(2)

    def read():
        start.wait()
        seen.append([e.leaf for e in region.input_edges])

    threads = [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 2 and all(s[0] is w and s[1] is b for s in seen)
