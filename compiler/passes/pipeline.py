"""The named pipelines, declared as data: each is a list of passes for a PipelineOptions, run by
a PassManager under the pass contract (requires -> run -> ensures).

- ``full``: the model as written, for export and analysis: fuse attention, drop dead nodes, choose
  each fused kernel for the target, quantise weights (--quantize), make mixtures of experts sparse
  (unless --no-sparse-moe), lower the precision (when exporting at a lower one), choose how scans
  are lowered.
- ``cached_decoder``: a decoder-only model for generation: quantise, then ``full``'s passes (at
  fp32, without the kernel override), the KV cache passes (passes/kv_cache.py), one linear for
  each group reading one input (passes/fuse_linears.py), and the precision lowering with the
  cache kept at the lower precision.
- ``encoder_decoder``: ``full``'s passes, the encoder split off (passes/encdec.py: the pipeline
  goes on with the decoder graph), the KV cache passes on the decoder.
- ``report``: the rewrites the report applies before it counts (sparse experts), run on a copy.

The cached pipelines also list the passes they run on the exported ONNX model (``MODEL_PASSES``,
passes/model_passes.py: dead nodes, the packed step and the combined call settled, skip norms, the
bound step), which compiler/build.py runs after export; ``describe()`` shows both.

The attention sites ``--explain`` prints are read from the passes' results (the fusion pass's
AttentionSite notes, completed by the kernel pass's KernelChoice notes), never handed from one
pass to the next; so is the CacheInfo (kv_cache.cache_info) and the encoder (EncoderPart).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable

from tessera.compiler.ir.graph import Graph
from tessera.compiler.passes.attention_kernels import ChooseAttentionKernels, Target
from tessera.compiler.passes.base import EliminateDeadNodes, Pass, PassError, PassManager, PipelineResult
from tessera.compiler.passes.encdec import SplitEncoder
from tessera.compiler.passes.expose_attention import ExposeAttentionProbs
from tessera.compiler.passes.fuse_attention import AttentionSite, FuseAttention
from tessera.compiler.passes.fuse_linears import FuseSharedInputLinears
from tessera.compiler.passes.kv_cache import CacheOptions, cache_passes, cache_tensors
from tessera.compiler.passes.kv_cache_dtype import StoreCacheAt, resolve as resolve_cache_dtype
from tessera.compiler.passes.model_passes import (DerivePrefixMask, FuseSkipNorms, HoistDataless, ModelPass, PruneDeadNodes,
                                                  SettleMixed, SettlePacked, SplitBoundStep)
from tessera.compiler.passes.precision import LowerPrecision
from tessera.compiler.passes.quantize import QuantConfig, QuantizeWeights
from tessera.compiler.passes.stored_codes import KeepStoredCodes
from tessera.compiler.passes.recurrence import ChooseRecurrenceLowering
from tessera.compiler.passes.site_groups import grouped_lines
from tessera.compiler.passes.sparse_moe import SparseExperts

ATTENTION_CHOICES = ("auto", "gqa", "mha", "block", "portable", "unfused")


GROUPED_DECODE_ENV = "TESSERA_GROUPED_DECODE"  # "0": the bound step's grouped form off (backends/onnx/grouped_decode.py)


def grouped_decode_default() -> bool:
    """PipelineOptions.grouped_decode's default: on, unless the environment sets TESSERA_GROUPED_DECODE=0 (read
    when the options are made, so the compile cache's key holds the value used)."""
    return os.environ.get(GROUPED_DECODE_ENV, "1").strip() != "0"


