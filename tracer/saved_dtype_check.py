"""saved_dtype / allow_saved_dtype checked against the traced step's dtypes: a dtype no narrower
than every float value the step computes (bfloat16 or float16 on a float16 step) can store
nothing in fewer bytes, so asking for it is refused with the dtype pair and the way out, rather
than compiling a plan that silently ignores it."""

from __future__ import annotations

from backplan.ir.types import is_float, np_dtype


def check_saved_dtype_narrows(choices, dtypes: tuple, where: str) -> None:
    """choices: the step's PlanChoices (ir/pipeline.py); dtypes: (saved_dtype,
    allow_saved_dtype) as IR names; where: the function, in words. Raises ValueError when the
    given one is no narrower than every float value the step holds for its gradients (those
    are what it would store; a float16 step's float32 mean accumulator is never held)."""
    for option, dtype in zip(("saved_dtype", "allow_saved_dtype"), dtypes, strict=True):
        if dtype is None or not choices.differentiated:
            continue
        schedule = choices.schedule
        held = {schedule.values[i].dtype for i in schedule.held}
        widths = {d for d in held if is_float(d)}
        if not widths:
            continue  # no float value held: nothing to narrow, nothing to refuse
        widest = max(widths, key=lambda d: np_dtype(d).itemsize)
        if np_dtype(widest).itemsize > np_dtype(dtype).itemsize:
            continue
        raise ValueError(_refusal(option, dtype, widest, where))


def _refusal(option: str, dtype: str, widest: str, where: str) -> str:
    asked, step = np_dtype(dtype), np_dtype(widest)
    effect = (
        "it would store every saved buffer as it is"
        if option == "saved_dtype"
        else "the memory planner could never meet a budget that way"
    )
    if step.itemsize == 2:
        wider = "float32 arrays (bfloat16 saved buffers then halve them)"
    else:
        wider = "arrays of a wider dtype"
    too = " too" if asked.itemsize == step.itemsize else ""
    return (
        f"{where}: {option}=bp.{asked.name} cannot narrow this step's saved buffers: the "
        f"float values it holds for its gradients are {step.name} ({step.itemsize} bytes) and "
        f"{asked.name} takes {asked.itemsize}{too}, so {effect}. Drop {option} (max_peak_bytes "
        f"and saved_bytes_budget are met by recomputing), or pass {wider}."
    )
