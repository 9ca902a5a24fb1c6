"""The training examples run on a small slice: a few steps each, the loss falls, the CNN beats
chance on the held-out digits, each training step is one compiled call with donated parameters
and optimizer state."""

import numpy as np
import pytest

import backplan as bp


@pytest.mark.reference
def test_cnn_digits_learns_in_one_compiled_donating_call():
    pytest.importorskip("sklearn")
    from backplan.examples import cnn_digits

    result = cnn_digits.train(epochs=1, batch_size=32, max_steps=30)
    losses = result["losses"]
    assert result["steps"] == 30 and np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    assert result["test_accuracy"] > 0.5  # chance is 0.1; 30 steps reach about 0.78
    assert cnn_digits.train_step.cache_info().traces == 1

    params = cnn_digits.init_params(bp.random.key(1))
    state = cnn_digits.OPTIMIZER.init(params)
    x_train, y_train, _, _ = cnn_digits.load_digits_split()
    batch = (bp.tensor(x_train[:32]), bp.tensor(y_train[:32]), bp.random.key(2))
    new_params, _, _, _ = cnn_digits.train_step(params, state, *batch)
    assert cnn_digits.train_step.cache_info().traces == 1
    with pytest.raises(bp.DonatedError):
        params["conv1_w"].numpy()
    assert new_params["conv1_w"].shape == (16, 1, 3, 3)


def test_char_model_loss_falls_and_samples_from_its_alphabet():
    from backplan.examples import char_model

    result = char_model.train(steps=30, batch_size=8, sample_length=5)
    losses = result["losses"]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3
    assert char_model.train_step.cache_info().traces == 1
    _, alphabet = char_model.corpus()
    assert len(result["sample"]) == 5 and set(result["sample"]) <= set(alphabet)


def test_char_model_sampling_is_reproducible_from_a_key():
    from backplan.examples import char_model

    data, alphabet = char_model.corpus()
    params = char_model.init_params(bp.random.key(0), len(alphabet))
    first = char_model.sample(params, alphabet, data[:32], 4, bp.random.key(5))
    again = char_model.sample(params, alphabet, data[:32], 4, bp.random.key(5))
    assert first == again and len(first) == 4


def test_the_digits_read_from_the_bundled_file_equal_scikit_learns_loader():
    """The example reads scikit-learn's CSV itself (importing scikit-learn took seconds)."""
    from sklearn.datasets import load_digits

    from backplan.examples import cnn_digits

    images, target = cnn_digits.load_digits()
    expected = load_digits()
    np.testing.assert_array_equal(images, expected.images)
    np.testing.assert_array_equal(target, expected.target)
    assert images.shape == (1797, 8, 8) and set(np.unique(target)) == set(range(10))


def test_mixed_precision_digits_match_float32_with_master_weights():
    pytest.importorskip("sklearn")
    from backplan.examples import mixed_precision

    results = mixed_precision.compare(epochs=1, batch_size=32, max_steps=30)
    for result in results.values():
        losses = result["losses"]
        assert np.all(np.isfinite(losses)) and np.mean(losses[-5:]) < np.mean(losses[:5])
        assert result["test_accuracy"] > 0.5  # chance is 0.1
    gap = results["bfloat16"]["test_accuracy"] - results["float32"]["test_accuracy"]
    assert abs(gap) <= 0.03  # 30 steps: 78.6% and 78.3% here (one image is 0.28 points)

    opt = mixed_precision.optimizer(bp.bfloat16)
    params = {"w": bp.tensor(np.ones(3, np.float32)).astype(bp.bfloat16)}
    state = opt.init(params)
    assert state["master"]["w"].dtype == np.float32
    grads = {"w": bp.tensor(np.full(3, 1e-3, np.float32)).astype(bp.bfloat16)}
    stepped, state = opt.update(grads, state, params)
    assert stepped["w"].dtype == bp.bfloat16
    assert np.all(state["master"]["w"].numpy() < 1.0)  # 1 - 3e-3 is kept in float32
