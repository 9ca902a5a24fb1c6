"""explain(): saved-buffer tables of known programs, predicted bytes against what the reference
interpreter really holds, the report's text, DOT and picture, and the live grad_fn table."""

import importlib.util
import pathlib
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from dot_parser import label_text, parse_dot
from helpers import here

import backplan as bp
from backplan.examples.mlp import init_mlp, mlp_loss
from backplan.ir.interpreter import run_plan
from backplan.ir.liveness import OWNED_ROLES
from backplan.ir.reference_storage import array_root
from backplan.ir.text import value_names
from backplan.tracer.pytree import flatten

RNG = np.random.default_rng(7)


def f32(*shape, requires_grad=False):
    data = RNG.standard_normal(shape).astype(np.float32)
    return bp.tensor(data, requires_grad=requires_grad)


def mul_sum(a, b):
    return (a * b).sum()


def tanh_sum(x):
    return bp.tanh(x).sum()


def plain_sum(x):
    return bp.sum(x)


def flat(report) -> str:
    """The report's text with line wrapping undone."""
    return " ".join(str(report).split())


def saved_facts(report):
    return [
        (s.name, s.op, s.shape, s.nbytes, s.reason, s.is_region_input) for s in report.saved_buffers
    ]


# ---- the saved-buffer table of known programs -----------------------------------------------


def test_mul_with_only_a_requiring_grad_saves_b_alone():
    a, b = f32(3, 4, requires_grad=True), f32(3, 4)
    report = bp.compile(mul_sum).explain(a, b)
    assert saved_facts(report) == [("b", "input", (3, 4), 48, "mul derivative reads input 1", True)]
    assert report.saved_bytes == 48 and report.saved_input_bytes == 48


def test_joint_mul_needs_no_saved_buffer_because_the_gradient_is_b_itself():
    a, b = f32(3, 4, requires_grad=True), f32(3, 4)
    report = bp.value_and_grad(mul_sum).explain(a, b)
    joint = report.plans["joint"].graph
    assert report.saved_buffers == [] and report.n_backward_steps == 0
    assert joint.outputs[1] is joint.inputs[1]


def test_mul_with_both_requiring_grad_saves_both():
    a, b = f32(3, 4, requires_grad=True), f32(3, 4, requires_grad=True)
    report = bp.explain(mul_sum, a, b)
    assert sorted((s.name, s.reason) for s in report.saved_buffers) == [
        ("a", "mul derivative reads input 0"),
        ("b", "mul derivative reads input 1"),
    ]


@pytest.mark.parametrize("form", ["compiled", "value_and_grad"])
def test_sum_saves_nothing(form):
    x = f32(5, 2, requires_grad=True)
    fn = bp.compile(plain_sum) if form == "compiled" else bp.value_and_grad(plain_sum)
    report = fn.explain(x)
    assert report.saved_buffers == [] and report.saved_bytes == 0
    assert report.n_backward_steps > 0
    assert "nothing is saved" in flat(report)


@pytest.mark.parametrize("form", ["compiled", "value_and_grad"])
def test_tanh_saves_its_output_with_its_lifetime(form):
    x = f32(3, 4, requires_grad=True)
    fn = bp.compile(tanh_sum) if form == "compiled" else bp.value_and_grad(tanh_sum)
    report = fn.explain(x)
    (saved,) = report.saved_buffers
    assert (saved.op, saved.shape, saved.nbytes, saved.is_region_input) == (
        "tanh",
        (3, 4),
        48,
        False,
    )
    assert saved.reason == "tanh derivative reads its output"
    assert saved.written_step == 0
    backward = [s for s in report.view.steps if s.phase == "backward"]
    readers = [i for i, s in enumerate(backward) if report.view.buffers["f%1"].key in s.reads]
    assert list(saved.read_steps) == readers and saved.last_read_step == readers[-1]
    assert all(backward[i].op == "mul" for i in readers)


@pytest.mark.parametrize("form", ["compiled", "value_and_grad"])
def test_a_value_two_rules_need_lists_both_reasons(form):
    x, w = f32(4, 3), f32(3, 3, requires_grad=True)
    fn = (
        bp.compile(relu_matmul_sum) if form == "compiled" else bp.value_and_grad(relu_matmul_sum, 1)
    )
    report = fn.explain(x, w)
    relu_out = next(s for s in report.saved_buffers if s.op == "relu")
    assert relu_out.reason == ("matmul derivative reads input 0; relu derivative reads its output")


