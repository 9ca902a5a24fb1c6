"""Compiled plans equal the reference interpreter: every registry op (through the shared sample
table, batched so a handful of compiles cover all; each batch's plan also under the checked
mode, its measured peak against the predicted one), forward, backward and joint plans of real
models, and inputs are never modified."""

import re

import numba
import numpy as np
import pytest
from op_samples import SAMPLES

import backplan as bp
from backplan.codegen.run.compiled import CompiledPlan
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.ir.builder import Builder
from backplan.ir.graph import Graph
from backplan.ir.interpreter import run_plan
from backplan.ir.lowering import BackwardMode, lower
from backplan.ir.peak import joint_calls, predicted_peak
from backplan.ir.pipeline import build_joint_plan
from backplan.ir.types import TensorType, dtype_name, is_float
from backplan.runtime.backend import use_backend

TOL = {"f32": dict(rtol=2e-5, atol=2e-5), "f64": dict(rtol=1e-11, atol=1e-11)}
BATCH = 12


def sample_batches(dtype):
    chosen = [s for s in SAMPLES if dtype in s.dtypes]
    return [chosen[i : i + BATCH] for i in range(0, len(chosen), BATCH)]


def batch_graph(samples, dtype):
    """One graph holding every sample's op; the loss sums each float output times a random
    weight, so the joint plan holds every op's derivative too."""
    graph = Graph(name=f"ops_{dtype}")
    b = Builder(graph)
    arrays, outputs, wrt, losses = [], [], [], []
    rng = np.random.default_rng(7)
    for s_index, sample in enumerate(samples):
        for name, array in sample.constants(dtype).items():
            graph.constants[f"{name}_{s_index}"] = array
        inputs = []
        for i, array in enumerate(sample.inputs(dtype)):
            inputs.append(graph.add_input(TensorType(dtype_name(array.dtype), array.shape)))
            arrays.append(array)
            wrt.append(i in sample.float_inputs(dtype))
        attrs = sample.resolved_attrs(dtype)
        if sample.op == "const":
            attrs = {**attrs, "name": f"{attrs['name']}_{s_index}"}
        node = b.emit(sample.op, *inputs, **attrs)
        outputs.append(node)
        if is_float(node.dtype) and node.dtype == dtype:
            weight = graph.add_input(node.type)
            arrays.append(
                rng.standard_normal(node.shape).astype(
                    arrays[-1].dtype if False else node.dtype == "f32" and np.float32 or np.float64
                )
            )
            wrt.append(False)
            losses.append(b.sum(b.mul(node, weight), axes=tuple(range(len(node.shape)))))
    total = losses[0]
    for loss in losses[1:]:
        total = b.add(total, loss)
    graph.outputs = [total] + outputs
    return graph, arrays, wrt


@pytest.mark.parametrize(
    "dtype, batch", [(d, i) for d in ("f32", "f64") for i in range(len(sample_batches(d)))]
)
def test_every_registry_op_compiles_to_the_reference_result(dtype, batch, monkeypatch):
    """One joint plan per batch of samples (a test each, so the suite's workers share them).
    Every op runs in both forms of its loops: f64 through the compiled driver, which inlines
    each loop's view form (`kernel`) into one function; f32 through the driver run as Python, as
    a first call does by default, calling each loop's address form (`kernel_at`), all compiled
    in one module. The compiled driver types every loop again on its own inside its one
    function: 1.7-3.8x the CPU of the Python-run driver's batch (f32 batches 0 and 3, empty
    cache, library compiled), so one dtype through it covers the view forms; a compiled f32
    driver is in the mlp model test below."""
    monkeypatch.setenv("BACKPLAN_DRIVER", "python" if dtype == "f32" else "inline")
    samples = sample_batches(dtype)[batch]
    graph, arrays, wrt = batch_graph(samples, dtype)
    plan = build_joint_plan(graph, wrt)
    copies = [a.copy() for a in arrays]
    expected = run_plan(plan, list(arrays))
    got = CompiledPlan(lower(plan))(list(arrays))
    for a, original in zip(arrays, copies, strict=True):
        np.testing.assert_array_equal(a, original)  # inputs never modified
    names = ["loss"] + [s.id for s in samples] + [f"grad {i}" for i in range(len(got))]
    for name, g, e in zip(names, got, expected, strict=False):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        if g.dtype.kind == "f":
            scale = max(1.0, float(np.max(np.abs(e), initial=0)))
            np.testing.assert_allclose(
                g, e, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * scale, err_msg=name
            )
        else:
            np.testing.assert_array_equal(g, e, err_msg=name)
    _check_memory(plan, arrays, samples)


