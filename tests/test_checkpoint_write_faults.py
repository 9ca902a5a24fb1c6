"""A checkpoint or artifact write that fails part way (a full disk, a file size limit) leaves
the file that was there as it was and no temporary file, and raises an error naming the call
and the path. save_tree wrote into the file itself: a full disk truncated the last good
checkpoint to what fitted. The fault is real: a process limited by RLIMIT_FSIZE, whose writes
past the limit fail with EFBIG as a full disk's fail with ENOSPC."""

import json
import os
import subprocess
import sys

import numpy as np

CHILD = """
import json, os, resource, signal, sys
import numpy as np
import backplan as bp

folder = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
tree = {"w": bp.tensor(np.ones((256, 256), np.float32))}  # 256 KiB, past the limit
compiled = bp.compile(lambda x: bp.sum(x * np.ones((256, 256), np.float32)))
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
found = {}
for name, save in (
    ("ckpt.npz", lambda path: bp.save_tree(path, tree)),
    ("model.safetensors", lambda path: bp.save_safetensors(path, tree)),
    ("step.bpz", lambda path: bp.export(compiled, tree["w"], path=path)),
):
    path = os.path.join(folder, name)
    try:
        save(path)
        found[name] = "written"
    except Exception as exc:
        found[name] = [type(exc).__name__, isinstance(exc, OSError), str(exc)]
print(json.dumps(found))
"""


def test_a_failed_write_keeps_the_old_file_and_names_the_path(tmp_path):
    names = ("ckpt.npz", "model.safetensors", "step.bpz")
    for name in names:
        (tmp_path / name).write_bytes(b"the last good one")
    env = dict(os.environ, BACKPLAN_BACKEND="reference")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    for name in names:
        kind, is_os_error, message = found[name]
        path = str(tmp_path / name)
        assert (tmp_path / name).read_bytes() == b"the last good one", name
        assert f"cannot write {path}" in message, (name, message)
        assert os.strerror(27) in message and "unchanged" in message, message  # EFBIG
        assert kind == "ExportError" if name == "step.bpz" else is_os_error, (name, kind)
    assert sorted(os.listdir(tmp_path)) == sorted(names)  # no temporary file left


def test_a_saved_tree_is_readable_by_others_as_before(tmp_path):
    """save_tree writes through a temporary file now; the file keeps the mode open() gives."""
    import backplan as bp

    umask = os.umask(0o022)
    try:
        path = bp.save_tree(tmp_path / "t.npz", {"a": np.arange(3.0)})
    finally:
        os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o644
    np.testing.assert_array_equal(bp.load_tree(path)["a"].numpy(), np.arange(3.0))
