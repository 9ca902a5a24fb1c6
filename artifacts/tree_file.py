"""save_tree / load_tree: a pytree of arrays (model parameters, optimizer state) in one .npz.

The structure is JSON inside the file (member `__tree__`), the leaves are `leaf_<i>` arrays, and
loading reads with allow_pickle=False, so a file can hold nothing but arrays and data. This is
for checkpoints; `bp.export` / `bp.load` are for whole compiled functions.
"""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np

from backplan.ir.errors import BackplanError
from backplan.ir.types import BFLOAT16, DTYPES, is_float
from backplan.tracer.pytree import flatten, unflatten
from backplan.tracer.tensor import Tensor

from .container import ZIP_ERRORS as _ZIP_ERRORS
from .format import ExportError
from .plans import machine_memory_bytes
from .replacing_write import default_file_mode, write_error, write_replacing
from .tree import MAX_DEPTH, leaf_paths, treedef_from_json, treedef_to_json
from .tree_members import TREE_MEMBER, TreeLimitError, check_zip_end, member_infos, read_array

FORMAT = "backplan-tree"
VERSION = 1


class TreeFileError(BackplanError, ValueError):
    """A tree cannot be saved (a leaf is not an array) or a file is not a saved tree."""


def save_tree(path, tree) -> str:
    """Write a pytree (dicts, lists, tuples, None) of tensors or NumPy arrays to path (.npz).

    >>> import backplan as bp, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "params.npz")
    >>> _ = bp.save_tree(path, {"w": bp.tensor([1.0, 2.0]), "layers": [bp.tensor([3.0])]})
    >>> bp.load_tree(path)["layers"][0].tolist()
    [3.0]
    """
    leaves, treedef, paths = flatten(tree, paths=True)
    arrays, flags, bf16 = {}, [], []
    for i, (leaf, leaf_path) in enumerate(zip(leaves, paths, strict=True)):
        array = leaf_array(leaf, leaf_path, "save_tree")
        if array.dtype == BFLOAT16:  # .npy has no bfloat16: its bit patterns, listed
            array = array.view(np.uint16)
            bf16.append(i)
        arrays[f"leaf_{i}"] = array
        flags.append(bool(isinstance(leaf, Tensor) and leaf.requires_grad))
    try:
        structure = treedef_to_json(treedef, "save_tree")
    except ExportError as exc:
        raise TreeFileError(f"{exc} (dict keys must be str, int, float or bool)") from None
    header = {"format": FORMAT, "version": VERSION, "tree": structure, "requires_grad": flags}
    if bf16:
        header["bfloat16"] = bf16
    arrays[TREE_MEMBER] = np.frombuffer(json.dumps(header).encode("utf-8"), np.uint8)
    return write_replacing(
        os.fspath(path),
        lambda file: np.savez(file, **arrays),
        write_error("save_tree"),
        mode=default_file_mode(),  # as open() made it before
    )


def leaf_array(leaf, where: str, api: str) -> np.ndarray:
    """The array of one leaf to store; anything but a tensor or a NumPy array of a supported
    dtype is refused, naming its path."""
    if isinstance(leaf, Tensor):
        return np.asarray(leaf.numpy())
    if isinstance(leaf, np.ndarray) and leaf.dtype in DTYPES.values():
        return leaf
    shown = f"an array of dtype {leaf.dtype}" if isinstance(leaf, np.ndarray) else repr(leaf)
    raise TreeFileError(
        f"{api}: leaf {where} is {shown[:80]} of type {type(leaf).__name__}; only tensors "
        f"and NumPy arrays of {', '.join(map(str, DTYPES.values()))} can be saved (wrap "
        "numbers in bp.tensor, keep other values outside the tree)"
    )