def _check_memory(plan, arrays, samples):
    """The checked mode on the same plan, in the same process (its kernels and driver are
    loaded already; test_memory_check.py's own numba run of every batch cost a worker about
    40 s a dtype): the second call's measured peak equals the joint plan's predicted one."""
    with checked_memory():
        run = CompiledPlan(lower(plan))
        run(list(arrays))
        with measure() as measured:
            run(list(arrays))
    predicted = predicted_peak(joint_calls(plan, 1 + len(samples)), "numba")
    assert measured.peak == predicted.allocated_peak_bytes, [s.id for s in samples]


def mlp_params(rng, sizes, dtype=np.float32):
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"w{i}"] = bp.tensor(
            (rng.standard_normal((a, b)) / np.sqrt(a)).astype(dtype), requires_grad=True
        )
        params[f"b{i}"] = bp.tensor(np.zeros(b, dtype), requires_grad=True)
    return params


def mlp_loss(params, x, labels):
    h = x
    n = len(params) // 2
    for i in range(n):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            h = bp.relu(h)
    return bp.cross_entropy(h, labels)


def block_loss(p, x):
    """A pre-LayerNorm transformer block, small."""
    batch, seq, d = x.shape
    heads = 2
    h = bp.layer_norm(x, p["ln1_g"], p["ln1_b"])
    qkv = h @ p["w_qkv"]
    q, k, v = qkv[..., :d], qkv[..., d : 2 * d], qkv[..., 2 * d :]

    def split(t):
        return t.reshape(batch, seq, heads, d // heads).transpose(0, 2, 1, 3)

    q, k, v = split(q), split(k), split(v)
    att = bp.softmax((q @ k.swapaxes(-1, -2)) * float(1.0 / np.sqrt(d // heads)), axis=-1)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(batch, seq, d)
    x = x + y @ p["w_o"]
    h = bp.gelu(bp.layer_norm(x, p["ln2_g"], p["ln2_b"]) @ p["w_1"], approximate="tanh")
    x = x + h @ p["w_2"]
    return bp.mean(x * x)


def block_params(rng, d=8, ff=16):
    def t(*shape, scale=0.3):
        return bp.tensor(
            (rng.standard_normal(shape) * scale).astype(np.float32), requires_grad=True
        )

    return {
        "ln1_g": t(d),
        "ln1_b": t(d),
        "w_qkv": t(d, 3 * d),
        "w_o": t(d, d),
        "ln2_g": t(d),
        "ln2_b": t(d),
        "w_1": t(d, ff),
        "w_2": t(ff, d),
    }


def run_both(fn, *args):
    results = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            results[backend] = fn(*args)
    return results["reference"], results["numba"]


def assert_trees_close(a, b, rtol=2e-5, atol=2e-6):
    la, _ = bp.tracer.pytree.flatten(a)
    lb, _ = bp.tracer.pytree.flatten(b)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=rtol, atol=atol)


@pytest.mark.parametrize("model", ["mlp", "block"])
def test_value_and_grad_of_models_compiled_equals_reference(model, monkeypatch):
    """The mlp through the Numba-compiled driver (f32 view forms of its loops, as
    bp.compile(fn, background=False) runs them), the block as a first call runs by default."""
    if model == "mlp":
        monkeypatch.setenv("BACKPLAN_DRIVER", "inline")
    rng = np.random.default_rng(3)
    if model == "mlp":
        params = mlp_params(rng, [6, 16, 16, 4])
        args = (
            params,
            bp.tensor(rng.standard_normal((5, 6)).astype(np.float32)),
            bp.tensor(rng.integers(0, 4, 5)),
        )
        fn = mlp_loss
    else:
        params = block_params(rng)
        args = (params, bp.tensor(rng.standard_normal((2, 4, 8)).astype(np.float32)))
        fn = block_loss
    before = [np.array(t) for t in bp.tracer.pytree.flatten(args)[0] if isinstance(t, bp.Tensor)]
    ref, got = run_both(lambda *a: bp.value_and_grad(fn)(*a), *args)
    assert_trees_close(ref, got)
    after = [np.array(t) for t in bp.tracer.pytree.flatten(args)[0] if isinstance(t, bp.Tensor)]
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)


def test_compiled_regions_backward_equals_reference_with_retain_graph():
    rng = np.random.default_rng(4)
    params = mlp_params(rng, [6, 16, 4])
    x = bp.tensor(rng.standard_normal((5, 6)).astype(np.float32))
    labels = bp.tensor(rng.integers(0, 4, 5))
    compiled = bp.compile(mlp_loss)
    grads = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            compiled.clear_cache()
            bp.zero_grad(params)
            loss = compiled(params, x, labels)
            held = bp.live_saved_bytes()
            for _ in range(3):
                loss.backward(retain_graph=True)
                assert bp.live_saved_bytes() == held  # retained buffers stay intact
            loss.backward()
            assert bp.live_saved_bytes() == 0
            with pytest.raises(bp.GraphFreedError):
                loss.backward()
            grads[backend] = {k: v.grad.numpy().copy() for k, v in params.items()}
    for k in params:
        np.testing.assert_allclose(grads["numba"][k], grads["reference"][k], rtol=2e-5, atol=1e-6)


def test_out_of_range_label_names_the_op_and_the_users_line():
    logits = bp.tensor(np.zeros((3, 4), np.float32))
    labels = bp.tensor(np.array([0, 9, 1]))
    fn = bp.compile(lambda logits, labels: bp.cross_entropy(logits, labels))
    with use_backend("numba"):
        with pytest.raises(bp.ExecutionError, match=r"cross_entropy at test_codegen.py:\d+"):
            fn(logits, labels)


def test_consuming_backward_reuses_saved_storage_that_retaining_backward_keeps():
    """The two backward variants: consume (retain_graph=False) places temporaries in private
    saved buffers after their last read, so it never needs more scratch; retain never touches
    them."""
    rng = np.random.default_rng(5)
    params = mlp_params(rng, [6, 32, 32, 4])
    x = bp.tensor(rng.standard_normal((64, 6)).astype(np.float32))
    labels = bp.tensor(rng.integers(0, 4, 64))
    compiled = bp.compile(mlp_loss)
    with use_backend("numba"):
        program = compiled.trace(params, x, labels).program
        consume = program.runner(BackwardMode.CONSUME).compiled
        retain = program.runner(BackwardMode.RETAIN).compiled
    assert consume.layout.reused_saved and not retain.layout.reused_saved
    assert consume.scratch_bytes <= retain.scratch_bytes
    private = set(program.private_saved_inputs())
    backward_inputs = program.plans.backward.graph.inputs
    assert {backward_inputs.index(s) for s in consume.layout.reused_saved.values()} <= private


def test_generated_source_runs_as_plain_python_with_the_same_results(tmp_path):
    """BACKPLAN_KERNELS_AS_PYTHON=1 runs the very same generated module without Numba."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import json
        import numpy as np
        import backplan as bp
        from backplan.runtime.backend import use_backend
        from backplan.codegen.jit import AS_PYTHON

        def loss(w, x, labels):
            return bp.cross_entropy(bp.tanh(x @ w) * 3.0, labels)

        w = bp.tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
        x = bp.tensor(np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3))
        with use_backend("numba"):
            value, grad = bp.value_and_grad(loss)(w, x, bp.tensor(np.array([1, 3])))
        print(json.dumps([AS_PYTHON, float(value.item()), grad.numpy().tolist()]))
    """)
    results = []
    for flag in ("0", "1"):
        env = {
            **os.environ,
            "BACKPLAN_CACHE_DIR": str(tmp_path),
            "BACKPLAN_KERNELS_AS_PYTHON": flag,
        }
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert [r[0] for r in results] == [False, True]
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-6)
    np.testing.assert_allclose(results[1][2], results[0][2], rtol=1e-5, atol=1e-7)


