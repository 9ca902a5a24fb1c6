"""One fresh process of the compile-time benchmark (bench/compile_time.py starts it by path, so
nothing of backplan is imported before the timed import): import the peer's framework, build
one model, time its first call (one forward + backward step, e.g. one `value_and_grad` call)
and its second, and print one JSON line. Caches come from the environment the parent sets.

    python bench/compile_child.py '{"model": "mlp", "peer": "backplan", "small": false,
                                    "dtype": "float32"}'
"""

import time

START = time.perf_counter()

import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

# What each peer's user imports before the first call; timed as the import.
FRAMEWORK_MODULES = {
    "backplan": ("numpy", "backplan"),
    "backplan.background": ("numpy", "backplan"),
    "torch": ("numpy", "torch"),
    "torch.compile": ("numpy", "torch"),
    "jax": ("numpy", "jax"),
}


def import_framework(peer: str) -> float:
    for name in FRAMEWORK_MODULES[peer]:
        importlib.import_module(name)
    return time.perf_counter() - START


def driver_hooks(peer: str) -> tuple:
    """(wait, driver state) for backplan's peers: its first calls run plan drivers as Python
    while the compiled drivers build in a background process (codegen/build/driver_builder.py);
    wait()
    returns once every build has finished. (None, None) for other peers."""
    if not peer.startswith("backplan"):
        return None, None
    from backplan.bench.internals import driver_builder

    state = "building" if driver_builder.pending() else "compiled"
    return driver_builder.wait_for_builds, state


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(request: dict) -> dict:
    import numpy as np

    from backplan.bench.check import check_output
    from backplan.bench.models import MODELS
    from backplan.bench.peers import PEERS, reference_output

    spec, peer = MODELS[request["model"]], PEERS[request["peer"]]()
    inputs = spec.inputs(request["small"], np.dtype(request["dtype"]))
    first_start = time.perf_counter()
    runner = peer.build(spec, inputs)
    runner.step()
    first = time.perf_counter() - first_start
    wait, tier_after_first = driver_hooks(request["peer"])
    second = timed(runner.step)
    result = {"first_call_s": first, "second_call_s": second, "driver_tier": tier_after_first}
    if wait is not None:
        wait()
        result["fast_after_s"] = time.perf_counter() - first_start
        result["fast_call_s"] = timed(runner.step)
        result["driver_tier_ready"] = driver_hooks(request["peer"])[1]
    check = check_output(runner.output(), reference_output(spec, inputs), request["dtype"])
    result["check"] = check.to_dict()
    result["resized_first_call_s"] = resized_first_call(spec, peer, request)
    if wait is not None:
        wait()  # its driver build: none may outlive this process and slow the next one
    return result


def resized_first_call(spec, peer, request: dict) -> float:
    """The first call of the same model at other sizes (the --small shapes, or the full ones
    under --small), in the same process: a second model that shares the first one's loop
    bodies, so backplan compiles no new kernel for it."""
    import numpy as np

    other = spec.inputs(not request["small"], np.dtype(request["dtype"]))
    start = time.perf_counter()
    peer.build(spec, other).step()
    return time.perf_counter() - start


def main() -> int:
    request = json.loads(sys.argv[1])
    import_s = import_framework(request["peer"])
    result = {"import_s": import_s, "load_average_1min": os.getloadavg()[0]}
    result |= measure(request)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
