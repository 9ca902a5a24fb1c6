"""Predicted against measured peak memory of each bench model's FIRST step, measured from outside,
in a fresh process.

A warm-up child runs the step once so the disk cache holds its kernels and driver. Then a fresh
child, with glibc told to map every block and return it when freed (MALLOC_MMAP_THRESHOLD_=0,
MALLOC_TRIM_THRESHOLD_=0), traces the step, loads its kernels and compiled driver from the
cache without calling them, writes 5 to /proc/self/clear_refs, reads VmRSS, runs the first step
and reads VmHWM. Their difference is the memory the step newly held at its peak. It should
equal the predicted peak (ir/peak.py) less the arrays passed in and the constants (both
resident before the step): nothing of the step is allocated before it runs (arenas are mapped
on construction but touched by the step). The GEMM's packing buffers (codegen/kernels/gemm/
scratch.py: ~4.3 MiB per concurrent GEMM, mapped by a process's first GEMMs and kept) are in
the prediction (its `packing`: the pages the step's products write, codegen/kernels/gemm/
packing.py) and shown apart too, mapped and written (their mappings' Rss in /proc/self/smaps,
gained over the step): a buffer is mapped whole and written only as far as the products packed
into it reach. What remains is not predicted: memory libraries touch on a process's first
calls of their code (OpenBLAS's per-thread packing buffers for these shapes, Numba's thread
pool) and page rounding (conv2d's im2col columns are a buffer of the arena,
ir/kernel_workspace.py). A second fresh process is
primed first with one step of the same model at 1/4 of the batch, so what libraries touch once
per process is resident before the measured step: the excess left there is what the step
itself allocates beyond the prediction.

    python -m backplan.bench.memory [--models mlp,mlp_deep] [--scale 8] [--steps train,vg,compile]

--scale multiplies the batch (and rows) so the step holds tens of MiB; transformer6 (the bench
transformer's block stacked 6 deep, bench.memory_budget) runs at its own size (--scale 1).
Steps: "vg" is bp.value_and_grad(loss); "train" is the step users write: value_and_grad and
adam's update in one bp.compile(donate_argnums=(0, 1)) (parameters and optimizer state updated
in place); "compile" is `loss = bp.compile(f)(params, *batch); loss.backward()`, a forward and
the backward() consuming it (both plans' runners made and the forward's driver loaded first).

The growth is compared with `peak_bytes` less the arrays passed in and the constants, which is
`allocated_peak_bytes` less the constants: no kernel allocates inside itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SCALABLE = ("batch", "rows")
STEPS = ("train", "vg", "compile")


def proc_status_bytes(field: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM) in bytes: what the kernel says the process
    holds."""
    with open("/proc/self/status", encoding="ascii") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _step(name: str, scale: int, kind: str):
    """(step function, its arguments, the ir.peak calls of its plans) for a bench model."""
    import numpy as np

    import backplan as bp
    from backplan.bench.models import MODELS
    from backplan.bench.peers.backplan_peer import bench_function

    if name not in MODELS:  # a bench.memory_budget model (transformer6), at its own size
        from backplan.bench.memory_budget import MODEL_MAKERS

        if name not in MODEL_MAKERS or scale != 1:
            raise ValueError(f"no bench model {name!r} at scale {scale}")
        loss, arrays, batch_arrays = MODEL_MAKERS[name]()
        params = {k: bp.tensor(v) for k, v in arrays.items()}
        batch = [bp.tensor(a) for a in batch_arrays]
    else:
        spec = MODELS[name]
        config = {k: v * scale if k in SCALABLE else v for k, v in spec.config.items()}
        inputs = spec.make_inputs(config, 0).cast(np.float32)
        params = {
            k: bp.tensor(v, requires_grad=kind == "compile") for k, v in inputs.params.items()
        }
        batch = [bp.tensor(a) for a in inputs.batch(True)]
        loss = bench_function(spec)
    if kind == "vg":
        return bp.value_and_grad(loss, background=False), [params, *batch]
    if kind == "compile":
        return _compile_step(loss), [params, *batch]
    opt = bp.optim.adam(1e-3)

    @bp.compile(donate_argnums=(0, 1), background=False)
    def train_step(params, state, *batch):
        value, grads = bp.value_and_grad(loss)(params, *batch)
        params, state = opt.update(grads, state, params)
        return params, state, value

    return train_step, [params, opt.init(params), *batch]


