"""The child process that compiles plans' drivers into the disk cache
(codegen/build/driver_builder.py
starts it): it reads, from stdin, a list of plans (generated source, loop kernels, the argument
types), compiles each plan's `run` for them and writes one JSON line per plan to stdout, `error`
null once it is in the cache. The parent then loads the compiled driver from the cache, where
Numba wrote it signed. If the parent has exited meanwhile it goes on: the next run finds them."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings

from backplan.codegen.build import cache, driver_lock, fingerprint, kernel_cache
from backplan.codegen.build.driver_tier import numba_signature
from backplan.codegen.jit import saved_overload, start_parallel_runtime
from backplan.codegen.render.kernel_source import KernelSource


def build(payload: dict) -> tuple[str | None, bool]:
    """Compile one plan's driver into the cache: (None, or why it is not there; whether it was
    compiled here). Another process compiling the same driver is waited for, and its driver
    used."""
    if payload["parts"]["codegen"] != fingerprint.codegen_fingerprint():
        here = fingerprint.CODEGEN_ROOT
        return (
            f"the build process found other code generator files in {here} than this program "
            "started with (edited since, or another copy of backplan): its driver would not be "
            "this program's"
        ), False
    kernels = [
        KernelSource(k["digest"], k["source"], k["parallel"], tuple(k["arguments"]))
        for k in payload["kernels"]
    ]
    kernel_cache.load(kernels)
    module, _, _ = cache.load_module(payload["source"], payload["parts"])
    signature = numba_signature(payload["signature"])
    with driver_lock.held(module.__file__), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.run.compile(signature)
    compiled = bool(module.run.stats.cache_misses)
    if saved_overload(module.run, signature) is None:
        said = " | ".join(str(w.message) for w in caught[-3:])
        return f"Numba compiled the driver but did not cache it ({said or 'no warning'})", compiled
    return None, compiled


def report(index: int, error: str | None, compiled: bool) -> None:
    """One line to the parent; nobody reads it once the parent has exited, and that is fine."""
    line = json.dumps({"index": index, "error": error, "compiled": compiled}) + "\n"
    try:
        os.write(1, line.encode())
    except OSError:
        pass


def stop_with_parent() -> None:
    """No build outlives the program unless asked (BACKPLAN_DRIVER_AT_EXIT=finish): a parent
    that ends without running its exit handler (killed, crashed) leaves this child to another
    parent, which it notices within half a second."""
    if os.environ.get("BACKPLAN_DRIVER_AT_EXIT", "kill") == "finish":
        return
    parent = int(os.environ.get("BACKPLAN_BUILD_PARENT", os.getppid()))  # the parent may be
    # gone before this child got here (importing Numba takes a second)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="backplan-parent-watch", daemon=True).start()


BUILD_NICENESS = 10


def niceness(cpus: set | None) -> int:
    """How much lower than the program's the build's priority is. With several CPUs the
    parent's steps keep running beside it (its BLAS threads spin-wait on every CPU and starve
    when a compiler takes one): the build gets what the steps leave. Limited to one CPU (the
    program pinned; the child inherits it) the build can only take turns with the steps, and
    at a lower priority it got about a tenth of the CPU from a busy step loop: mlp_tiny's
    26-statement driver was compiled 12 s after its 1.7 s first call. There it takes equal
    turns: the steps run at half speed for a few seconds instead of missing compiled speed."""
    return BUILD_NICENESS if cpus is None or len(cpus) > 1 else 0


def main() -> None:
    stop_with_parent()
    os.nice(niceness(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None))
    payloads = json.loads(sys.stdin.buffer.read())
    start_parallel_runtime()
    for index, payload in enumerate(payloads):
        try:
            error, compiled = build(payload)
        except Exception as exc:  # noqa: BLE001 - the next plan may still build
            error, compiled = f"{type(exc).__name__}: {exc}", False
        report(index, error, compiled)


if __name__ == "__main__":
    main()
