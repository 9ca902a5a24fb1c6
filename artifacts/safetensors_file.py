"""save_safetensors / load_safetensors: a pytree of tensors in the safetensors format, the
pickle-free checkpoint format of the Hugging Face ecosystem, so weights move between PyTorch and
backplan without pickle.

The format is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, and the raw little-endian bytes. Tensors are stored under state_dict-style
names (`layer1.0.weight`); the pytree's structure goes into the header's string metadata, so
backplan gets its tree back while PyTorch's `safetensors.torch.load_file` gets a flat dict.
Reading checks every length and offset against the file before trusting it, as bp.load does.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from backplan.ir.types import DTYPES, dtype_name, is_float
from backplan.tracer.pytree import flatten, unflatten
from backplan.tracer.tensor import Tensor

from .format import ExportError
from .replacing_write import write_error as _write_error
from .replacing_write import write_replacing
from .tree import dotted_leaf_names, treedef_from_json, treedef_to_json
from .tree_file import TreeFileError, leaf_array
from .tree_members import MAX_LEAVES

MAX_HEADER_BYTES = 100 * 2**20  # the reference implementation's limit
MAX_TENSORS = MAX_LEAVES  # load_tree's limit: 300,000 empty tensors took 48 s and 500 MB
MAX_NDIM = 64
TREE_KEY = "backplan.tree"
TO_FORMAT = {
    DTYPES["bool"]: "BOOL",
    DTYPES["u8"]: "U8",
    DTYPES["i32"]: "I32",
    DTYPES["i64"]: "I64",
    DTYPES["f16"]: "F16",
    DTYPES["f32"]: "F32",
    DTYPES["f64"]: "F64",
    **({DTYPES["bf16"]: "BF16"} if "bf16" in DTYPES else {}),
}
FROM_FORMAT = {code: dtype for dtype, code in TO_FORMAT.items()}
# stored dtypes backplan has no tensor type for, and the exact widening upcast=True applies
WIDENED = {
    "I8": (np.dtype("i1"), np.int32),
    "I16": (np.dtype("<i2"), np.int32),
    "U16": (np.dtype("<u2"), np.int32),
    "U32": (np.dtype("<u4"), np.int64),
}


def save_safetensors(path, tree) -> str:
    """Write a pytree of tensors (or NumPy arrays) to path in the safetensors format, each
    under its dotted name (`{"layer": {"w": t}}` stores `layer.w`); the file is replaced
    atomically.

    >>> import backplan as bp, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> _ = bp.save_safetensors(path, {"fc": {"weight": bp.tensor([[1.0, 2.0]])}})
    >>> bp.load_safetensors(path)["fc"]["weight"].tolist()
    [[1.0, 2.0]]
    """
    leaves, treedef, paths = flatten(tree, paths=True)
    names = _names(treedef, paths)
    arrays = [
        leaf_array(leaf, where, "save_safetensors")
        for leaf, where in zip(leaves, paths, strict=True)
    ]
    flags = [bool(isinstance(leaf, Tensor) and leaf.requires_grad) for leaf in leaves]
    try:
        structure = treedef_to_json(treedef, "save_safetensors")
    except ExportError as exc:
        raise TreeFileError(f"{exc} (dict keys must be str, int, float or bool)") from None
    order = sorted(range(len(arrays)), key=lambda i: -arrays[i].dtype.itemsize)  # aligned
    header, offset = {}, 0
    for i in order:
        size = arrays[i].nbytes
        header[names[i]] = {
            "dtype": TO_FORMAT[arrays[i].dtype],
            "shape": list(arrays[i].shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    tree_text = json.dumps({"tree": structure, "names": names, "requires_grad": flags})
    # "pt": the tensors are laid out as PyTorch's; transformers refuses files without it
    header["__metadata__"] = {"format": "pt", TREE_KEY: tree_text}
    return _write(os.fspath(path), header, [arrays[i] for i in order])


def _names(treedef, paths: list[str]) -> list[str]:
    names = dotted_leaf_names(treedef) if treedef.kind != "leaf" else ["tensor"]
    seen: dict[str, str] = {}
    for name, where in zip(names, paths, strict=True):
        if not name or name == "__metadata__" or name in seen:
            clash = f"; {seen[name]} has it too" if name in seen else ""
            raise TreeFileError(
                f"save_safetensors: leaf {where} would be stored under the name {name!r}"
                f"{clash}. Tensors are stored under dotted names, which must be unique and "
                "non-empty: rename the dict key"
            )
        seen[name] = where
    return names


def _write(path: str, header: dict, arrays: list[np.ndarray]) -> str:
    """Header and bytes into a temporary file beside path, then renamed over it: a reader
    never sees half a file, and a failed write leaves the old one."""
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned

    def write(file) -> None:
        file.write(len(text).to_bytes(8, "little"))
        file.write(text)
        for array in arrays:
            little = np.ascontiguousarray(array, array.dtype.newbyteorder("<"))
            file.write(little.reshape(-1).view(np.uint8).data)  # bytes: bfloat16 too

    return write_replacing(path, write, _write_error("save_safetensors"))


def load_safetensors(path, upcast: bool = False):
    """The pytree save_safetensors wrote, or for a file written elsewhere (PyTorch,
    Hugging Face) a flat dict {name: tensor} in the file's order. float16 and bfloat16 load
    as they are; int8, int16, uint16 and uint32 tensors, which backplan has no type for, are
    refused unless upcast=True widens them exactly (to int32 or int64)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as file:
            header, data_start = _read_header(file, path)
            metadata = header.pop("__metadata__", None)
            entries = _entries(header, os.fstat(file.fileno()).st_size - data_start, path)
            _refuse_narrow(entries, upcast, path)
            tensors = {name: _read(file, data_start, entry, path) for name, entry in entries}
    except OSError as exc:
        raise TreeFileError(f"load_safetensors: cannot read {path} ({exc})") from None
    return _tree(tensors, metadata, path)


