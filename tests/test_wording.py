"""The runtime states facts and report/ writes the words: a GraphFreedError's message and
print(t.grad_fn) are written by report from what the runtime hands it, so the message can be
rebuilt from the error's facts alone, and without report's writers the runtime says its short
forms (runtime/wording.py)."""

import numpy as np
import pytest

import backplan as bp
from backplan.report.freed_message import freed_message
from backplan.runtime import wording


def _freed_twice():
    x = bp.tensor(np.ones((2, 3), np.float32), requires_grad=True)
    shared = bp.tanh(x)
    (shared * 2.0).sum().backward()
    with pytest.raises(bp.GraphFreedError) as info:
        (shared * 3.0).sum().backward()
    return info.value, shared


def test_the_message_is_written_from_the_facts_alone():
    error, _ = _freed_twice()
    facts = error.facts
    assert str(error) == freed_message(facts)
    assert facts.case == "shared" and facts.saved_buffers == 1 and not facts.reached_root
    assert facts.region == "tanh" and facts.now_root.startswith("`sum`")
    assert facts.earlier_root.startswith("`sum`") and facts.earlier_root != facts.now_root
    assert "Fix: pass retain_graph=True" in str(error)


def test_without_report_the_runtime_says_its_short_forms(monkeypatch):
    monkeypatch.setattr(wording, "_writers", {})
    error, shared = _freed_twice()
    assert str(error).endswith(f"already freed by the backward() at {error.facts.freed_by}")
    assert "Fix:" not in str(error)
    assert str(shared.grad_fn) == repr(shared.grad_fn)
