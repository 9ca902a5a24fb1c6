"""--cold-caches: point the compilers' disk caches at a new empty folder for this process, so
"cold" first calls really compile. Without the flag the caches are used as found (a second
run's cold calls may hit kernels the first one stored) and nothing is changed."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

# Disk caches a cold first call would otherwise reuse. JAX keeps no persistent cache unless
# configured to.
CACHE_VARIABLES = {"backplan": "BACKPLAN_CACHE_DIR", "torch.compile": "TORCHINDUCTOR_CACHE_DIR"}


class FreshCaches:
    """Sets the cache variables in this process's environment for the run (printed with the
    results), then puts them back and removes the folder."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.root = None
        self.settings: dict[str, str] = {}
        self.previous: dict[str, str | None] = {}

    def __enter__(self) -> FreshCaches:
        if not self.enabled:
            return self
        if "torch" in sys.modules:
            self.settings["note"] = "torch was imported before the caches were moved"
        self.root = tempfile.mkdtemp(prefix="backplan-bench-caches-")
        for name, variable in CACHE_VARIABLES.items():
            path = os.path.join(self.root, name)
            self.settings[variable] = path
            self.previous[variable] = os.environ.get(variable)
            os.environ[variable] = path
        return self

    def __exit__(self, *exc) -> None:
        for variable, value in self.previous.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def describe(self) -> dict:
        if not self.enabled:
            return {"cold_caches": False}
        return {"cold_caches": True, "variables": dict(self.settings)}
