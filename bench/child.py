"""Measurements of a fresh process (a cold start, a first call, a warm start) run a child
Python that prints its result as one JSON line, the last it prints: this runs the child and
reads that line, or raises with the end of the child's stderr."""

from __future__ import annotations

import json
import subprocess


def child_result(command: list[str], env: dict, timeout: float, what: str, cwd=None) -> dict:
    """The child's last stdout line as JSON; RuntimeError naming `what` if it fails."""
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
