"""Graph passes. Each pass follows one contract (see base.Pass): requires, run, ensures."""

from .base import Pass, PassError, PassResult, run_passes

__all__ = ["Pass", "PassError", "PassResult", "run_passes"]