def _compile_step(loss):
    """loss = bp.compile(f)(params, *batch); loss.backward(): the compiled function is kept on
    the step (`compiled`) for the plans and drivers read before the call."""
    import backplan as bp

    compiled = bp.compile(loss, background=False)

    def step(params, *batch):
        value = compiled(params, *batch)
        value.backward()
        return value

    step.compiled = compiled
    return step


def _calls(step, args: list):
    """The step's plan calls, for predicted_peak."""
    from backplan.bench.internals import joint_calls, region_calls

    entry = getattr(step, "compiled", step).trace(*args)
    if hasattr(entry, "program"):
        return region_calls(entry.program.plans)
    return joint_calls(entry.plan, 1)


def _load(step, args: list) -> tuple:
    """Make the step's runner and load its compiled driver for these arguments without a
    call: (the runner's compiled plan, whether a driver was loaded)."""
    from backplan.bench.internals import BackwardMode, donatable

    compiled = getattr(step, "compiled", None)  # a compile step: its backward()'s runner too
    bound, entry = (compiled or step).lookup(tuple(args), {}, count_hit=False)
    call = bound if hasattr(bound, "tensor_positions") else bound.call  # value_and_grad's
    tensors = [call.leaves[p] for p in call.tensor_positions] + list(entry.captured)
    if hasattr(entry, "program"):
        runner = entry.program.runner(None)
        donate = donatable(tensors, entry.donated) if entry.donated else ()
    else:
        runner, donate = entry.runner(), ()
    if compiled is not None:
        entry.program.runner(BackwardMode.CONSUME)
    loaded = runner.load_driver([t._data for t in tensors], donate)
    return runner.compiled, loaded


def _gemm_packing_bytes() -> int:
    from backplan.bench.internals import gemm_scratch

    return int((gemm_scratch._table[:, 1] != 0).sum()) * gemm_scratch.MAPPED_BYTES


def _gemm_packing_resident() -> int:
    """Resident bytes of the mappings holding the GEMM's packing buffers (/proc/self/smaps
    Rss; each buffer is a mapping of its own)."""
    from backplan.bench.internals import gemm_scratch

    addresses = [int(a) for a in gemm_scratch._table[:, 1] if a]
    total, inside = 0, False
    if not addresses:
        return 0
    with open("/proc/self/smaps", encoding="ascii") as file:
        for line in file:
            first = line.split(maxsplit=1)[0]
            if first.endswith(":"):
                if inside and first == "Rss:":
                    total += int(line.split()[1]) * 1024
            else:  # a mapping's first line: start-end perms ...
                low, high = (int(x, 16) for x in first.split("-"))
                inside = any(low <= a < high for a in addresses)
    return total


def warm(name: str, scale: int, kind: str, primed: int = 0) -> None:
    """Run in a child: one step (and one at the priming scale), so the disk cache holds the
    kernels and the drivers."""
    for size in (scale, primed) if primed else (scale,):
        step, args = _step(name, size, kind)
        step(*args)


def child(name: str, scale: int, kind: str, primed: int = 0) -> dict:
    """Run in the fresh process: the first step, its kernels and driver loaded beforehand;
    primed: first run one step of the same model at that scale, so memory libraries touch
    once per process (OpenBLAS's buffers, the thread pool) is already resident."""
    if primed:
        warm(name, primed, kind)
    return first_step(*_step(name, scale, kind))