@dataclass(frozen=True)
class PipelineOptions:
    """Every choice a pipeline reads, in one typed value (the command line's and the API's compile
    options map onto it). ``target`` holds the device and the dtype; ``attention`` the kernel
    override (auto, or unfused for --no-fuse); ``quantize`` the weight-only quantisation (None: off);
    ``lower_precision`` adds full's fp32 -> target.dtype lowering (export does; analyses that only
    ask what fuses do not; the cached pipelines lower whenever the dtype is not fp32);
    ``attention_probs`` (site indices) or ``all_probs`` make those sites' probabilities outputs (kept
    unfused); ``recurrence`` how scans are lowered; ``cache``, ``decode``, ``last_only`` and
    ``max_positions`` the KV cache's (passes/kv_cache.py); ``fuse_linears`` the cached decoder's
    linear fusion; ``decoder_input`` the encoder-decoder's target tokens."""

    target: Target = Target()
    attention: str = "auto"
    quantize: QuantConfig | None = None
    sparse_moe: bool = True
    recurrence: str = "auto"
    lower_precision: bool = False
    attention_probs: tuple[int, ...] = ()
    all_probs: bool = False
    cache: str = "auto"
    decode: str = "auto"
    last_only: bool = True
    fuse_linears: bool = True
    max_positions: int = 4096
    decoder_input: str | None = None
    mixed: bool = False  # the serving engine's combined prefill+decode call (backends/onnx/mixed_attention.py)
    # with ``mixed``: a call that is not combined and has at most this many tokens gives every position's logits
    # (serve --speculative checks drafts in such calls: backends/onnx/mixed_attention.py settle_mixed); 0: none
    short_logits: int = 0
    # the serving engine's gqa decoding step without its mask (passes/kv_cache.py CacheOptions.prefix_keys)
    prefix_keys: bool = False
    # the cached decoder's two ONNX-level passes after export (compiler/build.py); off only to measure them
    skip_norm: bool = True  # residual Add + norm as Skip(Simplified)LayerNormalization (backends/onnx/skip_norm.py)
    bound_step: bool = True  # the bound decoding step as a branch of its own (backends/onnx/bound_step.py)
    # its GroupQueryAttention over an fp16 cache with each key/value head's queries as rows (backends/onnx/
    # grouped_decode.py); the default reads TESSERA_GROUPED_DECODE ("0": off), keyed by the compile cache as given
    grouped_decode: bool = dataclasses.field(default_factory=grouped_decode_default)
    # weights the checkpoint holds block-quantised (Param.stored, a GGUF file's codes): "codes" and
    # "codes-fp32" read them as MatMulNBits (passes/stored_codes.py), "dequantize" as the fp32 weights
    gguf_weights: str = "codes"
    # the KV cache's precision (passes/kv_cache_dtype.py): auto = the model's; fp16 on an fp32 model stores the
    # cache at fp16 (half the bytes), the model computing in fp32; int8/int4 refused with the reason
    kv_cache_dtype: str = "auto"

    def cache_options(self) -> CacheOptions:
        return CacheOptions(self.last_only, self.cache, None, self.decoder_input, self.max_positions, self.target,
                            self.decode, self.mixed, self.prefix_keys)

    def check_cached(self) -> None:
        """The cached pipelines choose the attention kernels per phase themselves."""
        if self.attention != "auto" or self.attention_probs or self.all_probs:
            raise PassError("the KV cache chooses the attention kernels per phase itself: it takes no attention "
                            "override and exposes no attention probabilities")

    @property
    def lower_cache(self) -> bool:
        """Whether the cache is stored below the model's precision (fp16 on an fp32 model)."""
        return resolve_cache_dtype(self.kv_cache_dtype, self.target.dtype) != self.target.dtype


def _optimize(o: PipelineOptions, lower_precision: bool, quantize: QuantConfig | None) -> list[Pass]:
    """full's passes, in order."""
    fuse = o.attention != "unfused"
    passes: list[Pass] = [FuseAttention(enabled=fuse), EliminateDeadNodes()]
    if o.attention_probs or o.all_probs:
        passes.insert(0, ExposeAttentionProbs(None if o.all_probs else list(o.attention_probs)))
    if fuse:
        passes.append(ChooseAttentionKernels(o.target, None if o.attention == "auto" else o.attention))
    if quantize is not None:
        passes.append(QuantizeWeights(quantize))
    passes.append(SparseExperts(enabled=o.sparse_moe, impl=sparse_moe_impl(o.target)))  # after quantisation:
    # quantised experts stay dense
    if lower_precision and o.target.dtype != "fp32":
        passes.append(LowerPrecision(o.target.dtype, device=o.target.device))
    passes.append(ChooseRecurrenceLowering(o.recurrence))  # last: onnx's cell ops are fp32 only
    return passes


