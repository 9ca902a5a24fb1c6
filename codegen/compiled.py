"""A compiled plan: generated source, loaded through the disk cache, behind a call that takes
and returns lists of arrays exactly like the reference interpreter."""

from __future__ import annotations

import re
import sys
import time

import numpy as np

from backplan.ir.errors import ExecutionError
from backplan.ir.liveness import Plan
from backplan.ir.lowering import lower
from backplan.ir.text import format_graph, format_loc, value_names
from backplan.ir.types import np_dtype

from . import cache
from .emit import generate
from .flags import FASTMATH, PARALLEL_MIN_ELEMENTS
from .loops import internal_shape


def canonical_text(plan: Plan) -> str:
    """Plan text without source locations, plus the constants' types: what the code depends on."""
    text = re.sub(r"  # .*$", "", format_graph(plan.graph, plan.frees_after), flags=re.M)
    consts = sorted((k, str(v.dtype), v.shape) for k, v in plan.graph.constants.items())
    return f"{text}\n# constants {consts}"


class CompiledPlan:
    """Calling it runs the whole plan in one compiled function."""

    def __init__(self, plan: Plan, private_saved: tuple[int, ...] = ()):
        self.plan = plan
        start = time.perf_counter()
        generated = generate(lower(plan, private_saved))
        self.layout = generated.layout
        self.source = generated.source
        self.kernel_count = generated.kernel_count
        self.key_parts = cache.key_parts(
            canonical_text(plan), f"{sorted(FASTMATH)}{PARALLEL_MIN_ELEMENTS}"
        )
        module, self.cache_hit, self.miss_reason = cache.load_module(self.source, self.key_parts)
        self._run = module.run
        graph = plan.graph
        self._constants = [
            np.ascontiguousarray(graph.constants[c]) for c in generated.constant_names
        ]
        self._scratch = [np.empty(max(n, 1), np_dtype(d)) for d, n in generated.scratch.items()]
        self._output_buffers = [
            (internal_shape(v.shape), np_dtype(v.dtype)) for v in generated.output_buffers
        ]
        self._literal_outputs = {
            i: (n.shape, n.attrs["value"], np_dtype(n.dtype))
            for i, n in generated.literal_outputs.items()
        }
        self._previous_outputs = [None] * len(self._output_buffers)
        self._scalar_inputs = [i for i, v in enumerate(graph.inputs) if v.shape == ()]
        self._scalar_outputs = [i for i, v in enumerate(graph.outputs) if v.shape == ()]
        self.generate_seconds = time.perf_counter() - start
        self.first_call_seconds = None

    def __call__(self, args: list) -> list:
        arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in args]
        args.clear()
        for i in self._scalar_inputs:
            arrays[i] = arrays[i].reshape(1)
        arrays += self._constants
        arrays += self._scratch
        arrays += self._output_arrays()
        try:
            if self.first_call_seconds is None:
                start = time.perf_counter()
                returned = self._run(*arrays)
                self.first_call_seconds = time.perf_counter() - start
            else:
                returned = self._run(*arrays)
        except IndexError as exc:
            raise self._located(exc) from None
        if not (self._literal_outputs or self._scalar_outputs):
            return list(returned)
        outputs = list(returned)
        for i, (shape, value, dtype) in self._literal_outputs.items():
            outputs.insert(i, np.full(shape, value, dtype))
        for i in self._scalar_outputs:
            outputs[i] = outputs[i].reshape(())
        return outputs

    def _output_arrays(self) -> list:
        """Fresh output buffers, except that a buffer from the previous call that nobody holds
        any more is reused: no new pages to fault in (16 MiB outputs cost ~1 ms each)."""
        arrays = []
        for i, (shape, dtype) in enumerate(self._output_buffers):
            previous = self._previous_outputs[i]
            if previous is not None and sys.getrefcount(previous) == 3:  # list, local, argument
                previous.flags.writeable = True
                arrays.append(previous)
            else:
                arrays.append(np.empty(shape, dtype))
            self._previous_outputs[i] = arrays[-1]
        return arrays

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the arenas this plan keeps and reuses on every call."""
        return sum(a.nbytes for a in self._scratch)

    @property
    def output_bytes(self) -> int:
        """Bytes allocated fresh on every call for what the call returns."""
        return sum(int(np.prod(s)) * d.itemsize for s, d in self._output_buffers)

    def _located(self, exc: Exception) -> ExecutionError:
        """Generated code names the failing value (%12); give the user's line."""
        message = str(exc)
        match = re.match(r"%(\d+) (\w+): (.*)", message)
        if match:
            names = {n: v for v, n in value_names(self.plan.graph).items()}
            node = names.get(f"%{match.group(1)}")
            where = f" at {format_loc(node.loc)}" if node is not None and node.loc else ""
            return ExecutionError(f"{match.group(2)}{where}: {match.group(3)}")
        return ExecutionError(message)
