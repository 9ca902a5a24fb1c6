"""Each ATen op family from_torch maps, checked against torch: forward values and gradients of
the parameters and float inputs (rtol 1e-4 in float32). Ops are grouped into small functions so
one export covers several."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch: pip install 'backplan[torch]'")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch_check import compare  # noqa: E402

import backplan as bp  # noqa: E402


class Fn(nn.Module):
    """A module around a function of its inputs (and an optional weight)."""

    def __init__(self, fn, *weights):
        super().__init__()
        self.fn = fn
        self.w = nn.ParameterList([nn.Parameter(w) for w in weights])

    def forward(self, *xs):
        return self.fn(*xs, *self.w)


def r(*shape):
    return torch.randn(*shape)


CASES = {
    "linear_addmm_mm_bmm_matmul": (
        Fn(
            lambda x, w, b: F.linear(x, w, b) @ w + torch.bmm(x, x.transpose(1, 2)) @ x,
            r(3, 3),
            r(3),
        ),  # fmt: skip
        [r(2, 4, 3)],
    ),
    "conv2d_stride_padding_dilation": (
        Fn(lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=2, dilation=2), r(4, 3, 3, 3), r(4)),
        [r(2, 3, 9, 9)],
    ),
    "conv2d_groups": (
        Fn(lambda x, w: F.conv2d(x, w, groups=2, padding=1), r(4, 2, 3, 3)),
        [r(1, 4, 5, 5)],
    ),  # fmt: skip
    "max_avg_pool": (
        Fn(lambda x: F.max_pool2d(x, 3, 2, 1) + F.avg_pool2d(x, 3, 2, 1)),
        [r(2, 2, 6, 6)],
    ),
    "activations": (
        Fn(
            lambda x: (
                F.relu(x)
                + F.gelu(x)
                + F.gelu(x, approximate="tanh")
                + F.silu(x)
                + torch.tanh(x)
                + torch.sigmoid(x)
            )
        ),  # fmt: skip
        [r(3, 5)],
    ),
    "softmax_log_softmax": (Fn(lambda x: F.softmax(x, 1) * F.log_softmax(x, 0)), [r(4, 5)]),
    "layer_norm_two_axes": (
        Fn(lambda x, w, b: F.layer_norm(x, (3, 4), w, b), r(3, 4), r(3, 4)),
        [r(2, 3, 4)],
    ),
    "batch_norm_eval": (
        Fn(
            lambda x, w, b: F.batch_norm(x, torch.ones(3) * 0.5, torch.ones(3) * 2, w, b),
            r(3),
            r(3),
        ),  # fmt: skip
        [r(4, 3, 2, 2)],
    ),
    "batch_norm_train_no_stats": (
        Fn(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), r(3), r(3)),
        [r(4, 3, 2, 2)],
    ),
    "group_norm": (nn.GroupNorm(2, 4), [r(2, 4, 3, 3)]),
    "embedding": (nn.Embedding(7, 3), [torch.tensor([[0, 6, 2], [2, 2, 1]])]),
    "embedding_padding_idx": (nn.Embedding(7, 3, padding_idx=2), [torch.tensor([[0, 6, 2]])]),
    "sdpa": (
        Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v)),
        [r(2, 2, 4, 8), r(2, 2, 5, 8), r(2, 2, 5, 8)],
    ),
    "sdpa_causal": (
        Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        [r(1, 2, 4, 8), r(1, 2, 4, 8), r(1, 2, 4, 8)],
    ),
    "views": (
        Fn(
            lambda x: (
                x.view(4, 6)
                .permute(1, 0)
                .reshape(2, 12)
                .transpose(0, 1)[2:9:3, 1]
                .unsqueeze(0)
                .expand(5, 3)
                .squeeze(0)
                .sum(0)
            )
        ),  # fmt: skip
        [r(2, 3, 4)],
    ),
    "cat_stack_split_chunk_select": (
        Fn(
            lambda x: (
                torch.cat([*x.split([1, 3], 1), *x.chunk(2, 1)], 1).sum()
                + torch.stack([x[0], x[1, :, 2:].sum(1, keepdim=True).expand(4, 4)]).sum(0)
            )
        ),  # fmt: skip
        [r(2, 4, 4)],
    ),
    "reductions": (
        Fn(
            lambda x: (
                x.sum((0, 2))
                + x.mean(1).sum(0)
                + x.amax(2).mean(0)
                + x.var(dim=2).sum(0)
                + x.max(1).values.sum(0)
                + x.min(dim=0)[0].mean(1)
            )
        ),  # fmt: skip
        [r(3, 4, 4)],
    ),
    "elementwise": (
        Fn(
            lambda x, y: (
                (x + y * 2 - 1) / (y.abs() + 1)
                + x.pow(2)
                + torch.exp(-x) * 0.5
                + torch.sqrt(y.abs() + 1)
                + torch.rsqrt(x * x + 1)
                - torch.log(y * y + 1)
                + torch.maximum(x, y)
                + torch.clamp(x, -0.5, 0.5)
            )
        ),  # fmt: skip
        [r(3, 4), r(3, 4)],
    ),
    "comparisons_where": (
        Fn(
            lambda x, y: (
                torch.where((x > y) & (x <= 1) | (y == 0), x, y * 3)
                + (x >= 0).float()
                + torch.where(x != y, 1.0, 0.0)
            )
        ),  # fmt: skip
        [r(3, 4), r(3, 4)],
    ),
    "losses": (
        Fn(
            lambda x, t, y: (
                F.cross_entropy(x, t)
                + F.nll_loss(F.log_softmax(x, 1), t, reduction="sum")
                + F.mse_loss(x, y)
            )
        ),  # fmt: skip
        [r(5, 4), torch.tensor([0, 3, 1, 1, 2]), r(5, 4)],
    ),
    "pad_and_python_arguments": (
        Fn(lambda x: F.pad(x, (1, 2, 0, 1), value=0.5) * 3 + 1),
        [r(2, 3)],
    ),
    "cumsum_flip": (
        Fn(
            lambda x: (
                torch.cumsum(x, 0) * torch.flip(x, [0, -1]) + torch.cumsum(torch.flip(x, [1]), -1)
            )
        ),
        [r(4, 3)],
    ),
    "repeat": (
        Fn(
            lambda x, w: x.repeat(2, 3) * w.repeat(2, 3) + w.repeat(2, 1, 1).sum(0).repeat(2, 3),
            r(2, 3),
        ),
        [r(2, 3)],
    ),
    "cross_entropy_ignore_index": (
        Fn(lambda x, t: F.cross_entropy(x, t, ignore_index=1)),
        [r(5, 4), torch.tensor([0, 3, 1, 1, 2])],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_torch(name):
    torch.manual_seed(0)
    module, inputs = CASES[name]
    compare(module, *inputs)


def test_cross_entropy_matches_backplan_spelling():
    torch.manual_seed(0)
    x, t = torch.randn(5, 4), torch.tensor([0, 3, 1, 1, 2])
    fn, params = bp.from_torch(Fn(lambda x, t: F.cross_entropy(x, t)), (x, t))
    ours = bp.cross_entropy(bp.tensor(x.numpy()), t.numpy())
    np.testing.assert_allclose(fn(params, x.numpy(), t.numpy()).item(), ours.item(), rtol=1e-6)
