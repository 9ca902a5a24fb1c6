"""bp.save_tree / bp.load_tree: a pytree of arrays in an .npz, structure as JSON, no pickle."""

import io
import json
import struct
import tracemalloc
import zipfile

import numpy as np
import pytest

import backplan as bp


def test_round_trip_of_params_and_optimizer_state(tmp_path):
    params = {
        "layers": [
            {"w": bp.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), requires_grad=True)},
            {"w": bp.tensor(np.ones((3, 1)))},
        ],
        "scale": np.full((), 2.0, np.float32),
        "skip": None,
        7: (bp.tensor(np.array([1, 2])), bp.tensor(np.array([True, False]))),
    }
    opt = bp.optim.adam(0.1)
    tree = {"params": params, "state": opt.init({"w": params["layers"][0]["w"]})}
    path = bp.save_tree(tmp_path / "ckpt.npz", tree)
    loaded = bp.load_tree(path)
    assert loaded["params"]["skip"] is None and isinstance(loaded["params"][7], tuple)
    first = loaded["params"]["layers"][0]["w"]
    assert first.requires_grad and first.dtype == np.float32
    assert not loaded["params"]["layers"][1]["w"].requires_grad
    assert loaded["params"]["layers"][1]["w"].dtype == np.float64
    np.testing.assert_array_equal(first.numpy(), np.arange(6).reshape(2, 3))
    assert loaded["params"][7][1].dtype == np.bool_
    assert loaded["state"]["count"].dtype == np.int64
    # the loaded state drives the optimizer like the original
    p = {"w": first}
    p, s = opt.update({"w": bp.tensor(np.ones((2, 3), np.float32))}, loaded["state"], p)
    assert s["count"].item() == 1


def test_refuses_what_it_cannot_store(tmp_path):
    with pytest.raises(bp.TreeFileError, match=r"leaf \['lr'\] is 0.1 of type float"):
        bp.save_tree(tmp_path / "x.npz", {"lr": 0.1})
    with pytest.raises(bp.TreeFileError, match="dtype object"):
        bp.save_tree(tmp_path / "x.npz", {"o": np.array([{}], dtype=object)})


def test_refuses_files_it_did_not_write(tmp_path):
    plain = tmp_path / "plain.npz"
    np.savez(plain, a=np.ones(3))
    with pytest.raises(bp.TreeFileError, match="no structure member"):
        bp.load_tree(plain)
    with pytest.raises(bp.TreeFileError, match="not a saved tree"):
        (tmp_path / "junk.npz").write_bytes(b"not a zip")
        bp.load_tree(tmp_path / "junk.npz")
    pickled = tmp_path / "pickled.npz"
    header = {"format": "backplan-tree", "version": 1, "tree": {"kind": "leaf"}}
    header["requires_grad"] = [False]
    np.savez(
        pickled,
        __tree__=np.frombuffer(json.dumps(header).encode(), np.uint8),
        leaf_0=np.array([{"x": 1}], dtype=object),
    )
    with pytest.raises(bp.TreeFileError, match=r"leaf <leaf> has dtype object"):
        bp.load_tree(pickled)  # object arrays need pickle, which load_tree never allows
    newer = tmp_path / "newer.npz"
    header["version"] = 99
    np.savez(newer, __tree__=np.frombuffer(json.dumps(header).encode(), np.uint8), leaf_0=[1.0])
    with pytest.raises(bp.TreeFileError, match="version 99"):
        bp.load_tree(newer)
    missing = tmp_path / "missing.npz"
    header["version"] = 1
    np.savez(missing, __tree__=np.frombuffer(json.dumps(header).encode(), np.uint8))
    with pytest.raises(bp.TreeFileError, match="damaged"):
        bp.load_tree(missing)
    assert zipfile.is_zipfile(missing)


# ---- crafted files: limits checked before the work they bound -----------------------------------


def npy_bytes(array: np.ndarray, shape=None) -> bytes:
    """array as a .npy file; with shape, a header claiming that shape over array's bytes."""
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        stream, {"descr": array.dtype.str, "fortran_order": False, "shape": shape or array.shape}
    )
    return stream.getvalue() + array.tobytes()


