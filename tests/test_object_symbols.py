"""Cached functions load without parsing their linking bitcode (codegen/build/object_symbols.py):
the symbols read off the object code are the ones LLVM finds defined (less internal constants),
and a function loaded that way still runs, and still links into a function compiled after it."""

import os
import textwrap

import numba
from helpers import script_facts
from llvmlite import binding as ll

from backplan.codegen.build import object_symbols

INTERNAL = ll.Linkage.internal, ll.Linkage.private


def test_the_object_code_defines_what_llvm_says_less_internal_names():
    @numba.njit
    def scaled(x, k):
        return x * k + 1.0

    scaled(2.0, 3.0)
    library = scaled.overloads[scaled.signatures[0]].library
    name, kind, (obj, bitcode) = library.serialize_using_object_code()
    module = ll.parse_bitcode(bitcode)
    defined = {
        g.name
        for g in [*module.functions, *module.global_variables]
        if not g.is_declaration and g.linkage not in INTERNAL
    }
    found = object_symbols.defined_symbols(obj)
    assert kind == "object" and found == defined
    assert any("scaled" in n for n in found)
    assert object_symbols.defined_symbols(b"not an object file") is None
    assert object_symbols.defined_symbols(obj[:80]) is None  # cut short: Numba's own path


SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import backplan.codegen.build.cache_signing  # installs the loader
    import numba
    from numba.core import codegen
    import cached_module
    value = cached_module.scaled(2.0, 3.0)
    library = cached_module.scaled.overloads[cached_module.scaled.signatures[0]].library
    unparsed = getattr(library, "_unparsed_bitcode", None) is not None

    @numba.njit
    def calls_it(x):  # compiled here: links the loaded library's module
        return cached_module.scaled(x, 2.0) - 1.0

    print(json.dumps({"value": value, "linked": calls_it(5.0), "unparsed": unparsed,
                      "hits": sum(cached_module.scaled.stats.cache_hits.values())}))
""")


def test_a_function_loaded_from_the_cache_runs_and_links_into_a_new_one(tmp_path):
    (tmp_path / "cached_module.py").write_text(
        "import numba\n\n@numba.njit(cache=True)\ndef scaled(x, k):\n    return x * k + 1.0\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}

    def run():
        return script_facts(SCRIPT, str(tmp_path), env=env, timeout=300)

    first, second = run(), run()
    assert first["hits"] == 0 and second["hits"] == 1  # the second process loaded it
    assert second["unparsed"] and not first["unparsed"]  # loaded without parsing the bitcode
    assert second["value"] == first["value"] == 7.0
    assert second["linked"] == first["linked"] == 10.0