def test_parallel_and_chunked_reduction_kernels_equal_reference():
    """Big enough for prange: row reductions run in parallel over rows; a row kernel with column
    and full sums runs its rows in chunks, with partial rows combined at the end."""
    rng = np.random.default_rng(6)
    shape = (2048, 1024)  # 2**21 elements: codegen/flags.PARALLEL_MIN_ELEMENTS

    def ln_gelu(x, g, b, up):
        y = bp.gelu(bp.layer_norm(x) * g + b, approximate="tanh") + x
        return bp.sum(y * up) + bp.max(y)

    args = [
        bp.tensor(rng.standard_normal(s).astype(np.float32))
        for s in (shape, shape[1:], shape[1:], shape)
    ]

    def row_sums(x, g, b, up):  # no row statistic: a layer norm's now run in chunks too
        return bp.sum(x * g + b * up, axis=1)

    vg = bp.value_and_grad(ln_gelu, argnums=(0, 1, 2))
    rows = bp.compile(row_sums)
    previous = numba.get_num_threads()
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread: no loop is parallel")
    try:
        numba.set_num_threads(2)  # an earlier test may have lowered it (bench --threads 1)
        with use_backend("numba"):
            compiled = [
                vg.trace(*args).runner().compiled,
                rows.trace(*args).program.runner(None).compiled,
            ]
        kernels = "".join(k.source for c in compiled for k in c.loop_kernels)
        assert "for chunk in prange(" in kernels and "for i0 in range(lo, hi)" in kernels
        assert "for i0 in prange(n0)" in kernels
        for fn in (lambda *a: vg(*a), rows):
            ref, got = run_both(fn, *args)
            assert_trees_close(ref, got, rtol=1e-4, atol=1e-4)
    finally:
        numba.set_num_threads(previous)


