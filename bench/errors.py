"""Errors of the benchmark harness: bad command-line choices and peers that cannot run."""

from backplan import BackplanError


class BenchError(BackplanError):
    """A benchmark could not be set up as asked (unknown model or peer, bad option)."""
