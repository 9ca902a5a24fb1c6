"""A loop kernel's lines rendered once for every batch size of one symbolic plan.

The sizes of a symbolic plan (ir/symbolic.py) render the same loops over other sizes: a loop's
lines name its sizes, offsets and strides (n0, o3, d3_1: arguments whose values
LoopEmitter.scalars holds), so most of its text does not change with the size. What the text
does read of a size is decided before the lines are written, and is this key: each access's
array name, loop dimensions, whether it is strided and through which index map each operand
reads it; the collapsed loop groups and which of them have size 1 (a literal 1 instead of a
name); the mode (serial, parallel, chunked: pinned across sizes, codegen/render/choices.py);
every computed node's name, op, attributes (as text: 1 == 1.0 == True and 0.0 == -0.0 render
apart), dtype and operands (their names, ops, alias bases, literal texts: a mean's 1/n is one);
which values are stored, local or read unrounded; the reductions' axes. Equal keys render
equal lines (LoopEmitter._views, _nest, _chunked_nest and _body read nothing else:
tests/test_loop_template.py renders sizes both ways), so a later size takes the lines of the
first with its own sizes, offsets and strides (LoopEmitter._arguments).

Only loops of their own (not a stage of a row kernel or a GEMM's epilogue, whose lines depend
on the stages around them) of a symbolic plan's sizes; a plan of one size renders as before.
"""

from __future__ import annotations

# loop templates one symbolic plan keeps (its sizes' loops; an unrolled LSTM has ~200)
TEMPLATES_KEPT = 4096


def template_key(emitter, mode: str) -> tuple:
    """Everything the lines of `emitter` (a LoopEmitter after its accesses and groups) read:
    equal keys, equal lines."""
    names = emitter.array_name
    parts: list = [
        emitter.size_prefix,
        mode,
        tuple(tuple(group) for group in emitter.groups),
        tuple(n == 1 for n in emitter.sizes),
    ]
    index = {}
    shared = emitter.shared_views()  # one view for two accesses: sizes may differ in it
    for j, (key, access) in enumerate(emitter.accesses.items()):
        index[key] = j
        parts.append((access.name, tuple(access.dims), access.strided, isinstance(key, tuple)))
        parts.append(index.get(shared.get(key)))
    kernel = emitter.kernel
    for red in kernel.reductions:
        parts.append((names[red], tuple(sorted(emitter.reduced_dims[red]))))
    parts.append((len(kernel.recomputed), len(kernel.nodes)))
    local, stored, unrounded = emitter.local, emitter.stored, emitter.unrounded
    reads = iter(emitter.reads)
    for node in kernel.computed:
        attrs = repr(sorted(node.attrs.items())) if node.attrs else ""
        parts.append((names[node], node.op, node.dtype, attrs, node in stored, node in local))
        for _ in node.inputs:
            value, key, lit = next(reads)
            base = key[0]
            read = index.get(key) if lit is None and base not in local else None
            full = repr(value.attrs.get("value")) if value.op == "full" else None
            parts.append(
                (
                    names[value],
                    value.op,
                    value.dtype,
                    names[base],
                    base is value,
                    base in local,
                    value in local,
                    base in unrounded,
                    value in unrounded,
                    lit,
                    read,
                    full,
                )
            )
    return tuple(parts)