def sparse_moe_impl(target) -> str | None:
    """The sparse experts' lowering for ``target``: onnxruntime's fused com.microsoft.MoE on CUDA in every dtype
    (onnxruntime-gpu 1.31.1 registers it for fp32, fp16 and bf16: placed on CUDA and run under tests/cuda_stub;
    the gather form's NonZero count would be read back on the host once per expert per layer), else the default (passes/sparse_moe.py DEFAULT_IMPL, measured on the CPU). MoE's semantics
    (softmax of the router logits, top k, renormalised; SwiGLU experts as fc1 [E, 2f, d] interleaved, fc2
    [E, d, f]) are held to the gather form on onnxruntime's CPU kernel in tests/compiler/test_sparse_moe.py."""
    if target.device == "cuda":
        return "moe"
    return None


def _stored(o: PipelineOptions) -> list[Pass]:
    """The checkpoint's own block-quantised weights, first (before any --quantize)."""
    if o.gguf_weights == "dequantize":
        return []
    # --quantize-activations, where given with --quantize, chooses the codes' products' activations too
    floats = o.quantize.activations if o.quantize is not None and not o.quantize.per_row else None
    return [KeepStoredCodes(o.gguf_weights, floats)]


def full(o: PipelineOptions) -> list[Pass]:
    return _stored(o) + _optimize(o, o.lower_precision, o.quantize)


def cached_decoder(o: PipelineOptions) -> list[Pass]:
    # quantised first, before fusion: the cached graph inherits the
    # quantised linears, and quantised experts stay dense
    o.check_cached()
    passes: list[Pass] = _stored(o) + ([QuantizeWeights(o.quantize)] if o.quantize is not None else [])
    passes += _optimize(o, False, None) + cache_passes(o.cache_options())
    if o.fuse_linears:
        passes.append(FuseSharedInputLinears())
    if o.lower_cache:  # after the kernels are chosen: it needs every site decoding by GroupQueryAttention
        passes.append(StoreCacheAt())
    if o.target.dtype != "fp32":  # the cache crosses the interface at the lower precision
        passes.append(LowerPrecision(o.target.dtype, native=cache_tensors, device=o.target.device))
    return passes


def encoder_decoder(o: PipelineOptions) -> list[Pass]:
    """An encoder-decoder for generation: at --dtype (fp16 on the CPU too: it used to compile fp32 there whatever
    --dtype said), linears unfused."""
    o.check_cached()
    if o.decoder_input is None:
        raise PassError("the encoder_decoder pipeline needs the decoder's input (decoder_input)")
    if o.lower_cache:
        raise PassError(f"--kv-cache-dtype {o.kv_cache_dtype}: an encoder-decoder's decoder keeps its cache at the "
                        f"model's precision (its cached attention does not decode by GroupQueryAttention); not built")
    passes: list[Pass] = _stored(o) + ([QuantizeWeights(o.quantize)] if o.quantize is not None else [])
    lower = o.target.dtype != "fp32"  # at --dtype on every device (bf16 refused on the CPU by LowerPrecision)
    return passes + _optimize(o, lower, None) + [SplitEncoder([o.decoder_input])] + cache_passes(o.cache_options())


def report(o: PipelineOptions) -> list[Pass]:
    """The rewrites the report counts after: experts sparse as compile makes them (not when quantised:
    quantised experts stay dense)."""
    return [SparseExperts(enabled=o.sparse_moe and o.quantize is None)]


PIPELINES: dict[str, Callable[[PipelineOptions], list[Pass]]] = {
    "full": full, "cached_decoder": cached_decoder, "encoder_decoder": encoder_decoder, "report": report}


def cached_decoder_after_export(o: PipelineOptions) -> list[ModelPass]:
    """The cached decoder's rewrites of the exported model: dead nodes out, the packed step's and the
    combined call's nodes settled, the engine's mask derived in the graph (CUDA, ``prefix_keys``), then
    (both on by default; off only to measure them) the residual
    Add + norm fused and the bound decoding step split into a branch of its own."""
    passes: list[ModelPass] = [PruneDeadNodes(), SettlePacked(), SettleMixed(o.short_logits)]
    if o.prefix_keys and o.target.device == "cuda":  # the engine's mask from cache_length, in the graph
        passes.append(DerivePrefixMask())
    if o.target.device == "cuda":  # no shape arithmetic left in a branch, where it would be on the device
        passes.append(HoistDataless())
    if o.skip_norm:
        passes.append(FuseSkipNorms())
    if o.bound_step and o.target.device == "cpu":  # on CUDA its If would hold shape arithmetic on the device
        passes.append(SplitBoundStep(grouped=o.grouped_decode))
    return passes