def _read_header(file, path: str) -> tuple[dict, int]:
    """The JSON header and where the data starts; the length field is checked against the
    limit and the file's size before anything that long is read."""
    size = os.fstat(file.fileno()).st_size
    prefix = file.read(8)
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if length < 2 or length > MAX_HEADER_BYTES or 8 + length > size:
        raise TreeFileError(
            f"load_safetensors: {path} ({size} bytes) is not a safetensors file: its header "
            f"length field says {length} bytes (at most {MAX_HEADER_BYTES}, within the file)"
        )
    raw = file.read(length)
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise TreeFileError(f"load_safetensors: {path}: unreadable header ({exc})") from None
    except RecursionError:
        raise TreeFileError(
            f"load_safetensors: {path}: its header is JSON nested too deeply to read (a "
            "safetensors header is one level of tensor entries)"
        ) from None
    if not isinstance(header, dict):
        raise TreeFileError(f"load_safetensors: {path}: the header is not a JSON object")
    return header, 8 + length


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _entries(header: dict, data_bytes: int, path: str) -> list[tuple[str, dict]]:
    """Each tensor's entry checked: known dtype, sane shape, a byte range that matches it, and
    ranges that tile the data exactly (no gaps, overlaps or trailing bytes)."""
    if len(header) > MAX_TENSORS:
        raise TreeFileError(
            f"load_safetensors: {path} lists {len(header):,} tensors, more than the "
            f"{MAX_TENSORS:,} a file may hold (load_tree's limit); refused before reading them"
        )
    entries = [(name, _entry(name, entry, path)) for name, entry in header.items()]
    entries.sort(key=lambda item: item[1]["data_offsets"])
    end = 0
    for name, entry in entries:
        begin, stop = entry["data_offsets"]
        if begin != end:
            raise TreeFileError(
                f"load_safetensors: {path}: tensor {name!r} starts at byte {begin}, the data "
                f"before it ends at {end} (overlapping or gapped tensors: a damaged file)"
            )
        end = stop
    if end != data_bytes:
        raise TreeFileError(
            f"load_safetensors: {path}: the tensors cover {end} bytes, the file holds "
            f"{data_bytes} after the header (truncated or damaged)"
        )
    return entries


