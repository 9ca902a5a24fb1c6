"""What a function's plans run on now, over all its runners: `fn.driver_tier` is the slowest of
them (a function is as fast as its slowest plan), and `fn.wait_until_compiled()` waits for their
background builds (codegen/build/driver_tier.py) under one deadline."""

from __future__ import annotations

import time

from backplan.codegen.build.driver_tier import TIERS


def slowest_tier(runners: list) -> str | None:
    """The slowest of "reference", "python", "direct", "compiled"; None before any plan has a
    runner."""
    if not runners:
        return None
    return min((r.driver_tier for r in runners), key=TIERS.index)


def wait_until_compiled(runners: list, timeout: float | None = None) -> bool:
    """True once every runner's calls run compiled code (a direct or a compiled driver); False
    when one stays on a slower tier (its build failed, it cannot compile, it runs on the
    reference backend) or `timeout` seconds passed first. With no runners there is nothing
    compiled yet: False."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for runner in runners:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        runner.wait_until_compiled(left)
    return bool(runners) and all(r.driver_tier in ("direct", "compiled") for r in runners)