PEAK_SCRIPT = """
import json, tracemalloc
import numpy as np
import backplan as bp
from backplan.runtime.backend import use_backend

def loss(params, x, labels):
    h = bp.relu(x @ params["w0"] + params["b0"])
    return bp.cross_entropy(h @ params["w1"] + params["b1"], labels)

rng = np.random.default_rng(8)
params = {"w0": bp.tensor(rng.standard_normal((6, 32)).astype(np.float32)),
          "b0": bp.tensor(np.zeros(32, np.float32)),
          "w1": bp.tensor(rng.standard_normal((32, 4)).astype(np.float32)),
          "b1": bp.tensor(np.zeros(4, np.float32))}
args = (params, bp.tensor(rng.standard_normal((16, 6)).astype(np.float32)),
        bp.tensor(rng.integers(0, 4, 16)))
with use_backend("numba"):
    vg = bp.value_and_grad(loss)
    vg(*args)
    kept = vg(*args)  # held (fast path: no copies), so the next call cannot reuse their buffers
    compiled = vg.trace(*args).runner().compiled
    arrays = [params[k]._data for k in params] + [args[1]._data, args[2]._data]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    outputs = compiled(list(arrays))
    after = tracemalloc.take_snapshot()
numpy_domain = tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)
grown = sum(s.size_diff for s in after.filter_traces([numpy_domain]).compare_to(
    before.filter_traces([numpy_domain]), "filename"))
print(json.dumps({"grown": grown, "planned_outputs": compiled.layout.output_bytes,
                  "returned": sum(o.nbytes for o in outputs),
                  "scratch": compiled.scratch_bytes,
                  "planned_scratch": compiled.layout.scratch_bytes,
                  "source": compiled.source}))
"""


