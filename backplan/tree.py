"""Pytrees, as `bp.tree`: nested dicts, lists, tuples, namedtuples, dataclasses (frozen or not)
and classes registered with `bp.tree.register`, whose leaves are tensors and static values.
Compiled functions, value_and_grad and export take and return them.

>>> import backplan as bp
>>> params = {"w": bp.ones((2,)), "b": bp.zeros((2,))}
>>> bp.tree.map(lambda p: p * 2, params)["w"].numpy().tolist()
[2.0, 2.0]
>>> leaves, treedef = bp.tree.flatten(params)
>>> bp.tree.unflatten(treedef, leaves).keys()
dict_keys(['w', 'b'])
"""

from backplan.tracer.pytree import (
    TreeDef,
    flatten,
    leaves,
    register,
    static_field,
    structure,
    unflatten,
)
from backplan.tracer.pytree import tree_map as map  # noqa: A004 - bp.tree.map, as jax.tree.map

__all__ = [
    "TreeDef",
    "flatten",
    "leaves",
    "map",
    "register",
    "static_field",
    "structure",
    "unflatten",
]
