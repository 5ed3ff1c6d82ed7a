"""Graph passes. Each pass follows one contract (see base.Pass): requires, run, ensures; a
PassManager runs a declared list of them (pipeline.PIPELINES, the named pipelines) and returns every result."""

from .base import Pass, PassError, PassManager, PassResult, PipelineResult, run_passes

__all__ = ["Pass", "PassError", "PassManager", "PassResult", "PipelineResult", "run_passes"]
