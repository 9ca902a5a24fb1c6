"""bp.export / bp.load: artifacts that run forward and backward without the model's source, and
that refuse every kind of damage with an ExportError at load time."""

import collections
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest

import backplan as bp
from backplan.artifacts.format import sha256

MODEL_SOURCE = """
import numpy as np
import backplan as bp

OFFSET = bp.tensor(np.linspace(-1, 1, 8).astype(np.float32))  # captured by predict


@bp.compile
def predict(params, x, scale=2.0):
    h = bp.tanh(x @ params["w"] + params["b"] + OFFSET)
    return {"y": h * scale, "mean": h.mean()}


@bp.compile
def loss(params, x, target):
    return ((predict(params, x)["y"] - target) ** 2).mean()
"""


def run_fresh(code: str, cwd, timeout: int = 120) -> subprocess.CompletedProcess:
    """A fresh interpreter in an empty folder: -I keeps the model's folder off sys.path."""
    return subprocess.run(
        [sys.executable, "-I", "-c", textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model_src")
    (folder / "tinymodel.py").write_text(MODEL_SOURCE)
    spec = importlib.util.spec_from_file_location("tinymodel", folder / "tinymodel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    params = {
        "w": rng.standard_normal((6, 8)).astype(np.float32),
        "b": rng.standard_normal(8).astype(np.float32),
    }
    x = rng.standard_normal((5, 6)).astype(np.float32)
    target = rng.standard_normal((5, 8)).astype(np.float32)
    return params, x, target


def leaf_params(params):
    return {k: bp.tensor(v, requires_grad=True) for k, v in params.items()}


@pytest.fixture(scope="module")
def artifacts(model, data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("artifacts")
    params, x, target = data
    predict_path = bp.export(
        model.predict, leaf_params(params), x, 2.0, path=folder / "predict.bpz"
    )  # scale passed: traced, so the artifact takes any float for it
    step_path = bp.export(
        bp.value_and_grad(model.loss), params, x, target, path=folder / "step.bpz"
    )
    return {"predict": str(predict_path), "step": str(step_path)}


# ---- round trips ------------------------------------------------------------------------------


def test_fresh_process_without_model_source_matches_original(model, data, artifacts, tmp_path):
    params, x, target = data
    np.savez(tmp_path / "inputs.npz", w=params["w"], b=params["b"], x=x, target=target)
    result = run_fresh(
        f"""
        import numpy as np, backplan as bp
        try:
            import tinymodel
            raise SystemExit("the model module must not be importable here")
        except ModuleNotFoundError:
            pass
        inputs = np.load("inputs.npz", allow_pickle=False)
        params = {{k: bp.tensor(inputs[k], requires_grad=True) for k in ("w", "b")}}
        predict = bp.load({artifacts["predict"]!r})
        out = predict(params, inputs["x"])
        out["mean"].backward()
        step = bp.load({artifacts["step"]!r})
        value, grads = step({{k: inputs[k] for k in ("w", "b")}}, inputs["x"], inputs["target"])
        np.savez("outputs.npz", y=out["y"].numpy(), mean=out["mean"].numpy(),
                 gw=params["w"].grad.numpy(), gb=params["b"].grad.numpy(),
                 value=value.numpy(), step_gw=grads["w"].numpy(), step_gb=grads["b"].numpy())
    """,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    got = np.load(tmp_path / "outputs.npz", allow_pickle=False)

    original = leaf_params(params)
    out = model.predict(original, x)
    out["mean"].backward()
    value, grads = bp.value_and_grad(model.loss)(params, x, target)
    np.testing.assert_array_equal(got["y"], out["y"].numpy())
    np.testing.assert_array_equal(got["mean"], out["mean"].numpy())
    np.testing.assert_array_equal(got["gw"], original["w"].grad.numpy())
    np.testing.assert_array_equal(got["gb"], original["b"].grad.numpy())
    np.testing.assert_array_equal(got["value"], value.numpy())
    np.testing.assert_array_equal(got["step_gw"], grads["w"].numpy())
    np.testing.assert_array_equal(got["step_gb"], grads["b"].numpy())


def test_numba_backend_compiles_the_loaded_plan_into_the_cache_folder_only(
    model, data, artifacts, tmp_path
):
    """With the compiled backend, kernels are regenerated from the artifact's IR and written to
    the cache folder, nowhere else; results match the original's."""
    params, x, target = data
    np.savez(tmp_path / "inputs.npz", w=params["w"], b=params["b"], x=x, target=target)
    cache = tmp_path / "cache"
    code = f"""
        import numpy as np, backplan as bp
        from backplan.runtime.backend import current_backend
        assert current_backend() == "numba"
        inputs = np.load("inputs.npz", allow_pickle=False)
        step = bp.load({artifacts["step"]!r})
        value, grads = step({{k: inputs[k] for k in ("w", "b")}}, inputs["x"], inputs["target"])
        np.savez("outputs.npz", value=value.numpy(), gw=grads["w"].numpy(), gb=grads["b"].numpy())
    """
    env = {**os.environ, "BACKPLAN_BACKEND": "numba", "BACKPLAN_CACHE_DIR": str(cache)}
    result = subprocess.run(
        [sys.executable, "-I", "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert any(cache.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "inputs.npz", "outputs.npz"]
    got = np.load(tmp_path / "outputs.npz", allow_pickle=False)
    value, grads = bp.value_and_grad(model.loss)(params, x, target)
    np.testing.assert_allclose(got["value"], value.numpy(), rtol=1e-5)
    np.testing.assert_allclose(got["gw"], grads["w"].numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["gb"], grads["b"].numpy(), rtol=1e-4, atol=1e-6)


def test_loaded_gradients_match_float64_finite_differences(tmp_path):
    @bp.compile
    def energy(a, b):
        return (bp.tanh(a @ b) * bp.sigmoid(a).sum()).sum()

    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    loaded = bp.load(
        bp.export(bp.value_and_grad(energy, argnums=(0, 1)), a, b, path=tmp_path / "energy.bpz")
    )
    _, (ga, gb) = loaded(a, b)
    da, db = rng.standard_normal(a.shape), rng.standard_normal(b.shape)
    eps = 1e-6
    plus = loaded(a + eps * da, b + eps * db)[0].item()
    minus = loaded(a - eps * da, b - eps * db)[0].item()
    directional = (plus - minus) / (2 * eps)
    predicted = float((ga.numpy() * da).sum() + (gb.numpy() * db).sum())
    assert directional == pytest.approx(predicted, rel=1e-6, abs=1e-9)


def test_backward_frees_saved_buffers_and_second_backward_fails(artifacts, data):
    params, x, _ = data
    predict = bp.load(artifacts["predict"])
    out = predict(leaf_params(params), x)
    region = out["mean"].grad_fn
    assert region.saved_bytes == sum(b.nbytes for b in region.saved_buffers) > 0
    out["mean"].backward()
    assert region.saved_bytes == 0
    with pytest.raises(bp.GraphFreedError):
        out["y"].sum().backward()


def test_float_argument_and_dict_key_order(model, data, artifacts):
    """A Python float argument is traced, so the artifact takes any float for it."""
    params, x, _ = data
    predict = bp.load(artifacts["predict"])
    reordered = {"b": bp.tensor(params["b"]), "w": bp.tensor(params["w"])}
    expected = model.predict(leaf_params(params), x)["y"].numpy()
    np.testing.assert_array_equal(predict(reordered, x, 2.0)["y"].numpy(), expected)
    expected = model.predict(leaf_params(params), x, 3.0)["y"].numpy()
    np.testing.assert_array_equal(predict(reordered, x, scale=3.0)["y"].numpy(), expected)
    assert predict(reordered, x, 3.0)["y"].dtype == np.float32  # the float stays weak
    with pytest.raises(bp.ExportError, match=r"scale = a float.*3 of type int"):
        predict(reordered, x, scale=3)


def test_static_float_argument_keeps_its_value(tmp_path):
    @bp.compile(static_argnames=("scale",))
    def scaled(x, scale):
        return x * scale

    x = np.ones(3, np.float32)
    loaded = bp.load(bp.export(scaled, x, 2.0, path=tmp_path / "static.bpz"))
    np.testing.assert_array_equal(loaded(x, 2.0).numpy(), [2.0, 2.0, 2.0])
    with pytest.raises(bp.ExportError, match=r"scale = the static value 2\.0.*3\.0"):
        loaded(x, 3.0)


def test_a_float_default_not_passed_is_exported_as_its_value(tmp_path):
    @bp.compile
    def scaled(x, scale=2.0):
        return x * scale

    x = np.ones(3, np.float32)
    loaded = bp.load(bp.export(scaled, x, path=tmp_path / "default.bpz"))
    np.testing.assert_array_equal(loaded(x).numpy(), [2.0, 2.0, 2.0])
    with pytest.raises(bp.ExportError, match=r"scale = the static value 2\.0.*3\.0"):
        loaded(x, 3.0)


@pytest.mark.parametrize(
    "bad_call, message",
    [
        (lambda p, x: (p, x[:2]), r"x = a tensor f32\[5, 6\].*f32\[2, 6\]"),
        (lambda p, x: (p, x.astype(np.float64)), r"x = a tensor f32\[5, 6\].*f64\[5, 6\]"),
        (lambda p, x: ({"w": p["w"]}, x), r"params = a dict with keys \['b', 'w'\]"),
        (lambda p, x: (p, 1.5), r"x = a tensor f32\[5, 6\], but the call passed 1\.5"),
    ],
)
def test_call_that_does_not_match_the_export_is_refused(artifacts, data, bad_call, message):
    params, x, _ = data
    predict = bp.load(artifacts["predict"])
    with pytest.raises(bp.ExportError, match=message):
        predict(*bad_call(params, x))


def test_inputs_without_grad_run_forward_only(artifacts, data):
    params, x, _ = data
    predict = bp.load(artifacts["predict"])
    plain = {k: bp.tensor(v) for k, v in params.items()}
    assert predict(plain, x)["y"].grad_fn is None
    with bp.no_grad():
        assert predict(leaf_params(params), x)["y"].grad_fn is None
    half = {"w": bp.tensor(params["w"], requires_grad=True), "b": bp.tensor(params["b"])}
    predict(half, x)["mean"].backward()
    assert half["w"].grad is not None and half["b"].grad is None


def test_requires_grad_that_was_not_exported_is_refused(model, data, tmp_path):
    params, x, _ = data
    plain = {k: bp.tensor(v) for k, v in params.items()}
    loaded = bp.load(bp.export(model.predict, plain, x, path=tmp_path / "inference.bpz"))
    assert loaded.explain().backward_ir is None
    with pytest.raises(bp.ExportError, match=r"params\['w'\] requires grad"):
        loaded(leaf_params(params), x)


def test_loaded_function_inlines_into_an_enclosing_trace(model, data, artifacts):
    params, x, target = data
    predict = bp.load(artifacts["predict"])

    def loss_through_loaded(p, x, target):
        return ((predict(p, x)["y"] - target) ** 2).mean()

    value, grads = bp.value_and_grad(loss_through_loaded)(params, x, target)
    expected_value, expected = bp.value_and_grad(model.loss)(params, x, target)
    np.testing.assert_allclose(value.numpy(), expected_value.numpy(), rtol=1e-6)
    for name in params:
        np.testing.assert_allclose(grads[name].numpy(), expected[name].numpy(), rtol=1e-5)


def without_retracing(report) -> str:
    """The report text up to its retracing section, which depends on the caller's history,
    without the memory frontier, which only the function's own planner knows."""
    text = str(report).split(". Retracing\n")[0]
    return re.sub(r"\n  [Mm]emory frontier.*?(?=\n\n|\Z)", "", text, flags=re.S)


def test_example_args_signature_and_explain(model, artifacts, data):
    params, x, target = data
    predict = bp.load(artifacts["predict"])
    args, kwargs = predict.example_args()
    assert args[0]["w"].requires_grad and args[1].shape == x.shape and args[2] == 0.0
    assert predict.signature.startswith("predict(params: {'w': f32[6,8] requires_grad")
    report = predict.explain()  # the exported signature, every argument a tensor (a NumPy x
    # would be copied at the call and its copy counted: explain(*args) says so)
    original = bp.explain(model.predict, leaf_params(params), bp.tensor(x), 2.0)
    assert [b.name for b in report.saved_buffers] == [b.name for b in original.saved_buffers]
    assert report.saved_bytes == original.saved_bytes > 0
    assert report.peak_bytes == original.peak_bytes > 0
    assert "params['w']" in str(report) and "OFFSET (captured)" in str(report)
    # the float `scale` is an input now, and artifacts do not record which values the backward
    # recomputes, so the texts agree up to the summary
    assert str(report).split("1. Summary")[0] == str(original).split("1. Summary")[0]
    step = bp.load(artifacts["step"]).explain()
    original = bp.explain(bp.value_and_grad(model.loss), params, x, target)
    assert step.peak_bytes == original.peak_bytes > 0
    assert [b.name for b in step.saved_buffers] == [b.name for b in original.saved_buffers]
    assert without_retracing(step) == without_retracing(original)


Pair = collections.namedtuple("Pair", "w b")


def test_namedtuples_static_outputs_keyword_only_and_aux(tmp_path):
    @bp.compile
    def affine(p, x, *, mode="sum"):
        return Pair(bp.tanh(x @ p.w + p.b).sum(), 3), {"mode": mode}

    pair = Pair(
        bp.tensor(np.ones((3, 2), np.float32), requires_grad=True),
        bp.tensor(np.zeros(2, np.float32)),
    )
    x = np.full((4, 3), 0.1, np.float32)
    loaded = bp.load(bp.export(affine, pair, x, mode="mean", path=tmp_path / "affine.bpz"))
    (total, three), extra = loaded(pair, x, mode="mean")
    assert three == 3 and extra == {"mode": "mean"}
    np.testing.assert_array_equal(total.numpy(), affine(pair, x, mode="mean")[0][0].numpy())
    total.backward()
    assert pair.w.grad.shape == (3, 2)
    with pytest.raises(bp.ExportError, match="mode = the static value 'mean'"):
        loaded(pair, x)

    def loss(p, x, scale, target=None):
        y = bp.tanh(x @ p["w"]) * scale - target
        return (y**2).mean(), {"y": y}

    vg = bp.value_and_grad(loss, has_aux=True)
    params, target = {"w": np.ones((3, 2), np.float32)}, np.zeros((4, 2), np.float32)
    step = bp.load(bp.export(vg, params, x, 2.0, target=target, path=tmp_path / "aux.bpz"))
    (value, aux), grads = step(params, x, 2.0, target=target)
    (expected_value, expected_aux), expected = vg(params, x, 2.0, target=target)
    np.testing.assert_array_equal(value.numpy(), expected_value.numpy())
    np.testing.assert_array_equal(aux["y"].numpy(), expected_aux["y"].numpy())
    np.testing.assert_array_equal(grads["w"].numpy(), expected["w"].numpy())
    with pytest.raises(bp.ExportError, match=r"target = a tensor f32\[4, 2\]"):
        step(params, x, 2.0, target=target[:1])


def test_export_refuses_what_it_cannot_store(tmp_path):
    @bp.compile
    def with_dtype_arg(x, kind):
        return x * 2.0

    with pytest.raises(bp.ExportError, match="static value .* cannot be stored"):
        bp.export(with_dtype_arg, bp.tensor([1.0]), frozenset({1}), path=tmp_path / "a.bpz")
    with pytest.raises(bp.ExportError, match="needs a @bp.compile function"):
        bp.export(lambda x: x, bp.tensor([1.0]), path=tmp_path / "b.bpz")
    assert not list(tmp_path.iterdir())


# ---- damaged artifacts ------------------------------------------------------------------------


def read_members(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def write_members(path, members: dict[str, bytes], resign: bool = True) -> str:
    """Rewrite an artifact; with resign the manifest is updated, as a tamperer would."""
    members = dict(members)
    if resign:
        manifest = json.loads(members["manifest.json"])
        manifest["members"] = {
            n: {"sha256": sha256(d), "bytes": len(d)}
            for n, d in members.items()
            if n != "manifest.json"
        }
        members["manifest.json"] = json.dumps(manifest).encode()
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            method = zipfile.ZIP_STORED if name.endswith(".npy") else zipfile.ZIP_DEFLATED
            zf.writestr(name, data, compress_type=method)
    return str(path)


def edit_member(members, name, old: str, new: str) -> dict:
    text = members[name].decode()
    assert old in text, f"{old!r} not in {name}"
    return {**members, name: text.replace(old, new, 1).encode()}


def edit_json(members, name, change) -> dict:
    obj = json.loads(members[name])
    change(obj)
    return {**members, name: json.dumps(obj).encode()}


def expect_refused(path, *patterns):
    with pytest.raises(bp.ExportError) as info:
        bp.load(path)
    message = str(info.value)
    assert str(path) in message
    for pattern in patterns:
        assert pattern in message, message
    return message


@pytest.mark.parametrize("keep", [0, 10, 200, 0.5, -22, -1])
def test_truncated_artifact(artifacts, tmp_path, keep):
    data = open(artifacts["predict"], "rb").read()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data) if keep else 0
    path = tmp_path / "cut.bpz"
    path.write_bytes(data[:cut])
    expect_refused(path)


def test_flipped_byte_in_each_kind_of_member(artifacts, tmp_path):
    members = read_members(artifacts["predict"])
    kinds = {
        "meta.json",
        "ir/forward.txt",
        "ir/backward.txt",
        "plans/forward.json",
        "plans/backward.json",
        "arrays/captured_0.npy",
    }
    assert kinds <= set(members)
    for name in sorted(kinds):
        data = bytearray(members[name])
        data[len(data) // 2] ^= 0x01
        path = write_members(tmp_path / "flip.bpz", {**members, name: bytes(data)}, resign=False)
        expect_refused(path, name, "SHA-256")
    data = bytearray(members["manifest.json"])
    data[data.index(b'"sha256"') + 12] ^= 0x01  # inside a hash: now it lies about a member
    path = write_members(
        tmp_path / "flip.bpz", {**members, "manifest.json": bytes(data)}, resign=False
    )
    expect_refused(path, "SHA-256")


def test_raw_byte_flips_are_refused_or_harmless(artifacts, data, tmp_path):
    """Flip bytes anywhere in the file: a load either fails with ExportError or (when the byte
    was in a field nothing reads, like a timestamp) gives the very same results."""
    params, x, _ = data
    raw = open(artifacts["predict"], "rb").read()
    expected = bp.load(artifacts["predict"])(leaf_params(params), x)["y"].numpy()
    rng = np.random.default_rng(7)
    refused = 0
    for position in rng.choice(len(raw), size=150, replace=False):
        damaged = bytearray(raw)
        damaged[position] ^= 1 << int(rng.integers(8))
        path = tmp_path / "raw.bpz"
        path.write_bytes(bytes(damaged))
        try:
            loaded = bp.load(path)
        except bp.ExportError:
            refused += 1
            continue
        np.testing.assert_array_equal(loaded(leaf_params(params), x)["y"].numpy(), expected)
    assert refused > 100


def test_manifest_that_lies(artifacts, tmp_path):
    members = read_members(artifacts["predict"])
    path = tmp_path / "lie.bpz"

    def lie(change):
        return write_members(path, edit_json(members, "manifest.json", change), resign=False)

    expect_refused(
        lie(lambda m: m["members"]["meta.json"].update(sha256="0" * 64)), "meta.json", "SHA-256"
    )
    expect_refused(lie(lambda m: m["members"]["meta.json"].update(bytes=5)), "meta.json")
    expect_refused(
        lie(lambda m: m["members"].update({"arrays/extra.npy": {"sha256": "0" * 64, "bytes": 1}})),
        "listed but absent ['arrays/extra.npy']",
    )
    expect_refused(
        lie(lambda m: m["members"].pop("plans/forward.json")),
        "members not listed ['plans/forward.json']",
    )
    extra = {**members, "arrays/unused_9.npy": members["arrays/captured_0.npy"]}
    expect_refused(write_members(path, extra), "not used by meta.json")


@pytest.mark.parametrize(
    "version, message",
    [
        (2, "format version 2 was written by backplan"),
        (0, "unknown artifact format version 0"),
        ("1", "unknown artifact format version '1'"),
    ],
)
def test_wrong_or_newer_format_version(artifacts, tmp_path, version, message):
    members = edit_json(
        read_members(artifacts["predict"]),
        "manifest.json",
        lambda m: m.update(format_version=version),
    )
    expect_refused(write_members(tmp_path / "v.bpz", members, resign=False), message)


def test_not_an_artifact(tmp_path):
    path = tmp_path / "other.bpz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("hello.txt", "hi")
    expect_refused(path, "no manifest.json")
    path.write_text("just text")
    expect_refused(path, "truncated or corrupted zip")


def test_unknown_op_names(artifacts, tmp_path):
    members = read_members(artifacts["predict"])
    for fake, reported in (("evil_op", "evil_op"), ("os.system", "os"), ("input", "input")):
        edited = edit_member(members, "ir/forward.txt", "= tanh ", f"= {fake} ")
        expect_refused(
            write_members(tmp_path / "op.bpz", edited), "ir/forward.txt", f"unknown op {reported!r}"
        )


def test_absurd_shapes(artifacts, tmp_path):
    members = read_members(artifacts["predict"])
    path = tmp_path / "huge.bpz"
    huge = "1000000,1000000,1000"
    edited = edit_member(members, "ir/forward.txt", "%0: f32[6,8] arg", f"%0: f32[{huge}] arg")
    expect_refused(write_members(path, edited), "ir/forward.txt", "more than backplan accepts")
    edited = edit_json(members, "meta.json", lambda m: m["captured"][0].update(shape=[10**15]))
    expect_refused(write_members(path, edited), "more than backplan accepts")
    header_lie = members["arrays/captured_0.npy"].replace(b"(8,)", b"(10000000000000,)")
    edited = {**members, "arrays/captured_0.npy": header_lie}
    expect_refused(write_members(path, edited), "arrays/captured_0.npy")


def test_plan_that_needs_more_memory_than_allowed(artifacts):
    with pytest.raises(bp.ExportError, match="pass max_bytes= to load"):
        bp.load(artifacts["predict"], max_bytes=64)


def test_attribute_values_out_of_range(artifacts, tmp_path):
    members = read_members(artifacts["step"])
    cases = [
        ("axes=(0, 1)", "axes=(0, 7)", "out of range"),
        ("keepdims=False", "keepdims=3", "must be True or False"),
        ("keepdims=False", "keepdims=__import__('os')", "not a literal"),
    ]
    for old, new, message in cases:
        edited = edit_member(members, "ir/joint.txt", old, new)
        expect_refused(write_members(tmp_path / "attr.bpz", edited), "ir/joint.txt", message)


def test_edited_free_statements_and_facts(artifacts, tmp_path):
    members = read_members(artifacts["predict"])
    lines = members["ir/backward.txt"].decode().splitlines()
    free_at = next(i for i, line in enumerate(lines) if line.strip().startswith("free "))
    moved = (
        lines[:1] + [lines[free_at]] + [ln for i, ln in enumerate(lines) if i not in (0, free_at)]
    )
    edited = {**members, "ir/backward.txt": "\n".join(moved).encode()}
    expect_refused(write_members(tmp_path / "free.bpz", edited), "ir/backward.txt")
    edited = edit_json(members, "plans/forward.json", lambda f: f.update(peak_bytes=1))
    expect_refused(write_members(tmp_path / "facts.bpz", edited), "disagree with the IR")
    edited = edit_json(members, "meta.json", lambda m: m["region"].update(n_outputs=99))
    expect_refused(write_members(tmp_path / "meta.bpz", edited), "n_outputs 99")


def test_a_joint_plan_keeps_its_saved_reasons_and_refuses_edited_ones(artifacts, tmp_path):
    """Why the joint plan holds each value is stored with its facts (the loader cannot
    differentiate again to learn it); a reason naming no value of the plan is refused."""
    members = read_members(artifacts["step"])
    reasons = json.loads(members["plans/joint.json"])["reasons"]
    assert "tanh derivative reads its output" in reasons.values()
    loaded = bp.load(artifacts["step"])
    assert set(loaded.plan.graph.reasons.values()) == set(reasons.values())
    edited = edit_json(members, "plans/joint.json", lambda f: f["reasons"].update({"%999": "x"}))
    expect_refused(write_members(tmp_path / "reasons.bpz", edited), "reasons do not name")


def test_npy_holding_a_pickle_is_never_unpickled(artifacts, tmp_path):
    marker = tmp_path / "pickle_ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buffer = io.BytesIO()
    np.save(buffer, np.array([Payload()], dtype=object), allow_pickle=True)
    members = {**read_members(artifacts["predict"]), "arrays/captured_0.npy": buffer.getvalue()}
    expect_refused(
        write_members(tmp_path / "pickle.bpz", members), "arrays/captured_0.npy", "dtype object"
    )
    assert not marker.exists()


@pytest.mark.parametrize(
    "name",
    [
        "../escaped.npy",
        "/tmp/escaped.npy",
        "arrays/../../x.npy",
        "arrays\\..\\x.npy",
        "ARRAYS/X.npy",
    ],
)
def test_member_path_escaping_the_folder(artifacts, tmp_path, name):
    inner = tmp_path / "inner"
    inner.mkdir()
    members = {**read_members(artifacts["predict"]), name: b"\x93NUMPY"}
    path = write_members(inner / "slip.bpz", members)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    expect_refused(path, "is not allowed")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert not os.path.exists("/tmp/escaped.npy")


def test_bad_artifacts_in_a_fresh_process_write_and_run_nothing(artifacts, tmp_path):
    members = read_members(artifacts["predict"])
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    edited = edit_member(members, "ir/forward.txt", "= tanh ", "= evil_op ")
    write_members(sandbox / "bad_op.bpz", edited)
    write_members(sandbox / "slip.bpz", {**members, "../escaped.txt": b"x"})
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    result = run_fresh(
        """
        import backplan as bp
        for name in ("bad_op.bpz", "slip.bpz"):
            try:
                bp.load(name)
            except bp.ExportError as exc:
                print("refused:", exc)
    """,
        cwd=sandbox,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("refused:") == 2
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


# ---- command line -----------------------------------------------------------------------------


def test_export_and_inspect_commands(model, tmp_path):
    script = tmp_path / "src" / "tinymodel.py"
    script.parent.mkdir()
    script.write_text(MODEL_SOURCE)
    work = tmp_path / "work"
    work.mkdir()
    spec = "params.w=f32[6,8]:grad,params.b=f32[8]:grad,x=f32[5,6],target=f32[5,8]"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "backplan",
            "export",
            f"{script}:loss",
            "--value-and-grad",
            "--args",
            spec,
            "-o",
            "step.bpz",
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "signature: value_and_grad(loss, argnums=0)(params: {'w': f32[6,8]" in result.stdout
    result = subprocess.run(
        [sys.executable, "-m", "backplan", "inspect", "step.bpz"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    loaded = bp.load(work / "step.bpz")
    for name, size in loaded.member_sizes.items():
        assert f"{name}" in result.stdout and f"{size} B" in result.stdout
    report = loaded.explain()
    assert f"peak bytes: {report.peak_bytes:,} (the arrays passed in included" in result.stdout
    assert f"peak: {report.peak_bytes:,} B" in result.stdout  # the same number as the report's
    assert f"saved for backward: {len(report.saved_buffers)} buffer(s)" in result.stdout
    (work / "bad.bpz").write_bytes((work / "step.bpz").read_bytes()[:100])
    result = subprocess.run(
        [sys.executable, "-m", "backplan", "inspect", "bad.bpz"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "invalid artifact" in result.stderr


@pytest.mark.parametrize(
    "spec, message",
    [
        ("x=f32[2,", "not a type like f32[2,3]"),
        ("=3", "must look like name="),
        ("x.=3", "must look like name="),
        ("x=c64[2]", "not a type like f32[2,3]"),
        ("x=__import__('os')", "not a type like f32[2,3]"),
        ("x=[1, 2]", "only numbers, strings and booleans"),
        ("x=1,x=2", "given twice"),
    ],
)
def test_export_command_argument_spec_errors(spec, message):
    from backplan.export_cli import parse_arg_spec

    with pytest.raises(bp.ExportError, match=message.replace("[", r"\[")):
        parse_arg_spec(spec)


def test_export_command_argument_spec():
    from backplan.export_cli import parse_arg_spec

    parsed = parse_arg_spec('p.w=f32[2,3]:grad, p.b=f32[3], n=3, mode="sum", s=f64[]')
    assert parsed["p"]["w"].shape == (2, 3) and parsed["p"]["w"].requires_grad
    assert not parsed["p"]["b"].requires_grad and parsed["p"]["b"].dtype == np.float32
    assert parsed["n"] == 3 and parsed["mode"] == "sum" and parsed["s"].shape == ()


def with_this_python_first() -> dict:
    """The environment where the guide's `python` is the interpreter running the tests (a venv
    not activated is not first on PATH)."""
    folder = os.path.dirname(sys.executable)
    return {**os.environ, "PATH": folder + os.pathsep + os.environ.get("PATH", "")}


def test_the_guides_export_commands_train_from_the_copied_file(tmp_path):
    """The export guide's commands, exactly as written: export the demo step, inspect it, copy
    the file to another folder and train with it in a fresh interpreter."""
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "export.md")).read()
    section = page[page.index("## From the command line") :]
    script = section.split("```bash\n", 1)[1].split("\n```", 1)[0]
    result = subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=with_this_python_first(),
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "elsewhere" / "mlp_step.bpz").exists()
    losses = [
        float(line.split()[-1]) for line in result.stdout.splitlines() if line.startswith("step ")
    ]
    assert len(losses) == 5 and losses[-1] < 0.5 * losses[0]


def test_artifact_holds_the_compiled_memory_plan(artifacts, data):
    """plans/*.json carry the memory plan (scratch arena sizes, where every buffer lives); the
    loader recomputes it from the IR and it must agree."""
    with zipfile.ZipFile(artifacts["step"]) as archive:
        facts = json.loads(archive.read("plans/joint.json"))
    memory = facts["memory_plan"]
    assert memory["compiled"] and memory["kernels"] >= 1
    kinds = {where[0] for where in memory["buffers"].values()}
    assert "output" in kinds and "scratch" in kinds and set(memory["scratch_elements"]) == {"f32"}
    bp.load(artifacts["step"])  # recomputes the facts from the IR; a mismatch would refuse it


def test_a_value_and_grad_artifact_names_the_keyword_arguments_it_takes(tmp_path):
    def loss(w, x, scale=1.0):
        return bp.sum((x @ w) * scale)

    w, x = bp.tensor(np.ones((3, 2), np.float32)), bp.tensor(np.ones((4, 3), np.float32))
    plain = bp.load(bp.export(bp.value_and_grad(loss), w, x, path=tmp_path / "plain.bpz"))
    assert plain(w, x)[0].item() == 24.0
    with pytest.raises(bp.ExportError, match=r"keyword argument\(s\) none .* passed \['scale'\]"):
        plain(w, x, scale=1.0)
    scaled = bp.load(
        bp.export(bp.value_and_grad(loss), w, x, scale=2.0, path=tmp_path / "scaled.bpz")
    )
    assert scaled(w, x, scale=3.0)[0].item() == 72.0  # a passed float is traced
    with pytest.raises(bp.ExportError, match=r"keyword argument\(s\) \['scale'\] .* passed none"):
        scaled(w, x)


def test_loading_a_folder_says_it_is_a_folder(tmp_path):
    """bp.load of a folder said `no such artifact file`, as if nothing were there."""
    with pytest.raises(bp.ExportError, match="a folder, not an artifact file"):
        bp.load(tmp_path)
    with pytest.raises(bp.ExportError, match="no such artifact file"):
        bp.load(tmp_path / "missing.bpz")
