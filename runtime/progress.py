"""Progress of long work on the command line: a rich progress bar on stderr when stderr is a terminal,
else one summary line once the work is done, and nothing with -q.

Why: `compile gpt2 --variant xl` streamed its weights for 50 s in silence, and `generate` from a .tsr
compiled its cached decoder for ~15 s before the first token (issue 21). The work reports itself
through a plain callable, ``progress(done, total, stage=None)`` (the compiler knows nothing of rich:
compiler/backends/onnx/stream.py calls it with bytes); this module draws it. Only the command line
makes one: the Python API prints nothing.
"""

from __future__ import annotations

import time


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


class Progress:
    """``with Progress("streaming the weights", "bytes") as p: work(progress=p)``. ``unit`` is "bytes"
    (done and total counted in bytes) or "stages" (done of total named stages: each call names the stage
    starting now, and the summary gives each stage's seconds). ``console``: a rich Console (tests force a
    terminal or not); by default one on stderr."""

    def __init__(self, title: str, unit: str = "bytes", *, quiet: bool = False, console=None):
        self.title, self.unit, self.quiet = title, unit, quiet
        self._console = console
        self.started: float | None = None
        self.done = self.total = 0
        self.stages: list[list] = []  # [name, seconds]
        self._bar = self._task = None

    @property
    def console(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=True)
        return self._console

    def __call__(self, done: int, total: int, stage: str | None = None) -> None:
        if self.quiet:
            return
        now = time.perf_counter()
        if self.started is None:
            self.started = now
        if stage is not None:
            if self.stages:
                self.stages[-1][1] = now - self.stages[-1][1]  # the previous stage's start becomes its duration
            self.stages.append([stage, now])
        self.done, self.total = done, total
        if self.console.is_terminal:
            self._draw(stage)

    def _draw(self, stage: str | None) -> None:
        from rich import progress as rp

        if self._bar is None:
            amount = rp.DownloadColumn() if self.unit == "bytes" else rp.MofNCompleteColumn()
            self._bar = rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(), amount,
                                    rp.TimeElapsedColumn(), console=self.console)
            self._task = self._bar.add_task(self.title, total=self.total)
            self._bar.start()
        description = f"{self.title}: {stage}" if stage else self.title
        self._bar.update(self._task, completed=self.done, total=self.total, description=description)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._bar is not None:
            if exc_type is None:
                self._bar.update(self._task, description=self.title)
            self._bar.stop()
        elif not self.quiet and exc_type is None and self.started is not None:
            print(self.summary(), file=self.console.file, flush=True)
        return False

    def summary(self) -> str:
        """The one line printed when stderr is not a terminal."""
        seconds = time.perf_counter() - self.started
        if self.unit == "bytes":
            return f"{self.title}: {_bytes(self.total)} in {seconds:.1f} s"
        if self.unit != "stages":  # a count of things (windows, ...)
            return f"{self.title}: {self.done} of {self.total} {self.unit} in {seconds:.1f} s"
        if self.stages:
            self.stages[-1][1] = time.perf_counter() - self.stages[-1][1]
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.stages)
        return f"{self.title} in {seconds:.1f} s ({parts})"
