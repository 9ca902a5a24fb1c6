"""How much of an address loop's compile is Numba's own and how much LLVM's: the size of emitting
a loop's LLVM IR directly (no Numba typing or lowering).

    taskset -c 1 python -m backplan.bench.loop_llvm_cost --loops 5

After Numba's one-time set-up, compiles `--loops` one-statement elementwise address loops (the
form codegen/render/address_loops.py writes: loads and stores at an origin and an index), each
its own function, and times each compile (thread CPU s); then runs llvmlite alone on the IR
Numba made for the last of them: parse, the O3 pipeline, machine code, each timed.
"""

from __future__ import annotations

import argparse
import json
import time


def numba_compiles(count: int):
    """(thread CPU s of each loop's Numba compile, the last loop's LLVM IR)."""
    import numba
    import numpy as np
    from numba import types
    from numba.core.registry import cpu_target

    from backplan.bench.internals import address_views, kernel_modules

    load, origin, store = address_views.load, address_views.origin, address_views.store
    kernel_modules()  # as rendering does, before any compile
    cpu_target.target_context.refresh()
    signature = (types.voidptr, types.intp, types.intp, types.intp) + (
        types.voidptr, types.intp, types.voidptr, types.intp
    )  # fmt: skip
    seconds, loop = [], None
    for k in range(count):
        source = (
            "def kernel_at(a0, o0, n0, n1, a1, o1, a2, o2):\n"
            "    p0 = origin(a0, o0, np.float32)\n"
            "    p1 = origin(a1, o1, np.float32)\n"
            "    p2 = origin(a2, o2, np.float32)\n"
            "    for i0 in range(n0):\n"
            "        for i1 in range(n1):\n"
            f"            t0 = (load(p0, i0 * n1 + i1) + load(p1, i1)) * {k + 2}.0\n"
            "            store(p2, i0 * n1 + i1, t0)\n"
        )
        scope = {"origin": origin, "load": load, "store": store, "np": np}
        exec(compile(source, f"<loop {k}>", "exec"), scope)
        loop = numba.njit(nogil=True)(scope["kernel_at"])
        start = time.thread_time()
        loop.compile(signature)
        seconds.append(time.thread_time() - start)
    return seconds, loop.inspect_llvm(signature)


def llvm_alone(ir_text: str) -> dict:
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3
    )
    start = time.thread_time()
    module = llvm.parse_assembly(ir_text)
    module.verify()
    parsed = time.thread_time()
    builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(3))
    builder.getModulePassManager().run(module, builder)
    optimised = time.thread_time()
    machine.emit_object(module)
    done = time.thread_time()
    return {"parse_s": parsed - start, "o3_s": optimised - parsed, "object_s": done - optimised}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=5)
    args = parser.parse_args(argv)
    seconds, ir_text = numba_compiles(args.loops)
    facts = {
        "numba_compile_s": [round(s, 4) for s in seconds],
        "ir_lines": ir_text.count("\n"),
        "llvmlite_alone": {k: round(v, 4) for k, v in llvm_alone(ir_text).items()},
    }
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
