"""A compiled plan: generated source, loaded through the disk cache, behind a call that takes
and returns lists of arrays exactly like the reference interpreter."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import time
import warnings
from typing import Any

import numpy as np

from backplan.codegen.build import (
    cache,
    cache_health,
    direct_driver,
    driver_builder,
    driver_numbers,
    driver_tier,
    kernel_cache,
    loop_calls,
    plan_facts,
    progress,
)
from backplan.codegen.flags import flags_text
from backplan.codegen.jit import is_cached, load_cached, start_parallel_runtime
from backplan.codegen.kernels.gemm import choice as gemm_choice
from backplan.codegen.kernels.gemm.packing import planned_packing
from backplan.codegen.render.emit import generate
from backplan.codegen.render.lift import code_text
from backplan.codegen.render.loops import internal_shape
from backplan.codegen.run import compile_garbage, packing_check
from backplan.codegen.run.memory_check import (
    ALLOCATOR,
    PACKING,
    check_packing,
    checking,
    compare,
    packing_buffer,
    refuse_uncounted,
)
from backplan.codegen.run.workspace import (
    ArenaPool,
    WorkspacePool,
    reused_output_bytes,
    sized_launch,
)
from backplan.ir.argument_layout import base
from backplan.ir.errors import ExecutionError
from backplan.ir.flops import node_flops
from backplan.ir.gc_pause import paused_gc
from backplan.ir.index_check import format_position
from backplan.ir.interpreter import run_plan
from backplan.ir.liveness import Plan
from backplan.ir.lowering import LoweredPlan
from backplan.ir.plan_buffers import compiled_buffers, copy_buffers
from backplan.ir.registry import REGISTRY as OPS
from backplan.ir.text import format_graph, format_loc, value_names
from backplan.ir.types import is_half, np_dtype

# A call into a parallel kernel (generated or from the library) appears in the source as one of:
PARALLEL_LAUNCH = re.compile(r"parallel=True|\b\w+_par\(")
# Kernels the driver calls that run BLAS products on the calling thread (not inside a parallel
# kernel, whose pool threads each call it): the step sizes OpenBLAS's threads around them.
BLAS_CALL = re.compile(
    r"\b(?:batched_)?gemm_(?:at_)?f(?:32|64)\(|\bconv2d_\w*gemm\(|\battention_(?:forward|backward)\("
)
# Calls of the GEMM whose rows the caller shares with helper threads (gemm/team.py).
SHARED_GEMM = re.compile(r"\bown_gemm_(?:at_)?par\(")
SIZES_COMPARED = 8  # the sizes' driver arguments a symbolic plan keeps (_generic_places)


def canonical_text(plan: Plan) -> str:
    """Plan text without source locations, plus the constants' types: what the code depends on."""
    text = re.sub(r"  # .*$", "", format_graph(plan.graph, plan.frees_after), flags=re.M)
    consts = sorted((k, str(v.dtype), v.shape) for k, v in plan.graph.constants.items())
    return f"{text}\n# constants {consts}"


def _key_flags() -> str:
    """What a plan's code depends on beside its IR (codegen/build/cache.py key_parts' flags)."""
    return flags_text() + loop_calls.key_text() + gemm_choice.key_text()


def rendering(lowered: LoweredPlan) -> tuple:
    """(the plan's rendering, its cache key's parts, whether it was recorded by an earlier
    process). A fixed-size plan's key needs no rendering, and a rendering recorded under it
    (codegen/build/plan_facts.py) whose files check is used as it is; a size-generic driver's
    key is the hash of its rendered code."""
    if lowered.plan.shared is None:
        parts = cache.key_parts(canonical_text(lowered.plan), _key_flags())
        key = cache.entry_key(parts)
        if lowered.rendered is not None:  # rendered already (explain): its facts may be kept
            return lowered.rendered, parts, plan_facts.recorded(key)
        found = plan_facts.read(key, lowered)
        return (found, parts, True) if found is not None else (generate(lowered), parts, False)
    generated = generate(lowered)
    parts = cache.key_parts(code_text(generated.source), _key_flags())
    return generated, parts, False


def _output_sources(sources: list, buffers: list) -> list[tuple]:
    """(output buffer or None, position in what `run` returns, shape to reshape to or None)
    per output that is not a literal; `run` returns arrays of their internal shape (a scalar
    as one element)."""
    found: list[tuple] = []
    returned = 0
    for buffer, shape in sources:
        if buffer is None:
            found.append((None, returned, () if shape == () else None))
            returned += 1
        else:
            found.append((buffer, None, None if buffers[buffer][0] == shape else shape))
    return found


def _load_from_cache(dispatcher, signature):
    """The dispatcher with its compiled version for `signature` loaded from the disk cache,
    where the build process left it; never compiles here (that would hold this process's GIL
    for the whole compile)."""
    if not load_cached(dispatcher, signature):
        index = dispatcher._cache._cache_file._index_path
        raise RuntimeError(
            f"the build left no compiled driver in the cache ({index}) for {signature}"
        )
    return dispatcher


def lifted_arrays(literals) -> tuple:
    """The arrays a size-generic driver takes (codegen/render/lift.py), () for any other."""
    if literals is None:
        return ()
    ints, floats = literals
    return (np.array(ints, dtype=np.intp), np.array(floats, dtype=np.float64))


