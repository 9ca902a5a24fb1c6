"""A plan's address loops compile together on its first Python-run call, in one LLVM module per
optimisation level (codegen/build/loop_batch.py), with the reference interpreter's values; a
later process loads that machine code from the cache folder and compiles none of them, a plan
sharing one of those loops does not compile it again, and a batch file that does not check
(edited, or signed by another key) is never run: the loops compile again."""

import os
import textwrap

import numpy as np
from helpers import script_facts

SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    import numpy as np
    import backplan as bp
    from backplan.codegen.build import kernel_cache, loop_batch
    from backplan.runtime.backend import use_backend

    warned = []  # the CacheWarnings of files that failed their check
    warnings.showwarning = lambda message, *rest, **more: warned.append(str(message))

    def loss(w, x):
        h = bp.tanh(x @ w + 0.5)
        return bp.sum(h * h * 0.75) + bp.sum(bp.exp(x * 0.125))

    def other(w, x):  # shares loss's exp loop, and adds loops of its own
        return bp.sum(bp.exp(x * 0.125)) + bp.sum(bp.sigmoid(x @ w) * 1.5)

    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    results, digests = {}, {}
    for name in sys.argv[1].split(","):
        fn = {"loss": loss, "other": other}[name]
        for backend in ("numba", "reference"):
            with use_backend(backend):
                step = bp.value_and_grad(fn)
                value, grad = step(bp.tensor(w), bp.tensor(x))
                if backend == "numba":
                    plan = step.trace(bp.tensor(w), bp.tensor(x)).runner().compiled
                    digests[name] = sorted({k.digest for k in plan.loop_kernels})
                    kernels = plan.loop_kernels
            results[f"{name} {backend}"] = [float(value.item()), grad.numpy().tolist()]
    compiled = [call for call in kernel_cache._PYTHON_CALLS.values() if call._libraries[False]
                or call._libraries[True]]
    numba_compiled = sum(sum(loop.stats.cache_misses.values())
                         for loops in kernel_cache._ADDRESS_LOOPS.values() for loop in loops)
    counted = None
    if sys.argv[2:] == ["drop-notes"]:  # what ran here counts as compiled without its notes
        import os
        folder = os.path.join(os.environ["BACKPLAN_CACHE_DIR"], "__pycache__")
        for note in [n for n in os.listdir(folder) if n.endswith(".batch")]:
            os.remove(os.path.join(folder, note))
        ran = [k for k in kernels if any(kernel_cache.python_call(
            kernel_cache.kernel(k.digest))._libraries)]
        counted = bool(ran) and kernel_cache.cached_digests(ran) == {k.digest for k in ran}
    print(json.dumps({"values": results, "batch": loop_batch.counts, "digests": digests,
                      "counted": counted, "warned": warned,
                      "numba_compiled": numba_compiled, "loops": len(compiled)}))
""")


def facts(folder, plans="loss", *more):
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(folder), "BACKPLAN_DRIVER": "python"}
    return script_facts(SCRIPT, plans, *more, env=env)


def close(result, plans):
    for plan in plans.split(","):
        got, want = result["values"][f"{plan} numba"], result["values"][f"{plan} reference"]
        assert np.allclose(got[0], want[0], rtol=1e-5)
        assert np.allclose(got[1], want[1], rtol=1e-5, atol=1e-6)


def batch_files(folder):
    names = os.listdir(folder / "__pycache__")  # loop batches; not Numba's runtime (bp_nrt_)
    return sorted(n for n in names if n.endswith(".o") and not n.startswith("bp_nrt_"))


def test_loops_compile_together_then_load_in_a_later_process(tmp_path):
    first = facts(tmp_path)
    close(first, "loss")
    assert first["loops"] >= 2
    assert first["batch"] == {"compiled": first["loops"], "loaded": 0}
    assert first["numba_compiled"] == 0  # none compiled on its own
    assert batch_files(tmp_path)

    second = facts(tmp_path)
    assert second["batch"] == {"compiled": 0, "loaded": first["loops"]}
    assert second["numba_compiled"] == 0
    assert second["values"] == first["values"]


GEMM_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import backplan as bp
    from test_gemm_epilogue import layer_arrays, layer_loss, value_and_grad

    arrays = layer_arrays(np.random.default_rng(4), 7, 33, 127, np.float32)
    got = value_and_grad(layer_loss(bp.tanh), arrays, "numba")
    want = value_and_grad(layer_loss(bp.tanh), arrays, "reference")
    print(json.dumps([float(np.max(np.abs(g - w))) for g, w in zip(got, want)]))
""")


