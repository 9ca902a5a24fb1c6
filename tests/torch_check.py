"""Comparing an imported module with torch: forward values and gradients of the parameters and
float inputs, for a loss that weighs every output element differently."""

import numpy as np
import torch

import backplan as bp

RTOL, ATOL = 1e-4, 1e-5


def weights_like(out) -> np.ndarray:
    return np.random.default_rng(1).standard_normal(tuple(out.shape)).astype(np.float32)


def compare(module, *inputs, grads: bool = True, train_buffers: bool = False):
    """Import module, check forward (and gradients) against torch; returns (fn, params)."""
    fn, params = bp.from_torch(module, inputs)
    args = [bp.tensor(x.numpy()) for x in inputs]
    out = fn(params, *args)
    if train_buffers:
        out, _ = out
    ref = module(*inputs)
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), rtol=RTOL, atol=ATOL)
    if not grads:
        return fn, params
    r = weights_like(ref)
    floats = [i for i, x in enumerate(inputs) if x.dtype.is_floating_point]
    names = [n for n, p in module.named_parameters() if p.requires_grad]

    def loss(p, xs):
        full = {**params, **p}
        out = fn(full, *[xs[i] if i in floats else a for i, a in enumerate(args)])
        return ((out[0] if train_buffers else out) * r).sum()

    xs = {i: args[i] for i in floats}
    _, (g_params, g_inputs) = bp.value_and_grad(loss, argnums=(0, 1))(
        {n: params[n] for n in names}, xs
    )
    leaves = [x.detach().requires_grad_(True) if i in floats else x for i, x in enumerate(inputs)]
    module.zero_grad()
    (module(*leaves) * torch.from_numpy(r)).sum().backward()
    for n, p in module.named_parameters():
        if p.requires_grad:
            np.testing.assert_allclose(g_params[n].numpy(), p.grad.numpy(), rtol=RTOL, atol=ATOL)
    for i in floats:
        np.testing.assert_allclose(
            g_inputs[i].numpy(), leaves[i].grad.numpy(), rtol=RTOL, atol=ATOL
        )
    return fn, params