def _entry(name, entry, path: str) -> dict:
    """One tensor's entry, checked: a known dtype, a shape of non-negative ints, and a byte
    range exactly as long as dtype and shape need."""

    def bad(why: str) -> TreeFileError:
        return TreeFileError(f"load_safetensors: {path}: tensor {str(name)[:200]!r} {why}")

    if not isinstance(entry, dict):
        raise bad("has no dtype/shape/data_offsets entry")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if code not in FROM_FORMAT and code not in WIDENED:
        raise bad(
            f"has dtype {code!r}; backplan reads {', '.join([*FROM_FORMAT, *WIDENED])} "
            "(the last ones with upcast=True)"
        )
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not _all_counts(shape):
        raise bad(f"has shape {str(shape)[:80]}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not _all_counts(offsets):
        raise bad(f"has data_offsets {str(offsets)[:80]}, not [begin, end]")
    itemsize = (FROM_FORMAT.get(code) or WIDENED[code][0]).itemsize
    if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
        raise bad(
            f"of dtype {code} and shape {shape} needs {math.prod(shape) * itemsize} bytes, "
            f"its data_offsets {offsets} hold {offsets[1] - offsets[0]}"
        )
    return {"dtype": code, "shape": tuple(shape), "data_offsets": offsets}


def _all_counts(values: list) -> bool:
    return all(type(v) is int and 0 <= v < 2**62 for v in values)


def _refuse_narrow(entries: list, upcast: bool, path: str) -> None:
    narrow = [f"{name} ({entry['dtype']})" for name, entry in entries if entry["dtype"] in WIDENED]
    if narrow and not upcast:
        raise TreeFileError(
            f"load_safetensors: {path} holds {len(narrow)} tensor(s) of dtypes backplan has no "
            f"type for: {', '.join(narrow[:8])}{' ...' if len(narrow) > 8 else ''}. "
            "load_safetensors(path, upcast=True) widens them exactly (to int32 or int64)"
        )


def _read(file, data_start: int, entry: dict, path: str) -> Tensor:
    """One tensor read straight into its own array (no buffer shared between tensors)."""
    code, shape = entry["dtype"], entry["shape"]
    stored = FROM_FORMAT[code].newbyteorder("<") if code in FROM_FORMAT else WIDENED[code][0]
    count = math.prod(shape)
    file.seek(data_start + entry["data_offsets"][0])
    array = np.fromfile(file, stored, count) if count else np.empty(0, stored)
    if array.size != count:
        raise TreeFileError(f"load_safetensors: {path} ended inside a tensor (changed while read)")
    if code in WIDENED:
        array = array.astype(WIDENED[code][1])
    array = array.astype(array.dtype.newbyteorder("="), copy=False)
    array.shape = shape  # in place: a reshaped view would be copied again by the tensor
    return Tensor._from_array(array)


def _tree(tensors: dict, metadata, path: str):
    """The saved pytree when the metadata holds one (its names must be the file's), else the
    flat dict."""
    text = metadata.get(TREE_KEY) if isinstance(metadata, dict) else None
    if not isinstance(text, str):
        return tensors  # a flat file from PyTorch or Hugging Face: names as they are
    try:
        saved = json.loads(text, parse_constant=_no_constant)
        treedef = treedef_from_json(saved["tree"], f"load_safetensors {path}")
        names, flags = saved["names"], saved["requires_grad"]
    except (ValueError, KeyError, TypeError, ExportError) as exc:
        raise TreeFileError(f"load_safetensors: {path}: unreadable tree metadata ({exc})") from None
    except RecursionError:
        raise TreeFileError(
            f"load_safetensors: {path}: its tree metadata is nested too deeply to read"
        ) from None
    if (
        not isinstance(names, list)
        or sorted(map(str, names)) != sorted(tensors)
        or not (isinstance(flags, list) and len(flags) == len(names) == treedef.num_leaves)
    ):
        raise TreeFileError(
            f"load_safetensors: {path}: the tree metadata names {str(names)[:200]}, the file "
            f"holds {sorted(tensors)[:8]}: a damaged file"
        )
    leaves = []
    for name, flag in zip(names, flags, strict=True):
        tensor = tensors[name]
        tensor.requires_grad = flag is True and is_float(dtype_name(tensor.dtype))
        leaves.append(tensor)
    return unflatten(treedef, leaves)