def relu_matmul_sum(x, w):
    return (bp.relu(x @ w) @ w).sum()


def test_the_joint_plan_keeps_why_it_holds_each_value_through_its_expansions():
    """value_and_grad's reasons are the ones its own differentiation heard, carried through the
    passes onto the plan's values: layer_norm is expanded into primitives before the joint
    plan's cleanup, yet its scale is held because layer_norm's rule reads it, as the compiled
    region says."""

    def norm_tanh(x, w, g, b):
        return bp.tanh(bp.layer_norm(x @ w, g, b)).sum()

    args = f32(4, 3), f32(3, 5, requires_grad=True), f32(5, requires_grad=True), f32(5)
    joint = bp.value_and_grad(norm_tanh, (1, 2)).explain(*args)
    region = bp.compile(norm_tanh).explain(*args)
    reasons = {(s.name, s.reason) for s in joint.saved_buffers}
    assert ("g", "layer_norm derivative reads input 1") in reasons
    assert ("g", "layer_norm derivative reads input 1") in {
        (s.name, s.reason) for s in region.saved_buffers
    }
    graph = joint.plans["joint"].graph
    tanh = next(n for n in graph.nodes if n.op == "tanh")
    assert graph.reasons[tanh] == "tanh derivative reads its output"


def test_no_input_requiring_grad_has_no_backward():
    report = bp.explain(tanh_sum, f32(2, 2))
    assert report.backward_ir is None and report.saved_buffers == []
    assert report.n_backward_steps == 0 and "no backward" in flat(report)


def test_under_no_grad_there_is_no_backward():
    with bp.no_grad():
        report = bp.explain(tanh_sum, f32(2, 2, requires_grad=True))
    assert report.backward_ir is None and "grad mode is off" in flat(report)


def test_arguments_are_named_by_their_path_in_the_call():
    params = init_mlp([6, 5, 3])
    x, labels = f32(4, 6), bp.tensor(np.array([0, 2, 1, 0]))
    report = mlp_loss.explain(params, x, labels)
    names = {s.name for s in report.saved_buffers if s.is_region_input}
    assert names == {"x", "labels", "params['w1']"}
    assert "%0 = params['w0']: f32[6,5], requires grad" in str(report)

    vg = bp.value_and_grad(lambda p, inputs: mlp_loss.fn(p, inputs, labels))
    joint = vg.explain(params, x)
    assert {s.name for s in joint.saved_buffers if s.is_region_input} == {
        "inputs",
        "p['w1']",
        "labels (captured)",
    }
    assert "grad p['w0']" in {b.name for b in joint.view.buffers.values()}


GLOBAL_PARAMS = {"w": f32(3, 3, requires_grad=True)}


def uses_global_params(x):
    return bp.tanh(x @ GLOBAL_PARAMS["w"]).sum()


def test_captured_tensors_are_named_as_the_code_calls_them():
    scale = f32(3, requires_grad=True)
    x = f32(2, 3)
    report = bp.explain(lambda x: (x * scale).sum(), x)
    assert [s.name for s in report.saved_buffers] == ["x"]
    assert "grad scale (captured)" in {b.name for b in report.view.buffers.values()}
    report = bp.explain(uses_global_params, x)
    assert "%1 = GLOBAL_PARAMS['w'] (captured): f32[3,3], requires grad" in str(report)
    joint = bp.value_and_grad(lambda x: (x * scale).sum()).explain(x)
    assert "scale (captured)" in {b.name for b in joint.view.buffers.values()}


# ---- predicted bytes against what the interpreter holds -------------------------------------


def held_bytes(arrays, caller_ids) -> int:
    """Bytes of the distinct buffers held (a view counts as the array it views), not counting
    the caller's own."""
    roots = [array_root(a) for a in arrays]
    distinct = {id(r): r.nbytes for r in roots if id(r) not in caller_ids}
    return sum(distinct.values())