def encoder_decoder_after_export(o: PipelineOptions) -> list[ModelPass]:
    """The decoder's (the encoder is exported as it is)."""
    return [PruneDeadNodes(), SettlePacked(), SettleMixed()]


# The passes over the exported ONNX model (passes/model_passes.py), per pipeline; none for the others.
MODEL_PASSES: dict[str, Callable[[PipelineOptions], list[ModelPass]]] = {
    "cached_decoder": cached_decoder_after_export, "encoder_decoder": encoder_decoder_after_export}


def pipeline(name: str, options: PipelineOptions = PipelineOptions()) -> PassManager:
    """The named pipeline for these options: its graph passes, and the passes it runs on the exported
    model (``PassManager.after_export``)."""
    if name not in PIPELINES:
        raise PassError(f"unknown pipeline '{name}' (choose from {', '.join(PIPELINES)})")
    after = MODEL_PASSES.get(name)
    return PassManager(PIPELINES[name](options), after(options) if after else [])


def run_report(graph: Graph, options: PipelineOptions = PipelineOptions()) -> PipelineResult:
    """The report pipeline on a copy of ``graph`` (the graph as written is left as it is)."""
    return pipeline("report", options)(graph.copy())


def build_pipeline(target: Target = Target(), attention: str = "auto", lower_precision: bool = False,
                   quantize: QuantConfig | None = None, attention_probs: list[int] | None = None,
                   all_probs: bool = False, recurrence: str = "auto", sparse_moe: bool = True) -> PassManager:
    """The ``full`` pipeline from keyword arguments (kept for its callers; see PipelineOptions)."""
    return pipeline("full", PipelineOptions(target, attention, quantize, sparse_moe, recurrence, lower_precision,
                                            tuple(attention_probs or ()), all_probs))


def attention_sites(result: PipelineResult) -> list[AttentionSite]:
    """Every attention site with what happened to it: fusion's notes, with the kernel chosen for each."""
    choices = {c.node: c for c in result.notes(ChooseAttentionKernels.name)}
    sites = []
    for s in result.notes(FuseAttention.name):
        c = choices.get(s.node) if s.fused else None
        sites.append(dataclasses.replace(s, impl=c.impl, impl_reason=c.reason) if c else s)
    return sites


def optimize(graph: Graph, target: Target = Target(), attention: str = "auto",
             lower_precision: bool = False, quantize: QuantConfig | None = None,
             sparse_moe: bool = True) -> list[AttentionSite]:
    """Run the pipeline on the graph (in place); return every attention site with what happened to it."""
    return attention_sites(build_pipeline(target, attention, lower_precision, quantize, sparse_moe=sparse_moe)(graph))


def expert_sites(result: PipelineResult) -> list:
    """Every mixture of experts the sparse-experts pass looked at, sparse or dense and why."""
    return result.notes(SparseExperts.name)


def explain(sites: list[AttentionSite], exposed: list | None = None) -> str:
    fused = sum(s.fused for s in sites)
    lines = [f"attention sites: {len(sites)} ({fused} fused, {len(sites) - fused} not fused)"]
    lines += [f"  {line}" for line in grouped_lines(sites)]
    if exposed:
        lines.append(f"attention probabilities exposed as outputs: {len(exposed)}")
        lines += [f"  {e.describe()}" for e in exposed]
    return "\n".join(lines)


def explain_experts(sites: list) -> str:
    """--explain's lines for the mixtures of experts ("" when the model has none)."""
    if not sites:
        return ""
    sparse = sum(s.sparse for s in sites)
    lines = [f"mixtures of experts: {len(sites)} ({sparse} sparse, {len(sites) - sparse} dense)"]
    return "\n".join(lines + [f"  {line}" for line in grouped_lines(sites)])
