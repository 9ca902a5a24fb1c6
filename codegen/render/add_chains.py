"""A loop that only adds arrays (the gradient of a weight used at every step of an unrolled loop
sums one term per step) runs as one shared two-term add and then one shared in-place add per
further term: the kernels compiled stay the same whatever the number of steps. Each further pass
reads and writes the sum again; such sums are small next to the work that made their terms."""

from __future__ import annotations

import math

from backplan.ir.fusion import Kernel
from backplan.ir.graph import Value


def add_chain(kernel: Kernel) -> list[Value]:
    """The adds of a loop that computes nothing but adds (earlier sums may be recomputed
    here), in order; empty for any other loop."""
    chain = kernel.recomputed + kernel.nodes
    if kernel.kind != "loop" or kernel.reductions or any(n.op != "add" for n in chain):
        return []
    return chain


def chain_terms(kernel: Kernel, stored: set, flat) -> list[Value] | None:
    """The terms of a loop that is a chain of adds, each add reading the one before, storing
    only the last sum, every term an array for which flat(term) holds (C-contiguous, of the
    sum's dtype and element count: so of its shape up to axes of size 1, a reshape of a
    buffer included); None for any other loop."""
    chain = add_chain(kernel)
    if not chain or stored != {chain[-1]}:
        return None
    terms = list(chain[0].inputs)
    for previous, node in zip(chain, chain[1:], strict=False):
        others = [i for i in node.inputs if i is not previous]
        if len(others) != 1 or previous not in node.inputs:
            return None
        terms += others
    out = chain[-1]
    if any(t in chain or not flat(t, out) for t in terms):
        return None
    return terms


def chain_loops(terms: int) -> list[tuple[list[str], list[int]]]:
    """The loops for out = sum(terms), each with the arrays it takes: operand 0 is out, k is
    term k - 1; arrays are flat views of n0 elements at base b<j>, offset o<j>. One two-term
    add, then one in-place add per further term."""

    def views(count: int) -> list[str]:
        return [f"w{j} = contiguous_view(b{j}, o{j}, (n0,))" for j in range(count)]

    first = [*views(3), "for i0 in range(n0):", "    w0[i0] = w1[i0] + w2[i0]"]
    rest = [*views(2), "for i0 in range(n0):", "    w0[i0] += w1[i0]"]
    return [(first, [0, 1, 2])] + [(rest, [0, term]) for term in range(3, terms + 1)]


def size_of(value: Value) -> int:
    """Elements of value's array: 1 for a scalar, 0 for an empty batch."""
    return math.prod(value.shape)