def replay_region(program, arrays):
    """Run a region program's plans the way the runtime does (forward, the region holding the
    saved buffers and the caller the outputs, then backward releasing each saved buffer at its
    free), recording the bytes held after every step."""
    plans, caller_ids, held = program.plans, {id(a) for a in arrays}, []
    outputs = run_plan(
        plans.forward,
        list(arrays),
        on_step=lambda s, env: held.append(held_bytes(env.values(), caller_ids)),
    )
    user_outputs = outputs[: plans.n_outputs]
    saved = {
        slot: arrays[i] if kind == "input" else outputs[i]
        for slot, (kind, i) in enumerate(s.source for s in plans.saved)
    }
    del outputs
    if plans.backward is None:
        return held
    args = []
    for index in program.cotangent_slot:
        out = plans.forward.graph.outputs[index]
        args.append(np.ones(out.shape, dtype=user_outputs[index].dtype))
    n_cot = len(args)
    args += [saved[i] for i in range(len(saved))]

    def on_step(step, env):
        held.append(held_bytes([*env.values(), *user_outputs, *saved.values()], caller_ids))

    run_plan(plans.backward, args, release=lambda i: saved.pop(i - n_cot, None), on_step=on_step)
    return held


def plan_bytes_by_step(plan, arrays):
    """Bytes the plan's own values hold in the interpreter's environment after every step."""
    held = []

    def on_step(step, env):
        held.append(
            sum(a.nbytes for v, a in env.items() if v.op != "input" or v.role in OWNED_ROLES)
        )

    run_plan(plan, list(arrays), on_step=on_step)
    return held


def mlp_case():
    params = init_mlp([12, 16, 16, 5])
    return mlp_loss, (params, f32(8, 12), bp.tensor(RNG.integers(0, 5, 8)))


def returns_saved_output(x, w):
    h = bp.tanh(x @ w)
    return (h * h).mean(), h


def softmax_layer(x, w):
    return bp.layer_norm(bp.softmax(x @ w, axis=-1) * 3.0).sum()


REGION_CASES = {
    "mlp": mlp_case,
    "mul": lambda: (bp.compile(mul_sum), (f32(3, 4, requires_grad=True), f32(3, 4))),
    "tanh": lambda: (bp.compile(tanh_sum), (f32(6, 5, requires_grad=True),)),
    "saved_output": lambda: (
        bp.compile(returns_saved_output),
        (f32(4, 3), f32(3, 6, requires_grad=True)),
    ),
    "softmax_layer": lambda: (
        bp.compile(softmax_layer),
        (f32(4, 7, requires_grad=True), f32(7, 9, requires_grad=True)),
    ),
}


def call_arrays(fn, args):
    traced = fn.trace(*args)
    call_tensors = [leaf for leaf in flatten(args)[0] if isinstance(leaf, bp.Tensor)]
    return traced, [t.numpy() for t in call_tensors] + [t.numpy() for t in traced.captured]


@pytest.mark.parametrize("case", sorted(REGION_CASES))
def test_predicted_bytes_equal_what_the_reference_path_holds(case):
    fn, args = REGION_CASES[case]()
    traced, arrays = call_arrays(fn, args)
    report = fn.explain(*args)
    held = replay_region(traced.program, arrays)
    assert held == report.live_bytes
    assert report.reference_peak_bytes == max(held)
    n_fwd = report.n_forward_steps
    assert report.forward_peak_bytes == max(held[:n_fwd])
    assert report.backward_peak_bytes == max(held[n_fwd:], default=0)
    plans = traced.program.plans
    forward_held = plan_bytes_by_step(plans.forward, arrays)
    assert forward_held == plans.forward.live_bytes_by_step()
    assert max(forward_held) == plans.forward.peak_bytes


@pytest.mark.parametrize("case", sorted(REGION_CASES))
def test_each_plans_own_peak_equals_its_interpreter_run(case):
    fn, args = REGION_CASES[case]()
    traced, arrays = call_arrays(fn, args)
    plans = traced.program.plans
    outputs = run_plan(plans.forward, list(arrays))
    cotangents = [
        np.ones(plans.forward.graph.outputs[i].shape, outputs[i].dtype)
        for i in traced.program.cotangent_slot
    ]
    saved = [
        arrays[i] if kind == "input" else outputs[i] for kind, i in (s.source for s in plans.saved)
    ]
    held = plan_bytes_by_step(plans.backward, cotangents + saved)
    assert held == plans.backward.live_bytes_by_step()
    assert max(held) == plans.backward.peak_bytes