def plan_label(graph) -> str:
    """What the compile lines call a plan: `@loss`, `@loss_backward`; a lambda's name says
    nothing (`@_lambda_`), so it is named by its first op's line: `the lambda at train.py:12`,
    `the lambda at train.py:12 (backward)`."""
    name = graph.name
    if not name.startswith("_lambda_"):
        return f"@{name}"
    loc = next((node.loc for node in graph.nodes if node.loc is not None), None)
    where = f"the lambda at {format_loc(loc)}" if loc is not None else "a lambda"
    rest = name[len("_lambda_") :].strip("_")
    return f"{where} ({rest})" if rest else where


def switch_line(label: str, was: str, seconds: float) -> str:
    if was == "reference":
        return (
            f"{label}: compiled kernels and driver ready after {seconds:.1f} s; calls switch "
            "from the reference interpreter to them"
        )
    return f"{label}: compiled driver ready after {seconds:.1f} s"


def driver_worth_compiling(
    plan: Plan, statements: int, fraction: float = driver_tier.WORTH_FRACTION
) -> bool:
    """driver_tier.worth_compiling of the step's estimated arithmetic (ir/flops.py), summed
    only until it says no: more arithmetic never makes a compiled driver worth more (the whole
    sum was 0.18 ms of a transformer's first call at every new batch size)."""
    flops = 0
    for node in plan.graph.nodes:
        if node.op in OPS:
            flops += node_flops(node)
            if not driver_tier.worth_compiling(statements, flops, fraction):
                return False
    return driver_tier.worth_compiling(statements, flops, fraction)


def source_calls(source: str, shared: dict | None) -> tuple[bool, bool, bool]:
    """Whether the driver's source launches parallel kernels, calls BLAS on the calling thread,
    calls the shared GEMM. The sizes of a symbolic plan share one source, searched once: an
    unrolled LSTM's is 110 KB, 5 ms of every new batch size's first call."""
    key = ("source calls", source)
    found = None if shared is None else shared.get(key)
    if found is None:
        found = tuple(
            pattern.search(source) is not None
            for pattern in (PARALLEL_LAUNCH, BLAS_CALL, SHARED_GEMM)
        )
        if shared is not None:
            shared[key] = found
    return found


# OpenBLAS runs a GEMM of fewer multiply-adds (m * n * k) than this on one thread.
BLAS_SERIAL_MACS = 262_144


def threaded_blas(plan: Plan) -> bool:
    """Whether some op of the plan is big enough for OpenBLAS to thread (a step calling BLAS
    then sizes its threads to the free cores, codegen/run/workspace.SizedLaunch)."""
    return any(
        node_flops(node) > 2 * BLAS_SERIAL_MACS for node in plan.graph.nodes if node.op in OPS
    )


def contiguous(array: np.ndarray) -> np.ndarray:
    """The array in C order; a copy stays read-only like the caller's array (a NumPy argument's
    read-only view, a tensor's buffer): a writeable copy would be another argument type, and
    the compiled driver would be compiled again, in the call, for it."""
    if array.flags.c_contiguous:
        return array
    copy = np.ascontiguousarray(array)
    copy.flags.writeable = array.flags.writeable
    return copy


def storage_dtype(name: str) -> np.dtype:
    """What a buffer is in compiled code: bfloat16 and float16 as uint16 bit patterns (Numba
    has no bfloat16; codegen/kernels/half.py converts), the rest as themselves."""
    return np.dtype(np.uint16) if is_half(name) else np_dtype(name)


def _as_bits(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint16) if array.dtype.itemsize == 2 and array.dtype.kind != "u" else array


def _reshaped(buffer: np.ndarray, shape) -> np.ndarray:
    """An output buffer in its IR shape, read-only: a writeable view of another array is
    copied when a tensor wraps it (tracer/tensor.py), which would hold the output twice."""
    view = buffer.reshape(shape)
    _setflags(view, False)  # view.flags.writeable = False without making a flags object
    return view


_setflags = np.ndarray.setflags
_NO_GUARD = contextlib.nullcontext()


def output_buffers(generated) -> list:
    """(shape, dtype) of each output buffer a call of the rendered plan allocates."""
    return [(internal_shape(v.shape), storage_dtype(v.dtype)) for v in generated.output_buffers]


def returning_outputs(graph, buffers: list, donations: dict) -> frozenset[int]:
    """Output buffers that may come back as a donated input in the next call: those paired
    with one (donations: output buffer -> donated input), and any of the same type as one (a
    training step's new state, which the pairing may have given another input's buffer). A
    workspace keeps none of them for reuse: its reference would stop that donation."""
    donated = {
        (internal_shape(graph.inputs[j].shape), storage_dtype(graph.inputs[j].dtype))
        for j in donations.values()
    }
    same = {k for k, kind in enumerate(buffers) if kind in donated}
    return frozenset(donations) | frozenset(same)


