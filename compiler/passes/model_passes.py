"""Passes over the exported ONNX model: the rewrites a cached decoder needs after export, as passes of
the named pipelines (compiler/passes/pipeline.py ``MODEL_PASSES``) under the same contract as the
graph passes (requires -> run -> ensures; onnx-ir's pass contract is the model).

Why after export: each rewrites ONNX structure the IR does not have (If branches, onnxruntime's
contrib ops, the nodes export emits for a kernel). The rewrite functions stay with the ONNX
backend (compiler/backends/onnx/); here each becomes a pass with a name, the checks it needs and
its notes for ``--explain``, so ``describe()`` lists the whole compile and compiler/build.py runs it
in one place.

A model pass reads an ``Exported``: the ONNX model it rewrites in place, the IR graph it was
exported from (for value types) and the cache's interface (which outputs a decoding step writes).
The default ``ensures``: every value a node of the main graph reads is a graph input, an
initializer or the output of a node before it (a rewrite that moves nodes keeps the order valid).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.compiler.backends.onnx.walk import all_nodes
from tessera.compiler.ir.graph import Graph
from tessera.compiler.passes.base import PassError, PassResult


@dataclass
class Exported:
    """What a model pass reads: the ONNX model (rewritten in place), the IR graph it came from and,
    for a cached decoder, its CacheInfo (compiler/passes/kv_cache.py)."""

    model: object          # onnx.ModelProto
    graph: Graph
    info: object = None    # CacheInfo | None
    notes: list[str] = field(default_factory=list)


class ModelPass:
    """A pass over an exported ONNX model; ``run`` returns a PassResult whose graph is the model."""

    name = "model-pass"

    def requires(self, exported: Exported) -> None:
        """Raise PassError if the pass cannot run on this model."""

    def run(self, exported: Exported) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def ensures(self, exported: Exported) -> None:
        graph = exported.model.graph
        known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
        for node in graph.node:
            missing = [x for x in node.input if x not in known]
            if missing:
                raise PassError(f"{self.name} left {node.op_type} {node.name or ''} reading {missing[0]} before it is "
                                f"written")
            known.update(node.output)

    def __call__(self, exported: Exported) -> PassResult:
        self.requires(exported)
        result = self.run(exported)
        result.name = result.name or self.name
        self.ensures(exported)
        return result


class PruneDeadNodes(ModelPass):
    """Drop nodes none of whose outputs is read (a buffer-mode cache leaves the concatenated keys and
    values unread: its attention reads past and new apart)."""

    name = "prune-dead-nodes"

    def run(self, exported: Exported) -> PassResult:
        from tessera.compiler.backends.onnx.cached_attention import prune_dead_nodes  # onnx: ~0.6 s

        n = prune_dead_nodes(exported.model)
        return PassResult(exported.graph, bool(n), [n] if n else [])


class SettlePacked(ModelPass):
    """A packed decoding step's prefill-only nodes moved into the prefill branch (then the nodes that
    left unread pruned), so a decoding step does not run them."""

    name = "settle-packed"

    def run(self, exported: Exported) -> PassResult:
        from tessera.compiler.backends.onnx.cached_attention import prune_dead_nodes, settle_packed  # onnx: ~0.6 s

        moved = settle_packed(exported.model)
        if moved:
            prune_dead_nodes(exported.model)
        return PassResult(exported.graph, bool(moved), [moved] if moved else [])


class SettleMixed(ModelPass):
    """The serving engine's combined call: the logits it needs (and, with ``short_logits``, every position's
    in a call of at most that many tokens that is not combined: serve --speculative's checks)."""

    name = "settle-mixed"

    def __init__(self, short_logits: int = 0):
        self.short_logits = short_logits

    def run(self, exported: Exported) -> PassResult:
        from tessera.compiler.backends.onnx.mixed_attention import settle_mixed  # onnx: ~0.6 s

        return PassResult(exported.graph, bool(settle_mixed(exported.model, self.short_logits)))


class HoistDataless(ModelPass):
    """CUDA: the shape arithmetic of the If branches (a sliding window's key positions in a decoding step)
    moved into the main graph (backends/onnx/hoist.py), so onnxruntime puts no Memcpy inside a branch."""

    name = "hoist-dataless"

    def run(self, exported: Exported) -> PassResult:
        from tessera.compiler.backends.onnx.hoist import hoist_dataless  # onnx: ~0.6 s

        moved = hoist_dataless(exported.model)
        return PassResult(exported.graph, bool(moved), [moved] if moved else [])


