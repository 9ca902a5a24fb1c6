"""Does explain's peak hold for programs written as a user writes them, outside the bench
models? Eight of them: an MLP trained with adam (donated), a CNN, an unrolled LSTM, attention,
a torch module imported with from_torch and trained with adamw, a value_and_grad whose batch
axis turned dynamic (calls at 64 and 128 rows, then a new size), a deep MLP under
max_peak_bytes (a recomputing plan) and a step keeping its saved buffers in bfloat16; three more:
a torch module in bfloat16 imported with from_torch and trained with adamw(master_dtype=float32),
an MLP trained with accumulate(adam, steps=3), and a value_and_grad exported with bp.export and
run from the file by bp.load; two more: such an artifact exported with dynamic= and run at a
batch of 300 x scale + 4 rows, and a function mixing float64 and bfloat16.

`--check`: calls 1-5 of each counted by the checked mode (BACKPLAN_CHECK_MEMORY's allocator),
against `report.peak_on_call(n)`, and with the last results kept bound until the next call
returns, against `report.loop_peak_on_call(n)` (bench.memory_calls). Otherwise each program's
first step in a fresh process against the predicted growth, as bench.memory measures the bench
models (VmHWM; GEMM packing buffers apart; a process primed at a quarter of the batch).

    python -m backplan.bench.memory_programs [--programs mlp_adam,cnn] [--scale 4] [--check]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import numpy as np

import backplan as bp


def _rng():
    return np.random.default_rng(0)


def _f32(rng, *shape, s=0.1):
    return (rng.standard_normal(shape) * s).astype(np.float32)


def _train_step(loss, opt):
    @bp.compile(donate_argnums=(0, 1), background=False)
    def step(params, state, *batch):
        value, grads = bp.value_and_grad(loss)(params, *batch)
        params, state = opt.update(grads, state, params)
        return params, state, value

    return step


def mlp_adam(scale: int):
    rng, n = _rng(), 256 * scale
    params = {"w1": _f32(rng, 512, 1024), "b1": np.zeros(1024, np.float32)}
    params |= {"w2": _f32(rng, 1024, 1024), "w3": _f32(rng, 1024, 10)}
    params = {k: bp.tensor(v) for k, v in params.items()}

    def loss(p, x, y):
        h = bp.gelu(bp.relu(x @ p["w1"] + p["b1"]) @ p["w2"])
        return bp.cross_entropy(h @ p["w3"], y)

    opt = bp.optim.adam(1e-3)
    x, y = _f32(rng, n, 512, s=1.0), rng.integers(0, 10, n)
    return "train", _train_step(loss, opt), [params, opt.init(params), x, y]


def cnn(scale: int):
    rng, n = _rng(), 64 * scale
    params = {"c1": _f32(rng, 16, 3, 3, 3), "c2": _f32(rng, 32, 16, 3, 3)}
    params = {k: bp.tensor(v) for k, v in (params | {"w": _f32(rng, 32 * 8 * 8, 10)}).items()}

    def loss(p, x, y):
        h = bp.max_pool2d(bp.relu(bp.conv2d(x, p["c1"], padding=1)), 2)
        h = bp.max_pool2d(bp.relu(bp.conv2d(h, p["c2"], padding=1)), 2)
        return bp.cross_entropy(bp.reshape(h, (h.shape[0], -1)) @ p["w"], y)

    x, y = _f32(rng, n, 3, 32, 32, s=1.0), rng.integers(0, 10, n)
    return "vg", bp.value_and_grad(loss, background=False), [params, x, y]


def lstm(scale: int):
    rng, n, steps, hidden = _rng(), 64 * scale, 12, 256
    params = {"wx": _f32(rng, 64, 4 * hidden), "wh": _f32(rng, hidden, 4 * hidden)}
    params = {k: bp.tensor(v) for k, v in (params | {"wo": _f32(rng, hidden, 1)}).items()}

    def loss(p, xs, y):
        h = c = bp.zeros((xs.shape[1], hidden))
        for t in range(steps):
            z = xs[t] @ p["wx"] + h @ p["wh"]
            i, f, g, o = (z[:, k * hidden : (k + 1) * hidden] for k in range(4))
            c = bp.sigmoid(f) * c + bp.sigmoid(i) * bp.tanh(g)
            h = bp.sigmoid(o) * bp.tanh(c)
        return bp.mse_loss(h @ p["wo"], y)

    xs, y = _f32(rng, steps, n, 64, s=1.0), _f32(rng, n, 1, s=1.0)
    return "vg", bp.value_and_grad(loss, background=False), [params, xs, y]


def attention(scale: int):
    rng, n, seq, d, heads = _rng(), 8 * scale, 128, 128, 4
    params = {"wqkv": _f32(rng, d, 3 * d), "wo": _f32(rng, d, d)}
    params |= {"g": np.ones(d, np.float32), "b": np.zeros(d, np.float32)}
    params = {k: bp.tensor(v) for k, v in params.items()}

    def loss(p, x):
        h = bp.layer_norm(x, p["g"], p["b"])
        qkv = bp.reshape(h @ p["wqkv"], (x.shape[0], seq, 3, heads, d // heads))
        q, k, v = (bp.transpose(qkv[:, :, j], (0, 2, 1, 3)) for j in range(3))
        scores = q @ bp.swapaxes(k, -1, -2) * (1.0 / float(np.sqrt(d // heads)))
        a = bp.softmax(scores, axis=-1) @ v
        out = bp.reshape(bp.transpose(a, (0, 2, 1, 3)), (x.shape[0], seq, d)) @ p["wo"]
        return bp.mean((out + x) ** 2)

    return "vg", bp.value_and_grad(loss, background=False), [params, _f32(rng, n, seq, d, s=1.0)]


def from_torch(scale: int):
    import torch

    torch.manual_seed(0)
    rng, n = _rng(), 256 * scale
    layers = [torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.GELU()]
    layers += [torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 16)]
    x, y = _f32(rng, n, 256, s=1.0), rng.integers(0, 16, n)
    fn, params = bp.from_torch(torch.nn.Sequential(*layers), (torch.from_numpy(x),))
    params = {k: bp.tensor(np.array(v.numpy())) for k, v in params.items()}  # not torch's memory
    opt = bp.optim.adamw(1e-3)
    step = _train_step(lambda p, x, y: bp.cross_entropy(fn(p, x), y), opt)
    return "train", step, [params, opt.init(params), x, y]


def dynamic(scale: int):
    rng = _rng()
    params = {"w1": bp.tensor(_f32(rng, 512, 2048)), "w2": bp.tensor(_f32(rng, 2048, 1024))}

    def loss(p, x):
        return bp.mean(bp.tanh(bp.gelu(x @ p["w1"]) @ p["w2"]) ** 2)

    step = bp.value_and_grad(loss, background=False)
    for rows in (64, 128):  # the batch axis turns dynamic
        step(params, _f32(rng, rows, 512, s=1.0))
    return "vg", step, [params, _f32(rng, max(3001 * scale // 4, 129), 512, s=1.0)]


def budget(scale: int):
    rng = _rng()
    params = {f"w{i}": bp.tensor(_f32(rng, 256, 256, s=0.06)) for i in range(12)}
    x = _f32(rng, 1024 * scale, 256, s=1.0)

    def loss(p, x):
        for w in p.values():
            x = bp.tanh(x @ w)
        return bp.mean(x * x)

    default = bp.value_and_grad(loss).explain(params, x).peak_bytes
    step = bp.value_and_grad(loss, max_peak_bytes=int(default * 0.85), background=False)
    return "vg", step, [params, x]


def bf16_saved(scale: int):
    rng = _rng()
    params = {"w1": _f32(rng, 512, 1024), "w2": _f32(rng, 1024, 1024), "w3": _f32(rng, 1024, 16)}
    params = {k: bp.tensor(v) for k, v in params.items()}

    def loss(p, x):
        h = bp.tanh(bp.gelu(x @ p["w1"]) @ p["w2"])
        return bp.mean((h @ p["w3"]) ** 2)

    step = bp.value_and_grad(loss, saved_dtype=bp.bfloat16, background=False)
    return "vg", step, [params, _f32(rng, 512 * scale, 512, s=1.0)]


def torch_bf16(scale: int):
    import torch

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.ln = torch.nn.Linear(512, 1024), torch.nn.LayerNorm(1024)
            self.fc2, self.out = torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 16)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.ln(self.fc1(x)))
            return self.out(torch.tanh(self.fc2(h)))

    rng, n = _rng(), 512 * scale
    x = torch.from_numpy(_f32(rng, n, 512, s=1.0)).to(torch.bfloat16)
    fn, params = bp.from_torch(Net().to(torch.bfloat16), (x,))
    params = {k: bp.tensor(np.array(v.numpy())) for k, v in params.items()}  # not torch's memory
    x = bp.tensor(np.array(bp.from_dlpack(x).numpy()))
    opt = bp.optim.adamw(1e-3, master_dtype=bp.float32)
    step = _train_step(lambda p, x, y: bp.cross_entropy(fn(p, x), y), opt)
    return "train", step, [params, opt.init(params), x, rng.integers(0, 16, n)]


def accumulate(scale: int):
    rng, n = _rng(), 256 * scale
    params = {"w1": _f32(rng, 512, 1024), "b1": np.zeros(1024, np.float32)}
    params |= {"w2": _f32(rng, 1024, 1024), "w3": _f32(rng, 1024, 10)}
    params = {k: bp.tensor(v) for k, v in params.items()}

    def loss(p, x, y):
        h = bp.tanh(bp.relu(x @ p["w1"] + p["b1"]) @ p["w2"])
        return bp.cross_entropy(h @ p["w3"], y)

    opt = bp.optim.accumulate(bp.optim.adam(1e-3), steps=3)  # calls 1-5 cross a step
    x, y = _f32(rng, n, 512, s=1.0), rng.integers(0, 10, n)
    return "train", _train_step(loss, opt), [params, opt.init(params), x, y]


def _artifact_loss(p, x, y):
    h = bp.tanh(bp.gelu(x @ p["w1"] + p["b1"]) @ p["w2"])
    return bp.cross_entropy(h @ p["w3"], y)


def artifact(scale: int):
    import os
    import tempfile

    rng, n = _rng(), 512 * scale
    params = {"w1": _f32(rng, 512, 1024), "b1": np.zeros(1024, np.float32)}
    params |= {"w2": _f32(rng, 1024, 1024), "w3": _f32(rng, 1024, 10)}
    args = [{k: bp.tensor(v) for k, v in params.items()}, _f32(rng, n, 512, s=1.0)]
    args.append(rng.integers(0, 10, n))
    with tempfile.TemporaryDirectory() as folder:  # load reads the whole file
        path = os.path.join(folder, "step.bpz")
        bp.export(bp.value_and_grad(bp.compile(_artifact_loss)), *args, path=path)
        step = bp.load(path)
    return "vg", step, args


def any_batch(scale: int):
    """An artifact exported with dynamic= (any batch size) and run from the file at a batch that
    is not a multiple of 8: its 10-class last layer's product takes the narrow GEMM's edge
    block, which the fresh children (every block its own mapping) caught read after it was
    freed."""
    import os
    import tempfile

    rng, n = _rng(), 300 * scale + 4
    params = {"w1": _f32(rng, 512, 1024), "b1": np.zeros(1024, np.float32)}
    params |= {"w2": _f32(rng, 1024, 1024), "w3": _f32(rng, 1024, 10)}
    params = {k: bp.tensor(v) for k, v in params.items()}
    x, y = _f32(rng, 64, 512, s=1.0), rng.integers(0, 10, 64)  # exported at 64 rows
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "step.bpz")
        step = bp.value_and_grad(bp.compile(_artifact_loss))
        bp.export(step, params, x, y, path=path, dynamic={"x": {0: "n"}, "y": {0: "n"}})
        step = bp.load(path)
    return "vg", step, [params, _f32(rng, n, 512, s=1.0), rng.integers(0, 10, n)]


def mixed_dtypes(scale: int):
    """float64 and bfloat16 in one function: a float64 layer, its output cast to bfloat16 for
    a bfloat16 layer, the loss in float64 (dgemm, the bf16 GEMM and casts in one joint plan)."""
    rng, n = _rng(), 256 * scale
    params = {"w1": bp.tensor(_f32(rng, 512, 1024).astype(np.float64))}
    params["w2"] = bp.tensor(_f32(rng, 1024, 256).astype(bp.bfloat16))

    def loss(p, x):
        h = bp.tanh(x.astype(bp.float64) @ p["w1"])
        h = bp.gelu(h.astype(bp.bfloat16) @ p["w2"])
        return bp.mean(h.astype(bp.float64) ** 2)

    x = bp.tensor(_f32(rng, n, 512, s=1.0).astype(bp.bfloat16))
    return "vg", bp.value_and_grad(loss, background=False), [params, x]


PROGRAMS = {
    f.__name__: f
    for f in (
        mlp_adam,
        cnn,
        lstm,
        attention,
        from_torch,
        dynamic,
        budget,
        bf16_saved,
        torch_bf16,
        accumulate,
        artifact,
        any_batch,
        mixed_dtypes,
    )
}


def available() -> list[str]:
    """The programs this installation runs (from_torch needs the [torch] extra)."""
    has_torch = importlib.util.find_spec("torch") is not None
    return [name for name in PROGRAMS if has_torch or name not in ("from_torch", "torch_bf16")]


def checked_row(name: str, scale: int, calls: int = 5) -> tuple[str, bool]:
    """Calls 1..calls counted by the checked mode against the printed peaks, results dropped
    and results kept; the row and whether every call equals its printed peak."""
    from backplan.bench.internals import checked_memory

    from .memory_calls import counted_calls, donated_calls, printed_calls

    cells, same = [], True
    for keep in (False, True):
        with checked_memory():
            kind, step, args = PROGRAMS[name](scale)
            if kind == "train":
                call, report = donated_calls(step, args, keep)
            else:
                report, held = step.explain(*args), [None]

                def call(step=step, args=args, held=held, keep=keep):
                    result = step(*args)
                    held[0] = result if keep else None

            counted = counted_calls(call, calls)
        printed = printed_calls(report, calls, loop=keep)
        same = same and counted == printed
        cells.append(
            " / ".join(
                f"{p:,}" if p == c else f"{p:,} printed, {c:,} counted"
                for p, c in zip(printed, counted, strict=True)
            )
        )
    return f"| {name} | {cells[0]} | {cells[1]} | {'equal' if same else 'MISMATCH'} |", same


def warm(name: str, scale: int, primed: int = 0) -> None:
    """Run in a child: the program's first step (and one at the priming scale), so the disk
    cache holds its kernels and drivers."""
    for size in (scale, primed) if primed else (scale,):
        _, step, args = PROGRAMS[name](size)
        step(*args)


def child(name: str, scale: int, primed: int = 0) -> dict:
    """Run in a fresh process: the first step measured as bench.memory measures a model's."""
    from .memory import first_step

    if primed:
        warm(name, primed)
    return first_step(*PROGRAMS[name](scale)[1:])