@pytest.mark.parametrize("case", ["mlp", "tanh", "softmax_layer"])
def test_joint_plan_bytes_equal_what_the_interpreter_holds(case):
    fn, args = REGION_CASES[case]()
    vg = bp.value_and_grad(fn.fn, argnums=1 if case == "softmax_layer" else 0)
    entry = vg.trace(*args)
    arrays = [t.numpy() for t in flatten(args)[0] if isinstance(t, bp.Tensor)]
    arrays += [t.numpy() for t in entry.captured]
    caller_ids = {id(a) for a in arrays}
    held = []
    run_plan(
        entry.plan,
        list(arrays),
        on_step=lambda s, env: held.append(held_bytes(env.values(), caller_ids)),
    )
    report = vg.explain(*args)
    assert held == report.live_bytes and report.reference_peak_bytes == max(held)


def test_explain_runs_no_arithmetic(monkeypatch):
    import backplan.ir.interpreter as interpreter
    import backplan.tracer.dispatch as dispatch

    def refuse(*args, **kwargs):
        raise AssertionError("explain() evaluated an op")

    monkeypatch.setattr(interpreter, "evaluate", refuse)
    monkeypatch.setattr(dispatch, "evaluate", refuse)
    fn, args = mlp_case()
    assert fn.explain(*args).peak_bytes > 0
    assert bp.value_and_grad(tanh_sum).explain(f32(3, 3)).peak_bytes > 0


# ---- values recomputed instead of saved ------------------------------------------------------


def ln_gelu(x, g, b, w):
    y = bp.gelu(bp.layer_norm(x) * g + b, approximate="tanh") + x
    return bp.sum(y * w)


def ln_gelu_inputs():
    return (
        f32(6, 8, requires_grad=True),
        f32(8, requires_grad=True),
        f32(8, requires_grad=True),
        f32(8),
    )


def saved_table_rows(text: str) -> dict[str, str]:
    """Rows of the saved-buffer table in a report or a grad_fn print, by their name column."""
    table = text.split("3. Saved buffers")[-1].split("4. Memory")[0]
    rows = [line for line in table.splitlines() if line.startswith("  ")]
    return {row.split()[0]: row for row in rows[1:] if " " in row.strip()}


def test_recomputed_values_have_their_own_rows_and_are_not_in_the_saved_bytes():
    args = ln_gelu_inputs()
    fn = bp.compile(ln_gelu)
    report = fn.explain(*args)
    assert report.saved_bytes - report.saved_input_bytes == 0
    assert report.saved_bytes == sum(s.nbytes for s in report.saved_buffers)
    recomputed = {r.op: r for r in report.recomputed}
    # compiled plans run layer_norm as its primitives: the row names the op inside it
    assert sorted(recomputed) == ["add", "layer_norm [mul]"]
    assert [(r.shape, r.nbytes) for r in recomputed.values()] == [((6, 8), 192)] * 2
    assert recomputed["add"].chain == ("mul", "add")
    normalised = recomputed["layer_norm [mul]"].chain
    assert normalised[-1] == "mul" and {"sum", "sub", "sqrt", "div"} <= set(normalised)
    # each chain is found again in the backward, expanded as the forward was
    assert all(r.recomputed_step is not None for r in report.recomputed)
    assert report.recomputed_bytes == 2 * 6 * 8 * 4
    text = str(report)
    rows = saved_table_rows(text)
    backward = fn.trace(*args).program.plans.backward.graph
    names = value_names(backward)
    for r in report.recomputed:  # the backward IR's header gives both names: they differ
        assert f"{r.name} -> {names[backward.nodes[r.recomputed_step]]} at b" in text
    for r in report.recomputed:
        row = rows[r.name]
        assert f"{r.op} at " in row and "192" in row
        assert f"recomputed, not saved: {len(r.chain)} op" in row
        assert f"rerun at b{r.recomputed_step}" in row
    assert (
        f"3. Saved buffers ({len(report.saved_buffers)}, {report.saved_bytes} B; "
        "2 recomputed instead, 384 B not saved)"
    ) in text
    assert "Rematerialisation recomputes 2 values" in flat(report)
    assert "384 B are not saved" in flat(report)

    out = fn(*args)
    count = f"{len(report.saved_buffers)} saved buffer(s) and 2 recomputed instead"
    assert count in repr(out.grad_fn)
    live = saved_table_rows(str(out.grad_fn))
    assert [live[r.name].split()[-1] for r in report.recomputed] == ["recomputed"] * 2
    assert all(live[s.name].split()[-1] == "alive" for s in report.saved_buffers)


