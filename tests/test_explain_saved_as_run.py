"""On the numba backend explain's saved buffers and saved totals are the compiled plan's: a
value the unfused plan reads across from its forward part but the compiled plan computes inside
the fused loop that reads it (ln_gelu's tanh, in its one loop over rows) is not listed as saved
nor counted in any saved total; it is named apart as not stored. The reference interpreter
stores every value, so its report lists them all. Nothing here compiles (explain only)."""

from __future__ import annotations

import numpy as np
from test_explain_as_run import held

import backplan as bp
from backplan.bench.memory_audit import readme_step
from backplan.ir.lowering import lower
from backplan.ir.text import value_names
from backplan.runtime.backend import use_backend


def _ln_gelu(x, g, b, up):
    y = bp.gelu(bp.layer_norm(x) * g + b, approximate="tanh") + x
    return bp.sum(y * up)


def ln_gelu_args():
    rng = np.random.default_rng(0)
    x, up = (rng.standard_normal((64, 32)).astype(np.float32) for _ in range(2))
    g = (1 + 0.1 * rng.standard_normal(32)).astype(np.float32)
    return x, g, (0.1 * rng.standard_normal(32)).astype(np.float32), up


def both(explain):
    with use_backend("reference"):
        reference = explain()
    with use_backend("numba"):
        compiled = explain()
    return reference, compiled


def has_buffer(lowered, value) -> bool:
    """Whether the compiled plan's memory layout gives value (or the base it aliases) bytes."""
    layout = lowered.layout
    places = set(layout.scratch_offsets) | set(layout.outputs) | set(layout.reused_saved)
    while value not in places and value.op in ("reshape", "broadcast_to") and value.inputs:
        value = value.inputs[0]
    return value in places


def test_the_joint_plan_lists_what_the_compiled_plan_stores():
    vg = bp.value_and_grad(_ln_gelu, argnums=(0, 1, 2))
    reference, compiled = both(lambda: vg.explain(*ln_gelu_args()))
    plan = compiled.plans["joint"]
    values = {name: v for v, name in value_names(plan.graph).items()}
    lowered = lower(plan)
    assert compiled.fused_saved and not reference.fused_saved
    assert "tanh" in {f.op for f in compiled.fused_saved}
    assert "tanh" in {b.op for b in reference.saved_buffers}
    assert "tanh" not in {b.op for b in compiled.saved_buffers}
    for row in compiled.saved_buffers:
        assert row.is_region_input or has_buffer(lowered, values[row.name]), row.name
    for row in compiled.fused_saved:
        assert not has_buffer(lowered, values[row.name]), row.name
    assert sorted(b.name for b in compiled.saved_buffers + compiled.fused_saved) == sorted(
        b.name for b in reference.saved_buffers
    )
    fused = sum(f.nbytes for f in compiled.fused_saved)
    assert compiled.saved_bytes + fused == reference.saved_bytes
    text = " ".join(str(compiled).split())
    assert f"in total ({compiled.saved_input_bytes:,} B" in text
    assert f"3. Saved buffers ({len(compiled.saved_buffers)}, {compiled.saved_bytes:,} B" in text
    assert "Not stored by the compiled plan, so in no total above:" in text
    assert "Not stored" not in str(reference)


def test_the_readme_step_lists_the_held_values_its_compiled_plan_stores():
    reference, compiled = both(lambda: readme_step()[0].explain(*readme_step()[1]))
    plan = compiled.plans["forward"]
    values = {name: v for v, name in value_names(plan.graph).items()}
    lowered = lower(plan)
    assert compiled.fused_saved, "the README step fuses some held values away"
    for row in compiled.inlined_saved:
        if not row.is_region_input and "(view of" not in row.name:
            assert has_buffer(lowered, values[row.name]), row.name
    for row in compiled.fused_saved:
        assert not has_buffer(lowered, values[row.name]), row.name
    fused = sum(f.nbytes for f in compiled.fused_saved)
    assert held(compiled) + fused == held(reference)
    assert len(compiled.inlined_saved) + len(compiled.fused_saved) == len(reference.inlined_saved)
    text = " ".join(str(compiled).split())
    assert f"inside value_and_grad, {compiled.inner_saved_bytes:,} B" in text
    assert "never stored (section 3)" in text
