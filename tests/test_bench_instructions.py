"""bench/instructions.py: valgrind client requests issued from Python, and instructions per
step read from callgrind's dumps. The module needs only the standard library, so a run under
callgrind loads it by path without importing backplan."""

import os
import shutil
import subprocess
import sys

import pytest

from backplan.bench import instructions

HERE = os.path.dirname(os.path.abspath(instructions.__file__))


def test_outside_valgrind_a_client_request_returns_its_default():
    assert not instructions.running_on_valgrind()
    assert instructions.client_request(instructions.ZERO_STATS, default=7) == 7


def test_read_dumps_takes_the_labelled_dumps_and_divides_by_the_steps(tmp_path):
    header = "version: 1\ncreator: callgrind-3.19.0\n"
    (tmp_path / "callgrind.out.1").write_text(
        header + "desc: Trigger: Client Request: backplan-steps mlp_tiny 400\nsummary: 800000\n"
    )
    (tmp_path / "callgrind.out.2").write_text(
        header + "desc: Trigger: Client Request: backplan-steps cnn 4\ntotals: 1000\n"
    )
    (tmp_path / "callgrind.out").write_text(
        header + "desc: Trigger: Program termination\nsummary: 99\n"
    )
    assert instructions.read_dumps(str(tmp_path)) == {"mlp_tiny": 2000.0, "cnn": 250.0}


SCRIPT = """
import sys
sys.path.insert(0, {here!r})
import instructions

def work(n):
    return sum(i * i for i in range(n))

assert instructions.running_on_valgrind()
instructions.counted("small", lambda: work(200), 10, 2)
instructions.counted("large", lambda: work(2000), 10, 2)
"""


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_under_callgrind_only_the_counted_steps_count_and_scale_with_the_work(tmp_path):
    script = tmp_path / "count.py"
    script.write_text(SCRIPT.format(here=HERE))
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "-q",
        f"--callgrind-out-file={tmp_path}/callgrind.out",
        sys.executable,
        "-I",
        str(script),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    counts = instructions.read_dumps(str(tmp_path))
    # 200 and 2000 iterations of one loop: ten times the work, plus a fixed call cost
    assert 8 < counts["large"] / counts["small"] < 11
    assert 200 * 50 < counts["small"] < 200 * 5000  # hundreds of instructions a turn


def test_read_events_takes_every_event_the_dump_names_per_step(tmp_path):
    (tmp_path / "callgrind.out.1").write_text(
        "events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\n"
        "desc: Trigger: Client Request: backplan-steps ln_gelu 4\n"
        "summary: 400 200 100 4 40 8 0 12 4\n"
    )
    events = instructions.read_events(str(tmp_path))["ln_gelu"]
    assert events == {
        "Ir": 100,
        "Dr": 50,
        "Dw": 25,
        "I1mr": 1,
        "D1mr": 10,
        "D1mw": 2,
        "ILmr": 0,
        "DLmr": 3,
        "DLmw": 1,
    }
    assert instructions.read_dumps(str(tmp_path)) == {"ln_gelu": 100}