class CompiledPlan:
    """Calling it runs the whole plan in one compiled function. background: the function's own
    choice (True: first calls on the reference interpreter while a child compiles; False:
    compile in the first call; None: BACKPLAN_DRIVER's, see codegen/build/driver_tier.py).
    arenas: the ArenaPool (codegen/run/workspace.py) its calls draw their scratch arena from,
    shared with plans that never run inside its calls; None: one of its own."""

    def __init__(
        self, lowered: LoweredPlan, background: bool | None = None, arenas: ArenaPool | None = None
    ):
        plan = self.plan = lowered.plan
        self._interpreted = lowered.interpreted or plan
        start = time.perf_counter()
        with paused_gc():  # ir/gc_pause.py: rendering's objects are no garbage
            generated, self.key_parts, recorded = rendering(lowered)
        self.donations = lowered.donations  # output buffer -> donated input
        self.layout = generated.layout
        self.source = generated.source
        self.kernel_count = generated.kernel_count
        self.loop_kernels = generated.loop_kernels
        start_parallel_runtime()
        kernel_cache.load(self.loop_kernels)
        module, self.cache_hit, self._why_missed = cache.load_module(self.source, self.key_parts)
        if not recorded:
            plan_facts.write(cache.entry_key(self.key_parts), lowered, generated)
        self._compiled_run = self._run = module.run
        self._driver_ready = threading.Event()
        self.driver_tier, self.driver_error, self.driver_seconds = "compiled", None, None
        self.driver_found_cached = False  # its build found it compiled by another process
        self.driver_skipped = None  # why no driver is built: its Python costs a step little
        self._background = False
        self._asked_background = background is True  # its switch is a line, however quick
        mode = driver_tier.driver_mode(background)
        if mode in ("background", "reference"):
            driver_tier.at_exit_mode()  # a bad value is refused here, not at the program's end
        self.module_path = module.__file__  # the generated module in the cache folder
        if mode in ("background", "reference") and cache_health.is_unwritable(
            os.path.dirname(self.module_path)
        ):
            mode = "python"  # a build hands its driver over through the folder: none can
        self._build_lock = threading.Lock()
        self._direct = False  # whether the second call builds the direct driver
        self._compiled_coming = False  # build_skipped_driver started the compiled driver's build
        self._direct_pending = None  # (its arguments, the plan's label) until it does
        self._direct_places = frozenset()  # what it reads when it runs (_generic_places)
        self._direct_lock = threading.Lock()
        self.direct_error = None  # why the direct driver was not built, where it was not
        self.direct_seconds = None  # the direct driver's build, wall seconds
        if hasattr(module.run, "py_func") and mode != "inline":
            compiled = module.run.overloads or is_cached(module.run)
            if mode == "reference" and not compiled:
                self.driver_tier = "reference"  # kernels and driver build in the child
                self._background = True
            elif mode == "python" or not compiled:
                self._run = self._python_run = driver_tier.python_driver(module)
                self.driver_tier = "python"
                self._background = mode == "background" and driver_worth_compiling(
                    plan, generated.driver_statements
                )
                self._direct = direct_driver.enabled() and (
                    self._background
                    or mode == "background"
                    and driver_worth_compiling(
                        plan, generated.driver_statements, driver_tier.DIRECT_WORTH_FRACTION
                    )
                )
                if mode == "background" and not self._background:
                    self.driver_skipped = "a compiled driver would save under 5% of a step"
        if not self._background:
            self._driver_ready.set()  # no build is coming
        self._driver_statements = generated.driver_statements
        self._driver_parts = tuple(
            getattr(module, f"run_part{i}") for i in range(generated.driver_parts)
        )
        graph = plan.graph
        self._constants = [
            _as_bits(np.ascontiguousarray(graph.constants[c])) for c in generated.constant_names
        ]
        self._lifted = lifted_arrays(generated.literals)  # this size's numbers, or ()
        self._output_buffers = output_buffers(generated)
        self._half_inputs = [i for i, v in enumerate(graph.inputs) if is_half(v.dtype)]
        self._half_outputs = [
            (i, np_dtype(v.dtype)) for i, v in enumerate(graph.outputs) if is_half(v.dtype)
        ]
        self._workspaces = WorkspacePool(
            [(storage_dtype(d), n) for d, n in generated.scratch.items()],
            self._output_buffers,
            self._returning_outputs(graph),
            arenas,
        )
        launches, calls_blas, shares = source_calls(self.source, plan.shared)
        parallel = launches or any(k.parallel for k in self.loop_kernels)
        blas = calls_blas and threaded_blas(plan)
        self._launch_guard = sized_launch(bool(parallel), blas, shares) or _NO_GUARD
        self._literal_outputs = {
            i: (n.shape, n.attrs["value"], np_dtype(n.dtype))
            for i, n in generated.literal_outputs.items()
        }
        self._scalar_inputs = [i for i, v in enumerate(graph.inputs) if v.shape == ()]
        # arguments the plan reads in place, as views of a C-ordered array (argument_layout.base)
        self._in_place = list(plan.in_place)
        self._output_sources = _output_sources(generated.output_sources, self._output_buffers)
        self._buffer_outputs = None
        if not self._literal_outputs and all(j is not None for j, _, _ in self._output_sources):
            self._buffer_outputs = [(j, shape) for j, _, shape in self._output_sources]
        self._checked = None  # BACKPLAN_CHECK_MEMORY=1: the buffers a call must hold
        if checking():
            refuse_uncounted(plan.graph.name, self.source)
            self._checked = (
                compiled_buffers(lowered),
                ["scratch"] if generated.scratch else [],
                planned_packing(lowered),
            )
        self.generate_seconds = time.perf_counter() - start
        self.first_call_seconds = None

    @functools.cached_property
    def miss_reason(self) -> str | None:
        """Why the plan's module was not in the cache folder (None on a hit)."""
        return None if self._why_missed is None else self._why_missed()

    def _returning_outputs(self, graph) -> frozenset[int]:
        return returning_outputs(graph, self._output_buffers, self.donations)

    def __call__(self, args: list, donate=()) -> list:
        """donate: inputs whose buffers the caller gives up; outputs paired with them
        (self.donations) are written into them instead of into new arrays."""
        if self._direct_pending is not None:
            self._build_direct()
        lean = self.first_call_seconds is not None and self.driver_tier != "reference"
        if self._checked is not None and self.driver_tier != "reference":
            return self._checked_call(args, donate)
        if not lean:
            return self._general_call(args, donate)
        for i, word in self._in_place:
            args[i] = base(args[i], word)
        arrays = [a if a.flags.c_contiguous else contiguous(a) for a in args]
        given = self._donated_buffers(args, arrays, donate) if donate and self.donations else None
        args.clear()
        for i in self._scalar_inputs:
            arrays[i] = arrays[i].reshape(1)
        for i in self._half_inputs:
            arrays[i] = arrays[i].view(np.uint16)
        workspace = self._workspaces.checkout()
        if given:
            return self._launch_into_donated(arrays, workspace, given)
        return self._launch(self._run, arrays, workspace, workspace.output_arrays(), ())

    def _launch_into_donated(self, arrays: list, workspace, given: dict) -> list:
        """The lean call with the outputs in `given` ({output buffer: input}) written into
        those donated inputs: a training step donating its parameters and optimizer state
        every call runs here, not the general call (the README's step: 66 -> 57 us a call)."""
        outputs = workspace.output_arrays(given)
        for k, i in given.items():
            outputs[k] = arrays[i]
        try:
            return self._launch(self._run, arrays, workspace, outputs, (), frozenset(given))
        finally:
            for k in given:
                _setflags(outputs[k], False)  # the caller wraps it as an immutable tensor

    def call_into(self, args: list, into: dict, run, extra: tuple) -> list:
        """One call of `run`, this plan's driver or a variant taking `extra` arguments after
        its own (distributed/driver_hooks.py), writing the output buffers in `into` (buffer
        index -> a C-contiguous array of its shape and dtype) instead of new ones: a
        data-parallel step's gradients land in its bucket buffers, no copy. Needs the kernels
        built (driver_tier not "reference")."""
        arrays = self._driver_arrays(args)
        workspace = self._workspaces.checkout()
        outputs = workspace.output_arrays(frozenset(into))
        for j, array in into.items():
            outputs[j] = array
        return self._launch(run, arrays, workspace, outputs, extra, frozenset(into))

    def call_own_into(self, args: list, into: dict) -> list | None:
        """call_into with this plan's own driver (compiled or run as Python), once its first
        call has run (the plan set up, its kernels built); None before then or in the checked
        mode (which counts buffers of its own): call the plan as usual."""
        if self.first_call_seconds is None or self.driver_tier == "reference":
            return None
        if self._checked is not None:  # counted, as the plan runs unchecked
            return self._checked_call(args, (), into)
        if self._direct_pending is not None:
            self._build_direct()
        return self.call_into(args, into, self._run, ())

    def _launch(
        self, run, arrays: list, workspace, outputs: list, extra: tuple, theirs=frozenset()
    ) -> list:
        """One call of `run` (the driver, or call_into's variant) on the inputs, constants,
        scratch, output buffers, lifted arrays and `extra`, under the launch guard; the inputs
        are let go and the workspace handed back however it ends (a located IndexError).
        theirs: output buffers the caller passed (`_outputs`)."""
        try:
            if self._launch_guard is _NO_GUARD:  # serial kernels: no context manager to enter
                returned = run(
                    *arrays, *self._constants, *workspace.scratch, *outputs, *self._lifted, *extra
                )
            else:
                with self._launch_guard:
                    returned = run(
                        *arrays,
                        *self._constants,
                        *workspace.scratch,
                        *outputs,
                        *self._lifted,
                        *extra,
                    )
        except IndexError as exc:
            raise self._located(exc) from None
        finally:
            arrays.clear()
            self._workspaces.checkin(workspace)
        return self._outputs(returned, outputs, theirs)

    def output_slots(self) -> tuple[list, list]:
        """(per plan output: the output buffer it is, whole or reshaped, or None for a literal
        or an array `run` returns; per output buffer: (shape, dtype, its parameter in `run`))."""
        sources = iter(self._output_sources)
        per_output = [
            None if i in self._literal_outputs else next(sources)[0]
            for i in range(len(self.plan.graph.outputs))
        ]
        names = value_names(self.plan.graph)
        buffers = [
            (shape, dtype, "v" + names[v][1:])
            for (shape, dtype), v in zip(self._output_buffers, self.layout.outputs, strict=True)
        ]
        return per_output, buffers

    def _checked_call(self, args: list, donate, into=None) -> list:
        """A call that counts every buffer it holds and compares them with the prediction.
        into: output buffers the caller passed (call_own_into), not the call's to hold."""
        predicted, scratch_keys, packing = self._checked
        predicted = self._shared_arena(predicted) + self._predicted_copies(args)
        if into:
            theirs = {f"output {j}" for j in into}
            predicted = [b for b in predicted if b.key not in theirs]
        if packing.nbytes:
            predicted = [*predicted, packing_buffer(packing)]
        reading = packing_check.available() and self.driver_tier != "reference"
        if reading:
            before = packing_check.kept_slots()
            dropped = packing_check.drop()
        with ALLOCATOR.measuring() as measured:
            if packing.nbytes:  # the GEMM's kept buffers, written by the call's products
                ALLOCATOR.hold_kept(PACKING, packing.nbytes)
            for name, array in self.plan.graph.constants.items():
                ALLOCATOR.use(array, f"const {name}")
            outputs = self._general_call(args, donate, scratch_keys, into)
            for i in self._literal_outputs:
                ALLOCATOR.use(outputs[i], f"literal {i}")
        if reading:
            check_packing(self.plan.graph.name, packing, packing_check.written(dropped, before))
        compare(self.plan.graph.name, predicted, measured.at_peak, self._why_fresh())
        return outputs

    def _shared_arena(self, predicted: list) -> list:
        """The predicted buffers with the scratch arena at the size its pool hands out: the
        largest scratch of the plans sharing it (a forward and its consuming backward), as
        ir/peak.py counts it; this plan's own where it draws from a pool of its own."""
        size = self._workspaces.arena_bytes
        return [b._replace(nbytes=size) if b.category == "scratch" else b for b in predicted]

    def _predicted_copies(self, args: list) -> list:
        """The copies the plan predicts (Plan.copied) of the arguments that arrive in another
        layout than C order. One it predicts that arrives in C order was copied before the
        call, its bytes the same: a NumPy argument in the first call (made a tensor in its
        own order) or saved for a later backward (copied in C order: tracer/numpy_args.py)."""
        return [
            b
            for b, (i, _) in zip(copy_buffers(self.plan), self.plan.copied, strict=True)
            if not args[i].flags.c_contiguous
        ]

    def _why_fresh(self) -> dict[str, str]:
        """Why an output planned into a donated input can get a buffer of its own, and why an
        input can be copied that the plan did not expect to copy."""
        copies = {
            f"copy of input {i}": "its array is not in C order, and the plan was made for one "
            "that is: its layout is part of the signature (ir/argument_layout.py)"
            for i in range(len(self.plan.graph.inputs))
        }
        return copies | {
            f"output {k}": f"planned into donated input {i}, whose array was not given up "
            "this call (not donated, shared with a view or another tensor, or still held)"
            for k, i in self.donations.items()
        }

    @staticmethod
    def _count(scratch_keys, copies: dict, workspace, outputs, given) -> None:
        """Checked mode: the buffers this call holds, by the names the prediction uses."""
        for i, array in copies.items():
            ALLOCATOR.use(array, f"copy of input {i}")
        for key in scratch_keys:
            ALLOCATOR.use(workspace.arena, key)
        for k, array in enumerate(outputs):
            if k not in given:
                ALLOCATOR.use(array, f"output {k}")

    def _general_call(self, args: list, donate, scratch_keys=None, into=None) -> list:
        """Any call: while the reference interpreter stands in, the first call, donations.
        into: output buffers the caller passed (the checked mode's call_own_into)."""
        if self.driver_tier == "reference":
            return self._reference_call(args)
        for i, word in self._in_place:
            args[i] = base(args[i], word)  # C-ordered where the argument has that layout: a view
        arrays = [contiguous(a) for a in args]
        given = self._donated_buffers(args, arrays, donate) if donate and self.donations else {}
        copies = None
        if scratch_keys is not None:
            copies = {i: b for i, (a, b) in enumerate(zip(args, arrays, strict=True)) if a is not b}
        args.clear()
        for i in self._scalar_inputs:
            arrays[i] = arrays[i].reshape(1)
        for i in self._half_inputs:
            arrays[i] = arrays[i].view(np.uint16)
        arrays += self._constants
        workspace = self._workspaces.checkout()
        arrays += workspace.scratch
        theirs = frozenset(given) | frozenset(into or ())
        outputs = workspace.output_arrays(theirs)
        for k, i in given.items():
            outputs[k] = arrays[i]
        for k, array in (into or {}).items():
            outputs[k] = array
        if scratch_keys is not None:
            self._count(scratch_keys, copies, workspace, outputs, theirs)
        arrays += outputs
        arrays += self._lifted
        try:
            with self._launch_guard:
                if self.first_call_seconds is None:
                    returned = self._first_call(arrays)
                else:
                    returned = self._run(*arrays)
        except IndexError as exc:
            raise self._located(exc) from None
        finally:
            del arrays
            self._workspaces.checkin(workspace)
            for k in given:
                outputs[k].flags.writeable = False  # the caller wraps it as an immutable tensor
        return self._outputs(returned, outputs, theirs)

    def _outputs(self, returned: Any, buffers: list, theirs=frozenset()) -> list:
        """The plan's outputs, 16-bit floats viewed back from their bit patterns. Such a view
        of a whole output buffer of this call's own (not one of `theirs`, donated or passed
        in) is read-only: nothing else holds the buffer, so the tensor wrapping it need not
        copy it (a float16 mlp step copied its weight gradients, 0.2-0.4 ms each)."""
        outputs = self._stored_outputs(returned, buffers)
        if not self._half_outputs:  # every call: no set of ids made where nothing reads it
            return outputs
        own = {id(b) for j, b in enumerate(buffers) if j not in theirs}
        for i, dtype in self._half_outputs:
            bits = outputs[i]
            outputs[i] = bits.view(dtype)
            if id(bits) in own:
                outputs[i].flags.writeable = False
        return outputs

    def _stored_outputs(self, returned: Any, buffers: list) -> list:
        """The output buffers the caller passed (whole or reshaped), what `run` returned, and
        literal outputs, each in its IR shape (0-d for scalars)."""
        if self._buffer_outputs is not None:  # the common case: every output is a buffer
            return [
                buffers[j] if shape is None else _reshaped(buffers[j], shape)
                for j, shape in self._buffer_outputs
            ]
        outputs = []
        for buffer, position, shape in self._output_sources:
            array = returned[position] if buffer is None else buffers[buffer]
            if shape is not None:
                array = _reshaped(array, shape) if buffer is not None else array.reshape(shape)
            outputs.append(array)
        for i, (shape, value, dtype) in self._literal_outputs.items():
            outputs.insert(i, np.full(shape, value, dtype))
        return outputs

    def _first_call(self, arrays: list):
        start = time.perf_counter()
        label = plan_label(self.plan.graph)
        described = self._cached_direct(arrays) if self._direct else None
        compiling_driver = self.driver_tier == "compiled" and self.driver_seconds is None
        compiled_before = compile_garbage.compiles()
        again = self._ran_at_another_size()
        with progress.reporting(
            label,
            [] if again else self.loop_kernels,
            again or self.cache_hit or not compiling_driver,
            self._driver_statements if compiling_driver else 0,
            self._driver_parts if compiling_driver else (),
        ):
            returned = self._run(*arrays)
        self._ran_here()
        # what Numba's type inference left holds this call's frames, arrays included
        compile_garbage.collect_if_compiled(compiled_before)
        self.first_call_seconds = time.perf_counter() - start
        if described is None:  # no direct driver: not wanted, or not for these arguments
            self._start_build(lambda: driver_tier.argument_types(arrays), label)
        elif self.driver_tier == "python":
            self._direct_pending = (described, label)  # the second call builds it
        return returned

    def _ran_at_another_size(self) -> bool:
        """Whether another size of this plan's symbolic plan (ir/symbolic.py) ran this driver
        code in this process already, on the same driver tier: its kernels and driver are
        compiled, so a first call compiles nothing and needs no compile estimate (which lists
        the kernel folder: 0.15 s in a long-lived cache, at every new batch size)."""
        shared = self.plan.shared
        return shared is not None and (self.source, self.driver_tier) in shared.get("ran", ())

    def _ran_here(self) -> None:
        shared = self.plan.shared
        if shared is not None:
            shared.setdefault("ran", set()).add((self.source, self.driver_tier))

    def _cached_direct(self, arrays: list):
        """The arguments as the direct driver takes them (None where it cannot), switching to
        the driver where an earlier process (or plan) made it for calls like this first one."""
        try:
            described = direct_driver.described(arrays, len(self._lifted))
        except direct_driver.Unsupported as why:
            self.direct_error = str(why)
            return None
        self._direct_places = self._generic_places(described)
        try:
            driver = direct_driver.cached(
                self.source, described, self._python_run, self._direct_places
            )
            if driver is None and self._lifted and not self._direct_places:
                every = driver_numbers.every_place(described)  # another process's, every size
                driver = direct_driver.cached(self.source, described, self._python_run, every)
        except Exception:  # noqa: BLE001 - one it cannot load is built in the second call
            driver = None
        if driver is not None:
            self._use_direct(driver)
        return described

    def _generic_places(self, described: list) -> frozenset:
        """Where another size of this plan's symbolic plan ran in this process, every number
        the direct driver reads when it runs (driver_numbers.every_place: one driver for every
        size); none for the first size, whose direct driver has them written in."""
        shared = self.plan.shared
        if shared is None or not self._lifted:
            return frozenset()
        seen = shared.setdefault("direct_sizes", {}).setdefault(self.source, [])
        if described not in seen:
            seen.append(described)
            del seen[:-SIZES_COMPARED]
        return driver_numbers.every_place(described) if len(seen) > 1 else frozenset()

    def _first_of_sizes(self, described: list) -> frozenset:
        """For the first size of a symbolic plan, every place its direct driver could read
        when it runs (direct_driver.build makes the driver for every size at once where that
        costs its steps nothing); nothing for any other plan or size."""
        if self._direct_places or not self._lifted or self.plan.shared is None:
            return frozenset()
        return driver_numbers.every_place(described)

    def _varying(self) -> frozenset:
        """The places whose numbers differed between the sizes seen (driver_numbers.varying):
        a driver for every size binds none of them as a loop's constant size."""
        if not self._direct_places:
            return frozenset()
        seen = self.plan.shared["direct_sizes"][self.source]
        return driver_numbers.varying(list(seen))

    def _reference_call(self, args: list) -> list:
        """A call while kernels and driver build in the background: the reference interpreter
        computes it (the same plan; results within rounding of the compiled ones)."""
        return run_plan(self.stand_in(args), args)

    def stand_in(self, args: list) -> Plan:
        """The plan the reference interpreter runs while the kernels build (the plan before
        its strided copies: NumPy copies a strided reshape itself), the build started by the
        first call to get here."""
        if self._background:
            self._start_build(lambda: self._argument_types(args), f"@{self.plan.graph.name}")
        return self._interpreted

    def count_kept(self) -> None:
        """Checked mode, a call while the kernels build: the scratch arenas this plan keeps
        (allocated when it was made) are held by the process meanwhile."""
        for arena in self._workspaces.idle_arenas():
            ALLOCATOR.use(arena, "scratch")

    def release_idle(self) -> list:
        """Free the scratch arenas (and kept outputs) of the workspaces no call holds now;
        returns their reservations (codegen/run/arena_memory.py)."""
        return self._workspaces.release_idle()

    def _driver_arrays(self, args: list) -> list:
        """The inputs as the driver takes them: C-contiguous (an argument read in place as the
        C-ordered array it views), scalars as one element, 16-bit floats as their bit patterns."""
        arrays = list(args)
        for i, word in self._in_place:
            arrays[i] = base(arrays[i], word)
        arrays = [contiguous(a) for a in arrays]
        for i in self._scalar_inputs:
            arrays[i] = arrays[i].reshape(1)
        for i in self._half_inputs:
            arrays[i] = arrays[i].view(np.uint16)
        return arrays

    def _argument_types(self, args: list) -> list:
        """The types the compiled driver will be called with, as a call would pass them."""
        arrays = self._driver_arrays(args)
        workspace = self._workspaces.checkout()
        try:
            # a plan without scratch has () there: a list + a tuple raised TypeError, so
            # BACKPLAN_DRIVER=reference never built such a plan's driver
            arrays += [*self._constants, *workspace.scratch, *workspace.output_arrays()]
            return driver_tier.argument_types(arrays + list(self._lifted))
        finally:
            self._workspaces.checkin(workspace)

    def load_driver(self, args: list, donate=()) -> bool:
        """Load the compiled driver for a call with these arguments from the disk cache without
        calling it, so that the first call runs only the step (bench/memory.py measures the
        first step's memory apart from the loader's). False when no compiled driver for them
        is cached (the first call compiles or loads it then). donate: as in __call__."""
        if self.driver_tier != "compiled" or not hasattr(self._compiled_run, "py_func"):
            return False
        types = self._argument_types(list(args))
        for i in set(donate) & set(self.donations.values()):
            types[i][3] = False  # the call makes a donated input writeable
        return load_cached(self._compiled_run, driver_tier.numba_signature(types))

    def build_skipped_driver(self, args: list) -> bool:
        """Start the background build of the compiled driver that BACKPLAN_DRIVER=background
        skipped because it would save under 5% of a step (driver_skipped), for a caller to whom
        that share matters: a data-parallel step, where every rank waits for the slowest plan
        (the bench transformer's plan took 62.7 ms CPU run as Python against 59.3 compiled).
        args: the inputs of a call. True when the build starts; calls switch once it is loaded
        (wait_for_driver)."""
        with self._build_lock:
            if self.driver_skipped is None or self.driver_tier not in ("python", "direct"):
                return False
            self.driver_skipped = None
            self._background = True
            self._compiled_coming = True  # a direct driver built meanwhile does not end the wait
            self._direct_pending = None  # nor is one needed: the compiled driver is coming
            self._driver_ready.clear()
        self._start_build(lambda: self._argument_types(list(args)), plan_label(self.plan.graph))
        return True

    def _start_build(self, types, label: str) -> None:
        """Once per plan, by whichever call gets here first: types() gives the arguments."""
        with self._build_lock:
            if not self._background:
                return
            self._background = False
        try:
            self._build_driver(types(), label)
        except Exception as exc:  # noqa: BLE001 - this call's results are right: keep them
            self._build_failed(label, f"could not start the driver build ({exc!r})")

    def call_types(self, args: list, extra: tuple = ()) -> list:
        """The argument types of a driver call with these inputs and `extra` arguments after
        the driver's own (call_into's), as a driver build compiles for them."""
        return self._argument_types(args) + driver_tier.argument_types(list(extra))

    def build_payload(self, types: list, source: str | None = None, parts=None) -> dict:
        """What a driver build child takes: the source whose `run` it compiles (this plan's
        driver, or a variant calling the same kernels: distributed/in_plan.py) and its cache
        key parts, the loop kernels, the argument types and the cache folder."""
        return {
            "source": self.source if source is None else source,
            "parts": self.key_parts if parts is None else parts,
            "kernels": [
                {
                    "digest": k.digest,
                    "source": k.source,
                    "parallel": k.parallel,
                    "arguments": list(k.arguments),
                }
                for k in self.loop_kernels
            ],
            "signature": types,
            "folder": os.path.dirname(self.module_path),
        }

    def _build_direct(self) -> None:
        """Build the direct driver (codegen/build/direct_driver.py) for calls like the first,
        in the second call (or wait_for_driver), once: a fraction of a second where the
        background build of the compiled driver took seconds to minutes. It stands in for that
        build (its steps within 5% of that driver's, BENCHMARKS.md 31), which starts only where
        the direct driver cannot be built. A call from another thread meanwhile runs as Python."""
        if not self._direct_lock.acquire(blocking=False):
            return
        try:
            pending, self._direct_pending = self._direct_pending, None
            if pending is None:
                return
            arguments, label = pending
            start = time.perf_counter()
            scope = self._compiled_run.py_func.__globals__
            driver, self.direct_error = direct_driver.build(
                self.source,
                scope,
                arguments,
                self._python_run,
                self._direct_places,
                self._varying(),
                self._first_of_sizes(arguments),
            )
            self.direct_seconds = time.perf_counter() - start
            if driver is None and self.driver_skipped is not None:
                return  # no compiled driver worth its build either: calls stay Python
            if driver is None:
                with self._build_lock:
                    self._background = True
                types = [[str(a.dtype), len(a.shape), "C", a.read_only] for a in arguments]
                self._start_build(lambda: types, label)
                return
            self._use_direct(driver)
        finally:
            self._direct_lock.release()

    def _use_direct(self, driver) -> None:
        with self._build_lock:
            self._background = False
            if self.driver_tier == "python":
                self._run = driver
                self.driver_tier = "direct"
            if self._compiled_coming:  # build_skipped_driver's build: wait_for_driver waits it
                return
        self._driver_ready.set()

    def _build_driver(self, types: list, label: str) -> None:
        """Compile the driver in a child process; switch to it once it is loaded."""
        payload = self.build_payload(types)
        if self.driver_tier == "reference":
            announced = progress.announce_background_compile(
                label, self.loop_kernels, self._driver_statements
            )
        else:
            announced = progress.announce_driver_build(
                label, self._driver_statements, self.loop_kernels
            )

        def load():
            return _load_from_cache(self._compiled_run, driver_tier.numba_signature(types))

        def ready(dispatcher):
            was = self.driver_tier
            with self._build_lock:
                self._run = dispatcher
                self.driver_tier = "compiled"
            self.driver_seconds = build.seconds
            self.driver_found_cached = not build.compiled
            if announced or (self._asked_background and progress.verbose()):
                progress.say(switch_line(label, was, build.seconds))
            self._driver_ready.set()

        build = driver_builder.DriverBuild(
            payload,
            load,
            ready,
            lambda message: self._build_failed(label, message),
            label,
            announced,
            on_stopped=self._build_stopped,
        )
        driver_builder.submit(build)

    def _build_stopped(self) -> None:
        """driver_builder.stop_builds() ended the build: calls stay on the driver they run."""
        self.driver_error = "the driver build was stopped"
        self._driver_ready.set()

    def _build_failed(self, label: str, message: str) -> None:
        self.driver_error = message
        if self.driver_tier == "reference":
            still = "on the reference interpreter (the same results within rounding, slower)"
        else:
            still = "the driver as Python (the same compiled kernels, more time per call)"
        warnings.warn(
            f"{label}: {message}; its calls keep running {still}. bp.compile(fn, "
            "background=False) or BACKPLAN_DRIVER=inline compiles in the first call instead.",
            driver_tier.DriverBuildWarning,
            stacklevel=1,
        )
        self._driver_ready.set()

    def wait_for_driver(self, timeout: float | None = None) -> bool:
        """Wait until the driver is compiled (or its build failed); True when calls now run
        the compiled driver. Plans whose driver is compiled or cached return at once."""
        if self._direct_pending is not None:
            self._build_direct()
        self._driver_ready.wait(timeout)
        return self.driver_tier in ("direct", "compiled")

    def _donated_buffers(self, args: list, arrays: list, donate) -> dict[int, int]:
        """{output buffer: input} for the donations usable in this call: the input array is
        the caller's own (not a contiguous copy) and can be made writeable."""
        given = {}
        for k, i in self.donations.items():
            if i not in donate or arrays[i] is not args[i]:
                continue
            try:
                _setflags(arrays[i], True)  # no flags object: ~0.1 us, not 0.3, a donated array
            except ValueError:  # a view of someone else's read-only buffer
                continue
            given[k] = i
        return given

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the arenas this plan keeps and reuses on every call (per concurrent call)."""
        return self._workspaces.scratch_bytes

    @property
    def output_bytes(self) -> int:
        """Bytes allocated fresh on every call for what the call returns."""
        return sum(int(np.prod(s)) * d.itemsize for s, d in self._output_buffers)

    @property
    def reused_output_bytes(self) -> int:
        """Bytes of the outputs a workspace keeps between calls to write the next call's into
        (one generation: codegen/run/workspace.py)."""
        return reused_output_bytes(self._output_buffers, self._workspaces._donatable)

    def _located(self, exc: Exception) -> ExecutionError:
        """Generated code names the failing value (%12) and, for a bad index, passes its flat
        position, the value there and the indices' shape; give the user's line and the same
        words as the reference interpreter."""
        message = exc.args[0] if exc.args else str(exc)
        match = re.match(r"%(\d+) (\w+): (.*)", str(message), flags=re.S)
        if not match:
            return ExecutionError(str(exc))
        detail = match.group(3)
        if len(exc.args) == 4:
            flat, value, shape = exc.args[1:]
            detail = detail.format(value=value, position=format_position(flat, shape))
        names = {n: v for v, n in value_names(self.plan.graph).items()}
        node = names.get(f"%{match.group(1)}")
        where = f" at {format_loc(node.loc)}" if node is not None and node.loc else ""
        return ExecutionError(f"{match.group(2)}{where}: {detail}")