def load_tree(path, max_bytes: int | None = None):
    """The pytree save_tree wrote, with tensors as leaves (requires_grad as saved).

    Files are read with bp.load's limits, each checked before the work it bounds: at most
    100,000 leaves (from the zip's end record), their sizes from the zip's directory adding up
    to at most max_bytes (default: this machine's physical memory) before anything is inflated,
    and each leaf's shape and dtype from its header before its memory is allocated."""
    path = os.fspath(path)
    limit = max_bytes if max_bytes is not None else machine_memory_bytes()
    try:
        with open(path, "rb") as raw:
            declared = check_zip_end(raw)
            with zipfile.ZipFile(raw) as zf:
                return _read_tree(zf, member_infos(zf, declared, limit), path)
    except TreeFileError:
        raise
    except TreeLimitError as exc:
        raise TreeFileError(f"load_tree: {path}: {exc}") from None
    except MemoryError:
        raise TreeFileError(
            f"load_tree: {path}: its leaves do not fit in the memory available now"
        ) from None
    except _ZIP_ERRORS as exc:
        raise TreeFileError(f"load_tree: {path} is not a saved tree ({exc})") from None


def _read_tree(zf: zipfile.ZipFile, infos: dict, path: str):
    """The header first; then, once the leaf count it claims matches the members, the leaves."""
    if TREE_MEMBER not in infos:
        _header(None, path)  # raises, saying what the file is not
    header = _header(read_array(zf, infos[TREE_MEMBER], TREE_MEMBER), path)
    count = len(infos) - 1
    flags = header.get("requires_grad")
    if not isinstance(flags, list) or len(flags) != count or set(infos) != _names(count):
        raise TreeFileError(
            f"load_tree: {path} has members {sorted(infos)[:8]} for "
            f"{len(flags) if isinstance(flags, list) else 'no'} leaves; "
            "the file is damaged or not written by bp.save_tree"
        )
    try:
        treedef = treedef_from_json(header.get("tree"), f"load_tree {path}")
    except ExportError as exc:
        raise TreeFileError(str(exc)) from None
    if treedef.num_leaves != count:
        raise TreeFileError(
            f"load_tree: {path}: its structure has {treedef.num_leaves} leaves, the file "
            f"{count}; the file is damaged or not written by bp.save_tree"
        )
    leaves, bf16 = [], _bfloat16_leaves(header, count, path)
    for i, (flag, leaf_path) in enumerate(zip(flags, leaf_paths(treedef), strict=True)):
        array = read_array(zf, infos[f"leaf_{i}"], f"leaf {leaf_path}")
        if (i in bf16) != (array.dtype == np.uint16):
            raise TreeFileError(
                f"load_tree: {path}: leaf {leaf_path} holds {array.dtype}; uint16 leaves must be "
                "the bfloat16 ones the structure lists (the file is damaged)"
            )
        if i in bf16:
            array = array.view(BFLOAT16)
        tensor = Tensor._fresh(array)  # read into an array of its own: no second copy
        tensor.requires_grad = flag is True and is_float(tensor._ir_dtype)
        leaves.append(tensor)
    return unflatten(treedef, leaves)


def _bfloat16_leaves(header: dict, count: int, path: str) -> set[int]:
    """The leaves stored as bfloat16 bit patterns (the header's list, checked)."""
    listed = header.get("bfloat16", [])
    if not isinstance(listed, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count for i in listed
    ):
        raise TreeFileError(f"load_tree: {path}: its bfloat16 list {listed!r:.80} is damaged")
    if listed and BFLOAT16 is None:
        raise TreeFileError(f"load_tree: {path} holds bfloat16 leaves: pip install ml_dtypes")
    return set(listed)


def _names(count: int) -> set[str]:
    return {TREE_MEMBER} | {f"leaf_{i}" for i in range(count)}


def _header(raw, path: str) -> dict:
    if raw is None or raw.dtype != np.uint8 or raw.ndim != 1:
        raise TreeFileError(
            f"load_tree: {path} has no structure member {TREE_MEMBER!r}; it was not written "
            "by bp.save_tree (for artifacts of bp.export use bp.load)"
        )
    try:
        header = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TreeFileError(f"load_tree: {path}: unreadable structure ({exc})") from None
    except RecursionError:
        raise TreeFileError(
            f"load_tree: {path}: its structure is nested too deeply to read (save_tree writes "
            f"at most {MAX_DEPTH} levels)"
        ) from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TreeFileError(f"load_tree: {path} is not a saved tree")
    if header.get("version") != VERSION:
        raise TreeFileError(
            f"load_tree: {path} has format version {header.get('version')!r}; this backplan "
            f"reads version {VERSION} (upgrade backplan to read newer files)"
        )
    return header