def test_predicted_memory_equals_what_the_compiled_plan_allocates(tmp_path):
    """Scratch arenas are allocated once at the planned size; a call allocates exactly the
    planned output bytes (traced by tracemalloc), and the compiled code allocates nothing."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["grown"] == facts["planned_outputs"] == facts["returned"] > 0
    assert facts["scratch"] == facts["planned_scratch"] > 0
    for allocating in ("np.empty", "np.zeros", "np.full", "ascontiguousarray", "concatenate"):
        assert allocating not in facts["source"]


def test_compiled_region_of_a_transformer_block_saves_transposed_views_correctly():
    """Attention saves k transposed (a view): the forward plan returns it, backward reads it."""
    rng = np.random.default_rng(9)
    params = block_params(rng)
    x = bp.tensor(rng.standard_normal((2, 4, 8)).astype(np.float32))
    compiled = bp.compile(block_loss)
    grads = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            compiled.clear_cache()
            bp.zero_grad(params)
            compiled(params, x).backward()
            grads[backend] = {k: v.grad.numpy().copy() for k, v in params.items()}
    for k in params:
        np.testing.assert_allclose(grads["numba"][k], grads["reference"][k], rtol=2e-5, atol=1e-6)


def test_output_buffers_are_reused_only_when_nobody_holds_them():
    rng = np.random.default_rng(10)
    x = bp.tensor(rng.standard_normal((8, 8)).astype(np.float32))
    vg = bp.value_and_grad(lambda x: bp.sum(bp.tanh(x) * x))
    with use_backend("numba"):
        _, first = vg(x)
        first_values = first.numpy().copy()
        _, second = vg(bp.tensor(rng.standard_normal((8, 8)).astype(np.float32)))
        assert second.numpy() is not first.numpy()  # first is still held: not overwritten
        np.testing.assert_array_equal(first.numpy(), first_values)
        address = second.numpy().__array_interface__["data"][0]
        del second
        _, third = vg(x)
        assert third.numpy().__array_interface__["data"][0] == address  # reused
        np.testing.assert_array_equal(third.numpy(), first_values)
        assert not third.numpy().flags.writeable


def test_row_kernels_merge_consecutive_row_loops_and_equal_reference():
    """layer_norm's backward recomputes row statistics in several row loops; they run as stages
    of one loop over rows."""
    rng = np.random.default_rng(11)

    def ln(x, g, b):
        return bp.sum(bp.layer_norm(x, g, b) * bp.tensor(np.linspace(-1, 1, 24).astype(np.float32)))

    args = [bp.tensor(rng.standard_normal(s).astype(np.float32)) for s in ((40, 24), (24,), (24,))]
    vg = bp.value_and_grad(ln, argnums=(0, 1, 2))
    with use_backend("numba"):
        compiled = vg.trace(*args).runner().compiled
    rows = [  # a (rows, 1) stage, then a (rows, cols) stage, inside one loop over rows (a row
        # statistic only the row kernel reads is kept at element 0: ir/row_local.py)
        k.source
        for k in compiled.loop_kernels
        if re.search(
            r"(\[(i0|0|chunk)\] = t\d+|\+ i0, t\d+, np\.\w+\))\n {8}(row_\w+ = [^\n]+\n {8})*"
            r"(acc\d+ = \w+\n {8})?for i1 in range\(n\d+\):",
            k.source,
        )
    ]
    assert rows and "np.intp(40)" in compiled.source  # stages nested in one loop over 40 rows
    ref, got = run_both(lambda *a: vg(*a), *args)
    assert_trees_close(ref, got, rtol=1e-5, atol=1e-5)


def _inner_loops(source: str) -> list[list[str]]:
    """The lines inside each `for i1` loop of a kernel's source, one list per loop."""
    loops, depth = [], None
    for line in source.splitlines():
        indent = len(line) - len(line.lstrip())
        if depth is not None and line.strip() and indent <= depth:
            depth = None
        if depth is not None:
            loops[-1].append(line)
        if line.lstrip().startswith("for i1 in "):
            depth = indent
            loops.append([])
    return loops


