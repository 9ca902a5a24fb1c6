"""codegen/build/runtime_cache.py: Numba's runtime functions are compiled once and loaded as
signed machine code by later processes; a tampered file is compiled again, with a warning; code
allocating through the runtime runs the same either way."""

import glob
import os
import textwrap

from helpers import script_facts, tamper_signed_file

SCRIPT = textwrap.dedent(
    """
    import json, warnings
    import numpy as np
    import numba
    import backplan
    from backplan.codegen.build import loop_batch
    from numba.core.registry import cpu_target
    from numba.core.runtime import nrt

    loaded = []
    unserialize = loop_batch.unserialize_object
    loop_batch.unserialize_object = lambda payload, name="x": loaded.append(name) or unserialize(
        payload, name
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nrt.rtsys.initialize(cpu_target.target_context)

    @numba.njit
    def made(n):
        a = np.zeros(n)  # allocated through the runtime
        a[n - 1] = 2.5
        return a

    print(json.dumps({
        "loaded": loaded,
        "values": made(4).tolist(),
        "warnings": [str(w.message) for w in caught],
    }))
    """
)


def test_the_runtime_functions_are_compiled_once_then_loaded(tmp_path):
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path / "kernels")}
    first = script_facts(SCRIPT, env=env, timeout=300)
    second = script_facts(SCRIPT, env=env, timeout=300)
    assert first["loaded"] == [] and second["loaded"] == ["nrt"], (first, second)
    assert first["values"] == second["values"] == [0.0, 0.0, 0.0, 2.5]
    assert second["warnings"] == []
    (stored,) = glob.glob(str(tmp_path / "kernels" / "__pycache__" / "bp_nrt_*.o"))
    tamper_signed_file(stored)  # one hex digit of the signed payload changed
    third = script_facts(SCRIPT, env=env, timeout=300)
    assert third["loaded"] == [] and third["values"] == first["values"]
    assert any(
        w.startswith("runtime cache file (Numba's runtime functions)") and "bp_nrt_" in w
        for w in third["warnings"]
    ), third["warnings"]
    fourth = script_facts(SCRIPT, env=env, timeout=300)  # compiled and stored again
    assert fourth["loaded"] == ["nrt"] and fourth["values"] == first["values"]


def test_the_runtime_is_compiled_as_numba_does_where_the_folder_cannot_be_written(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(blocked / "kernels")}
    for _ in range(2):  # nothing stored, nothing loaded: compiled in each process
        facts = script_facts(SCRIPT, env=env, timeout=300)
        assert facts["loaded"] == [] and facts["values"] == [0.0, 0.0, 0.0, 2.5]
