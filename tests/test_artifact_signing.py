"""Artifact authenticity and limits before work: HMAC signing (export/load key=, --key-file),
the zip's member count read from its end record before the directory is parsed, and FLOPs per
call reported by inspect and bounded by load(max_flops=)."""

import json
import zipfile

import numpy as np
import pytest

import backplan as bp
from backplan.__main__ import main as cli_main
from backplan.artifacts.flops import graph_flops
from backplan.artifacts.format import MAX_MEMBERS, sha256
from backplan.artifacts.signing import Authenticity
from backplan.artifacts.zip_end import read_zip_end

KEY = b"0123456789abcdef-secret"


@bp.compile
def layer(w, x):
    return bp.tanh(x @ w).sum()


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(3)
    w = bp.tensor(rng.standard_normal((3, 2)).astype(np.float32), requires_grad=True)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    return w, x


@pytest.fixture(scope="module")
def files(inputs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("signed")
    w, x = inputs
    return {
        "signed": bp.export(layer, w, x, path=folder / "signed.bpz", key=KEY),
        "str_key": bp.export(layer, w, x, path=folder / "str.bpz", key="pass phrase"),
        "unsigned": bp.export(layer, w, x, path=folder / "plain.bpz"),
    }


def read_members(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def write_members(path, members: dict[str, bytes]) -> str:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            method = zipfile.ZIP_STORED if name.endswith(".npy") else zipfile.ZIP_DEFLATED
            zf.writestr(name, data, compress_type=method)
    return str(path)


def refused(path, pattern, **kwargs) -> str:
    with pytest.raises(bp.ExportError) as info:
        bp.load(path, **kwargs)
    assert pattern in str(info.value) and str(path) in str(info.value), str(info.value)
    return str(info.value)


# ---- signing ----------------------------------------------------------------------------------


def test_signed_round_trip_and_what_a_load_without_key_says(files, inputs):
    w, x = inputs
    expected = layer(w, x).item()
    verified = bp.load(files["signed"], key=KEY)
    assert verified.authenticity is Authenticity.VERIFIED
    assert verified(w, x).item() == expected
    assert bp.load(files["str_key"], key="pass phrase").authenticity is Authenticity.VERIFIED
    assert bp.load(files["str_key"], key=b"pass phrase").authenticity is Authenticity.VERIFIED
    unverified = bp.load(files["signed"])
    assert unverified.authenticity is Authenticity.NOT_VERIFIED
    assert "NOT verified" in unverified.authenticity.value
    assert unverified(w, x).item() == expected
    assert bp.load(files["unsigned"]).authenticity is Authenticity.UNSIGNED


def test_wrong_key_missing_signature_and_bad_keys_are_refused(files, tmp_path):
    refused(files["signed"], "does not match the key", key=b"another key")
    refused(files["str_key"], "does not match the key", key="pass phrase ")
    refused(files["unsigned"], "is not signed, but a key was given", key=KEY)
    stripped = read_members(files["signed"])
    del stripped["signature.json"]
    refused(write_members(tmp_path / "stripped.bpz", stripped), "is not signed", key=KEY)
    with pytest.raises(bp.ExportError, match="key is empty"):
        bp.load(files["signed"], key=b"")
    with pytest.raises(bp.ExportError, match="key must be bytes or str, got int"):
        bp.export(layer, bp.tensor(np.ones((3, 2))), np.ones((4, 3)), path="x.bpz", key=7)


def test_edit_with_rehashed_manifest_loads_without_key_but_not_with_it(files, inputs, tmp_path):
    """The attack the signature is for: weights changed and the manifest's hashes recomputed
    consistently. Every structural check passes; only the key catches it."""
    w, x = inputs
    members = read_members(files["signed"])
    name = "ir/forward.txt"
    text = members[name].decode()
    assert "tanh" in text
    members[name] = text.replace("tanh", "sigmoid").encode()
    plans = json.loads(members["plans/forward.json"])
    plans["schedule"] = [
        [v, "sigmoid" if op == "tanh" else op, t] for v, op, t in plans["schedule"]
    ]
    members["plans/forward.json"] = json.dumps(plans, indent=1).encode()
    manifest = json.loads(members["manifest.json"])
    for member in (name, "plans/forward.json"):
        manifest["members"][member] = {
            "sha256": sha256(members[member]),
            "bytes": len(members[member]),
        }
    members["manifest.json"] = json.dumps(manifest).encode()
    path = write_members(tmp_path / "edited.bpz", members)
    edited = bp.load(path)  # consistent: without a key nothing can tell
    assert edited.authenticity is Authenticity.NOT_VERIFIED
    assert edited(w, x).item() != pytest.approx(layer(w, x).item())
    refused(path, "changed after it was signed", key=KEY)


def test_signature_member_that_is_malformed_or_listed_in_the_manifest(files, tmp_path):
    members = read_members(files["signed"])
    bad = {**members, "signature.json": b'{"algorithm": "md5", "hmac": "00"}'}
    path = write_members(tmp_path / "md5.bpz", bad)
    refused(path, "signature.json is malformed")
    refused(path, "signature.json is malformed", key=KEY)


def test_key_file_on_the_command_line(inputs, tmp_path, capsys, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")  # one trailing newline is not part of the key
    other = tmp_path / "other"
    other.write_bytes(b"not the key\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.py").write_text(
        "import backplan as bp\n\n\ndef f(w, x):\n    return bp.tanh(x @ w).sum()\n"
    )
    spec = "w=f32[3,2]:grad,x=f32[4,3]"
    argv = ["export", "model.py:f", "--args", spec, "-o", "m.bpz", "--key-file", str(key_file)]
    assert cli_main(argv) == 0
    assert bp.load(tmp_path / "m.bpz", key=KEY).authenticity is Authenticity.VERIFIED
    capsys.readouterr()
    assert cli_main(["inspect", "m.bpz", "--key-file", str(key_file)]) == 0
    out = capsys.readouterr().out
    assert f"authenticity: {Authenticity.VERIFIED.value}" in out
    # forward 48 + 8 + 8; backward 3 * 8 elementwise + x.T @ g: 2*3*2*4
    assert "FLOPs per call: 136 (forward 64, backward 72)" in out
    assert cli_main(["inspect", "m.bpz"]) == 0
    assert f"authenticity: {Authenticity.NOT_VERIFIED.value}" in capsys.readouterr().out
    assert cli_main(["inspect", "m.bpz", "--key-file", str(other)]) == 1
    assert "does not match the key" in capsys.readouterr().err
    assert cli_main(["inspect", "m.bpz", "--key-file", str(tmp_path / "none")]) == 1
    assert "cannot read key file" in capsys.readouterr().err


# ---- limits before work -----------------------------------------------------------------------


def test_many_member_zip_is_refused_from_its_end_record(tmp_path, monkeypatch):
    path = tmp_path / "many.bpz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for i in range(MAX_MEMBERS + 1):
            zf.writestr(f"arrays/a{i}.npy", b"")

    def no_directory_parsing(*args, **kwargs):
        raise AssertionError("zipfile parsed the directory before the count was checked")

    monkeypatch.setattr(zipfile, "ZipFile", no_directory_parsing)
    message = refused(path, f"declares {MAX_MEMBERS + 1} members")
    assert "refused before reading its directory" in message


def test_end_record_that_lies_about_the_directory(files, tmp_path):
    raw = bytearray(open(files["unsigned"], "rb").read())
    end = raw.rindex(b"PK\x05\x06")
    count = int.from_bytes(raw[end + 10 : end + 12], "little")
    lying = bytearray(raw)
    lying[end + 8 : end + 12] = (1).to_bytes(2, "little") * 2
    (tmp_path / "count.bpz").write_bytes(bytes(lying))
    refused(tmp_path / "count.bpz", f"holds {count} members, its end record says 1")
    huge = bytearray(raw)
    huge[end + 12 : end + 16] = (2**31).to_bytes(4, "little")
    (tmp_path / "size.bpz").write_bytes(bytes(huge))
    refused(tmp_path / "size.bpz", "directory is 2147483648 bytes")


def test_zip64_end_record_gives_the_count(tmp_path, monkeypatch):
    """Past 65,535 members the plain record says 0xFFFF and the Zip64 record holds the count;
    a low limit makes zipfile write one for a few members."""
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 2)
    path = tmp_path / "z64.zip"
    with zipfile.ZipFile(path, "w") as zf:
        for i in range(5):
            zf.writestr(f"m{i}.txt", b"x")
    with open(path, "rb") as raw:
        end = read_zip_end(raw)
    assert end.members == 5 and end.directory_bytes > 0
    assert open(path, "rb").read().count(b"PK\x06\x06") == 1


def test_flops_per_plan_and_max_flops(files, inputs):
    loaded = bp.load(files["unsigned"])
    # x[4,3] @ w[3,2]: 2*4*2*3 = 48; tanh 8; sum 8 per input element
    assert loaded.flops["forward"] == 48 + 8 + 8
    assert loaded.flops == {
        role: graph_flops(plan.graph)
        for role, plan in (
            ("forward", loaded.program.plans.forward),
            ("backward", loaded.program.plans.backward),
        )
    }
    total = sum(loaded.flops.values())
    assert bp.load(files["unsigned"], max_flops=total).flops == loaded.flops
    message = refused(files["unsigned"], f"more than max_flops={total - 1:,}", max_flops=total - 1)
    assert f"one call computes {total:,} FLOPs" in message and "pass a larger max_flops=" in message
    with pytest.raises(bp.ExportError, match="max_flops must be a number"):
        bp.load(files["unsigned"], max_flops="many")
