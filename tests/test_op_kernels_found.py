"""A newcomer finds an op's whole definition from its registry entry and its kernel from the op
(issue 29): the entry's functions live in the one `ir/ops` module that registers it; an opaque
op's emitter is registered with `@emits("op")` in the `codegen/kernels` module beside the
kernels it calls, so searching for the op's name in quotes finds both; and the lines that
emitter writes into generated code call a kernel its module exports in `__all__` (what every
generated module imports). Nothing is compiled: plans are only rendered."""

import inspect
import re
import sys

import pytest
from op_samples import SAMPLES
from test_codegen import batch_graph

from backplan.codegen.render import opaque
from backplan.codegen.render.emit import generate
from backplan.ir.lowering import lower
from backplan.ir.pipeline import build_region_plans
from backplan.ir.registry import all_ops, get_op

EMITTERS = dict(opaque.emitters())
ANCHOR = next(s for s in SAMPLES if s.op == "tanh")  # a float loss for ops with integer outputs


@pytest.mark.parametrize("name", sorted(all_ops()))
def test_an_ops_definition_lives_in_the_module_that_registers_it(name):
    opdef = get_op(name)
    parts = [opdef.infer, opdef.reference, opdef.vjp, opdef.flops]
    modules = {
        part.__module__
        for part in parts
        if part is not None and getattr(part, "__module__", None) not in (None, "numpy")
    }
    assert len(modules) == 1, f"{name}: its entry's functions come from {sorted(modules)}"
    (module,) = modules
    assert module.startswith("backplan.ir.ops."), f"{name} is defined in {module}"
    assert f'"{name}"' in inspect.getsource(sys.modules[module]), f"{name} not named in {module}"


@pytest.mark.parametrize("name", sorted(EMITTERS))
def test_an_opaque_op_is_emitted_beside_its_kernels_under_its_own_name(name):
    emitter = EMITTERS[name]
    module = sys.modules[emitter.__module__]
    assert module.__name__.startswith("backplan.codegen.kernels."), module.__name__
    assert re.search(rf'@emits\([^)]*"{name}"', inspect.getsource(module)), (
        f'{module.__name__} registers {name} without the literal @emits("{name}")'
    )
    assert isinstance(module.__all__, list)
    assert all(hasattr(module, kernel) for kernel in module.__all__)


def emitted_lines(monkeypatch) -> dict[str, list[str]]:
    """The lines each opaque op's emitter writes while every op sample is rendered, as a joint
    plan's regions and with layer_norm kept whole (expand=False), as a region can run it."""
    written: dict[str, list[str]] = {name: [] for name in EMITTERS}

    def recording(name, emitter):
        def emit(ctx, node, out):
            lines = emitter(ctx, node, out)
            written[name].extend(lines)
            return lines

        return emit

    for name, emitter in EMITTERS.items():
        monkeypatch.setitem(opaque.OPAQUE_EMITTERS, name, recording(name, emitter))
    for sample in SAMPLES:
        dtype = next((d for d in ("f32", "f64") if d in sample.dtypes), None)
        if sample.op not in EMITTERS or dtype is None:
            continue
        for expand in (True, False):
            graph, _, wrt = batch_graph([ANCHOR, sample], dtype)
            plans = build_region_plans(graph, wrt, expand=expand)
            for plan in (plans.forward, plans.backward):
                if plan is not None:
                    lowered = lower(plan, ())
                    generate(*(lowered if isinstance(lowered, tuple) else (lowered,)))
    return written


def test_the_lines_an_opaque_ops_emitter_writes_call_its_modules_kernels(monkeypatch):
    written = emitted_lines(monkeypatch)
    for name, lines in sorted(written.items()):
        module = sys.modules[EMITTERS[name].__module__]
        assert lines, f"no op sample renders {name} through its emitter"
        called = set(re.findall(r"(\w+)\(", "\n".join(lines)))
        if module.__all__:
            assert called & set(module.__all__), f"{name}: {lines} call none of {module.__all__}"
        else:  # its loops are made per plan: shared loop kernels, k_<hash>
            assert any(c.startswith("k_") for c in called), f"{name}: {lines}"