def measure(name: str, scale: int) -> dict:
    """The first step in a fresh process, and in one primed at a quarter of the batch."""
    from .memory import retried_children

    here, primed = "backplan.bench.memory_programs", max(scale // 4, 1)  # not __main__
    runs = [("warm", name, scale, primed), ("child", name, scale), ("child", name, scale, primed)]
    fresh, after = retried_children(runs, module=here)
    kind = PROGRAMS[name].__name__  # the row's step column: the program
    return dict(fresh, model=name, step=kind, scale=scale, primed=after)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan.bench.memory_programs")
    parser.add_argument("--programs", default=",".join(available()))
    parser.add_argument("--scale", type=int, default=4, help="multiplies each batch")
    parser.add_argument("--check", action="store_true", help="the checked mode, calls 1-5")
    args = parser.parse_args(argv)
    names = args.programs.split(",")
    unknown = sorted(set(names) - set(PROGRAMS))
    if unknown:
        parser.error(f"no program {unknown}; there are {sorted(PROGRAMS)}")
    if args.check:
        print("| program | calls 1-5, results dropped | calls 1-5, results kept | verdict |")
        print("| --- | --- | --- | --- |")
        ok = True
        for name in names:
            text, same = checked_row(name, args.scale)
            ok = ok and same
            print(text, flush=True)
        return 0 if ok else 1
    from .memory import HEADER, row

    print(HEADER.format(what="program"))
    for name in names:
        found = measure(name, args.scale)
        if not (found["driver_loaded_before"] and found["primed"]["driver_loaded_before"]):
            print(f"<!-- {name}: the driver loaded inside the step -->")
        print(row(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
