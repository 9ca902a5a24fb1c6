"""Values the backward recomputes instead of saving (rematerialisation, ir/remat.py), as rows of
the saved-buffer table: what the forward computed, the bytes that were not saved, the chain of
cheap ops that rebuilds it and the backward step where that chain ends.

The backward step is found by structure, not by name: a recomputed node is the backward node
with the same op, attributes and type whose inputs are the backward's copies of the forward
node's inputs (saved buffers, or nodes recomputed before it). Where cleanup changed a chain so
that nothing matches, the row says so instead of naming a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backplan.ir.graph import Value
from backplan.ir.text import format_loc, value_names
from backplan.ir.types import np_dtype
from backplan.runtime.location import loc_text, op_text


@dataclass(frozen=True)
class RecomputedInfo:
    """One forward value that is not saved: the backward rebuilds it from what it holds."""

    name: str
    op: str
    produced_at: str
    shape: tuple[int, ...]
    dtype: np.dtype  # the NumPy dtype, as Tensor.dtype
    nbytes: int  # bytes not saved
    chain: tuple[str, ...]  # ops of the forward nodes the backward reruns, in order
    reason: str  # the derivative rule that reads it (why it would otherwise be saved)
    written_step: int  # forward step that computes it
    recomputed_step: int | None = None  # backward step where the chain ends; None if not found
    read_steps: tuple[int, ...] = ()  # backward steps that read the recomputed value
    read_by: tuple[str, ...] = ()
    is_region_input: bool = False  # never: region inputs are held by reference, not rebuilt

    @property
    def last_read_step(self) -> int:
        return self.read_steps[-1] if self.read_steps else -1


def recomputed_infos(program) -> list[RecomputedInfo]:
    """The recomputed rows of a region program, in the order the forward computes them."""
    plans = program.plans
    if plans.backward is None or not plans.recomputed:
        return []
    forward = plans.forward
    names = value_names(forward.graph)
    copies = backward_copies(program)
    steps = {node: i for i, node in enumerate(plans.backward.graph.nodes)}
    infos = []
    for r in sorted(plans.recomputed, key=lambda r: forward.first_write.get(r.forward, -1)):
        value = r.forward
        copy = copies.get(value)
        readers = (
            [i for i, n in enumerate(plans.backward.graph.nodes) if copy in n.inputs]
            if copy is not None
            else []
        )
        infos.append(
            RecomputedInfo(
                name=names[value] if program.input_names is not None else "output",
                op=op_text(value.op, value.loc),
                produced_at=loc_text(value.loc) if value.loc else "<input>",
                shape=value.shape,
                dtype=np_dtype(value.dtype),
                nbytes=r.nbytes,
                chain=tuple(n.op for n in r.chain),
                reason=r.reason,
                written_step=forward.first_write.get(value, -1),
                recomputed_step=steps.get(copy),
                read_steps=tuple(readers),
                read_by=tuple(
                    f"{plans.backward.graph.nodes[i].op} at "
                    f"{format_loc(plans.backward.graph.nodes[i].loc)}"
                    for i in readers
                ),
            )
        )
    return infos


def backward_copies(program) -> dict[Value, Value]:
    """Forward value -> the backward value holding it: saved inputs, and recomputed nodes
    matched by structure (see the module docstring)."""
    plans = program.plans
    backward = plans.backward.graph
    n_cot = len(program.cotangent_slot)
    copies = {s.forward: backward.inputs[n_cot + slot] for slot, s in enumerate(plans.saved)}
    by_inputs: dict[tuple, list[Value]] = {}
    for node in backward.nodes:
        by_inputs.setdefault((node.op, tuple(id(i) for i in node.inputs)), []).append(node)
    chain_nodes = {n for r in plans.recomputed for n in r.chain}
    for node in [n for n in plans.forward.graph.nodes if n in chain_nodes]:
        if not all(i in copies for i in node.inputs):
            continue
        key = (node.op, tuple(id(copies[i]) for i in node.inputs))
        match = next(
            (c for c in by_inputs.get(key, ()) if c.type == node.type and c.attrs == node.attrs),
            None,
        )
        if match is not None:
            copies[node] = match
    return copies
