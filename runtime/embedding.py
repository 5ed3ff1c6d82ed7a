"""An encoder model (BERT, MiniLM) ready for sentence embeddings: compiled by run's pipeline, opened
in onnxruntime, its hidden states pooled as its folder declares (``tessera serve`` of an encoder:
serving/embeddings.py serves ``/v1/embeddings`` with it; the driver's ``serve_model`` builds it).
A batch's rows run in calls of rows of similar lengths (``length_groups``), each padded to its own
longest row, rather than all padded to the batch's longest.

Pooling: sentence-transformers' ``1_Pooling/config.json`` (mean or CLS; mean by default, as ``tessera
run --pool mean``) over the attention mask, L2-normalised when the folder's ``modules.json`` has a
Normalize module (normalised by default, without a modules.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tessera.compiler.ir.signature import input_limits, specs_from_graph
from tessera.runtime import pipeline
from tessera.runtime.errors import UsageError
from tessera.runtime.options import RunOptions

POOLINGS = ("mean", "cls")
# A call's fixed cost in padded tokens (``length_groups``): MiniLM-L6 at one thread took 3.7 ms for one row of
# 4 tokens and +0.2 ms a token after (~18 tokens a call), but at two threads small calls use the second core
# poorly: 8 sentences as 3 calls (399 padded tokens) took 1.17x one call of 504. At 128, 8 sentences of
# 16-63 tokens stay one call, 32 become 2 and 64 become 4 (docs/benchmarks/log.md, bench/embeddings.py)
CALL_TOKENS = 128


class EmbeddingError(UsageError):
    """A request that cannot be embedded (HTTP 400)."""


def is_encoder(graph) -> bool:
    """An encoder for embeddings: an output ``hidden`` of rank 3 and no ``logits``."""
    names = list(graph.outputs)
    return "hidden" in names and "logits" not in names and graph.type_of("hidden").rank == 3


def folder_pooling(folder: Path | None) -> tuple[str, bool, str]:
    """(pooling, normalise, where it came from) from a sentence-transformers folder: ``1_Pooling/config.json``
    (``pooling_mode_cls_token`` / ``pooling_mode_mean_tokens``) and ``modules.json`` (a Normalize module)."""
    if folder is None:
        return "mean", True, "default (no model folder)"
    pooling, normalize, where = "mean", True, "default"
    cfg = folder / "1_Pooling" / "config.json"
    if cfg.is_file():
        try:
            data = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as e:
            raise UsageError(f"cannot read {cfg}: {e}") from None
        if not isinstance(data, dict):
            raise UsageError(f"{cfg} is not a JSON object")
        if data.get("pooling_mode_cls_token"):
            pooling = "cls"
        elif data.get("pooling_mode_mean_tokens"):
            pooling = "mean"
        else:
            modes = [k for k, v in data.items() if k.startswith("pooling_mode") and v]
            raise UsageError(f"{cfg} asks for pooling {modes}; `tessera serve` pools mean or CLS")
        where = str(cfg)
    modules = folder / "modules.json"
    if modules.is_file():
        try:
            data = json.loads(modules.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as e:
            raise UsageError(f"cannot read {modules}: {e}") from None
        normalize = isinstance(data, list) and any(isinstance(m, dict) and "Normalize" in str(m.get("type", ""))
                                                   for m in data)
        where += f", {modules}"
    return pooling, normalize, where


class EmbeddingModel:
    """The encoder's onnxruntime session, its inputs, context and width, and the pooling."""

    def __init__(self, session, specs, context: int | None, dim: int, pooling: str = "mean", normalize: bool = True,
                 pooling_source: str = "default", name: str = "encoder"):
        if pooling not in POOLINGS:
            raise UsageError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        self.session, self.specs, self.context, self.dim = session, specs, context, dim
        self.pooling, self.normalize, self.pooling_source, self.name = pooling, normalize, pooling_source, name
        self.vocab = None

    def run(self, rows: list[list[int]], pad_id: int = 0) -> np.ndarray:
        """Embeddings [N, dim] of token-id rows: rows of similar lengths together, one call per group
        (``length_groups``: a batch of 16-63-token sentences padded to its longest row computes ~1.6 times
        its tokens), each right-padded to its own longest row and masked."""
        groups = length_groups([len(r) for r in rows])
        if len(groups) == 1:
            return self._run(rows, pad_id)
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        for g in groups:
            out[g] = self._run([rows[i] for i in g], pad_id)
        return out

    def _run(self, rows: list[list[int]], pad_id: int) -> np.ndarray:
        """Embeddings [N, dim] of token-id rows, in one call (right-padded, masked)."""
        from tessera.runtime.session import run_session  # session.py imports onnx (~0.6 s)

        ids, mask = right_padded(rows, pad_id)
        values = {"tokens": ids, "mask": mask, "token_types": np.zeros_like(ids)}
        feeds = {}
        for spec in self.specs:
            if spec.name not in values:
                raise EmbeddingError(f"the encoder's input {spec.name} cannot be filled from text")
            want = np.int32 if spec.dtype == "i32" else np.int64
            feeds[spec.name] = values[spec.name].astype(want)
        hidden = np.asarray(run_session(self.session, feeds)["hidden"], dtype=np.float32)
        if self.pooling == "cls":
            out = hidden[:, 0, :]
        else:
            m = mask[..., None].astype(np.float32)
            out = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
        if self.normalize:
            out = out / np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
        return out