class DerivePrefixMask(ModelPass):
    """CUDA, the serving engine's decoder (PipelineOptions.prefix_keys: the engine's layout, each row's keys its
    columns from 0; no combined call): the attention mask computed in the graph (backends/onnx/prefix_mask.py) from
    cache_length where every cached site is the mask-less gqa decoding step, from the first position ids where
    every site decodes with the plain branch (fp32); no longer an input, so a decoding step copies no mask to the
    device. Any other graph is left as it is."""

    name = "derive-prefix-mask"

    def requires(self, exported: Exported) -> None:
        if exported.info is None:
            raise PassError(f"{self.name} needs the cached decoder's CacheInfo")

    def run(self, exported: Exported) -> PassResult:
        from tessera.compiler.backends.onnx.prefix_mask import derive_prefix_mask  # onnx: ~0.6 s
        from tessera.compiler.passes.kv_cache import DECODE_SPAN, LENGTH, MASK, POSITIONS, cached_sites

        info, sites = exported.info, cached_sites(exported.graph)
        if not sites or not info.layers or any(n.attrs.get("mixed") for n in sites):
            return PassResult(exported.graph, False)
        if all(n.attrs.get("prefix_keys") and n.attrs.get("decode_mask") == DECODE_SPAN for n in sites) and \
                info.length_input == LENGTH:
            if derive_prefix_mask(exported.model, MASK, info.tokens, LENGTH, info.layers[0].past_key):
                return PassResult(exported.graph, True, [
                    "attention mask derived in the graph from cache_length (each row's keys its columns "
                    "0..cache_length and the call's own tokens): not an input, nothing copied for it per call"])
        elif not any(n.attrs.get("decode") == "gqa" for n in sites) and not info.length_input and info.mode == "buffer":
            # the plain branch (fp32 on CUDA) in the engine's layout: a row's first position is its filled columns
            if derive_prefix_mask(exported.model, MASK, info.tokens, POSITIONS, info.layers[0].past_key,
                                  positions=True):
                return PassResult(exported.graph, True, [
                    "attention mask derived in the graph from the first position ids (each row's keys its columns "
                    "0..position and the call's own tokens; the plain branch): not an input, nothing copied for it "
                    "per call"])
        return PassResult(exported.graph, False)


class FuseSkipNorms(ModelPass):
    """The residual Add + norm as onnxruntime's Skip(Simplified)LayerNormalization, when the graph already
    uses onnxruntime's com.microsoft ops (the GroupQueryAttention step); its note says what it fused
    and why a norm kept its Add."""

    name = "fuse-skip-norms"

    def run(self, exported: Exported) -> PassResult:
        from tessera.compiler.backends.onnx.skip_norm import fuse_skip_norms, ir_types  # onnx: ~0.6 s

        if not any(n.domain == "com.microsoft" for n in all_nodes(exported.model.graph.node)):
            return PassResult(exported.graph, False)
        report = fuse_skip_norms(exported.model, ir_types(exported.graph))
        fused = ", ".join(f"{n} {kind}" for kind, n in report.fused.items()) or "none"
        kept = "; ".join(f"{name}: {why}" for name, why in list(report.kept.items())[:3])
        note = (f"residual Add + norm fused (Skip(Simplified)LayerNormalization): {fused}"
                + (f"; left: {kept}{' ...' if len(report.kept) > 3 else ''}" if kept else ""))
        return PassResult(exported.graph, bool(report.fused), [note])


def grouped_note(model, on: bool) -> str:
    """The grouped form's line of SplitBoundStep's note (backends/onnx/grouped_decode.py)."""
    if not on:
        return "GroupQueryAttention not grouped (off: grouped_decode / TESSERA_GROUPED_DECODE=0)"
    from tessera.compiler.backends.onnx.grouped_decode import group_bound_step

    done = group_bound_step(model)
    if isinstance(done, int):
        return (f"{done} GroupQueryAttention grouped (each key/value head's queries as rows: the fp16 cache "
                f"converted once a step), the compiled form for a step of several rows or where a buffer has no room "
                f"for the spare columns")
    if "not FLOAT16" in done and "is FLOAT," in done:  # an fp32 cache: nothing to say (the form is for fp16 only)
        return ""
    return f"GroupQueryAttention not grouped ({done})"


class SplitBoundStep(ModelPass):
    """The bound decoding step as a branch of its own under one If (backends/onnx/bound_step.py); a graph
    it does not fit is left as it is, and the note says why. With ``grouped`` (PipelineOptions.grouped_decode),
    then its GroupQueryAttention over an fp16 cache in the grouped form (backends/onnx/grouped_decode.py), or
    the reason it is left as compiled, in the same note."""

    name = "split-bound-step"

    def __init__(self, grouped: bool = True):
        self.grouped = grouped

    def requires(self, exported: Exported) -> None:
        if exported.info is None:
            raise PassError(f"{self.name} needs the cached decoder's CacheInfo")

    def run(self, exported: Exported) -> PassResult:
        from tessera.compiler.backends.onnx.bound_step import split_bound_step  # onnx: ~0.6 s

        columns = {n for layer in exported.info.layers if layer.buffer_key
                   for n in (layer.present_key, layer.present_value)}
        done = split_bound_step(exported.model, columns)
        note = (f"decoding step bound in place: one If, a branch of its own ({done} nodes; no per-layer If, no cache "
                "columns)" if isinstance(done, int) else f"decoding step bound in place: as above ({done})")
        grouped = grouped_note(exported.model, self.grouped) if isinstance(done, int) else ""
        if grouped:  # an fp16 (or bf16) cache's kernels grouped, or why not; an fp32 cache says nothing
            note += "; " + grouped

        return PassResult(exported.graph, isinstance(done, int), [note])
