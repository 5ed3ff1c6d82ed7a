"""`tessera batch --ray`: the same rows through Ray Data, one engine per actor.

The rows travel as ``{"index": i, "row": JSON text}`` (``from_items``): JSON text because rows are
heterogeneous (a prompt is text or a list of ids, fields come and go), which Arrow columns would
refuse or coerce. ``map_batches`` runs ``EngineActor`` -- a callable class, so each actor builds its
engine once (in ``__init__``: onnxruntime sessions do not pickle) and keeps it for every batch --
with ``concurrency`` actors. Each batch goes through ``batch.run_rows`` exactly as the local path
runs the whole file. Results carry their row index and are sorted by it, so the output is in input
order whatever order the actors finish in.

Each actor reserves ``--threads`` CPUs (default 1) and runs that many onnxruntime intra-op threads
(onnxruntime ignores OMP_NUM_THREADS, so the engine is told).
"""

from __future__ import annotations

import json

from tessera.runtime.errors import UsageError

from .batch import BatchOptions, run_rows
from .ray_support import connected, require_ray


class EngineActor:
    """One engine per Ray Data actor, built from picklable options."""

    def __init__(self, opts: BatchOptions, threads: int):
        from dataclasses import replace

        from .batch import load_engine

        self.opts = opts
        self.engine = load_engine(replace(opts, threads=threads)).start()

    def __call__(self, batch: dict) -> dict:
        rows = [json.loads(r) for r in batch["row"]]
        results = run_rows(self.engine, rows, self.opts.max_tokens)
        return {"index": list(batch["index"]), "result": [json.dumps(r) for r in results]}

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def batch_size(opts: BatchOptions, rows: int) -> int:
    """Rows per call of an actor: enough to fill its slots and queue (the engine batches within a
    call), few enough that every actor gets several calls."""
    per_actor = -(-rows // opts.concurrency)
    return max(1, min(opts.max_batch + opts.max_queue, per_actor))


def run_on_ray(opts: BatchOptions, rows: list[dict]) -> list[dict]:
    require_ray("`tessera batch --ray`", ("ray", "ray.data"))
    import ray.data

    threads = opts.threads or 1
    with connected(opts.address):
        ds = ray.data.from_items([{"index": i, "row": json.dumps(r)} for i, r in enumerate(rows)])
        out = ds.map_batches(EngineActor, fn_constructor_args=(opts, threads), concurrency=opts.concurrency,
                             num_cpus=threads, batch_size=batch_size(opts, len(rows)), batch_format="numpy")
        try:
            done = sorted(out.take_all(), key=lambda r: int(r["index"]))
        except Exception as e:  # an actor failed to start (a bad spec or path): say why, no traceback
            if not type(e).__module__.startswith("ray"):
                raise
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            raise UsageError(f"Ray Data failed: {lines[-1] if lines else type(e).__name__}") from None
    if [int(r["index"]) for r in done] != list(range(len(rows))):
        raise RuntimeError(f"Ray Data returned {len(done)} results for {len(rows)} rows")
    return [json.loads(r["result"]) for r in done]
