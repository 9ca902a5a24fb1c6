"""bp.save_tree / bp.load_tree: a pytree of arrays in an .npz, structure as JSON, no pickle."""

import json
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
    with pytest.raises(bp.TreeFileError, match="not a saved tree"):
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
