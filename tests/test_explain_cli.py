"""`python -m backplan explain script.py:function --args ...`: loading the user's script,
reading argument descriptions (literals only), printing the report, writing DOT and picture."""

import textwrap

import pytest

from backplan.__main__ import main

SCRIPT = textwrap.dedent("""
    import backplan as bp

    def mlp(params, x, labels, scale=1):
        h = bp.relu(x @ params["w0"] + params["b0"])
        return bp.cross_entropy(h @ params["w1"] * scale, labels)

    loss_and_grad = bp.value_and_grad(mlp)
    compiled = bp.compile(mlp)

    if __name__ == "__main__":
        raise SystemExit("the script's main block must not run")
""")
ARGS = [
    "--args",
    "params.w0=f32[8,16]:grad,params.b0=f32[16]:grad,params.w1=f32[16,4]:grad",
    "--args",
    "x=f32[5,8],labels=i64[5]",
]


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


def test_value_and_grad_flag_differentiates_the_arguments_marked_grad(script, capsys):
    assert main(["explain", f"{script}:mlp", *ARGS, "--value-and-grad"]) == 0
    text = capsys.readouterr().out
    assert "joint IR" in text and "%0 = params['w0']: f32[8,16], requires grad" in text


def test_static_values_reach_the_function(script, capsys):
    assert main(["explain", f"{script}:mlp", *ARGS, "--args", "scale=3"]) == 0
    assert "{value=3" in capsys.readouterr().out


def test_every_storage_dtype_has_a_spec(script, capsys):
    params = "params.w0=bf16[8,16]:grad,params.b0=bf16[16]:grad,params.w1=f16[16,4]:grad"
    assert (
        main(["explain", f"{script}:mlp", "--args", params, "--args", "x=bf16[5,8],labels=i32[5]"])
        == 0
    )
    out = capsys.readouterr().out
    assert "params['w0']: bf16[8,16]" in out and "params['w1']: f16[16,4]" in out
    assert "labels: i32[5]" in out


def test_float_values_are_traced_inputs(script, capsys):
    assert main(["explain", f"{script}:mlp", *ARGS, "--args", "scale=0.5"]) == 0
    assert "= scale: f64[]" in capsys.readouterr().out


@pytest.mark.parametrize(
    "spec, message",
    [
        ("x=__import__('os')", "not a type like f32[2,3] (dtypes"),
        ("x=c64[2]", "not a type like f32[2,3] (dtypes: bool, u8, i32, i64, f16"),
        ("x=f32[5,8],x=f32[3]", "x is given twice"),
        ("2x=f32[2]", "must look like name=f32[2,3]"),
    ],
)
def test_bad_specs_exit_2_with_the_reason(script, capsys, spec, message):
    assert main(["explain", f"{script}:mlp", "--args", ARGS[1], "--args", spec]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "target, args, message",
    [
        ("{script}:nope", ARGS, "has no attribute 'nope'"),
        ("{script}:mpl", ARGS, "has no attribute 'mpl'; did you mean mlp?"),
        ("{script}", ARGS, "must look like script.py:function"),
        ("{missing}:mlp", ARGS, "no such script"),
        (
            "{script}:mlp",
            [*(a.replace(":grad", "") for a in ARGS), "--value-and-grad"],
            "needs at least one argument marked :grad",
        ),
        ("{script}:mlp", ["--args", "x=f32[5,8]"], "describe parameter 'params'"),
        ("{script}:mlp", [*ARGS, "--args", "width=3"], "has no parameter(s) ['width']"),
    ],
)
def test_bad_command_lines_exit_2_with_the_reason(script, tmp_path, capsys, target, args, message):
    target = target.format(script=script, missing=tmp_path / "missing.py")
    assert main(["explain", target, *args]) == 2
    assert message in capsys.readouterr().err


DEEP = textwrap.dedent("""
    import backplan as bp

    def deep(params, x):
        for name in ("w0", "w1", "w2", "w3"):
            x = bp.tanh(x @ params[name])
        return bp.mean(x * x)
""")


def test_the_report_ends_its_memory_section_with_the_frontier(tmp_path, capsys):
    path = tmp_path / "deep.py"
    path.write_text(DEEP)
    specs = ",".join(f"params.w{i}=f32[16,16]:grad" for i in range(4)) + ",x=f32[64,16]"
    assert main(["explain", f"{path}:deep", "--args", specs, "--value-and-grad"]) == 0
    text = capsys.readouterr().out
    memory = text[text.index("4. Memory") : text.index("5. Kernels")]
    assert "memory frontier of deep:" in memory
    rows = [r for r in memory[memory.index("memory frontier of deep:") :].splitlines()[2:] if r]
    assert len(rows) >= 2 and rows[0].split()[-1] == "0" and int(rows[-1].split()[-1]) >= 1
