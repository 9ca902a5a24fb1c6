"""A plan found in the disk cache with its recorded rendering facts is not rendered again; facts
or files that do not check (edited, planted, another environment or buffer layout) are ignored:
the plan renders, its entry is rewritten, and nothing from the edited files runs."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.build import plan_facts
from backplan.codegen.render import emit
from backplan.runtime.backend import use_backend


def loss(w, x):
    return bp.sum(bp.tanh(x @ w) * 2.0)


def step():
    """A fresh value_and_grad of the same function (its own trace and lowering): its value,
    gradient and compiled plan."""
    w = bp.tensor(np.arange(12, dtype=np.float32).reshape(3, 4) / 10)
    x = bp.tensor(np.ones((2, 3), np.float32))
    with use_backend("numba"):
        vg = bp.value_and_grad(loss)
        value, grad = vg(w, x)
        compiled = vg.trace(w, x).runner().compiled
    return float(value.item()), grad.numpy().tolist(), compiled


@pytest.fixture
def renders(tmp_path, monkeypatch):
    """The cache in tmp_path; the list records each plan rendered from its IR."""
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))
    done = []
    real = emit._generate
    monkeypatch.setattr(
        emit, "_generate", lambda lowered, *rest: done.append(lowered) or real(lowered, *rest)
    )
    return done


def test_a_plan_cached_with_its_facts_is_not_rendered_again(tmp_path, renders):
    value, grad, first = step()
    assert len(renders) == 1
    assert [n for n in os.listdir(tmp_path) if n.endswith(".facts")]
    again_value, again_grad, again = step()
    assert len(renders) == 1  # the second plan was not rendered
    assert again.cache_hit and again.source == first.source
    assert [k.digest for k in again.loop_kernels] == [k.digest for k in first.loop_kernels]
    assert (again_value, again_grad) == (value, grad)


def _flip_a_byte(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("what", ["facts", "layout", "environment"])
def test_facts_that_do_not_check_are_ignored(tmp_path, renders, monkeypatch, what):
    value, grad, first = step()
    if what == "facts":
        (facts,) = [tmp_path / n for n in os.listdir(tmp_path) if n.endswith(".facts")]
        _flip_a_byte(facts)  # edited: its signature fails
    elif what == "layout":  # this process's lowering placed buffers elsewhere
        monkeypatch.setattr(plan_facts, "layout_hash", lambda lowered: "another layout")
    else:
        monkeypatch.setenv("BACKPLAN_GEMM", "blas")  # rendering reads it; the key does not
    again_value, again_grad, again = step()
    assert len(renders) == 2  # rendered again
    assert np.allclose(again_value, value) and np.allclose(again_grad, grad)
    if what != "environment":
        assert again.source == first.source
    assert step()[:2] == (again_value, again_grad)
    assert len(renders) == 2  # the facts were written again, for this process


SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import test_plan_facts as t
    from backplan.codegen.build.fingerprint import codegen_fingerprint
    from backplan.codegen.render import emit
    renders, real = [], emit._generate
    emit._generate = lambda lowered, *rest: renders.append(1) or real(lowered, *rest)
    value, grad, compiled = t.step()
    print(json.dumps({"value": value, "grad": grad, "renders": len(renders),
                      "path": compiled.module_path, "source": compiled.source,
                      "kernel": compiled.loop_kernels[0].name,
                      "code": codegen_fingerprint()}))
""")


def _same_code_generator(first, later):
    """The plans' cache key covers every file of the code generator (fingerprint.py): a
    checkout edited or rebased while this test runs gives the later process another key, an
    entry of its own and a rendering, which is right, and not what this test is about."""
    assert later["code"] == first["code"], (
        "the code generator's files changed while the test ran (an edit or a rebase of this "
        "checkout): the later process's plan has another cache key; run it again"
    )


def fresh_process(cache_dir):
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(cache_dir)}
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, tests], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_edited_files_are_never_run_a_fresh_process_renders_and_rewrites_them(tmp_path):
    """A process that finds the driver's or a loop kernel's file edited after its facts were
    recorded renders the plan, runs what it generated (not the files) and writes them again;
    the next process uses the facts again."""
    first = fresh_process(tmp_path)
    assert first["renders"] == 1
    marker = tmp_path / "edited-code-ran"
    planted = f"\nopen({str(marker)!r}, 'w').write('x')\n"
    kernel = tmp_path / f"{first['kernel']}.py"
    generated_kernel = kernel.read_text()
    for path in (first["path"], kernel):
        with open(path, "a") as f:
            f.write(planted)
    second = fresh_process(tmp_path)
    _same_code_generator(first, second)
    assert second["renders"] == 1 and not marker.exists()
    assert (second["value"], second["grad"]) == (first["value"], first["grad"])
    assert open(first["path"]).read() == first["source"] == second["source"]
    assert kernel.read_text() == generated_kernel
    third = fresh_process(tmp_path)
    _same_code_generator(first, third)
    assert third["renders"] == 0 and (third["value"], third["grad"]) == (
        first["value"],
        first["grad"],
    )