def test_without_remat_the_same_values_are_saved():
    args = ln_gelu_inputs()
    report = bp.compile(remat=False)(ln_gelu).explain(*args)
    assert report.recomputed == [] and report.recomputed_bytes == 0
    computed = sorted((s.op, s.nbytes) for s in report.saved_buffers if not s.is_region_input)
    assert computed == [("add", 192), ("layer_norm [mul]", 192)]
    assert report.saved_bytes - report.saved_input_bytes == 384
    assert "recomputed" not in str(report).split("4. Memory")[0]


def test_the_recomputed_step_rebuilds_the_value_the_forward_computed():
    fn = bp.compile(ln_gelu)
    args = ln_gelu_inputs()
    traced, arrays = call_arrays(fn, args)
    report = fn.explain(*args)
    plans = traced.program.plans
    forward, backward = {}, {}
    outputs = run_plan(
        plans.forward,
        list(arrays),
        on_step=lambda step, env: forward.update(
            {step: env[plans.forward.graph.nodes[step]].copy()}
        ),
    )
    saved = [
        arrays[i] if kind == "input" else outputs[i] for kind, i in (s.source for s in plans.saved)
    ]
    run_plan(
        plans.backward,
        [np.float32(1.0), *saved],
        on_step=lambda step, env: backward.update(
            {step: env[plans.backward.graph.nodes[step]].copy()}
        ),
    )
    assert len(report.recomputed) == 2
    backward_nodes = plans.backward.graph.nodes
    for r in report.recomputed:
        rebuilt = backward_nodes[r.recomputed_step]
        assert r.written_step >= 0
        assert rebuilt.op == plans.forward.graph.nodes[r.written_step].op
        assert r.op.endswith(f"[{rebuilt.op}]") or r.op == rebuilt.op
        np.testing.assert_array_equal(backward[r.recomputed_step], forward[r.written_step])
        readers = [i for i, n in enumerate(backward_nodes) if rebuilt in n.inputs]
        assert list(r.read_steps) == readers and r.last_read_step == readers[-1]


# ---- the text report ------------------------------------------------------------------------


def test_report_text_has_the_sections_in_order_with_user_lines():
    @bp.compile
    def model(x, w):
        return bp.tanh(x @ w).sum()  # the line every op of the report must point at

    line = here(-2)
    report = model.explain(f32(2, 3), f32(3, 4, requires_grad=True))
    text = str(report)
    titles = [
        "1. Summary",
        "2. Plans",
        "3. Saved buffers",
        "4. Memory",
        "5. Kernels",
        "6. Retracing",
    ]
    positions = [text.index(t) for t in titles]
    assert positions == sorted(positions)
    assert report.forward_ir in "\n".join(row[8:] for row in text.splitlines())
    for ir in (report.forward_ir, report.backward_ir):
        ops = [row for row in ir.splitlines() if row.lstrip().startswith("%")]
        assert ops and all(row.endswith(f"# {line}") for row in ops)
    summary = " ".join(text[positions[0] : positions[1]].split())
    assert f"{report.n_forward_steps} forward and {report.n_backward_steps} backward" in summary
    assert f"peak: {report.peak_bytes:,} B on the reference backend" in summary
    assert f"{report.saved_bytes:,} B" in summary


def test_retrace_reason_names_the_changed_part_of_the_key():
    fn = bp.compile(tanh_sum, dynamic=False)
    fn(f32(3, 4))
    report = fn.explain(f32(5, 4))
    assert report.traces == 2 and report.retrace_reason == "x: shape (3, 4) -> (5, 4)"
    assert "x: shape (3, 4) -> (5, 4)" in flat(report)
    assert "Traced once" in flat(bp.compile(tanh_sum).explain(f32(3, 4)))

    vg = bp.value_and_grad(tanh_sum)
    vg(f32(3, 4))
    report = vg.explain(f32(3, 4).astype("f64"))
    assert report.traces == 2 and "dtype f32 -> f64" in report.retrace_reason


def test_kernel_groups_from_a_fusion_pass_are_reported():
    fn = bp.compile(tanh_sum)
    x = f32(3, 4, requires_grad=True)
    report = fn.explain(x)
    assert len(report.kernels) == len(report.view.steps) and report.fused_kernels == 0
    assert report.backend == "reference" and "runs each of the 8 steps" in flat(report)
    from backplan.report.report import region_report

    program = fn.trace(x).program
    backward = program.plans.backward.graph.nodes
    fused = region_report(program, kernel_groups={"forward": [[0, 1]], "backward": [backward[-3:]]})
    assert fused.fused_kernels == 2
    assert len(fused.kernels) == len(report.view.steps) - 3
    assert "k0 (op): f0 tanh, f1 sum" in flat(fused)
    with pytest.raises(bp.BackplanError, match="cover a step twice"):
        region_report(program, kernel_groups={"forward": [[0, 1], [1]]})
    with pytest.raises(bp.BackplanError, match="unknown plan"):
        region_report(program, kernel_groups={"middle": [[0]]})


