"""bench/memory_programs.py: programs written as a user writes them, each call counted by the
checked mode against the peak explain printed for it (results dropped and kept)."""

from __future__ import annotations

import pytest

from backplan.bench import memory_programs


@pytest.mark.parametrize("name", ["attention"])
def test_each_call_holds_what_explain_prints(name):
    text, same = memory_programs.checked_row(name, 1, calls=3)
    assert same, text
    assert text.startswith(f"| {name} | ") and text.endswith("| equal |")


def test_unknown_programs_are_named(capsys):
    with pytest.raises(SystemExit):
        memory_programs.main(["--check", "--programs", "mlp_adam,nope"])
    assert "no program ['nope']" in capsys.readouterr().err


def test_every_program_is_listed_where_it_can_run():
    assert set(memory_programs.available()) <= set(memory_programs.PROGRAMS)
    assert "mlp_adam" in memory_programs.available()
