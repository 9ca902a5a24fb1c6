"""What a step saves, counted once: explain() of a compiled training step lists what the
value_and_grad inside it saves; eager and compiled totals count each array once and keep your
own arrays apart from what the graph allocated."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp


def exp_product(x):
    return bp.sum(x * bp.exp(x / 1e7))


@pytest.mark.reference
def test_eager_and_compiled_totals_count_each_array_once_and_yours_apart():
    x = bp.tensor(np.linspace(0, 1, 1000, dtype=np.float32), requires_grad=True)
    for fn in (exp_product, bp.compile(exp_product)):
        out = fn(x)
        graph = out.graph()
        # exp's output, saved by exp and by mul, is one array; x is yours, not allocated
        assert bp.live_saved_bytes() == graph.saved_bytes == graph.planned_bytes == 4000
        assert bp.live_saved_bytes(yours=True) == graph.input_bytes == 4000
        assert graph.planned_input_bytes == 4000
        assert "4,000 B allocated by the graph, 4,000 B your own arrays" in str(graph)
        out.backward()
        assert bp.live_saved_bytes() == 0 == bp.live_saved_bytes(yours=True)
        np.testing.assert_allclose(x.grad.numpy(), 1 + 2 * x.numpy() / 1e7, rtol=1e-5)
        x.grad = None


def mse(params, x, y):
    return bp.mean((bp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def test_explain_of_a_compiled_training_step_lists_what_its_value_and_grad_saves():
    rng = np.random.default_rng(0)
    params = {
        "w1": bp.tensor(rng.standard_normal((8, 16)).astype(np.float32)),
        "w2": bp.tensor(rng.standard_normal((16, 1)).astype(np.float32)),
    }
    x = rng.standard_normal((32, 8)).astype(np.float32)
    y = rng.standard_normal((32, 1)).astype(np.float32)
    opt = bp.optim.adam(1e-2)

    @bp.compile(donate_argnums=(0, 1))
    def step(params, state, x, y):
        loss, grads = bp.value_and_grad(lambda p: mse(p, x, y))(params)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    report = step.explain(params, opt.init(params), x, y)
    alone = bp.value_and_grad(mse).explain(params, x, y)
    assert report.n_backward_steps == 0 and not report.saved_buffers
    ((joint, inner),) = report.inner
    assert joint.name == "<lambda>" and joint.loc.endswith(f":{step_line(step)}")
    assert [b.nbytes for b in inner.saved_buffers] == [b.nbytes for b in alone.saved_buffers]
    assert report.inner_saved_bytes == alone.saved_bytes > 0
    assert report.inner_saved_input_bytes == alone.saved_input_bytes > 0
    text = str(report)
    assert "nothing is saved" not in text
    assert f"keeps {len(alone.saved_buffers)} saved buffers for that backward" in text
    assert "inside value_and_grad(<lambda>) called at" in text


def step_line(step) -> int:
    """The line of the value_and_grad call in the step's source."""
    import inspect

    lines, first = inspect.getsourcelines(step.fn)
    return first + next(i for i, line in enumerate(lines) if "value_and_grad" in line)
