"""Where an exported node came from in the user's model: the innermost module path from
torch.export's nn_module_stack and the innermost stack-trace frame outside torch itself, made
into the SourceLoc backplan records for the ops that compute the node (`layer2.0.conv1 at
model.py:41`)."""

from __future__ import annotations

import os
import re

import torch

from backplan.runtime.location import SourceLoc

_TORCH_DIR = os.path.dirname(torch.__file__)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _clean(path)


def _clean(path: str) -> str:
    """`L['self'].layer2[0].conv1` (some torch versions) as `layer2.0.conv1`."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", path).strip(".")


def user_frame(node) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost frame of the node's stack trace that is not
    torch's own code (nn.Linear's forward is torch's; the line calling it is the user's)."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    for file, line, function in reversed(frames):
        if not os.path.abspath(file).startswith(_TORCH_DIR):
            return file, int(line), function
    return None


def node_location(node, owner: str) -> SourceLoc | None:
    """The SourceLoc for a node's ops; its text names the module path and the user's line."""
    frame = user_frame(node)
    path = module_path(node) or owner
    if frame is None:
        return None
    file, line, function = frame
    loc = SourceLoc(((path or function, file, line),), None)  # the path keeps modules apart
    if path:
        loc.scope = path  # read by the IR printer: `layer2.0.conv1 at model.py:41`
        loc.text = f"{path} at {os.path.basename(file)}:{line}"
    return loc


def where(node, owner: str) -> str:
    """A node's place for a message: `layer1.0.conv1 at model.py:12`, or its name."""
    loc = node_location(node, owner)
    return loc.text if loc is not None else module_path(node) or str(node.name)
