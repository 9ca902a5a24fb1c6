"""The explain() report of one traced signature: a compiled function's region plans, or
value_and_grad's joint plan, named the way the user's function names its parameters."""

from __future__ import annotations

import inspect
import re
from dataclasses import replace

from backplan.report.argument_copies import mark_call_copies
from backplan.report.report import ExplainReport, InnerJoint, joint_report, region_report

from .budget import rebuilt_joint
from .captured_names import captured_names
from .numpy_args import joint_copies
from .source import loc_text, user_frame_loc


def explain_traced(traced, cache_info) -> ExplainReport:
    """The report of one signature of a compiled function, with the joint plans of the
    value_and_grad calls it inlined (what they save lives inside this step)."""
    report = region_report(
        traced.program, traces=cache_info.traces, retrace_reason=cache_info.last_miss_reason
    )
    joints = inner_as_run(traced.planner, traced.inner_joints)
    report.inner = [(joint, joint.report(report.backend)) for joint in joints]
    return report


def inner_as_run(planner, joints) -> list[InnerJoint]:
    """The inlined value_and_grad plans as the step runs them: under a budget (or a saved
    dtype) the step recomputes or narrows some of the values its inlined gradients read, so
    each joint plan is rebuilt with the same choice (BudgetPlanner.inner_choices); else, or
    when the step's held values cannot be matched to the joint plans', as traced."""
    if planner is None or not joints or any(j.choices is None for j in joints):
        return list(joints)
    chosen = planner.inner_choices([j.choices for j in joints])
    if chosen is None:
        return list(joints)
    drops, dtype, words = chosen
    return [
        replace(j, plan=rebuilt_joint(j.choices, drop, dtype), chosen_for=words)
        for j, drop in zip(joints, drops, strict=True)
    ]


def inner_joint(entry, call, fn) -> InnerJoint:
    """A value_and_grad call being inlined into an enclosing trace, for that trace's report."""
    names = _joint_input_names(entry, call, fn)
    name = getattr(fn, "__name__", "fn")
    choices = entry.planner.choices if entry.planner is not None else None
    return InnerJoint(
        entry.plan,
        1 + entry.n_aux,
        tuple(entry.wrt),
        names,
        name,
        loc_text(user_frame_loc()),
        choices,
    )


def _joint_input_names(entry, call, fn) -> list[str]:
    names = [_parameter_path(fn, call.key.leaves[p].path) for p in call.tensor_positions]
    return names + captured_names(fn, entry.captured)


def explain_joint(entry, call, fn, cache_info) -> ExplainReport:
    """The report of one signature of value_and_grad: its joint plan."""
    names = _joint_input_names(entry, call, fn)
    name = getattr(fn, "__name__", "fn")
    report = joint_report(
        entry.plan,
        1 + entry.n_aux,
        entry.wrt,
        names,
        name,
        traces=cache_info.traces,
        retrace_reason=cache_info.last_miss_reason,
    )
    mark_call_copies(report, frozenset(), *joint_copies(entry, call))
    return report


def named_reason(fn, reason: str) -> str:
    """A value_and_grad retrace reason with its positional paths named as fn does
    ("args[1]: shape ..." -> "x: shape ...", "['args'][0]" -> "params")."""
    params = _positional_parameters(fn)
    return re.sub(
        r"(?:\['args'\]|\bargs)\[(\d+)\]",
        lambda m: params[int(m[1])] if int(m[1]) < len(params) else m[0],
        reason,
    )


def _parameter_path(fn, path: str) -> str:
    """value_and_grad binds arguments by position ("args[0]['w']"); name them as fn does."""
    match = re.match(r"args\[(\d+)\]", path)
    if match:
        params = _positional_parameters(fn)
        index = int(match.group(1))
        if index < len(params):
            return params[index] + path[match.end() :]
        return path
    match = re.match(r"kwargs\['(\w+)'\]", path)
    return match.group(1) + path[match.end() :] if match else path


def _positional_parameters(fn) -> list[str]:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]
