"""The training examples run on a small slice: a few steps each, loss finite, one trace per
training step function (each step is one compiled call)."""

import math

import numpy as np
import pytest


def test_cnn_digits_trains_a_few_steps_in_one_compiled_call():
    pytest.importorskip("sklearn")
    from backplan.examples import cnn_digits

    result = cnn_digits.train(epochs=1, batch_size=16, max_steps=4)
    assert result["steps"] == 4 and all(math.isfinite(v) for v in result["losses"])
    assert cnn_digits.train_step.cache_info().traces == 1
    assert 0.0 <= result["test_accuracy"] <= 1.0


def test_char_model_loss_falls_and_samples_from_its_alphabet():
    from backplan.examples import char_model

    result = char_model.train(steps=30, batch_size=8, sample_length=5)
    losses = result["losses"]
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    assert char_model.train_step.cache_info().traces == 1
    _, alphabet = char_model.corpus()
    assert len(result["sample"]) == 5 and set(result["sample"]) <= set(alphabet)
