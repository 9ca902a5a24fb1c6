"""`python -m backplan explain script.py:function --args ...`: loading the user's script,
reading argument descriptions (literals only), printing the report, writing DOT and picture."""

import textwrap

import pytest

import backplan as bp
from backplan.__main__ import main
from backplan.explain_cli import parse_specs, split_specs

SCRIPT = textwrap.dedent("""
    import backplan as bp

    def mlp(params, x, labels, scale=1.0):
        h = bp.relu(x @ params["w0"] + params["b0"])
        return bp.cross_entropy(h @ params["w1"] * scale, labels)

    loss_and_grad = bp.value_and_grad(mlp)
    compiled = bp.compile(mlp)

    if __name__ == "__main__":
        raise SystemExit("the script's main block must not run")
""")
ARGS = ["--args", "params.w0=f32[8,16]:grad,params.b0=f32[16]:grad,params.w1=f32[16,4]:grad",
        "--args", "x=f32[5,8],labels=i64[5]"]


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(SCRIPT)
    return path


def test_explain_prints_the_report_of_a_function_in_a_file(script, capsys):
    assert main(["explain", f"{script}:mlp", *ARGS]) == 0
    text = capsys.readouterr().out
    assert text.startswith("explain: mlp")
    assert "%0 = params['w0']: f32[8,16], requires grad" in text
    assert "x *" in text and "model.py:5" in text


@pytest.mark.parametrize("name", ["compiled", "loss_and_grad"])
def test_compiled_and_value_and_grad_objects_are_explained_as_they_are(script, capsys, name):
    assert main(["explain", f"{script}:{name}", *ARGS]) == 0
    text = capsys.readouterr().out
    assert ("joint IR" in text) == (name == "loss_and_grad")


def test_dot_and_picture_are_written(script, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    dot, png = tmp_path / "step.dot", tmp_path / "step.png"
    assert main(["explain", f"{script}:mlp", *ARGS, "--dot", str(dot), "--plot", str(png)]) == 0
    assert dot.read_text().startswith('digraph "mlp"')
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in capsys.readouterr().out


def test_specs_build_tensors_dicts_and_static_values():
    tree = parse_specs(["x=f32[2,3]:grad, p.w=f64[4], n=3", "eps=1e-5,flag=true,s=i64[]"])
    assert tree["x"].shape == (2, 3) and tree["x"].requires_grad
    assert tree["p"]["w"].dtype == "float64" and not tree["p"]["w"].requires_grad
    assert (tree["n"], tree["eps"], tree["flag"]) == (3, 1e-5, True)
    assert tree["s"].shape == () and tree["s"].dtype == "int64"
    assert split_specs("a=f32[1,2],b=3") == ["a=f32[1,2]", "b=3"]


@pytest.mark.parametrize("spec, message", [
    ("x=__import__('os')", "not a tensor description"),
    ("x=f16[2]", "unknown dtype 'f16'"),
    ("x=i64[2]:grad", "only f32 and f64 tensors can require grad"),
    ("x=f32[2],x=f32[3]", "x is described twice"),
    ("2x=f32[2]", "should look like name=f32"),
])
def test_bad_specs_are_clear_errors(spec, message):
    with pytest.raises(bp.BackplanError, match=message.replace("[", r"\[")):
        parse_specs([spec])


@pytest.mark.parametrize("target, args, message", [
    ("{script}:nope", ARGS, "has no attribute 'nope'"),
    ("{script}", ARGS, "path/to/script.py:function"),
    ("{missing}:mlp", ARGS, "no such script"),
    ("{script}:mlp", ["--args", "x=f32[5,8]"], "describe parameter 'params'"),
    ("{script}:mlp", [*ARGS, "--args", "width=3"], "has no parameter(s) ['width']"),
])
def test_bad_command_lines_exit_2_with_the_reason(script, tmp_path, capsys, target, args,
                                                  message):
    target = target.format(script=script, missing=tmp_path / "missing.py")
    assert main(["explain", target, *args]) == 2
    assert message in capsys.readouterr().err
