"""Every message the runtime raises or prints, checked for the facts it states: which region,
created where (the user's line, never backplan's), freed by which backward(), whether it saved
anything, whether the graph differentiated now shares it, and a loop only when there is one."""

import os
import re

import numpy as np
import pytest
from helpers import here

import backplan as bp
from backplan.runtime.backend import use_backend

BACKPLAN_FILES = {
    name
    for root, _, files in os.walk(os.path.dirname(os.path.dirname(bp.tracer.__file__)))
    for name in files
    if name.endswith(".py") and "tests" not in root and "examples" not in root
}


def vec(n=3, grad=True):
    return bp.tensor(np.arange(1.0, n + 1, dtype=np.float32), requires_grad=grad)


def test_a_backward_that_fails_part_way_marks_what_it_ran_and_says_so():
    x = vec()
    h = bp.tanh(x)
    out = bp.sum(h * 2)

    def broken(cotangents, mode):
        raise FloatingPointError("boom")

    h.grad_fn.run_backward = broken
    with pytest.raises(FloatingPointError):
        out.backward()
    failed_at = here(offset=-1)
    assert out.grad_fn.freed and out.grad_fn.freed_by.failed
    with pytest.raises(bp.GraphFreedError) as info:
        out.backward()
    message, facts = str(info.value), info.value.facts
    assert facts.case == "failed" and facts.freed_by == failed_at
    assert f"which the backward() at {failed_at} was running when it failed" in message
    assert message.endswith("Fix: run the forward again to build a new graph.")
    assert "retain_graph" not in message and "loop" not in message
    assert "freed when the backward() at" in str(out.grad_fn)
    assert x.grad is None  # nothing was written


def test_a_root_freed_by_a_downstream_backward_says_the_later_graph_freed_it():
    x = vec()
    y = bp.tanh(x)
    y_line = here(offset=-1)
    z = bp.sum(y)
    z.backward()
    z_backward = here(offset=-1)
    with pytest.raises(bp.GraphFreedError) as info:
        y.backward(np.ones(3, np.float32))
    message, facts = str(info.value), info.value.facts
    assert facts.case == "shared" and not facts.loop and facts.created_at == y_line
    assert facts.saved_buffers == 1 and facts.saved_bytes == 12
    assert f"whose 1 saved buffer (12 B) the backward() at {z_backward} already freed" in message
    assert "a graph built on top of this one, and freed this region on the way" in message
    assert "loop" not in message


def test_many_freed_regions_are_counted_and_the_first_three_named():
    x = vec()
    h = x
    for _ in range(5):
        h = bp.tanh(h)
    out = bp.sum(h)
    out.backward()
    with pytest.raises(bp.GraphFreedError) as info:
        out.backward()
    assert info.value.facts.more_freed == ("tanh",) * 5
    assert "5 more regions upstream are freed too: `tanh`, `tanh`, `tanh` and 2 more " in str(
        info.value
    )
    assert "(5 saved buffers, 60 B)" in str(info.value)


def test_grad_fn_says_how_many_regions_are_upstream_and_how_to_see_them():
    a = bp.tensor(np.ones((4, 3), np.float32), requires_grad=True)
    w = bp.tensor(np.ones((3, 2), np.float32), requires_grad=True)
    o = bp.sum((a @ w) * 5)
    text = str(o.grad_fn)
    assert "(no saved buffers)" in text
    assert "2 more regions upstream (holding 0 B they allocated and 72 B of your own" in text
    assert "t.graph() or bp.explain_graph(t)" in text
    assert "upstream" not in str(bp.tanh(a).grad_fn)


def test_regions_upstream_count_an_array_two_regions_save_once():
    # exp saves its output and mul saves the same array as its input; x is your own array
    x = vec(4)
    out = bp.sum(x * bp.exp(x))
    text = str(out.grad_fn)
    assert "2 more regions upstream (holding 16 B they allocated and 16 B of your own" in text
    assert out.graph().saved_bytes == 16 and out.graph().input_bytes == 16
    out.backward()
    with pytest.raises(bp.GraphFreedError) as info:
        out.backward()
    assert info.value.facts.more_saved_bytes == 32  # not 48: exp's output once
    assert "(3 saved buffers, 32 B)" in str(info.value)


def test_regions_take_the_public_name_with_the_primitive_in_brackets():
    t = bp.tensor(np.eye(2, dtype=np.float32), requires_grad=True)
    a = bp.tensor(np.ones(2, np.float32), requires_grad=True)
    names = [r.name for r in (t @ a).graph().regions]
    assert names == ["matmul [reshape]", "matmul", "matmul [reshape]"]
    loss = bp.mse_loss(t @ a, bp.tensor(np.zeros(2, np.float32)))
    assert {r.name for r in loss.graph().regions[:3]} == {"mse_loss [mul]", "mse_loss [sum]"}
    assert bp.tanh(a).grad_fn.name == "tanh" and (a * 5).grad_fn.name == "mul"
    assert a.mean().grad_fn.name == "mean [mul]"

    @bp.compile
    def loss_fn(t, a):
        return bp.mse_loss(t @ a, bp.zeros((2,)))

    produced = {s.op for s in loss_fn(t, a).grad_fn.saved_buffers}
    assert produced == {"input", "matmul [reshape]"}


def test_produced_by_and_created_at_never_point_into_backplan():
    x = bp.tensor(np.ones((2, 4), np.float32), requires_grad=True)
    outputs = [
        bp.mse_loss(x @ bp.tensor(np.ones(4, np.float32)), bp.tensor(np.zeros(2, np.float32))),
        bp.sum(bp.layer_norm(x) * x.T.T),
        bp.sum(bp.compile(lambda x: bp.softmax(bp.layer_norm(x)) * x)(x)),
        bp.var(x[0]),
    ]
    for out in outputs:
        text = str(out.graph())
        files = set(re.findall(r"([\w.]+\.py):\d+", text))
        assert files == {"test_runtime_messages.py"}, text
        assert not files & BACKPLAN_FILES


def test_unknown_backend_names_it_and_the_choices():
    with pytest.raises(ValueError, match=r"unknown backend 'gpu'; use one of \("):
        with use_backend("gpu"):
            pass


def test_backplan_run_as_a_script_is_still_backplan_code():
    """`python -m backplan demo` runs backplan/__main__.py as __main__: its lines must not
    appear as the user's; a user's own script run as __main__ stays user code."""
    import types

    from backplan.tracer.source import _is_library, _module_name

    ours = types.SimpleNamespace(name="backplan.__main__")
    assert _is_library(_module_name({"__name__": "__main__", "__spec__": ours}))
    assert not _is_library(_module_name({"__name__": "__main__", "__spec__": None}))
    assert not _is_library(_module_name({"__name__": "backplan.demo"}))
    assert not _is_library("backplan.bench.peers.backplan_peer")  # a training loop's stand-in
    assert _is_library("backplan.bench.measure")
