"""A compiled plan: generated source, loaded through the disk cache, behind a call that takes
and returns lists of arrays exactly like the reference interpreter."""

from __future__ import annotations

import contextlib
import re
import time

import numpy as np

from backplan.ir.donation import donation_pairs
from backplan.ir.errors import ExecutionError
from backplan.ir.index_check import format_position
from backplan.ir.liveness import Plan
from backplan.ir.lowering import LoweredPlan
from backplan.ir.text import format_graph, format_loc, value_names
from backplan.ir.types import np_dtype

from . import cache, kernel_cache, progress
from .emit import generate
from .flags import flags_text
from .jit import start_parallel_runtime
from .loops import internal_shape
from .workspace import WorkspacePool, parallel_guard

# A call into a parallel kernel (generated or from the library) appears in the source as one of:
PARALLEL_LAUNCH = re.compile(r"parallel=True|\b\w+_par\(")


def canonical_text(plan: Plan) -> str:
    """Plan text without source locations, plus the constants' types: what the code depends on."""
    text = re.sub(r"  # .*$", "", format_graph(plan.graph, plan.frees_after), flags=re.M)
    consts = sorted((k, str(v.dtype), v.shape) for k, v in plan.graph.constants.items())
    return f"{text}\n# constants {consts}"


class CompiledPlan:
    """Calling it runs the whole plan in one compiled function."""

    def __init__(self, lowered: LoweredPlan, donated: tuple[int, ...] = ()):
        plan = self.plan = lowered.plan
        start = time.perf_counter()
        generated = generate(lowered)
        self.donations = donation_pairs(lowered, donated)  # output buffer -> donated input
        self.layout = generated.layout
        self.source = generated.source
        self.kernel_count = generated.kernel_count
        self.key_parts = cache.key_parts(canonical_text(plan), flags_text())
        self.loop_kernels = generated.loop_kernels
        start_parallel_runtime()
        kernel_cache.load(self.loop_kernels)
        module, self.cache_hit, self.miss_reason = cache.load_module(self.source, self.key_parts)
        self._run = module.run
        self._driver_statements = generated.driver_statements
        self._driver_parts = tuple(
            getattr(module, f"run_part{i}") for i in range(generated.driver_parts)
        )
        graph = plan.graph
        self._constants = [
            np.ascontiguousarray(graph.constants[c]) for c in generated.constant_names
        ]
        self._output_buffers = [
            (internal_shape(v.shape), np_dtype(v.dtype)) for v in generated.output_buffers
        ]
        self._workspaces = WorkspacePool(
            [(np_dtype(d), n) for d, n in generated.scratch.items()],
            self._output_buffers,
            frozenset(self.donations),
        )
        self._launch_guard = (
            parallel_guard()
            if PARALLEL_LAUNCH.search(self.source) or any(k.parallel for k in self.loop_kernels)
            else contextlib.nullcontext()
        )
        self._literal_outputs = {
            i: (n.shape, n.attrs["value"], np_dtype(n.dtype))
            for i, n in generated.literal_outputs.items()
        }
        self._scalar_inputs = [i for i, v in enumerate(graph.inputs) if v.shape == ()]
        self._scalar_outputs = [i for i, v in enumerate(graph.outputs) if v.shape == ()]
        self.generate_seconds = time.perf_counter() - start
        self.first_call_seconds = None

    def __call__(self, args: list, donate=()) -> list:
        """donate: inputs whose buffers the caller gives up; outputs paired with them
        (self.donations) are written into them instead of into new arrays."""
        arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in args]
        given = self._donated_buffers(args, arrays, donate) if donate and self.donations else {}
        args.clear()
        for i in self._scalar_inputs:
            arrays[i] = arrays[i].reshape(1)
        arrays += self._constants
        workspace = self._workspaces.checkout()
        arrays += workspace.scratch
        outputs = workspace.output_arrays(given)
        for k, i in given.items():
            outputs[k] = arrays[i]
        arrays += outputs
        try:
            with self._launch_guard:
                if self.first_call_seconds is None:
                    start = time.perf_counter()
                    label = f"@{self.plan.graph.name}"
                    with progress.reporting(
                        label,
                        self.loop_kernels,
                        self.cache_hit,
                        self._driver_statements,
                        self._driver_parts,
                    ):
                        returned = self._run(*arrays)
                    self.first_call_seconds = time.perf_counter() - start
                else:
                    returned = self._run(*arrays)
        except IndexError as exc:
            raise self._located(exc) from None
        finally:
            del arrays
            self._workspaces.checkin(workspace)
            for k in given:
                outputs[k].flags.writeable = False  # the caller wraps it as an immutable tensor
        if not (self._literal_outputs or self._scalar_outputs):
            return list(returned)
        outputs = list(returned)
        for i, (shape, value, dtype) in self._literal_outputs.items():
            outputs.insert(i, np.full(shape, value, dtype))
        for i in self._scalar_outputs:
            outputs[i] = outputs[i].reshape(())
        return outputs

    def _donated_buffers(self, args: list, arrays: list, donate) -> dict[int, int]:
        """{output buffer: input} for the donations usable in this call: the input array is
        the caller's own (not a contiguous copy) and can be made writeable."""
        given = {}
        for k, i in self.donations.items():
            if i not in donate or arrays[i] is not args[i]:
                continue
            try:
                arrays[i].flags.writeable = True
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