@pytest.mark.parametrize("form", ["compiled", "value_and_grad"])
def test_numba_backend_reports_fusion_groups_without_compiling(form, monkeypatch):
    import backplan.codegen.run.compiled as compiled
    from backplan.ir.fusion import group_kernels
    from backplan.runtime.backend import use_backend

    monkeypatch.setattr(compiled, "CompiledPlan", None)  # explain() must not compile
    fn = bp.compile(tanh_sum) if form == "compiled" else bp.value_and_grad(tanh_sum)
    with use_backend("numba"):
        report = fn.explain(f32(3, 4, requires_grad=True))
    steps = report.view.steps
    expected, offset = [], 0
    for plan in report.plans.values():
        position = {node: offset + i for i, node in enumerate(plan.graph.nodes)}
        expected += [
            (tuple(sorted(position[n] for n in k.all_nodes)), k.kind)
            for k in group_kernels(plan.graph)
        ]
        offset += len(plan.graph.nodes)
    assert sorted((k.steps, k.kind) for k in report.kernels) == sorted(expected)
    tanh_kernel = next(k for k in report.kernels if steps[k.steps[0]].op == "tanh")
    assert [steps[i].op for i in tanh_kernel.steps][:2] == ["tanh", "sum"]
    assert report.fused_kernels == sum(1 for k in report.kernels if k.fused and k.runs_code)
    assert report.n_kernels < len(steps) and report.backend == "numba"
    assert "f0 tanh, f1 sum" in flat(report) and "no kernel:" in flat(report)
    assert sorted(s for k in report.kernels for s in k.steps) == list(range(len(steps)))


def compiled_layouts(fn, form, args) -> dict:
    """What the code generator lays out for each plan explain() describes, by plan label."""
    from backplan.codegen.render.emit import generate
    from backplan.ir.lowering import lower

    if form == "value_and_grad":
        return {"joint": generate(lower(fn.trace(*args).plan))}
    program = fn.trace(*args).program
    backward = program.plans.backward
    return {
        "forward": generate(lower(program.plans.forward)),
        "backward (consume)": generate(lower(backward, program.private_saved_inputs())),
        "backward (retain)": generate(lower(backward)),
    }


@pytest.mark.parametrize("form", ["compiled", "value_and_grad"])
@pytest.mark.parametrize("case", ["ln_gelu", "mlp"])
def test_numba_report_states_the_compiled_layout_without_compiling(
    form, case, tmp_path, monkeypatch
):
    import backplan.codegen.run.compiled as compiled
    from backplan.ir.lowering import lower
    from backplan.report.wording import format_bytes
    from backplan.runtime.backend import make_runner, use_backend

    cache = tmp_path / "kernels"
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(cache))
    if case == "ln_gelu":
        model, args = ln_gelu, ln_gelu_inputs()
    else:
        compiled_mlp, args = mlp_case()
        model = compiled_mlp.fn
    fn = bp.compile(model) if form == "compiled" else bp.value_and_grad(model)
    with monkeypatch.context() as patch, use_backend("numba"):
        patch.setattr(compiled.CompiledPlan, "__init__", None)  # compiling would raise
        report = fn.explain(*args)
    layouts = compiled_layouts(fn, form, args)
    assert [
        (f.plan, f.kernels, f.scratch_bytes, f.output_bytes, f.reused_saved)
        for f in report.compiled
    ] == [
        (
            name,
            g.kernel_count,
            g.layout.scratch_bytes,
            g.layout.output_bytes,
            len(g.layout.reused_saved),
        )
        for name, g in layouts.items()
    ]
    step = [g for name, g in layouts.items() if name != "backward (retain)"]
    assert report.n_kernels == sum(g.kernel_count for g in step)
    # the forward and backward() share one arena, the larger's size (runtime/program.py)
    assert report.compiled_scratch_bytes == max(g.layout.scratch_bytes for g in step)
    assert report.compiled_output_bytes == sum(g.layout.output_bytes for g in step)
    memory = " ".join(str(report).split("4. Memory")[1].split("5. Kernels")[0].split())
    assert "Reference interpreter (BACKPLAN_BACKEND=reference)" in memory
    assert "Numba backend (what runs here)" in memory
    for name, g in layouts.items():
        assert (
            f"{name} {g.kernel_count} {format_bytes(g.layout.scratch_bytes)} "
            f"{format_bytes(g.layout.output_bytes)}"
        ) in memory
    assert f"keeps {format_bytes(report.compiled_scratch_bytes)} of scratch" in flat(report)
    assert not cache.exists() or list(cache.iterdir()) == []
    plan = report.plans.get("forward", report.plans.get("joint"))
    make_runner(lower(plan), "numba")  # writes the generated module (Numba compiles on first call)
    assert any(path.suffix == ".py" for path in cache.iterdir())


