"""torch.export of the user's module, decomposed to core ATen, and everything refused before any
op is mapped: what torch.export could not capture (with torch's reason and the user's line),
complex or sparse tensors, ops without a mapping (all of them, each with its line), and
in-place changes other than batch norm's running statistics."""

from __future__ import annotations

import operator
import re
import warnings

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from .errors import TorchImportError
from .locations import where
from .table import TABLE

_USER_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def capture(module: torch.nn.Module, args: tuple, kwargs: dict) -> ExportedProgram:
    name = type(module).__name__
    _refuse_layouts(module, args, kwargs)
    try:
        with warnings.catch_warnings():  # torch's own deprecation inside export, not the user's
            warnings.filterwarnings("ignore", "`isinstance\\(treespec, LeafSpec\\)`")
            program = torch.export.export(module, args, kwargs)
            return program.run_decompositions()
    except Exception as exc:  # torch raises many kinds; each is the user's problem to see
        raise TorchImportError(
            f"from_torch: torch.export could not capture {name}.forward{_user_line(exc)}: "
            f"{_reason(exc)}"
        ) from exc


def _reason(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n  ".join(lines[:12]) + ("\n  ..." if len(lines) > 12 else "")


def _user_line(exc: Exception) -> str:
    """The last frame outside torch that torch's message names (` at model.py:12`)."""
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    found = [(f, n) for f, n in _USER_LINE.findall(str(exc)) if not f.startswith(torch_dir)]
    return f" at {found[-1][0].rsplit('/', 1)[-1]}:{found[-1][1]}" if found else ""


def _refuse_layouts(module, args, kwargs) -> None:
    """Sparse and complex tensors among the inputs and the state_dict, refused by name before
    torch.export sees them (its own errors about them do not name the tensor)."""
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    named = [(f"argument {i}", v) for i, v in enumerate(leaves)]
    named += list(module.state_dict().items())
    for name, value in named:
        if not isinstance(value, torch.Tensor):
            continue
        if value.layout != torch.strided:
            raise TorchImportError(
                f"from_torch: {name} is a {value.layout} tensor; backplan "
                "tensors are dense (call .to_dense() first)"
            )
        if value.is_complex():
            raise TorchImportError(
                f"from_torch: {name} is {value.dtype}; backplan has no complex tensors"
            )


def refuse_dynamic_shapes(program: ExportedProgram, owner: str) -> None:
    """A shape torch.export left symbolic (`x[x > 0]`: its length depends on the values)."""
    for node in program.graph.nodes:
        value = node.meta.get("val")
        shape = getattr(value, "shape", ())
        if isinstance(value, torch.SymInt) or any(not isinstance(d, int) for d in shape):
            raise TorchImportError(
                f"from_torch: {owner} computes a value whose shape depends on the data "
                f"({op_name(node)} at {where(node, owner)}, shape {list(shape)}): backplan "
                "plans have static shapes; use torch.where with a mask instead of boolean "
                "indexing or nonzero"
            )


def refuse_unmapped(program: ExportedProgram, owner: str) -> None:
    """One error naming every op without a mapping, each with its module and line."""
    missing = []
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            if op_name(node) not in TABLE:
                missing.append(f"  {op_name(node)} at {where(node, owner)}")
    if missing:
        raise TorchImportError(
            f"from_torch: {len(missing)} op(s) of {owner} have no backplan mapping:\n"
            + "\n".join(missing)
            + "\nrewrite those lines with ops that have one, or file an issue naming the op"
        )


def op_name(node) -> str:
    return str(node.target)  # `aten.convolution.default`


def refuse_mutations(program: ExportedProgram, module: torch.nn.Module, owner: str) -> None:
    """Buffers may change only as batch norm's running statistics do."""
    producers = {n.name: n for n in program.graph.nodes}
    for spec in program.graph_signature.output_specs:
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            node = producers[spec.arg.name]
            raise TorchImportError(
                f"from_torch: {owner} changes its input {spec.target} in place at "
                f"{where(node, owner)}; backplan tensors are immutable: return the new value"
            )
        if spec.kind == OutputKind.BUFFER_MUTATION and not _is_batch_norm(module, spec.target):
            node = producers[spec.arg.name]
            raise TorchImportError(
                f"from_torch: {owner} changes its buffer {spec.target} in place at "
                f"{where(node, owner)}; only batch norm's running statistics may change (they "
                "come back as new_buffers)"
            )
        if spec.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION):
            raise TorchImportError(f"from_torch: {owner} has an output of kind {spec.kind.name}")
    for spec in program.graph_signature.input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.USER_INPUT,
                             InputKind.CONSTANT_TENSOR):  # fmt: skip
            raise TorchImportError(f"from_torch: {owner} has an input of kind {spec.kind.name}")


def _is_batch_norm(module: torch.nn.Module, buffer: str) -> bool:
    owner = buffer.rsplit(".", 1)[0] if "." in buffer else ""
    return isinstance(module.get_submodule(owner), torch.nn.modules.batchnorm._NormBase)
