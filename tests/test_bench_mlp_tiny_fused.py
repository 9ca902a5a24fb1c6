"""The hand-fused mlp_tiny baseline computes the bench model's loss and every gradient (so a
comparison against it is fair), on layer sizes that are not multiples of a vector width."""

import numpy as np
import pytest

from backplan.bench import mlp_tiny_fused


def test_hand_fused_step_matches_the_float64_reference_on_odd_sizes():
    rng = np.random.default_rng(5)
    sizes, batch = (7, 13, 9, 5), 3
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"w{i}"] = rng.standard_normal((fan_in, fan_out)).astype(np.float32)
        params[f"b{i}"] = (0.1 * rng.standard_normal(fan_out)).astype(np.float32)
    x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
    labels = np.array([4, 0, 2], np.int64)
    value, grads = mlp_tiny_fused.hand_fused(params, x, labels)()
    want_value, want = mlp_tiny_fused.reference(params, x, labels)
    assert value == pytest.approx(want_value, rel=1e-5)
    for name, got, expected in zip(mlp_tiny_fused.NAMES, grads, want, strict=True):
        assert got.shape == expected.shape, name
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=name)
