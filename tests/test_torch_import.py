"""bp.from_torch on whole models: a small ResNet (batch norm in training and eval), a GPT-style
decoder block, an MLP-Mixer and nn.TransformerEncoderLayer import, run and match torch's forward
and gradients; optimizer steps match torch.optim; the weights go back with to_state_dict; the
plan names module paths and source lines."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch: pip install 'backplan[torch]'")

import torch_models as tm  # noqa: E402
from torch_check import ATOL, RTOL, compare  # noqa: E402

import backplan as bp  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _images():
    return torch.randn(2, 3, 8, 8)


def test_mlp_mixer_forward_and_gradients():
    compare(tm.MLPMixer(), _images())


def test_transformer_encoder_layer_forward_and_gradients():
    compare(tm.transformer_layer(), torch.randn(2, 5, 16))


def test_gpt_decoder_block_forward_and_gradients():
    compare(tm.DecoderBlock(), torch.randint(0, 11, (2, 8)))


def test_resnet_eval_forward_and_gradients():
    compare(tm.SmallResNet().eval(), _images())


def test_resnet_training_returns_new_running_statistics():
    module = tm.SmallResNet()
    x = _images()
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    fn, params = compare(module, x, train_buffers=True)  # torch's forwards move its statistics
    np.testing.assert_array_equal(params["bn.running_var"].numpy(), np.ones(4))  # copied
    out, new_buffers = fn(params, bp.tensor(x.numpy()))
    assert set(new_buffers) == {n for n, _ in module.named_buffers()}
    module.load_state_dict(initial)
    module(x)  # one step of torch's running statistics from the same start
    for name, value in new_buffers.items():
        np.testing.assert_allclose(
            value.numpy(), module.state_dict()[name].numpy(), rtol=RTOL, atol=ATOL
        )
    assert new_buffers["bn.num_batches_tracked"].item() == 1


def test_parameters_share_memory_with_the_module():
    module = tm.MLPMixer()
    _, params = bp.from_torch(module, (_images(),))
    assert set(params) == set(module.state_dict())
    assert np.shares_memory(params["head.weight"].numpy(), module.head.weight.detach().numpy())
    assert not params["head.weight"].requires_grad  # value_and_grad needs no flag


def test_sgd_steps_inside_compile_match_torch_optim():
    module, x = tm.MLPMixer(), _images()
    y = torch.tensor([1, 4])
    fn, params = bp.from_torch(module, (x,))
    opt = bp.optim.sgd(0.1, momentum=0.9)
    state = opt.init(params)

    @bp.compile
    def step(params, state, x, y):
        loss, grads = bp.value_and_grad(lambda p: bp.cross_entropy(fn(p, x), y))(params)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    torch_opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        params, state, loss = step(params, state, x.numpy(), y.numpy())
        torch_opt.zero_grad()
        ref = torch.nn.functional.cross_entropy(module(x), y)
        ref.backward()
        torch_opt.step()
        np.testing.assert_allclose(loss.item(), ref.item(), rtol=RTOL)
    assert step.cache_info().traces == 1
    fresh = tm.MLPMixer()
    fresh.load_state_dict(bp.to_state_dict(params))
    for name, p in fresh.named_parameters():
        np.testing.assert_allclose(
            p.detach().numpy(), module.get_parameter(name).detach().numpy(), rtol=RTOL, atol=ATOL
        )


def test_dropout_draws_from_the_key():
    module = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Dropout(0.5))
    x = torch.randn(3, 4)
    fn, params = bp.from_torch(module, (x,))
    with pytest.raises(bp.TorchImportError, match=r"training mode and has 1 dropout.*key="):
        fn(params, x.numpy())
    a = fn(params, x.numpy(), key=bp.random.key(0)).numpy()
    b = fn(params, x.numpy(), key=bp.random.key(0)).numpy()
    c = fn(params, x.numpy(), key=bp.random.key(1)).numpy()
    kept = module[0](x).detach().numpy() * 2.0
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    dropped = a == 0
    assert 0.2 < dropped.mean() < 0.8
    np.testing.assert_allclose(a[~dropped], kept[~dropped], rtol=RTOL)
    eval_fn, _ = bp.from_torch(module.eval(), (x,))
    np.testing.assert_allclose(eval_fn(params, x.numpy()).numpy(), kept / 2, rtol=RTOL)


def test_explain_names_module_paths_and_lines():
    module = tm.SmallResNet().eval()
    x, y = _images(), np.array([1, 3])
    fn, params = bp.from_torch(module, (x,))
    train = {k: params[k] for k in fn.parameter_names}
    buffers = {k: params[k] for k in fn.buffer_names}
    vg = bp.value_and_grad(lambda p, b, x, y: bp.cross_entropy(fn({**p, **b}, x), y))
    text = str(bp.explain(vg, train, buffers, x.numpy(), y))
    conv1, down = _line("self.bn1(self.conv1(x))"), _line("self.down(x)")
    assert f"conv2d at layer2.0.conv1 at torch_models.py:{conv1}" in text
    assert f"at layer2.0.down.0 at torch_models.py:{down}" in text


def _line(text: str) -> int:
    lines = open(tm.__file__).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


MODEL_FILE = """
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 2 * 2, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        return self.fc(x.flatten(1))
"""


def test_explain_command_prints_the_training_step_of_a_module_file(tmp_path, capsys):
    from backplan.__main__ import main

    (tmp_path / "mymodel.py").write_text(MODEL_FILE)
    target = f"{tmp_path / 'mymodel.py'}:Net"
    args = ["explain", "--torch", target, "--args", "x: f32[8,3,4,4]", "--loss", "cross_entropy"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert text.startswith("explain: Net_train_step")
    assert "params['conv1.weight']" in text and "target" in text
    assert "conv2d at conv1 at mymodel.py:14" in text  # a saved buffer, named by module and line
    with pytest.raises(SystemExit):  # argparse names the losses there are
        main([*args[:-1], "nll"])


def test_explain_command_takes_a_bfloat16_input(tmp_path, capsys):
    """`--args "x: bf16[...]"` raised a traceback: torch.from_numpy takes no ml_dtypes array."""
    from backplan.__main__ import main

    (tmp_path / "half.py").write_text(
        "import torch\n\n\n"
        "def Net():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(6, 4)).to(torch.bfloat16)\n"
    )
    args = ["explain", "--torch", f"{tmp_path / 'half.py'}:Net", "--args", "input: bf16[5,6]"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "inputs['input']: bf16[5,6]" in text and "params['0.weight']: bf16[4,6]" in text


# the model the README and docs/interop.md describe (conv1 -> bn1 -> relu -> max_pool2d, conv2 ->
# relu -> max_pool2d, fc), its forward on lines 14-16 as their tables name them
GUIDE_MODEL_FILE = """import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))
"""


def test_the_guides_explain_torch_tables_are_what_the_command_prints(tmp_path, capsys):
    """README's and docs/interop.md's saved-buffer rows (the README cuts the read-by column)
    are rows the command prints now, on the numba backend (explain compiles nothing)."""
    import re

    from test_docs import ROOT

    from backplan.__main__ import main
    from backplan.runtime.backend import use_backend

    (tmp_path / "mymodel.py").write_text(GUIDE_MODEL_FILE)
    args = ["--args", "x: f32[32,3,32,32]", "--loss", "cross_entropy"]
    with use_backend("numba"):
        assert main(["explain", "--torch", f"{tmp_path / 'mymodel.py'}:Net", *args]) == 0
    printed = capsys.readouterr().out.split("\n3. Saved buffers ")[1].split("\n  fN")[0]
    printed_rows = [re.split(r"\s{2,}", line.strip()) for line in printed.splitlines()[1:]]
    for page in ("README.md", "docs/interop.md"):
        text = (ROOT / page).read_text()
        command = 'explain --torch mymodel.py:Net --args "x: f32[32,3,32,32]" --loss cross_entropy'
        assert command in text
        shown = text.split("```text\n3. Saved buffers ")[1].split("\n```")[0].splitlines()
        assert shown[0] == printed.splitlines()[0], page  # the count and total
        columns = re.split(r"\s{2,}", shown[1].strip())
        for line in shown[2:]:
            row = re.split(r"\s{2,}", line.strip())
            match = next(r for r in printed_rows if r[0] == row[0])
            if len(columns) < len(printed_rows[0]):  # the read-by column cut
                match = match[:4] + match[5:]
            assert row == match, (page, row, match)


def test_the_guides_from_pytorch_block_runs(tmp_path, monkeypatch):
    from test_docs import ROOT, python_blocks, run_blocks

    blocks = [b for b in python_blocks(ROOT / "docs" / "interop.md") if "bp.from_torch" in b.code]
    assert len(blocks) == 1 and blocks[0].skip  # skipped by test_docs, which runs without torch
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    run_blocks([blocks[0].__class__(blocks[0].page, blocks[0].line, blocks[0].code)], namespace)
    assert namespace["loss"].item() < 1.0  # trained: it starts near log(4) = 1.39
    np.testing.assert_array_equal(
        namespace["model"][0].weight.detach().numpy(), namespace["params"]["0.weight"].numpy()
    )
    assert sorted(bp.load_safetensors("model.safetensors")) == sorted(namespace["params"])


def test_imported_function_exports_and_loads_without_torch_code(tmp_path):
    module = tm.MLPMixer().eval()
    x = _images()
    fn, params = bp.from_torch(module, (x,))
    path = bp.export(bp.compile(fn), params, x.numpy(), path=tmp_path / "mixer.bpz")
    loaded = bp.load(path)
    np.testing.assert_allclose(
        loaded(params, x.numpy()).numpy(), module(x).detach().numpy(), rtol=RTOL, atol=ATOL
    )


def test_imported_function_called_from_two_threads():
    from concurrent.futures import ThreadPoolExecutor

    module = tm.transformer_layer().eval()
    xs = [torch.randn(2, 5, 16) for _ in range(4)]
    fn, params = bp.from_torch(module, (xs[0],))
    grad = bp.value_and_grad(lambda p, x: fn(p, x).sum())
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda x: grad(params, x.numpy()), xs * 2))
    for x, (loss, grads) in zip(xs * 2, results, strict=True):
        module.zero_grad()
        ref = module(x).sum()
        ref.backward()
        np.testing.assert_allclose(loss.item(), ref.item(), rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(
            grads["linear1.weight"].numpy(),
            module.linear1.weight.grad.numpy(),
            rtol=RTOL,
            atol=ATOL,
        )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_modules_import_in_their_dtype(dtype):
    torch_dtype = getattr(torch, dtype)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    module = module.to(torch_dtype)
    x = torch.randn(3, 8).to(torch_dtype)
    fn, params = bp.from_torch(module, (x,))
    assert params["0.weight"].dtype == np.dtype(dtype)
    out = fn(params, x.float().numpy().astype(np.dtype(dtype)))
    assert out.dtype == np.dtype(dtype)
    # the torch input itself: a bfloat16 one has no NumPy view np.asarray takes (torch raised
    # "Got unsupported ScalarType BFloat16"); it is read through DLPack
    np.testing.assert_array_equal(fn(params, x).numpy(), out.numpy())
    ref = module(x).float().detach().numpy()
    ulp = {"float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]  # per op rounding may differ
    np.testing.assert_allclose(out.numpy().astype(np.float32), ref, atol=4 * ulp * abs(ref).max())


def test_explain_command_refuses_inputs_not_named_as_forwards_parameters(tmp_path, capsys):
    """They go to forward by position: `y` for forward(self, x) labelled the plan's input y."""
    from backplan.__main__ import main

    (tmp_path / "mymodel.py").write_text(MODEL_FILE)
    target = f"{tmp_path / 'mymodel.py'}:Net"
    assert main(["explain", "--torch", target, "--args", "y: f32[8,3,4,4]"]) != 0
    error = capsys.readouterr().err
    assert "--args names y, but Net.forward takes (x)" in error
