"""What rendering a plan found, kept beside its cache entry, so a warm process skips rendering.

A plan's cache key (codegen/build/cache.py) is the hash of its IR text and of everything else the
generated code depends on, and rendering is a function of them; yet a warm process rendered the
whole plan again (0.05 s for the bench transformer, 0.4 s for an unrolled 48-step LSTM) only to
compare the source with the file and learn the few facts a call needs. Those facts are written
once, signed like Numba's files (codegen/build/cache_signing.py) with the hashes of the driver's
and each loop kernel's source, and a later process runs the files whose hashes the signed facts
give: code is still only ever run if backplan generated it.

The facts' name also hashes what rendering reads from the environment and is not in the key
(the GEMM choice and its thread count, codegen/kernels/gemm/choice.py), and they hold a hash of
the buffer layout the source was rendered for: a process whose lowering placed any buffer
elsewhere renders again rather than run a driver writing where its arenas do not hold it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from backplan.codegen.build import cache, cache_signing
from backplan.codegen.render import emit
from backplan.codegen.render.emit import GeneratedModule
from backplan.codegen.render.kernel_source import KernelSource
from backplan.ir.lowering import LoweredPlan, literal_outputs
from backplan.ir.printer import value_names

# What only steers when, where or how loudly backplan compiles, not what it generates.
_NOT_RENDERING = {
    "BACKPLAN_CACHE_DIR",
    "BACKPLAN_LIBRARY_CACHE_DIR",
    "BACKPLAN_DRIVER",
    "BACKPLAN_DRIVER_AT_EXIT",
    "BACKPLAN_BUILD_PARENT",
    "BACKPLAN_QUIET",
    "BACKPLAN_VERBOSE",
}
_PREFIXES = ("BACKPLAN_", "NUMBA_", "OPENBLAS_", "OMP_", "MKL_")


def environment() -> str:
    """The variables rendering may read (every backplan, Numba and BLAS one but those that
    only steer builds and messages) and the CPUs this process may use (the GEMM choice counts
    BLAS threads): rendering with another of them may choose otherwise."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    read = sorted(
        (k, v) for k, v in os.environ.items() if k.startswith(_PREFIXES) and k not in _NOT_RENDERING
    )
    return json.dumps([cpus, read])