def high_water_growth(step, args: list) -> int:
    """How far one call of step lifts the process's resident high-water mark (VmHWM, reset
    first) above its resident bytes before the call."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as file:
        file.write("5")
    before = proc_status_bytes("VmRSS")
    result = step(*args)
    growth = proc_status_bytes("VmHWM") - before
    del result
    return growth


def first_step(step, args: list) -> dict:
    """The step's first call measured from outside, its kernels and driver loaded first."""
    from backplan.bench.internals import predicted_peak

    predicted = predicted_peak(_calls(step, args), "numba")
    compiled, loaded = _load(step, args)
    overloads = len(compiled._compiled_run.overloads)
    packing, written = _gemm_packing_bytes(), _gemm_packing_resident()
    growth = high_water_growth(step, args)
    resident = predicted.input_bytes + predicted.at_peak().get("constants", 0)
    return {
        "predicted_peak": predicted.peak_bytes,
        "inputs": predicted.input_bytes,
        "expected_growth": predicted.peak_bytes - resident,
        "gemm_packing": _gemm_packing_bytes() - packing,
        "gemm_packing_written": _gemm_packing_resident() - written,
        "measured_growth": growth,
        "driver_loaded_before": loaded and len(compiled._compiled_run.overloads) == overloads,
    }


def _run_child(function: str, *args, module: str = "backplan.bench.memory") -> str:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="0", MALLOC_TRIM_THRESHOLD_="0")
    env.setdefault("BACKPLAN_DRIVER", "inline")
    code = f"import json; from {module} import {function}; print(json.dumps({function}{args!r}))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise RuntimeError(f"{function}{args!r} failed:\n{out.stderr}")
    return out.stdout


def measure(name: str, scale: int, kind: str = "train") -> dict:
    """The first step in a fresh process, and in a fresh process primed by a step at 1/4 of
    the scale."""
    primed = max(scale // 4, 1)
    runs = [("warm", name, scale, kind, primed), ("child", name, scale, kind)]
    runs.append(("child", name, scale, kind, primed))
    fresh, after = retried_children(runs)
    return dict(fresh, model=name, step=kind, scale=scale, primed=after)


def retried_children(runs: list, module: str = "backplan.bench.memory") -> list[dict]:
    """The children's results after the warm one; once more, warm first, where a child found
    no compiled driver to load before its step (it compiled inside it: a void reading). The
    disk cache's key holds a hash of backplan's code generator: a child importing a tree that
    changed since the warm child ran (an editable install updated meanwhile) finds no driver
    for its key (the bench lstm48's fresh child, three times, 2026-11-29)."""
    found: list[dict] = []
    for attempt in range(2):
        _run_child(*runs[0], module=module)
        found = [
            json.loads(_run_child(*run, module=module).strip().splitlines()[-1]) for run in runs[1:]
        ]
        if all(f["driver_loaded_before"] for f in found) or attempt:
            return found
    return found


def _rest(found: dict) -> str:
    rest = found["measured_growth"] - found["expected_growth"]  # packing: in the prediction
    return f"{rest:+,} ({100 * rest / max(found['expected_growth'], 1):+.1f}%)"


def row(found: dict) -> str:
    primed = found["primed"]
    return (
        f"| {found['model']} | {found['step']} | {found['scale']} | "
        f"{found['predicted_peak']:,} | {found['inputs']:,} | {found['expected_growth']:,} | "
        f"{found['measured_growth']:,} | {_packing(found)} | {_rest(found)} | "
        f"{primed['measured_growth']:,} | {_packing(primed)} | {_rest(primed)} |"
    )


def _packing(found: dict) -> str:
    """GEMM packing buffers mapped over the step / their pages it wrote."""
    return f"{found['gemm_packing']:,} / {found.get('gemm_packing_written', 0):,}"


HEADER = (
    "| {what} | step | scale | predicted peak | arrays passed in | predicted growth | measured "
    "growth (VmHWM - VmRSS), fresh process | GEMM packing buffers mapped / written | not "
    "predicted (the packing written is in the prediction) | measured growth, primed process | "
    "GEMM packing buffers mapped / written | not predicted |\n|" + " --- |" * 12
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan.bench.memory")
    parser.add_argument("--models", default="mlp,mlp_deep,transformer,ln_gelu,cnn")
    parser.add_argument("--scale", type=int, default=8)
    parser.add_argument("--steps", default="train,vg")
    args = parser.parse_args(argv)
    print(HEADER.format(what="model"))
    for name in args.models.split(","):
        for kind in args.steps.split(","):
            found = measure(name, args.scale, kind)
            if not (found["driver_loaded_before"] and found["primed"]["driver_loaded_before"]):
                print(f"<!-- {name} {kind}: the driver loaded inside the step -->")
            print(row(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
