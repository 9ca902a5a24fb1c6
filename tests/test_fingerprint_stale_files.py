"""A process whose package files changed on disk after it imported them (an upgrade or a
checkout under a running process) compiles the code it imported: it must not label that
code with the new files' fingerprint, or every later process would load the older code
from the shared cache as the new version's."""

import subprocess
import sys
import textwrap

from backplan.codegen.build import fingerprint

SCRIPT = textwrap.dedent(
    """
    import warnings
    from backplan.codegen.build import fingerprint

    before = fingerprint._IMPORTED_STAMPS
    fingerprint._IMPORTED_STAMPS = before[:-1] + ((before[-1][0], 0, 0),)  # as if edited
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = fingerprint.codegen_fingerprint()
        kernels = fingerprint.kernel_fingerprint(), fingerprint.kernel_fingerprint(True)
    print(first, *kernels, len(caught), caught[0].category.__name__ if caught else "-")
    print(str(caught[0].message) if caught else "")
    """
)


def _fingerprints_in_a_fresh_process(script: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _this_process() -> list[str]:
    return [
        fingerprint.codegen_fingerprint(),
        fingerprint.kernel_fingerprint(),
        fingerprint.kernel_fingerprint(True),
    ]


def test_unchanged_files_give_the_same_fingerprints_in_every_process():
    plain = "from backplan.codegen.build import fingerprint as f\n"
    plain += "print(f.codegen_fingerprint(), f.kernel_fingerprint(), f.kernel_fingerprint(True))"
    assert fingerprint._stamps() == fingerprint._IMPORTED_STAMPS
    assert _fingerprints_in_a_fresh_process(plain)[0].split() == _this_process()


def test_files_changed_since_import_give_this_process_fingerprints_of_its_own():
    one, two = (_fingerprints_in_a_fresh_process(SCRIPT) for _ in range(2))
    fields = one[0].split()
    assert fields[3:] == ["1", "CacheWarning"], one  # said once, for all three keys
    assert "changed on disk after this process imported them" in one[1]
    assert not set(fields[:3]) & set(_this_process())  # no shared entry read or written
    assert not set(fields[:3]) & set(two[0].split()[:3])  # nor another stale process's