def _ln_gelu_compiled(seed: int):
    """ln_gelu's value_and_grad, its arguments, and its plan compiled on the numba backend."""
    rng = np.random.default_rng(seed)

    def ln_gelu(x, g, b, up):
        y = bp.gelu(bp.layer_norm(x) * g + b, approximate="tanh") + x
        return bp.sum(y * up)

    shapes = ((40, 24), (24,), (24,), (40, 24))
    args = [bp.tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    vg = bp.value_and_grad(ln_gelu, argnums=(0, 1, 2))
    with use_backend("numba"):
        compiled = vg.trace(*args).runner().compiled
    return vg, args, compiled


def test_a_row_stage_reads_each_row_statistic_from_the_local_computing_it():
    """A row's mean and 1/std, computed by one stage and read by the next stage's loop over
    columns, are read from the locals the earlier stage computed them in: neither loaded again
    at every column (the loop's stores go to the same arena) nor stored and loaded back once a
    row (in the loop on addresses every view is its own pointer, so the load waited on the
    store). Values equal the reference's."""
    vg, args, compiled = _ln_gelu_compiled(seed=12)
    sources = [k.source for k in compiled.loop_kernels if "for i1 in " in k.source]
    assert sources
    for source in sources:
        inner = [line for loop in _inner_loops(source) for line in loop]
        assert inner and not [line for line in inner if re.search(r"\[i0\]|, i0\)", line)]
        reads = re.findall(r"=.*(?:\bw\d+\[i0\]|load\(p\d+, i0\))", source)
        assert not reads, reads
        # the statistics still stored, each at its element 0 (kept one row at a time:
        # ir/row_local.py), none at its row
        assert re.search(r"\n +w\d+\[0\] = acc\d+\n", source)
        assert not re.search(r"\n +w\d+\[i0\] = ", source)
    ref, got = run_both(lambda *a: vg(*a), *args)
    assert_trees_close(ref, got, rtol=1e-5, atol=1e-5)


def test_a_rematerialised_chain_in_the_same_row_kernel_computes_once():
    """The joint plan copies x - mean (and the mean, 1/std, the scaled and shifted value) into
    its gradient part rather than hold them; in one row kernel the copy's row statistics are
    equal to the originals (the same ops on equal inputs), so the stage that reads both
    computes the chain once. Values equal the reference's."""
    vg, args, compiled = _ln_gelu_compiled(seed=13)
    (source,) = [k.source for k in compiled.loop_kernels if "tanh_f32(" in k.source]
    kernel = source[source.rindex("\ndef kernel(") :]  # the variant with views
    (loop,) = [loop for loop in _inner_loops(kernel) if any("tanh_f32(" in x for x in loop)]
    centred = [x for x in loop if re.search(r"= \(w\d+\[i0, i1\] - \w+\)$", x)]
    assert len(centred) == 1, centred  # x - mean, once for the forward and the gradients
    assert sum("tanh_f32(" in x for x in loop) == 1
    ref, got = run_both(lambda *a: vg(*a), *args)
    assert_trees_close(ref, got, rtol=1e-5, atol=1e-5)


def test_buffers_of_one_row_kernel_never_share_storage():
    """Stages of a row kernel interleave row by row, so a buffer last read in one stage must not
    share bytes with a buffer written in a later stage (found by the random programs)."""
    rng = np.random.default_rng(12)

    def fn(a, b):
        x = bp.concatenate([a, a], axis=0) @ b
        return bp.sum(bp.var(bp.concatenate([a * 2.0 + 1.0, a], axis=0), axis=1) * x[:, 0])

    args = [bp.tensor(rng.standard_normal(s)) for s in ((1, 2), (2, 3))]
    vg = bp.value_and_grad(fn, argnums=(0, 1))
    ref, got = run_both(lambda *a: vg(*a), *args)
    assert_trees_close(ref, got, rtol=1e-10, atol=1e-12)


def test_one_array_read_through_two_index_maps_in_one_loop():
    """x + x.reshape(n, 1) reads x along both axes of one loop (found by the random programs)."""
    x = bp.tensor(np.array([0.3, -1.1, 2.0]))
    w = bp.tensor(np.arange(9.0).reshape(3, 3))
    vg = bp.value_and_grad(lambda x: bp.sum((x + x.reshape(3, 1)) * w))
    ref, got = run_both(lambda a: vg(a), x)
    assert_trees_close(ref, got, rtol=1e-12, atol=1e-12)


def test_joint_plan_computes_gelus_tanh_once_for_forward_and_derivative():
    x = bp.tensor(np.linspace(-2, 2, 12).reshape(3, 4))
    vg = bp.value_and_grad(lambda x: bp.sum(bp.gelu(x, approximate="tanh") * x))
    plan = vg.trace(x).plan
    assert [n.op for n in plan.graph.nodes].count("tanh") == 1
    assert "gelu" not in [n.op for n in plan.graph.nodes]
    ref, got = run_both(lambda a: vg(a), x)
    assert_trees_close(ref, got, rtol=1e-12, atol=1e-12)
    xs = x.numpy()
    gelu = 0.5 * xs * (1 + np.tanh(np.sqrt(2 / np.pi) * (xs + 0.044715 * xs**3)))
    np.testing.assert_allclose(ref[0].numpy(), np.sum(gelu * xs), rtol=1e-12)