def tree_header(tree: dict, count: int) -> bytes:
    header = {"format": "backplan-tree", "version": 1, "tree": tree}
    header["requires_grad"] = [False] * count
    return npy_bytes(np.frombuffer(json.dumps(header).encode(), np.uint8))


def write_zip(path, members: dict[str, bytes], deflate=()) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            method = zipfile.ZIP_DEFLATED if name in deflate else zipfile.ZIP_STORED
            zf.writestr(name, data, compress_type=method)


ONE_LEAF = {"kind": "leaf"}


def claiming_members(zip_bytes: bytes, members: int) -> bytes:
    """The zip with a Zip64 end record (the only one that counts past 65,535) claiming members."""
    end = zip_bytes.rfind(b"PK\x05\x06")
    directory_size, directory_offset = struct.unpack_from("<2L", zip_bytes, end + 12)
    zip64_end = struct.pack(
        "<4sQ2H2L4Q",
        b"PK\x06\x06",
        44,
        45,
        45,
        0,
        0,
        members,
        members,
        directory_size,
        directory_offset,
    )
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, end, 1)
    record = bytearray(zip_bytes[end:])
    struct.pack_into("<2H", record, 8, 0xFFFF, 0xFFFF)
    return zip_bytes[:end] + zip64_end + locator + bytes(record)


def test_a_deflated_leaf_is_refused_above_max_bytes_before_inflating(tmp_path):
    """One 32 MiB leaf of zeros deflates to a few tens of KB; the directory says how big it
    will be, so it is refused before inflating, and loaded with one copy of its bytes."""
    bomb = tmp_path / "bomb.npz"
    big = np.zeros(4 * 2**20, np.float64)
    write_zip(
        bomb,
        {"__tree__.npy": tree_header(ONE_LEAF, 1), "leaf_0.npy": npy_bytes(big)},
        deflate={"leaf_0.npy"},
    )
    assert bomb.stat().st_size < 2**20
    with pytest.raises(bp.TreeFileError, match=r"would take \d+ bytes .* than the 16777216 bytes"):
        bp.load_tree(bomb, max_bytes=16 * 2**20)
    tracemalloc.start()
    try:
        loaded = bp.load_tree(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert loaded.shape == big.shape and not loaded.numpy().any()
    assert peak < 1.25 * big.nbytes  # read straight into the leaf's array: no second copy


def test_a_header_claiming_a_huge_shape_is_refused_not_a_memory_error(tmp_path):
    liar = tmp_path / "liar.npz"
    leaf = npy_bytes(np.zeros(1), shape=(2**40,))
    write_zip(liar, {"__tree__.npy": tree_header(ONE_LEAF, 1), "leaf_0.npy": leaf})
    with pytest.raises(bp.TreeFileError, match=r"claims shape \(1099511627776,\) .* holds 8 bytes"):
        bp.load_tree(liar)


def test_a_structure_nested_100000_deep_is_refused_not_a_recursion_error(tmp_path):
    deep = tmp_path / "deep.npz"
    nested = "[" * 100_000 + "]" * 100_000
    text = '{"format": "backplan-tree", "version": 1, "requires_grad": [], "tree": ' + nested + "}"
    write_zip(
        deep,
        {"__tree__.npy": npy_bytes(np.frombuffer(text.encode(), np.uint8))},
        deflate={"__tree__.npy"},
    )
    with pytest.raises(bp.TreeFileError, match="nested too deeply"):
        bp.load_tree(deep)


def test_claimed_leaf_counts_are_refused_before_the_structure_is_built(tmp_path):
    """A deflated structure claiming a million leaves is refused by its size in the directory;
    a zip whose end record claims 200,001 members before its directory is parsed."""
    many = tmp_path / "many.npz"
    tree = {"kind": "list", "children": [ONE_LEAF] * 1_000_000}
    write_zip(many, {"__tree__.npy": tree_header(tree, 1_000_000)}, deflate={"__tree__.npy"})
    with pytest.raises(bp.TreeFileError, match=r"the structure member claims \d+ bytes, over"):
        bp.load_tree(many)
    counted = tmp_path / "counted.npz"
    bp.save_tree(counted, {"w": bp.tensor([1.0])})
    counted.write_bytes(claiming_members(counted.read_bytes(), 200_001))
    with pytest.raises(bp.TreeFileError, match="declares 200001 members, more than"):
        bp.load_tree(counted)
