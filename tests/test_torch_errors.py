"""What from_torch refuses, each with torch's reason or backplan's, and the user's line: ops
without a mapping (all of them in one error), control flow and shapes torch.export cannot
capture, in-place changes other than batch norm's statistics, complex and sparse tensors, and
params or inputs that do not match the import."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch: pip install 'backplan[torch]'")

from torch import nn  # noqa: E402

import backplan as bp  # noqa: E402


class Unmapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.topk(self.fc(x), 2, 1).values  # UNMAPPED-1
        return torch.sort(y, 1).values + torch.fmod(y, 0.5)  # UNMAPPED-2


def _line(marker: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if marker in line)


def test_every_unmapped_op_is_named_with_its_line():
    with pytest.raises(bp.TorchImportError) as info:
        bp.from_torch(Unmapped(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "3 op(s) of Unmapped have no backplan mapping" in message
    assert f"aten.topk.default at Unmapped at test_torch_errors.py:{_line('UNMAPPED-1')}" in message
    assert f"aten.sort.default at Unmapped at test_torch_errors.py:{_line('UNMAPPED-2')}" in message
    assert "aten.fmod" in message


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # DATA-DEPENDENT
            return x * 2
        return x


class Masked(nn.Module):
    def forward(self, x):
        return x[x > 0].sum()


def test_control_flow_torch_export_cannot_capture_gives_torch_reason_and_line():
    with pytest.raises(bp.TorchImportError) as info:
        bp.from_torch(Branchy(), (torch.randn(3),))
    message = str(info.value)
    assert message.startswith("from_torch: torch.export could not capture Branchy.forward at ")
    assert f"test_torch_errors.py:{_line('DATA-DEPENDENT')}" in message
    assert "data-dependent" in message.lower() or "control flow" in message.lower()


def test_data_dependent_shapes_are_refused():
    with pytest.raises(bp.TorchImportError) as info:
        bp.from_torch(Masked(), (torch.randn(5),))
    assert "Masked computes a value whose shape depends on the data" in str(info.value)
    assert f"test_torch_errors.py:{_line('x[x > 0]')}" in str(info.value)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1  # BUFFER-MUTATION
        return x * 2


class InputMutation(nn.Module):
    def forward(self, x):
        x.add_(1)
        return x * 2


def test_in_place_buffer_mutation_other_than_batch_norm_is_refused():
    with pytest.raises(bp.TorchImportError, match=r"changes its buffer calls in place at .*only"):
        bp.from_torch(Counter(), (torch.randn(3),))


def test_in_place_input_mutation_is_refused():
    with pytest.raises(bp.TorchImportError, match=r"changes its input x in place.*immutable"):
        bp.from_torch(InputMutation(), (torch.randn(3),))


def test_complex_and_sparse_tensors_are_refused():
    lin = nn.Linear(2, 2)
    with pytest.raises(bp.TorchImportError, match="argument 0 is torch.complex64"):
        bp.from_torch(lin, (torch.randn(2, 2, dtype=torch.complex64),))
    with pytest.raises(bp.TorchImportError, match="argument 0 is a torch.sparse_coo tensor"):
        bp.from_torch(lin, (torch.randn(2, 2).to_sparse(),))


def test_params_with_missing_or_extra_keys_are_named():
    lin = nn.Linear(2, 3)
    fn, params = bp.from_torch(lin, (torch.randn(4, 2),))
    x = np.ones((4, 2), np.float32)
    broken = {"weight": params["weight"], "scale": params["bias"]}
    with pytest.raises(bp.TorchImportError, match=r"missing \['bias'\], unexpected \['scale'\]"):
        fn(broken, x)
    with pytest.raises(
        bp.TorchImportError, match=r"params\['bias'\] is float32\[2\].*float32\[3\]"
    ):
        fn({**params, "bias": bp.zeros((2,))}, x)


def test_inputs_of_another_shape_say_to_import_again():
    fn, params = bp.from_torch(nn.Linear(2, 3), (torch.randn(4, 2),))
    with pytest.raises(bp.TorchImportError, match=r"input 0 is float32\[5, 2\].*float32\[4, 2\]"):
        fn(params, np.ones((5, 2), np.float32))


def test_state_dict_goes_back_and_refuses_other_trees():
    lin = nn.Linear(2, 3)
    _, params = bp.from_torch(lin, (torch.randn(4, 2),))
    doubled = {k: v * 2.0 for k, v in params.items()}
    state = bp.to_state_dict(doubled)
    fresh = nn.Linear(2, 3)
    fresh.load_state_dict(state)
    np.testing.assert_allclose(fresh.weight.detach().numpy(), 2 * lin.weight.detach().numpy())
    with pytest.raises(bp.TorchImportError, match="flat {state_dict name: tensor} dict"):
        bp.to_state_dict([params["weight"]])


class Scaled(nn.Module):
    def forward(self, x, n: int, scale: float = 2.0):
        return x * scale + n


def test_python_arguments_are_fixed_at_import_and_checked_at_calls():
    x = torch.randn(2, 3)
    fn, params = bp.from_torch(Scaled(), (x, 3), {"scale": 0.5})
    np.testing.assert_allclose(fn(params, x.numpy(), 3, scale=0.5).numpy(), x.numpy() * 0.5 + 3)
    with pytest.raises(bp.TorchImportError, match="input 1 is 4, the module was imported with 3"):
        fn(params, x.numpy(), 4, scale=0.5)
    called = r"called with 2 positional argument\(s\), imported with 2 .* keywords \['scale'\]"
    with pytest.raises(bp.TorchImportError, match=called):
        fn(params, x.numpy(), 3)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)  # float32

    def forward(self, x):
        return self.fc(x)  # MIXED


def test_a_product_of_two_dtypes_torch_refuses_is_refused_with_the_line():
    """torch.export takes a float32 Linear on a bfloat16 input, which torch's own call refuses
    ('mat1 and mat2 must have the same dtype'); the imported function computed it in float32."""
    x = torch.randn(5, 6).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="same dtype"):
        Mixed()(x)
    fn, params = bp.from_torch(Mixed(), (x,))
    with pytest.raises(bp.TorchImportError) as info:
        fn(params, bp.from_dlpack(x))
    message = str(info.value)
    assert "addmm of f32[4], bf16[5,6], f32[6,4]" in message, message
    assert f"at fc at test_torch_errors.py:{_line('# MIXED')}" in message
    fn, params = bp.from_torch(Mixed().to(torch.bfloat16), (x,))  # one dtype: imported
    assert fn(params, bp.from_dlpack(x)).dtype == bp.bfloat16