def test_reference_report_says_which_path_its_bytes_describe():
    report = bp.compile(ln_gelu).explain(*ln_gelu_inputs())
    assert report.compiled is None and report.compiled_scratch_bytes is None
    memory = " ".join(str(report).split("4. Memory")[1].split("5. Kernels")[0].split())
    assert "Reference interpreter (BACKPLAN_BACKEND=reference)" in memory
    assert f"peaks at {report.reference_peak_step.label}" in memory
    assert "BACKPLAN_BACKEND=numba" in memory and "scratch arena" in memory


def test_a_plan_numba_cannot_compile_is_reported_on_the_reference_interpreter():
    from backplan.runtime.backend import use_backend

    def integer_matmul(a, b, w):
        return bp.sum((a @ b).astype("f32") * w)

    args = (
        bp.tensor(np.arange(6).reshape(2, 3)),
        bp.tensor(np.arange(12).reshape(3, 4)),
        f32(2, 4, requires_grad=True),
    )
    with use_backend("numba"):
        report = bp.explain(integer_matmul, *args)
    facts = {f.plan: f for f in report.compiled}
    assert not facts["forward"].compiled and "integer matmul" in facts["forward"].unsupported
    assert facts["backward (consume)"].compiled
    forward_steps = [s.index for s in report.view.steps if s.phase == "forward"]
    assert [k.steps for k in report.kernels if k.steps[0] in forward_steps] == [
        (i,) for i in forward_steps
    ]
    assert report.n_kernels == len(forward_steps) + facts["backward (consume)"].kernels
    text = flat(report)
    assert "forward runs on the reference interpreter: integer matmul" in text
    assert "The forward plan runs on the reference interpreter, one kernel per step" in text


def test_explain_of_something_not_callable_is_a_clear_error():
    with pytest.raises(bp.BackplanError, match="needs a function, got int"):
        bp.explain(3)


def test_grad_wrapper_explains_its_joint_plan():
    report = bp.grad(tanh_sum).explain(f32(2, 2))
    assert [s.reason for s in report.saved_buffers] == ["tanh derivative reads its output"]
    assert report.backward_ir is None and "joint IR" in flat(report)


# ---- the live table after backward ----------------------------------------------------------


def test_grad_fn_prints_the_same_table_with_a_freed_column():
    fn = bp.compile(mul_sum)
    a, b = f32(3, 4, requires_grad=True), f32(3, 4)
    report = fn.explain(a, b)
    out = fn(a, b)
    alive = str(out.grad_fn).splitlines()
    assert alive[1].split()[-1] == "state" and alive[2].split()[-1] == "alive"
    table = str(report).split("3. Saved buffers")[1].splitlines()
    assert alive[2].rsplit("alive", 1)[0].rstrip() == table[2].rstrip()
    out.backward()
    freed = str(out.grad_fn).splitlines()
    assert freed[2].split()[-1] == "freed"
    assert "lives on while you still hold it" in "\n".join(freed)
    assert b.numpy().shape == (3, 4)


# ---- DOT ------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["compiled", "value_and_grad"])
def test_dot_parses_and_draws_every_saved_buffer_between_producer_and_readers(form):
    fn, args = mlp_case()
    report = fn.explain(*args) if form == "compiled" else bp.value_and_grad(fn.fn).explain(*args)
    graph = parse_dot(report.to_dot())
    assert graph.clusters == ["cluster_forward", "cluster_backward"]
    saved_nodes = {k: v for k, v in graph.nodes.items() if k.startswith("saved:")}
    assert len(saved_nodes) == len(report.saved_buffers)
    labels = [label_text(v["label"]).splitlines()[0] for v in saved_nodes.values()]
    assert sorted(labels) == sorted(f"saved {s.name}" for s in report.saved_buffers)
    for node in saved_nodes:
        incoming = [a for a, b, _ in graph.edges if b == node]
        outgoing = [b for a, b, _ in graph.edges if a == node]
        assert incoming == [node[len("saved:") :]] and outgoing
        assert all(report.view.buffers[b].phase == "backward" for b in outgoing)
    declared = set(graph.nodes)
    assert all(a in declared and b in declared for a, b, _ in graph.edges)