def test_loops_calling_the_own_gemm_load_in_a_later_process(tmp_path):
    """A batch whose machine code calls the own GEMM by symbol (a GEMM epilogue's loop): a
    fresh process publishes the symbol before it loads the batch (before, LLVM aborted the
    second process: "Symbol not found: backplan_gemm_f32")."""
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path), "BACKPLAN_DRIVER": "python"}
    env |= {"BACKPLAN_GEMM": "own", "PYTHONPATH": os.path.dirname(__file__)}
    first = script_facts(GEMM_SCRIPT, env=env)
    assert batch_files(tmp_path)
    second = script_facts(GEMM_SCRIPT, env=env)
    assert second == first and max(first) < 1e-3


def test_a_plan_sharing_a_loop_does_not_compile_it_again(tmp_path):
    first = facts(tmp_path, "loss")
    both = facts(tmp_path, "loss,other")
    close(both, "loss,other")
    assert set(both["digests"]["loss"]) & set(both["digests"]["other"])  # a loop in both
    assert both["values"]["loss numba"] == first["values"]["loss numba"]
    # loss's loops (the shared one among them) come from its batch; only other's own compile
    assert both["batch"]["loaded"] == first["loops"]
    assert both["batch"]["compiled"] + both["numba_compiled"] == both["loops"] - first["loops"]


def test_a_batch_file_that_does_not_check_is_never_run(tmp_path):
    first = facts(tmp_path)
    for name in batch_files(tmp_path):
        path = tmp_path / "__pycache__" / name
        text = path.read_text()
        path.write_text(text[:-8] + ("0" if text[-8] != "0" else "1") + text[-7:])  # one byte
    again = facts(tmp_path)
    close(again, "loss")
    assert again["values"] == first["values"]
    assert again["batch"] == {"compiled": first["loops"], "loaded": 0}  # compiled again


def test_a_batch_file_or_note_that_does_not_check_is_removed_saying_so(tmp_path):
    """A truncated object or an edited note is never run, and not left on disk for every later
    process to reject in silence: it is removed with a CacheWarning naming it, as Numba's
    signed files are, and the loops compile again."""
    facts(tmp_path)
    folder = tmp_path / "__pycache__"
    (batch,) = batch_files(tmp_path)
    truncated = (folder / batch).read_text()[:2000]
    (folder / batch).write_text(truncated)
    note = sorted(name for name in os.listdir(folder) if name.endswith(".batch"))[0]
    text = (folder / note).read_text()
    (folder / note).write_text(text[:-8] + ("0" if text[-8] != "0" else "1") + text[-7:])
    again = facts(tmp_path)
    close(again, "loss")
    assert again["batch"]["loaded"] == 0
    assert any(batch in w and "truncated" in w and "removed it" in w for w in again["warned"])
    assert any(note in w and "signature" in w for w in again["warned"])
    assert not (folder / batch).exists() or (folder / batch).read_text() != truncated
    assert facts(tmp_path)["warned"] == []  # what the second process wrote checks


