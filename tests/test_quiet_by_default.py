"""Quiet by default (codegen/build/compile_notice.py): a program whose first calls compile says
so in at most one stderr line, naming what compiles and how long so far, over three batch sizes
too (the second makes axis 0 dynamic, the third runs its plan); BACKPLAN_VERBOSE=1 gives each
stage, BACKPLAN_QUIET=1 nothing. Run in fresh processes with an empty cache folder, and the
threshold at 0 s so that even a fast machine's compile is long enough to be announced."""

import io
import os
import subprocess
import sys
import time

import numpy as np

import backplan as bp
from backplan.codegen.build import compile_notice
from backplan.codegen.run.compiled import plan_label

SCRIPT = """
import numpy as np
import backplan as bp

def loss(w, x):
    return bp.mean(bp.tanh(x @ w) ** 2)

@bp.compile
def predict(w, x):
    return bp.relu(x @ w) * 2.0

w = bp.tensor(np.ones((5, 3), np.float32))
step = bp.value_and_grad(bp.compile(loss))
for n in (7, 7, 7, 9, 12):  # batch 9 makes axis 0 dynamic: 12 runs the same plan
    x = bp.tensor(np.ones((n, 5), np.float32))
    step(w, x)
    predict(w, x)
print("done", step.cache_info().traces, predict.cache_info().traces)
"""


def stderr_lines(tmp_path, **settings) -> list[str]:
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path / "kernels"), **settings}
    for name in ("BACKPLAN_DRIVER", "BACKPLAN_BACKEND", "BACKPLAN_QUIET", "BACKPLAN_VERBOSE"):
        env.pop(name, None)  # the defaults a user gets (the suite's conftest sets some)
    env.update(settings)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip() == "done 2 2", done.stderr
    return done.stderr.splitlines()


def test_a_default_run_prints_one_line_naming_the_compile(tmp_path):
    lines = stderr_lines(tmp_path, BACKPLAN_PROGRESS_SECONDS="0")
    assert len(lines) == 1, lines
    assert lines[0].startswith("backplan: compiling @loss") and "s so far" in lines[0], lines


def test_verbose_says_each_stage_and_quiet_says_nothing(tmp_path):
    verbose = stderr_lines(tmp_path / "a", BACKPLAN_PROGRESS_SECONDS="0", BACKPLAN_VERBOSE="1")
    assert len(verbose) > 2 and all(line.startswith("backplan: ") for line in verbose), verbose
    assert any("loop kernels" in line for line in verbose), verbose
    quiet = stderr_lines(tmp_path / "b", BACKPLAN_PROGRESS_SECONDS="0", BACKPLAN_QUIET="1")
    assert quiet == []


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _wait_for(stream, text: str) -> None:
    """Until the notice's timer thread has written text (no timing is asserted)."""
    deadline = time.monotonic() + 60
    while text not in stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_on_a_terminal_the_line_names_each_long_compile_and_is_erased_after(monkeypatch):
    """A 2 s loss function then a 10 s training step: the status line names the step while it
    compiles (a log gets only the first), and nothing stays on screen once compiles end."""
    for name in ("BACKPLAN_QUIET", "BACKPLAN_VERBOSE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BACKPLAN_PROGRESS_SECONDS", "0")
    monkeypatch.setenv("COLUMNS", "200")  # the line is cut to the terminal's width
    screen = _Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    for what in ("@loss", "@train_step"):
        with compile_notice.compiling(what):
            with compile_notice.compiling("the library's f32 GEMM"):
                _wait_for(screen, f"compiling {what} (now the library's f32 GEMM), ")
            _wait_for(screen, f"compiling {what}, ")
    written = screen.getvalue()
    assert "compiling @train_step (now the library's f32 GEMM), " in written, written
    assert "\n" not in written and written.endswith("\r\x1b[K"), repr(written)


def test_a_narrow_terminal_loses_the_hint_and_whole_words_never_half_of_one():
    line = compile_notice._text([("@train_step", time.perf_counter())])
    assert compile_notice._fitted(line, 500) == line
    short = compile_notice._fitted(line, 60)
    assert short == "backplan: compiling @train_step, 0 s so far", short
    tiny = compile_notice._fitted(line, 30)
    assert len(tiny) <= 30 and tiny.endswith("...") and line.startswith(tiny[:-3]), tiny
    assert tiny[:-3] + " " in line + " ", tiny  # ends on a whole word


def test_a_lambda_is_named_by_its_file_and_line():
    """A lambda's plans are all called `@_lambda_`, which told the user nothing ("compiling
    @_lambda_ (now @_lambda_)"): the lines name its file and line instead."""
    line = sys._getframe().f_lineno + 1
    double = bp.compile(lambda x: bp.tanh(x) * 2.0)
    plans = double.trace(bp.tensor(np.ones(3, np.float32), requires_grad=True)).program.plans
    where = f"the lambda at test_quiet_by_default.py:{line}"
    assert plan_label(plans.forward.graph) == where
    assert plan_label(plans.backward.graph) == f"{where} (backward)"

    def loss(x):
        return bp.tanh(x).sum()

    named = bp.compile(loss).trace(bp.tensor(np.ones(3, np.float32))).program.plans
    assert plan_label(named.forward.graph) == "@loss"


def test_a_compile_that_cannot_be_cached_does_not_say_it_is(monkeypatch):
    """With the cache folder unwritable (a full disk, a read-only mount) the line said `cached
    for later runs` while the process compiled in memory and the next run compiled again."""
    from backplan.codegen.build import cache_health

    monkeypatch.setattr(cache_health, "_unwritable", {})
    line = compile_notice._text([("@train_step", time.perf_counter())])
    assert "(cached for later runs;" in line
    monkeypatch.setattr(cache_health, "_unwritable", {"/full/kernels": "No space left on device"})
    line = compile_notice._text([("@train_step", time.perf_counter())])
    assert "cached for later runs" not in line
    assert "(compiled in memory: the cache folder cannot be written;" in line
    assert compile_notice._fitted(line, 60) == "backplan: compiling @train_step, 0 s so far"
