"""A compiled plan: generated source, loaded through the disk cache, behind a call that takes
and returns lists of arrays exactly like the reference interpreter."""

from __future__ import annotations

import re
import time

import numpy as np

from backplan.ir.errors import ExecutionError
from backplan.ir.liveness import Plan
from backplan.ir.text import format_graph, format_loc, value_names

from . import cache
from .emit import generate
from .flags import FASTMATH, PARALLEL_MIN_ELEMENTS


def canonical_text(plan: Plan) -> str:
    """Plan text without source locations, plus the constants' types: what the code depends on."""
    text = re.sub(r"  # .*$", "", format_graph(plan.graph, plan.frees_after), flags=re.M)
    consts = sorted((k, str(v.dtype), v.shape) for k, v in plan.graph.constants.items())
    return f"{text}\n# constants {consts}"


class CompiledPlan:
    """Calling it runs the whole plan in one compiled function."""

    def __init__(self, plan: Plan):
        self.plan = plan
        start = time.perf_counter()
        generated = generate(plan)
        self.source = generated.source
        self.kernel_count = generated.kernel_count
        self.key_parts = cache.key_parts(canonical_text(plan), f"{sorted(FASTMATH)}"
                                         f"{PARALLEL_MIN_ELEMENTS}")
        module, self.cache_hit, self.miss_reason = cache.load_module(self.source, self.key_parts)
        self._run = module.run
        graph = plan.graph
        self._constants = [np.ascontiguousarray(graph.constants[c])
                           for c in generated.constant_names]
        self._scalar_inputs = [i for i, v in enumerate(graph.inputs) if v.shape == ()]
        self._scalar_outputs = [i for i, v in enumerate(graph.outputs) if v.shape == ()]
        self.generate_seconds = time.perf_counter() - start
        self.first_call_seconds = None

    def __call__(self, args: list) -> list:
        arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in args]
        args.clear()
        for i in self._scalar_inputs:
            arrays[i] = arrays[i].reshape(1)
        try:
            if self.first_call_seconds is None:
                start = time.perf_counter()
                outputs = list(self._run(*arrays, *self._constants))
                self.first_call_seconds = time.perf_counter() - start
            else:
                outputs = list(self._run(*arrays, *self._constants))
        except IndexError as exc:
            raise self._located(exc) from None
        for i in self._scalar_outputs:
            outputs[i] = outputs[i].reshape(())
        return outputs

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