def layout_hash(lowered: LoweredPlan) -> str:
    """Where the lowering put every buffer: the driver's offsets and output order are these."""
    layout = lowered.layout
    names = value_names(lowered.plan.graph)
    text = json.dumps(
        [
            sorted((names[v], o) for v, o in layout.scratch_offsets.items()),
            sorted((names[v], names[s]) for v, s in layout.reused_saved.items()),
            [names[v] for v in layout.outputs],
            sorted(layout.scratch_elements.items()),
            sorted((names[v], o, n) for v, (o, n) in layout.workspaces.items()),
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()


VERSION = "1"  # of what the facts hold: another version is another file


def _name(key: str) -> str:
    return f"bp_{key}.{VERSION}.{hashlib.sha256(environment().encode()).hexdigest()[:16]}.facts"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write(key: str, lowered: LoweredPlan, generated: GeneratedModule) -> None:
    """Record a rendering's facts for the entry `key` (nothing for a size-generic driver: its
    key hashes its rendered source, so it cannot be found without rendering)."""
    directory = cache.writable_cache_dir()
    if directory is None or generated.literals is not None:
        return
    facts = {
        "source": _sha(generated.source),
        "constants": generated.constant_names,
        "kernels": [
            [k.digest, k.parallel, list(k.arguments), _sha(k.source)]
            for k in generated.loop_kernels
        ],
        "statements": generated.driver_statements,
        "parts": generated.driver_parts,
        "layout": layout_hash(lowered),
        "nodes": _node_facts(lowered, generated),
    }
    if facts["nodes"] is None:
        return
    name = _name(key)
    signed = cache_signing.signed(name, json.dumps(facts).encode())
    cache.write_entry(directory, {name: signed.hex()})


def recorded(key: str) -> bool:
    """Whether facts for `key` (in this environment) are in the cache folder."""
    return os.path.exists(os.path.join(cache.cache_path(), _name(key)))


def _text(folder: str, name: str, sha: str, module: str) -> str | None:
    """The text of the generated file `name` if its hash is `sha`: the module this process
    already runs for it (a plan made again), else the file in the cache folder."""
    text = getattr(sys.modules.get(module), "__source_text__", None)
    if text is None or _sha(text) != sha:
        text = cache._read(os.path.join(folder, name))  # noqa: SLF001
    return text if text is not None and _sha(text) == sha else None


def read(key: str, lowered: LoweredPlan) -> GeneratedModule | None:
    """The rendering recorded for `key`, its files checked against the signed hashes; None
    when there is none, or any part fails (then the plan renders and the facts are written
    again)."""
    folder = cache.cache_path()
    name = _name(key)
    text = cache._read(os.path.join(folder, name))  # noqa: SLF001
    if text is None:
        return None
    try:
        payload, _ = cache_signing.verified(name, bytes.fromhex(text))
        if payload is None:
            return None
        facts = json.loads(payload)
        if facts["layout"] != layout_hash(lowered):
            return None
        source = _text(folder, f"bp_{key}.py", facts["source"], f"backplan_kernels_{key}")
        kernels = []
        for digest, parallel, arguments, sha in facts["kernels"]:
            name = f"k_{digest[:20]}"
            text = _text(folder, f"{name}.py", sha, f"backplan_kernel_{name}")
            if text is None:
                return None
            kernels.append(KernelSource(digest, text, parallel, tuple(arguments)))
        if source is None:
            return None
        return _generated(
            lowered,
            source,
            facts["constants"],
            kernels,
            (facts["statements"], facts["parts"]),
            facts["nodes"],
        )
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def _node_facts(lowered: LoweredPlan, generated: GeneratedModule) -> dict | None:
    """What rendering found per node (explain reads it: the GEMM each matmul calls, GEMMs
    whose epilogue runs apart, kernels run as several calls), by position in the plan; None
    if a node is not one of the plan's (then no facts are kept)."""
    at = {node: i for i, node in enumerate(lowered.plan.graph.nodes)}
    found = [*generated.gemms, *generated.epilogues_apart, *generated.calls_of]
    if any(n not in at for n in found):
        return None
    return {
        "gemms": [[at[n], text] for n, text in generated.gemms.items()],
        "apart": [at[n] for n in generated.epilogues_apart],
        "calls_of": [[at[n], count] for n, count in generated.calls_of.items()],
    }


def _generated(
    lowered: LoweredPlan, source: str, constants: list, kernels: list, driver: tuple, facts: dict
) -> GeneratedModule:
    """The rendering put together from the recorded facts and the lowering's own, as
    emit.generate makes it, and kept with the plan as a rendering is. driver: (statements,
    parts); facts: _node_facts'."""
    graph, layout = lowered.plan.graph, lowered.layout
    statements, parts = driver
    nodes = graph.nodes
    apart = frozenset(nodes[i] for i in facts["apart"])
    calls_of = {nodes[i]: count for i, count in facts["calls_of"]}
    literal_outs = literal_outputs(lowered)
    generated = GeneratedModule(
        source,
        list(constants),
        dict(sorted(layout.scratch_elements.items())),
        list(layout.outputs),
        literal_outs,
        emit._output_sources(graph.outputs, literal_outs, layout.outputs),  # noqa: SLF001
        lowered.kernel_count + len(apart) + sum(n - 1 for n in calls_of.values()),
        layout,
        kernels,
        statements,
        parts,
        None,
        apart,
        calls_of,
        {nodes[i]: text for i, text in facts["gemms"]},
    )
    with emit._rendering:  # noqa: SLF001 - one rendering per plan, whoever makes it
        if lowered.rendered is None:
            lowered.rendered = generated
        return lowered.rendered