THREADS = textwrap.dedent("""
    import json, threading
    import numpy as np
    import backplan as bp
    from backplan.codegen.build import kernel_cache, loop_batch
    from backplan.runtime.backend import use_backend

    def first(w, x):
        h = x @ w
        return bp.sum(bp.sin(h) * bp.cos(h) * 1.25) + bp.sum(bp.abs(x) * 0.5)

    def second(w, x):  # first's loops and one of its own
        h = x @ w
        return bp.sum(bp.sin(h) * bp.cos(h) * 1.25) + bp.sum(bp.sqrt(bp.abs(x) + 1.0))

    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 3)).astype(np.float32)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    got, start = {}, threading.Barrier(2)

    def run(fn):
        with use_backend("numba"):
            step = bp.value_and_grad(fn)
            step.trace(bp.tensor(w), bp.tensor(x))  # planned: both first calls start together
            start.wait()
            value, grad = step(bp.tensor(w), bp.tensor(x))
        got[fn.__name__] = [float(value.item()), grad.numpy().tolist()]

    threads = [threading.Thread(target=run, args=(fn,)) for fn in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    want = {}
    for fn in (first, second):
        with use_backend("reference"):
            value, grad = bp.value_and_grad(fn)(bp.tensor(w), bp.tensor(x))
        want[fn.__name__] = [float(value.item()), grad.numpy().tolist()]
    forms = sum(bool(lib) for call in kernel_cache._PYTHON_CALLS.values()
                for lib in call._libraries)
    numba_compiled = sum(sum(loop.stats.cache_misses.values())
                         for loops in kernel_cache._ADDRESS_LOOPS.values() for loop in loops)
    print(json.dumps({"got": got, "want": want, "forms": forms, "batch": loop_batch.counts,
                      "numba_compiled": numba_compiled}))
""")


def test_two_threads_making_first_calls_at_once_compile_each_loop_once(tmp_path):
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path), "BACKPLAN_DRIVER": "python"}
    result = script_facts(THREADS, env=env)
    for name in ("first", "second"):
        got, want = result["got"][name], result["want"][name]
        assert np.allclose(got[0], want[0], rtol=1e-5)
        assert np.allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert result["forms"] >= 3
    # every loop form either thread ran was compiled once, in a batch or on its own
    assert result["batch"]["compiled"] + result["numba_compiled"] == result["forms"]
    assert result["batch"]["loaded"] == 0


def test_loops_that_ran_here_count_as_compiled_without_their_notes(tmp_path):
    """What progress lines and explain call cached includes loops compiled in a batch here."""
    assert facts(tmp_path, "loss", "drop-notes")["counted"] is True


EXPLAIN = textwrap.dedent("""
    import json, sys
    import numpy as np
    import backplan as bp
    from backplan.runtime.backend import use_backend

    def loss(w, x):
        h = bp.tanh(x @ w + 0.5)
        return bp.sum(h * h * 0.75) + bp.sum(bp.exp(x * 0.125))

    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    with use_backend("numba"):
        report = bp.value_and_grad(loss).explain(bp.tensor(w), bp.tensor(x))
    print(json.dumps({"cached": sum(len(f.cached_kernels) for f in report.compiled)}))
""")


def test_a_note_whose_batch_object_is_gone_does_not_count_as_cached(tmp_path):
    """explain and the progress lines count a loop with a batch note as cached; a note whose
    object was removed (or one written for another CPU target) compiles its loop again, and
    is not counted."""
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path), "BACKPLAN_DRIVER": "python"}
    first = facts(tmp_path)
    before = script_facts(EXPLAIN, env=env)["cached"]
    for name in batch_files(tmp_path):
        os.remove(tmp_path / "__pycache__" / name)
    after = script_facts(EXPLAIN, env=env)["cached"]
    assert after == before - first["batch"]["compiled"]


def test_two_processes_starting_at_once_compile_the_batch_once(tmp_path):
    """The ranks of `mpiexec -n 2` (or two test workers) make the same plan's first call at the
    same moment: one compiles the batch while the other waits on its lock
    (codegen/build/batch_lock.py), then loads it. Both compiled it before, each in full."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path), "BACKPLAN_DRIVER": "python"}
    started = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, "loss"], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = []
    for process in started:
        out, _ = process.communicate(timeout=600)
        assert process.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    for result in results:
        close(result, "loss")
        assert result["numba_compiled"] == 0
    loops = results[0]["loops"]
    assert loops >= 2
    assert sorted(r["batch"]["compiled"] for r in results) == [0, loops]
    assert sorted(r["batch"]["loaded"] for r in results) == [0, loops]
    assert results[0]["values"] == results[1]["values"]
    assert [name for name in os.listdir(tmp_path / "__pycache__") if name.endswith(".lock")]
