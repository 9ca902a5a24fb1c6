"""bp.save_safetensors / bp.load_safetensors: pytrees round-trip, files move to and from the
safetensors package and PyTorch, and damaged or hostile files are refused before anything is
trusted."""

import json

import numpy as np
import pytest

import backplan as bp


def _tree():
    rng = np.random.default_rng(0)
    return {
        "layer1": [
            {
                "weight": bp.tensor(
                    rng.standard_normal((3, 4)).astype(np.float32), requires_grad=True
                )
            },
            {"bias": bp.tensor(np.arange(3, dtype=np.float64))},
        ],
        "steps": bp.tensor(np.int64(7)),
        "mask": bp.tensor(np.array([True, False])),
        "ids": bp.tensor(np.array([1, 2, 3], np.int32)),
        "empty": bp.tensor(np.zeros((0, 5), np.uint8)),
        "plain": np.ones((2, 2), np.float32),
    }


def test_pytree_round_trip_keeps_structure_dtypes_and_flags(tmp_path):
    tree = _tree()
    path = bp.save_safetensors(tmp_path / "m.safetensors", tree)
    back = bp.load_safetensors(path)
    assert list(back) == list(tree) and isinstance(back["layer1"], list)
    for a, b in zip(bp.tree.leaves(tree), bp.tree.leaves(back), strict=True):
        assert b.dtype == np.asarray(a).dtype and b.shape == np.asarray(a).shape
        np.testing.assert_array_equal(b.numpy(), np.asarray(a))
    assert back["layer1"][0]["weight"].requires_grad and not back["steps"].requires_grad


def test_file_layout_is_the_safetensors_format(tmp_path):
    path = bp.save_safetensors(tmp_path / "m.safetensors", _tree())
    raw = open(path, "rb").read()
    length = int.from_bytes(raw[:8], "little")
    assert (8 + length) % 8 == 0  # data aligned
    header = json.loads(raw[8 : 8 + length])
    entry = header["layer1.0.weight"]
    assert entry["dtype"] == "F32" and entry["shape"] == [3, 4]
    begin, end = entry["data_offsets"]
    weight = np.frombuffer(raw[8 + length + begin : 8 + length + end], "<f4").reshape(3, 4)
    np.testing.assert_array_equal(weight, _tree()["layer1"][0]["weight"].numpy())
    assert header["__metadata__"]["format"] == "pt"
    for item in header.values():  # every tensor aligned to its itemsize
        if "data_offsets" in item:
            size = {"F64": 8, "I64": 8, "F32": 4, "I32": 4}.get(item["dtype"], 1)
            assert item["data_offsets"][0] % size == 0


def test_files_move_to_and_from_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    path = bp.save_safetensors(tmp_path / "m.safetensors", _tree())
    theirs = st.load_file(path)
    np.testing.assert_array_equal(theirs["layer1.1.bias"], np.arange(3.0))
    flat = {"b": np.arange(4, dtype=np.int64), "a.w": np.eye(2, dtype=np.float32)}
    st.save_file(flat, tmp_path / "theirs.safetensors")
    ours = bp.load_safetensors(tmp_path / "theirs.safetensors")
    assert sorted(ours) == ["a.w", "b"]
    np.testing.assert_array_equal(ours["a.w"].numpy(), np.eye(2))


def test_half_precision_loads_as_it_is_and_small_ints_need_upcast(tmp_path):
    halves = np.array([1.5, -2.25, 65504.0], np.float16)
    bf16 = np.array([0x3FC0, 0xC010], np.uint16)  # 1.5, -2.25 in bfloat16 bits
    small = np.array([-3, 7], np.int8)
    body = halves.tobytes() + bf16.tobytes() + small.tobytes()
    header = {
        "h": {"dtype": "F16", "shape": [3], "data_offsets": [0, 6]},
        "b": {"dtype": "BF16", "shape": [2], "data_offsets": [6, 10]},
        "i": {"dtype": "I8", "shape": [2], "data_offsets": [10, 12]},
    }
    path = _write_raw(tmp_path, header, body)
    with pytest.raises(bp.TreeFileError, match=r"1 tensor\(s\) .*: i \(I8\).*upcast=True"):
        bp.load_safetensors(path)
    out = bp.load_safetensors(path, upcast=True)
    assert out["h"].dtype == np.float16 and out["b"].dtype == bp.bfloat16
    np.testing.assert_array_equal(out["h"].numpy(), halves)
    np.testing.assert_array_equal(out["b"].numpy().astype(np.float32), [1.5, -2.25])
    assert out["i"].dtype == np.int32 and out["i"].tolist() == [-3, 7]
    again = bp.save_safetensors(tmp_path / "again.safetensors", out)
    back = bp.load_safetensors(again)
    assert back["b"].dtype == bp.bfloat16 and back["h"].dtype == np.float16
    np.testing.assert_array_equal(back["b"].numpy().view(np.uint16), bf16)