def right_padded(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token-id rows as one [N, T] batch, each row from column 0 and ``pad_id`` after it, and its mask (1 on the
    rows' tokens): the layout an encoder's call takes (its attention mask hides the padding)."""
    n, t = len(rows), max(len(r) for r in rows)
    ids = np.full((n, t), pad_id, dtype=np.int64)
    mask = np.zeros((n, t), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
        mask[i, :len(r)] = 1
    return ids, mask


def length_groups(lengths: list[int], call_tokens: int = CALL_TOKENS) -> list[list[int]]:
    """The rows (indices) split into calls of similar lengths: sorted by length and cut into runs that
    minimise the padded tokens computed plus ``call_tokens`` per call (each run padded to its longest;
    exact over the runs of the sorted rows, by dynamic programming over the distinct lengths)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if len(order) < 2:
        return [order]
    values, counts = np.unique(np.array([lengths[i] for i in order], dtype=np.int64), return_counts=True)
    upto = np.concatenate([[0], np.cumsum(counts)])  # rows with length < values[j]: upto[j]
    best = np.zeros(len(values) + 1)
    cut = np.zeros(len(values) + 1, dtype=np.int64)
    for j in range(1, len(values) + 1):  # the first j distinct lengths, the last run ending at values[j - 1]
        cost = best[:j] + call_tokens + (upto[j] - upto[:j]) * values[j - 1]
        cut[j] = int(np.argmin(cost))
        best[j] = cost[cut[j]]
    bounds, j = [], len(values)
    while j > 0:
        bounds.append((int(upto[cut[j]]), int(upto[j])))
        j = int(cut[j])
    return [order[a:b] for a, b in reversed(bounds)]


def load(built, weights, threads: int | None, folder: Path | None, name: str) -> EmbeddingModel:
    """The encoder compiled (run's optimisation pipeline) and opened with ``threads`` onnxruntime threads."""
    from tessera.compiler.backends.onnx import export as onnx_export  # imports onnx (~0.6 s)

    specs = specs_from_graph(built.graph)
    missing = [s.name for s in specs if s.name not in ("tokens", "mask", "token_types")]
    if missing or "tokens" not in [s.name for s in specs]:
        raise UsageError(f"/v1/embeddings fills the inputs tokens, mask and token_types; this encoder takes "
                         f"{', '.join(s.name for s in specs)}")
    limits = input_limits(built.graph)
    ctx = limits.dims["T"][0] if "T" in limits.dims else None  # the position table's rows
    vocab = limits.ids["tokens"][0] if "tokens" in limits.ids else None
    dim = built.graph.type_of("hidden").shape[-1]
    pipeline.optimize(built, RunOptions().pipeline_options(()), False)
    source = onnx_export.to_bytes(built.graph, weights, pipeline.metadata(built))
    import onnxruntime as ort  # heavy, and only a served encoder needs it

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    session = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    pooling, normalize, where = folder_pooling(folder)
    model = EmbeddingModel(session, specs, ctx, int(dim), pooling, normalize, where, name)
    model.vocab = vocab
    return model
