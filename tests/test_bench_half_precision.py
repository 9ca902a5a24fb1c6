"""The 16-bit step bench (backplan/bench/half_precision.py) runs the models whose loss it knows
and refuses the others before it compiles anything, naming the models it takes (a cnn ended
in a KeyError from inside its first compile)."""

import pytest

from backplan.bench import half_precision


@pytest.mark.parametrize("models", ["mlp,cnn", "lstm12", "nope"])
def test_a_model_it_cannot_time_is_refused_naming_those_it_can(models, capsys):
    with pytest.raises(SystemExit):
        half_precision.main(["--models", models])
    error = capsys.readouterr().err
    assert f"--models {models.split(',')[-1]}:" in error
    assert "ln_gelu, mlp, transformer" in error