def test_dot_is_accepted_by_graphviz_where_installed(tmp_path):
    fn, args = mlp_case()
    path = tmp_path / "step.dot"
    fn.explain(*args).save_dot(path)
    try:
        import pydot
    except ImportError:
        pydot = None
    if pydot is not None:
        (graph,) = pydot.graph_from_dot_file(str(path))
        assert any(n.get_name().startswith('"saved:') for n in graph.get_node_list()) or any(
            n.get_name().startswith('"saved:')
            for s in graph.get_subgraph_list()
            for n in s.get_node_list()
        )
    if shutil.which("dot") is not None:
        result = subprocess.run(["dot", "-Tsvg", str(path)], capture_output=True, timeout=60)
        assert result.returncode == 0, result.stderr.decode()
        ET.fromstring(result.stdout)
    if pydot is None and shutil.which("dot") is None:
        pytest.skip("neither pydot nor Graphviz is installed")


def test_dot_quotes_names_with_quotes_and_backslashes():
    key = 'a"b\\c'

    @bp.compile
    def quoted(weights):
        return (weights[key] * weights[key]).sum()

    report = quoted.explain({key: f32(2, 2, requires_grad=True)})
    name = report.saved_buffers[0].name
    assert '"' in name and "\\" in name
    graph = parse_dot(report.to_dot())
    first_lines = {label_text(v["label"]).splitlines()[0] for v in graph.nodes.values()}
    assert name in first_lines and f"saved {name}" in first_lines


# ---- the picture ----------------------------------------------------------------------------


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as file:
        head = file.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_plot_writes_a_readable_png_and_svg(tmp_path):
    pytest.importorskip("matplotlib")
    fn, args = mlp_case()
    report = fn.explain(*args)
    png, svg = tmp_path / "step.png", tmp_path / "step.svg"
    report.plot(png)
    width, height = png_size(png)
    assert width >= 800 and height >= 500
    from matplotlib.image import imread

    pixels = imread(png)
    assert pixels.shape[:2] == (height, width) and pixels.std() > 0.05
    report.plot(svg)
    text = svg.read_text()
    ET.fromstring(text)
    peak = report.reference_peak_step
    for expected in ("peak", "bytes held", "step (fN", f"at {peak.label}", "saved for backward"):
        assert expected in text.replace("&#39;", "'")


def test_plot_refuses_other_formats(tmp_path):
    report = bp.explain(tanh_sum, f32(2, 2, requires_grad=True))
    with pytest.raises(bp.BackplanError, match=r"\.png or \.svg"):
        report.plot(tmp_path / "step.jpg")


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    report = bp.explain(tanh_sum, f32(2, 2, requires_grad=True))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(bp.BackplanError, match=r"pip install 'backplan\[plot\]'"):
        report.plot(tmp_path / "step.png")
    assert not (tmp_path / "step.png").exists()


# ---- the guide's explain page -------------------------------------------------------------


ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_explain_page_shows_the_current_example_report_and_picture():
    from backplan.runtime.backend import use_backend

    spec = importlib.util.spec_from_file_location(
        "explain_example", ROOT / "docs" / "explain_example.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with use_backend("numba"):
        report = example.loss_fn.explain(*example.example_inputs())
    page = (ROOT / "docs" / "explain.md").read_text()
    shown = page.split("```text\n")[1].split("\n```")[0]
    assert shown == str(report).rstrip("\n")
    readme = (ROOT / "README.md").read_text()
    excerpt = readme.split("## Explain in one screen")[1].split("```text\n")[1].split("\n```")[0]
    for section in excerpt.split("\n\n"):  # the README's abridged report: whole sections of it
        assert section in shown, section
    picture = ROOT / "docs" / "explain_example.png"
    assert "](explain_example.png)" in page
    width, height = png_size(picture)
    assert width >= 800 and height >= 500 and picture.stat().st_size < 200_000
