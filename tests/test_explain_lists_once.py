"""explain asks which kernels are cached for every plan of a step (and of every size of a
dynamic one): the kernel folder, which a long-lived cache fills with tens of thousands of
files, is listed once per explain call, and the answers are those of a listing per question."""

import contextlib

import numpy as np

import backplan as bp
import backplan.codegen.build.kernel_cache as kernel_cache
import backplan.tracer.planned as planned
from backplan.runtime.backend import use_backend

RNG = np.random.default_rng(11)
W = bp.tensor(RNG.standard_normal((5, 7)).astype(np.float32), requires_grad=True)


def loss(w, x):
    return bp.mean(bp.tanh(x @ w) * x.sum())


def batch(n):
    return bp.tensor(RNG.standard_normal((n, 5)).astype(np.float32))


def test_explain_of_a_dynamic_step_lists_the_kernel_folder_once(monkeypatch):
    step = bp.compile(loss, dynamic={"x": {0: "batch"}})
    x4, x6 = batch(4), batch(6)
    with use_backend("numba"):
        for x in (x4, x6):
            W.grad = None
            step(W, x).backward()
        scans = []
        scanned = kernel_cache._scanned
        monkeypatch.setattr(kernel_cache, "_scanned", lambda keep: scans.append(1) or scanned(keep))
        once = str(step.explain(W, x6))
        assert len(scans) == 1
        monkeypatch.setattr(planned, "one_listing", contextlib.nullcontext)
        each = str(step.explain(W, x6))
    assert len(scans) > 2  # a listing per question without it
    assert once == each
