"""What bp.load returns: callables with the exported signature, running the artifact's plans
through the same code paths as @compile and value_and_grad (run_traced, run_joint)."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np

from backplan.ir.argument_layout import C_ORDER, copied_inputs, layout
from backplan.ir.graph import inline_graph
from backplan.ir.pipeline import mark_copied
from backplan.ir.types import np_dtype
from backplan.report.argument_copies import (
    mark_argument_copies,
    mark_call_copies,
    numpy_saved_inputs,
)
from backplan.report.report import ExplainReport, joint_report, region_report
from backplan.runtime import RegionProgram, is_grad_enabled
from backplan.tracer.compile import TracedFunction, region_copies, run_traced
from backplan.tracer.dynamic import DynamicEntry, SymbolicCall, dynamic_text, symbolic_key
from backplan.tracer.functional import JointCall, JointTrace, _as_diff_arg, run_joint
from backplan.tracer.numpy_args import joint_copies
from backplan.tracer.planned import PlannedFunction
from backplan.tracer.pytree import TreeDef, flatten, unflatten
from backplan.tracer.signature import BoundCall, SignatureKey
from backplan.tracer.source import loc_text, user_frame_loc
from backplan.tracer.tensor import Tensor
from backplan.tracer.trace import current_trace

from .call import borrowed_leaves, conform, match_leaves
from .format import ExportError
from .signing import Authenticity
from .tree import render_tree


class LoadedArtifact(PlannedFunction):
    """Shared by both kinds: the exported signature, argument matching and the report. A
    planned function whose cache holds the one exported signature: it cannot retrace."""

    kind = "artifact"

    def __init__(
        self,
        path: str,
        manifest: dict,
        members: dict[str, bytes],
        name: str,
        signature: inspect.Signature,
        key: SignatureKey,
        flops: dict[str, int],
        authenticity: Authenticity,
    ):
        super().__init__(None)
        self.path = path
        self.flops = flops  # per plan role, one call: matmul 2*m*n*k, one per element otherwise
        self.authenticity = authenticity  # what the signature check said
        self.name = name
        self.manifest = manifest
        self.member_sizes = {n: len(d) for n, d in members.items()}
        self.__signature__ = signature
        self._key = key
        self._symbol: str | None = None  # a dynamic artifact's symbol (make_dynamic)
        self._places: list = []  # its (leaf, axis) places
        self._exported_key = None  # the entry key of the exported (or symbolic) signature
        self._special: dict[int, str | None] = {}  # size 0/1 -> None (stored) or why not
        self._layouts: dict = {}  # (id of an entry, Plan.copied) -> the entry in those layouts

    @property
    def format_version(self) -> int:
        return self.manifest["format_version"]

    def _match(self, args, kwargs) -> tuple[dict, list, list[int], SignatureKey]:
        """(arguments, leaves, tensor positions, the signature at this call's size); a call
        the artifact cannot take is refused naming the user's line, as a compiled call is."""
        try:
            return self._matched(args, kwargs)
        except ExportError as exc:
            loc = user_frame_loc()
            if loc is None:
                raise
            raise ExportError(f"{exc} (the call at {loc_text(loc)})") from None

    def _matched(self, args, kwargs) -> tuple[dict, list, list[int], SignatureKey]:
        try:
            bound = self.__signature__.bind(*args, **kwargs)
        except TypeError as exc:
            raise ExportError(f"{self.path}: {self.name}{self.__signature__}: {exc}") from None
        bound.apply_defaults()
        arguments = self._conform(dict(bound.arguments))
        keys = self._keys_at(arguments)
        symbolic = {p: (axis, self._symbol) for p, axis in self._places}
        leaves, positions = match_leaves(arguments, keys, self.path, symbolic)
        return arguments, leaves, positions, SignatureKey(self._key.treedef, tuple(keys))

    def _keys_at(self, arguments: dict) -> list:
        """The exported leaf keys, a dynamic artifact's axes at the size this call passes."""
        keys = list(self._key.leaves)
        if self._symbol is None:
            return keys
        leaves = flatten(arguments)[0]
        sizes = {
            (keys[p].path, axis): tuple(leaves[p].shape)[axis]
            for p, axis in self._places
            if len(getattr(leaves[p], "shape", ())) == len(keys[p].shape)
        }
        if len(set(sizes.values())) > 1:
            self._refuse_sizes(sizes)
        if len(set(sizes.values())) != 1:
            return keys  # match_leaves says which argument does not fit
        (size,) = set(sizes.values())
        if size < 2 and (size not in self._special or self._special[size] is not None):
            self._refuse(size)
        return list(self.key_at(size).leaves)

    def _refuse_sizes(self, sizes: dict):
        """Arguments sharing the dynamic axis passed it at several sizes (as bp.compile's
        TracingError says), not a shape the artifact was exported for."""
        passed = ", ".join(f"{path} has {n} on axis {axis}" for (path, axis), n in sizes.items())
        raise ExportError(
            f"{self.path}: the dynamic axis {self._symbol!r} takes any size, one per call, but "
            f"{passed}; axes sharing a symbol share one size"
        )

    def _refuse(self, size: int):
        why = self._special.get(size)
        if size not in self._special:  # written before artifacts stored sizes 0 and 1
            raise ExportError(
                f"{self.path} was exported with {self._symbol} dynamic, for sizes of 2 or more "
                f"(0 and 1 broadcast and get plans of their own); the call passed {size}: "
                "export it again with this version of backplan, or export one at that size"
            )
        raise ExportError(
            f"{self.path} holds no plan for {self._symbol}={size}: tracing the function at "
            f"that size failed when it was exported ({why})"
        )

    def key_at(self, size: int) -> SignatureKey:
        """The exported signature with the dynamic axes at this size."""
        keys = list(self._key.leaves)
        for p, axis in self._places:
            shape = list(keys[p].shape)
            shape[axis] = size
            keys[p] = dataclasses.replace(keys[p], shape=tuple(shape))
        return SignatureKey(self._key.treedef, tuple(keys))

    def add_size(self, size: int, entry) -> None:
        """The entry of size 0 or 1 of a dynamic axis (planned on its own, as compile does)."""
        self._entries[self._stored_key(self.key_at(size))] = entry
        self._special[size] = None

    def refuse_size(self, size: int, reason: str) -> None:
        """Size 0 or 1 could not be traced at export: a call at that size says why."""
        self._special[size] = reason

    def make_dynamic(self, symbol: str, size: int, places: list, fitted) -> None:
        """Run any size of `symbol` through these fitted plans (artifacts/dynamic.py)."""
        rank = {p: len(self._key.leaves[p].shape) for p, _ in places}
        if any(not 0 <= axis < rank[p] for p, axis in places):
            raise ExportError("meta.json dynamic: an axis is out of range")
        self._symbol, self._places = symbol, places
        (template,) = self._entries.values()
        found = SymbolicCall(symbol, size, tuple(places))
        key = self._stored_key(symbolic_key(self._key, found))
        self._learned = {self._key.leaves[p].path: (rank[p], axis, symbol) for p, axis in places}
        self._entries.clear()
        self._entries[key] = DynamicEntry(template, symbol, size, fitted, None, self._instantiate)
        self._exported_key = key

    def _stored_key(self, key: SignatureKey):
        return key

    def _conform(self, arguments: dict) -> dict:
        return conform(self._key.treedef, arguments, "", self.path)

    def _build(self, bound):
        raise ExportError(f"{self.path}: a loaded artifact runs its exported signature only")

    def explain(self, *args, **kwargs) -> ExplainReport:
        """The same report as bp.explain gives the original: with no arguments at the exported
        signature; with arguments at their sizes (a dynamic axis's), as a call would run."""
        if args or kwargs:
            return super().explain(*args, **kwargs)
        entry = self._entries.get(self._exported_key) or next(iter(self._entries.values()))
        report = self._report(getattr(entry, "template", entry), None)
        if type(entry) is DynamicEntry:  # the bytes as formulas of the symbol, as bp.explain
            report_of = lambda e: self._report(e, None)  # noqa: E731
            report.dynamic = dynamic_text(entry, report_of, entry.first_size, report)
        return report

    def _leaf_texts(self, show_requires_grad: bool = True) -> list[str]:
        texts = []
        symbolic = dict(self._places)
        for p, key in enumerate(self._key.leaves):
            if key.weak:
                texts.append("float")
            elif key.kind == "tensor":
                flag = " requires_grad" if key.requires_grad and show_requires_grad else ""
                dims = [str(d) for d in key.shape]
                if p in symbolic:
                    dims[symbolic[p]] = str(self._symbol)
                texts.append(f"{key.dtype}[{','.join(dims)}]{flag}")
            else:
                texts.append(repr(key.static[1]))
        return texts

    def example_args(self) -> tuple[list, dict]:
        """(args, kwargs) of zero tensors with the exported dtypes, shapes and requires_grad
        flags (static arguments at their exported values): a template to fill with real data."""
        leaves = []
        for key in self._key.leaves:
            if key.weak:
                leaves.append(0.0)
            elif key.kind == "tensor":
                zeros = np.zeros(key.shape, dtype=np_dtype(key.dtype))
                leaves.append(Tensor(zeros, requires_grad=key.requires_grad))
            else:
                leaves.append(key.static[1])
        arguments = unflatten(self._key.treedef, leaves)
        args, kwargs = [], {}
        for param in self.__signature__.parameters.values():
            value = arguments[param.name]
            if param.kind == param.VAR_POSITIONAL:
                args.extend(value)
            elif param.kind == param.VAR_KEYWORD:
                kwargs.update(value)
            elif param.kind == param.KEYWORD_ONLY:
                kwargs[param.name] = value
            else:
                args.append(value)
        return args, kwargs

    def __repr__(self) -> str:
        return f"<loaded {self.kind} {self.signature} from {self.path}>"


class LoadedFunction(LoadedArtifact):
    """A loaded @compile function: returns tensors whose .backward() runs the stored backward
    plan, exactly as the original's did."""

    kind = "compiled function"

    def __init__(self, traced: TracedFunction, **common):
        super().__init__(**common)
        self._traced = traced
        self.program = traced.program
        self.captured = traced.captured
        self._entries[self._key] = traced

    def _bind(self, args, kwargs) -> BoundCall:
        arguments, leaves, positions, key = self._match(args, kwargs)
        sources = flatten(arguments)[0]  # as passed: a NumPy array became a view of it
        borrowed = borrowed_leaves(sources, positions)
        return BoundCall(key, leaves, positions, sources=sources, borrowed=borrowed)

    def _instantiate(self, template: TracedFunction, fitted, size: int) -> TracedFunction:
        program = template.program
        plans = RegionProgram(fitted.at(size), name=program.name, input_names=program.input_names)
        return dataclasses.replace(template, program=plans)

    def _run(self, traced: TracedFunction, call: BoundCall):
        leaves, positions = call.leaves, call.tensor_positions
        outer = current_trace()
        if outer is not None:
            return self._inline(outer, [leaves[p] for p in positions], traced)
        record = self._prepare_grads(leaves, positions)
        return run_traced(self._in_layouts(traced, call), call, record)

    def _in_layouts(self, traced: TracedFunction, call: BoundCall | None) -> TracedFunction:
        """traced, or (arrays passed in another layout than C order) its plans told which
        (Plan.copied, as a compiled function's trace is: ir/pipeline.py mark_copied), so they
        read those in place or count their copies; one such program per layouts, kept."""
        copied = _copied(call)
        if not copied:
            return traced
        key = (id(traced), copied)
        variant = self._layouts.get(key)
        if variant is None:
            program = traced.program
            plans = program.plans
            plans = dataclasses.replace(
                plans,
                forward=dataclasses.replace(plans.forward, lowered={}),
                backward=plans.backward and dataclasses.replace(plans.backward, lowered={}),
            )
            mark_copied(plans, copied)
            variant = dataclasses.replace(
                traced,
                program=RegionProgram(plans, name=program.name, input_names=program.input_names),
            )
            self._layouts[key] = variant
        return variant

    def _prepare_grads(self, leaves: list, positions: list[int]) -> bool:
        """Whether to record a region. An input exported with a gradient but passed without
        requires_grad gets a stand-in leaf, so no .grad lands on a tensor that did not ask."""
        enabled = is_grad_enabled()
        wrt = self.program.plans.wrt[: len(positions)]
        flags = [enabled and leaves[p].requires_grad for p in positions]
        for p, flag, w in zip(positions, flags, wrt, strict=True):
            if flag and not w:
                path = self._key.leaves[p].path
                raise ExportError(
                    f"{self.path}: {path} requires grad, but the artifact was "
                    f"exported with {path} not requiring grad, so it has no "
                    "gradient for it; re-export with requires_grad=True"
                )
        record = any(flags) or (enabled and any(self._traced.captured_flags))
        if record:
            for p, flag, w in zip(positions, flags, wrt, strict=True):
                if w and not flag:  # the same buffer: a view of a NumPy argument stays one
                    leaves[p] = stand_in = Tensor._from_array(leaves[p]._data)
                    stand_in.requires_grad = True
        return record

    def _inline(self, outer, tensors: list, traced: TracedFunction):
        """Called inside another trace: the forward graph becomes part of the outer one."""
        forward = traced.program.plans.forward.graph
        inputs = [outer.value_of(t) for t in tensors + self.captured]
        values = inline_graph(outer.graph, forward, inputs)[: self.program.n_outputs]
        leaves = [
            item if kind == "static" else Tensor._traced(values[item], outer)
            for kind, item in traced.out_slots
        ]
        return unflatten(traced.out_treedef, leaves)

    @property
    def signature(self) -> str:
        """`name(x: f32[16,32], w: f32[32,8] requires_grad) -> f32[]`"""
        forward = self.program.plans.forward.graph
        outputs = [
            str(forward.outputs[item].type) if kind == "tensor" else repr(item)
            for kind, item in self._traced.out_slots
        ]
        return (
            f"{self.name}{_params_text(self._key.treedef, self._leaf_texts(), self)} -> "
            f"{render_tree(self._traced.out_treedef, outputs)}"
        )

    def _report(self, traced: TracedFunction, call) -> ExplainReport:
        """Plans, saved buffers, peak bytes (for a call, the copies of its NumPy arguments)."""
        variant = self._in_layouts(traced, call)
        report = region_report(variant.program)
        if call is not None and call.sources:
            copies = numpy_saved_inputs(variant.program, call)
            mark_argument_copies(report, variant.program, copies, *region_copies(variant, call))
        return report


class LoadedValueAndGrad(LoadedArtifact):
    """A loaded bp.value_and_grad: returns (value, grads), grads shaped like the differentiated
    arguments; ((value, aux), grads) when exported with has_aux."""

    kind = "value_and_grad"

    def __init__(
        self,
        entry: JointTrace,
        argnums,
        has_aux: bool,
        diff_positions: set[int],
        display_names: list[str],
        captured_names: list[str],
        **common,
    ):
        super().__init__(**common)
        self._entry = entry
        self.plan = entry.plan
        self.captured = entry.captured
        self._nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        self._single = isinstance(argnums, int)
        self.argnums = argnums
        self.has_aux = has_aux
        self._diff_positions = diff_positions
        self._display_names = display_names
        self._captured_names = captured_names
        self._entries[(self._key, frozenset(diff_positions))] = entry

    def _bind(self, args, kwargs) -> JointCall:
        args = tuple(_as_diff_arg(a) if i in self._nums else a for i, a in enumerate(args))
        arguments, leaves, positions, key = self._match(args, kwargs)
        sources = flatten(arguments)[0]  # as passed: a NumPy array became a view of it
        borrowed = borrowed_leaves(sources, positions)
        call = BoundCall(key, leaves, positions, sources=sources, borrowed=borrowed)
        return JointCall(arguments["args"], call, self._diff_positions)

    def _entry_key(self, bound: JointCall):
        found = self._symbol_of(bound)
        key = bound.call.key if found is None else symbolic_key(bound.call.key, found)
        return (key, frozenset(bound.diff_paths))

    def _signature_call(self, bound: JointCall):
        return bound.call

    def _stored_key(self, key: SignatureKey):
        return (key, frozenset(self._diff_positions))

    def _instantiate(self, template: JointTrace, fitted, size: int) -> JointTrace:
        return dataclasses.replace(template, plan=fitted.at(size)[0], _runners={})

    def _run(self, entry: JointTrace, bound: JointCall):
        entry = self._in_layouts(entry, bound.call)
        return run_joint(
            entry, bound.args, bound.call, bound.diff_paths, self._nums, self.has_aux, self._single
        )

    def _in_layouts(self, entry: JointTrace, call: BoundCall | None) -> JointTrace:
        """entry, or its joint plan told the layouts of the arrays not in C order (as
        LoadedFunction._in_layouts), one per layouts, kept."""
        copied = _copied(call)
        if not copied:
            return entry
        key = (id(entry), copied)
        variant = self._layouts.get(key)
        if variant is None:
            plan = dataclasses.replace(entry.plan, lowered={}, copied=copied)
            variant = self._layouts[key] = dataclasses.replace(entry, plan=plan, _runners={})
        return variant

    def _conform(self, arguments: dict) -> dict:
        """Each positional argument under the name the function gives it."""
        args_def, kwargs_def = self._key.treedef.children
        args = arguments["args"]
        if len(args) != len(args_def.children):
            raise ExportError(
                f"{self.path} was exported for {len(args_def.children)} positional "
                f"arguments, but the call passed {len(args)}"
            )
        conformed = tuple(
            conform(
                child,
                arg,
                self._display_names[i] if i < len(self._display_names) else f"args[{i}]",
                self.path,
            )
            for i, (child, arg) in enumerate(zip(args_def.children, args, strict=True))
        )
        kwargs, exported = arguments["kwargs"], list(kwargs_def.meta or ())
        if isinstance(kwargs, dict) and set(kwargs) != set(exported):
            raise ExportError(
                f"{self.path} was exported with the keyword argument(s) {exported or 'none'} and "
                f"takes exactly those, but the call passed {sorted(kwargs) or 'none'}: a loaded "
                "value_and_grad artifact does not know the function's defaults, so re-export it "
                "passing the keyword arguments you will call it with"
            )
        return {"args": conformed, "kwargs": conform(kwargs_def, kwargs, "kwargs", self.path)}

    @property
    def signature(self) -> str:
        """`value_and_grad(loss, argnums=0)(params: {...}, x: f32[64,32]) -> (f32[], grads)`"""
        texts = iter(self._leaf_texts(show_requires_grad=False))
        args_def, kwargs_def = self._key.treedef.children
        parts = []
        for i, child in enumerate(args_def.children):
            name = self._display_names[i] if i < len(self._display_names) else f"args[{i}]"
            parts.append(f"{name}: {render_tree(child, texts)}")
        for key, child in zip(kwargs_def.meta or (), kwargs_def.children, strict=True):
            parts.append(f"{key}={render_tree(child, texts)}")
        value = str(self.plan.graph.outputs[0].type)
        if self.has_aux:
            value = f"({value}, aux)"
        return (
            f"value_and_grad({self.name}, argnums={self.argnums})({', '.join(parts)}) -> "
            f"({value}, grads of argument(s) {self.argnums})"
        )

    def _report(self, entry: JointTrace, bound) -> ExplainReport:
        """The joint plan, the forward values its gradient steps read, peak bytes."""
        names = [k.path for k in self._key.leaves if k.kind == "tensor"]
        names += self._captured_names
        entry = self._in_layouts(entry, None if bound is None else bound.call)
        report = joint_report(entry.plan, 1 + entry.n_aux, entry.wrt, names, self.name)
        if bound is not None:
            mark_call_copies(report, frozenset(), *joint_copies(entry, bound.call))
        return report


def _copied(call: BoundCall | None) -> tuple:
    """Plan.copied for this call's arrays: (input, layout) of each not in C order; () with no
    call (explain() with no arguments: the exported layouts)."""
    if call is None:
        return ()
    words = []
    for p in call.tensor_positions:
        data = getattr(call.leaves[p], "_data", None)
        ordered = not isinstance(data, np.ndarray) or data.flags.c_contiguous
        words.append(C_ORDER if ordered else layout(data))
    return copied_inputs(words)


def _params_text(treedef: TreeDef, leaf_texts: list[str], loaded: LoadedArtifact) -> str:
    texts = iter(leaf_texts)
    parts = []
    params = loaded.__signature__.parameters
    for name, child in zip(treedef.meta, treedef.children, strict=True):
        star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(
            params[name].kind, ""
        )
        parts.append(f"{star}{name}: {render_tree(child, texts)}")
    return "(" + ", ".join(parts) + ")"