def test_half_precision_round_trips_bit_exact_with_the_safetensors_package(tmp_path):
    torch = pytest.importorskip("torch", reason="pip install torch")
    st = pytest.importorskip("safetensors.torch", reason="pip install safetensors")
    bits = np.array([0x3FC0, 0xC010, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x8000], np.uint16)
    halves = np.array([1.5, -65504.0, np.inf, 6e-8], np.float16)
    tree = {
        "w": bp.tensor(bits.view(bp.bfloat16), requires_grad=True),
        "h": bp.tensor(halves, requires_grad=True),
    }
    path = bp.save_safetensors(tmp_path / "half.safetensors", tree)
    theirs = st.load_file(path)
    assert theirs["w"].dtype == torch.bfloat16 and theirs["h"].dtype == torch.float16
    np.testing.assert_array_equal(theirs["w"].view(torch.int16).numpy().view(np.uint16), bits)
    np.testing.assert_array_equal(theirs["h"].numpy(), halves)
    back = bp.load_safetensors(path)  # no upcast: the dtypes as stored
    assert back["w"].dtype == bp.bfloat16 and back["h"].dtype == np.float16
    assert back["w"].requires_grad and back["h"].requires_grad
    np.testing.assert_array_equal(back["w"].numpy().view(np.uint16), bits)
    model = {"emb": torch.randn(4, 3).to(torch.bfloat16), "ln": torch.randn(3).half()}
    st.save_file(model, tmp_path / "torch.safetensors")
    ours = bp.load_safetensors(tmp_path / "torch.safetensors")
    assert ours["emb"].dtype == bp.bfloat16 and ours["ln"].dtype == np.float16
    want = model["emb"].view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours["emb"].numpy().view(np.uint16), want)
    np.testing.assert_array_equal(ours["ln"].numpy(), model["ln"].numpy())


def _write_raw(tmp_path, header, body: bytes, length=None):
    text = json.dumps(header).encode()
    path = tmp_path / "raw.safetensors"
    path.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + body)
    return path


F32_4 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "header,body,length,message",
    [
        ({"x": F32_4}, b"\0" * 8, 2**40, "header length field says 1099511627776"),
        ({"x": F32_4}, b"\0" * 8, 10**6, "within the file"),
        ({"x": F32_4}, b"\0" * 4, None, "cover 8 bytes, the file holds 4"),
        ({"x": F32_4}, b"\0" * 12, None, "cover 8 bytes, the file holds 12"),
        (
            {"x": F32_4, "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
            b"\0" * 12,
            None,
            "'y' starts at byte 4, the data before it ends at 8",
        ),
        (
            {"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "needs 12",
        ),
        ({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, None, "'C64'"),
        ({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "shape"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, None, "needs 8"),
        ({"x": [1, 2]}, b"", None, "no dtype/shape"),
        (
            {"x": F32_4, "__metadata__": {"backplan.tree": '{"tree": {"kind": "leaf"}}'}},
            b"\0" * 8,
            None,
            "unreadable tree metadata",
        ),
    ],
)
def test_damaged_or_hostile_files_are_refused(tmp_path, header, body, length, message):
    path = _write_raw(tmp_path, header, body, length)
    with pytest.raises(bp.TreeFileError, match=message.replace("[", r"\[").replace("(", r"\(")):
        bp.load_safetensors(path)


def test_more_tensors_than_load_tree_takes_are_refused_before_reading_them(tmp_path):
    empty = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    path = _write_raw(tmp_path, {f"t{i}": empty for i in range(100_001)}, b"")
    with pytest.raises(bp.TreeFileError, match="lists 100,001 tensors, more than the 100,000"):
        bp.load_safetensors(path)


def test_non_json_header_is_refused(tmp_path):
    path = tmp_path / "nan.safetensors"
    text = b'{"x": NaN}'
    path.write_bytes(len(text).to_bytes(8, "little") + text)
    with pytest.raises(bp.TreeFileError, match="unreadable header"):
        bp.load_safetensors(path)


def test_saving_refuses_clashing_names_and_non_tensors(tmp_path):
    clash = {"a.b": bp.tensor([1.0]), "a": {"b": bp.tensor([2.0])}}
    clashed = r"leaf \['a'\]\['b'\] would be stored under the name 'a.b'; \['a.b'\] has it too"
    with pytest.raises(bp.TreeFileError, match=clashed):
        bp.save_safetensors(tmp_path / "c.safetensors", clash)
    with pytest.raises(bp.TreeFileError, match=r"save_safetensors: leaf \['n'\] is 3"):
        bp.save_safetensors(tmp_path / "c.safetensors", {"n": 3})
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_state_dict_moves_to_torch_without_pickle(tmp_path):
    torch = pytest.importorskip("torch", reason="pip install 'backplan[torch]'")
    st = pytest.importorskip("safetensors.torch")
    module = torch.nn.Linear(3, 2)
    st.save_file(module.state_dict(), tmp_path / "lin.safetensors")
    params = bp.load_safetensors(tmp_path / "lin.safetensors")
    np.testing.assert_array_equal(params["weight"].numpy(), module.weight.detach().numpy())
    params = {k: v * 2.0 for k, v in params.items()}
    bp.save_safetensors(tmp_path / "back.safetensors", params)
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(st.load_file(tmp_path / "back.safetensors"))
    np.testing.assert_allclose(fresh.bias.detach().numpy(), 2 * module.bias.detach().numpy())


def test_a_header_nested_too_deeply_is_refused_not_a_recursion_error(tmp_path):
    path = tmp_path / "deep.safetensors"
    text = b"[" * 100_000 + b"]" * 100_000  # 200 kB, under the header limit
    path.write_bytes(len(text).to_bytes(8, "little") + text)
    with pytest.raises(bp.TreeFileError, match="header is JSON nested too deeply"):
        bp.load_safetensors(path)


def test_tree_metadata_nested_too_deeply_is_refused_not_a_recursion_error(tmp_path):
    deep = '{"kind": "list", "children": [' * 100_000 + '{"kind": "leaf"}' + "]}" * 100_000
    tree = '{"tree": ' + deep + ', "names": ["x"], "requires_grad": [false]}'
    path = _write_raw(tmp_path, {"x": F32_4, "__metadata__": {"backplan.tree": tree}}, b"\0" * 8)
    with pytest.raises(bp.TreeFileError, match="tree metadata is nested too deeply"):
        bp.load_safetensors(path)
