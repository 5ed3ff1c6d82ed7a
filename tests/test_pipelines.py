"""The named pipelines (compiler/passes/pipeline.py) and the compiler's export entry points
(compiler/build.py): each pipeline lists its passes in order, and the compiler-side cached and
encoder-decoder compiles give byte-identical ONNX to the runtime's hand-composed ones
(runtime/generate.py compile_cached / compile_seq2seq) for the same graph, weights and choices."""

from __future__ import annotations

import json

import pytest

from tessera.compiler import build as compiler_build
from tessera.compiler.passes import PassError
from tessera.compiler.passes.attention_kernels import Target
from tessera.compiler.passes.kv_cache import CacheError, CacheInfo
from tessera.compiler.passes.pipeline import PIPELINES, PipelineOptions, build_pipeline, pipeline, run_report
from tessera.compiler.passes.quantize import QuantConfig
from tessera.runtime.generation import cached as gen
from tessera.runtime import pipeline as rt

GPT2 = ("gpt2", ["layers=2", "d=64", "heads=4", "vocab=50", "ctx=32"])
LLAMA_GQA = ("llama", ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=96", "vocab=50", "ctx=64"])
TRANSFORMER = ("transformer", ["layers=2", "d=32", "heads=4", "d_ff=64", "vocab=40"])
MIXTRAL = ("mixtral", ["layers=2", "d=32", "heads=4", "kv_heads=2", "vocab=50", "d_ff=48", "experts=4", "top=2"])


def _built(case):
    spec, sets = case
    built = rt.build(spec, None, sets)
    return built, rt.weights_for(built, None, 0)


def _meta(model) -> dict:
    return {e.key: e.value for e in model.metadata_props}


def _without(model, key: str) -> bytes:
    """The serialised model with one metadata entry removed."""
    copy = type(model)()
    copy.CopyFrom(model)
    kept = [e for e in copy.metadata_props if e.key != key]
    del copy.metadata_props[:]
    copy.metadata_props.extend(kept)
    return copy.SerializeToString()


CACHED = {  # name: (model, the runtime's keywords, the same choices as PipelineOptions)
    "gpt2": (GPT2, {}, PipelineOptions()),
    "gpt2-concat-all-logits": (GPT2, dict(mode="concat", last_only=False),
                               PipelineOptions(cache="concat", last_only=False)),
    "gpt2-plain-decode-unfused-linears": (GPT2, dict(decode="plain", fuse_linears=False),
                                          PipelineOptions(decode="plain", fuse_linears=False)),
    "llama-gqa": (LLAMA_GQA, {}, PipelineOptions()),
    "gpt2-fp16": (GPT2, dict(dtype="fp16", target=Target("cpu", "fp16")), PipelineOptions(target=Target("cpu", "fp16"))),
}


@pytest.mark.parametrize("name", CACHED)
def test_cached_compile_is_byte_identical_to_the_runtime(name):
    case, runtime_kw, options = CACHED[name]
    built, weights = _built(case)
    want, want_info = gen.compile_cached(built, weights, **runtime_kw)
    built, weights = _built(case)
    got = compiler_build.compile_cached(built.graph, weights, built.info, options)
    assert got.model.SerializeToString() == want.SerializeToString()
    assert got.info.to_json() == want_info.to_json()
    assert len(got.info.layers) == 2  # one cache per attention layer (layers=2)
    assert [s.fused for s in got.sites] == [True, True]


def test_quantised_cached_compile_is_byte_identical_and_records_the_quantisation():
    """The runtime quantises before compile_cached; the cached_decoder pipeline quantises as its first
    pass. The graphs and weights are byte for byte the same; the compiler's file also records the
    quantisation (tessera.quantize), which the runtime's cached export left out."""
    config = QuantConfig("int4", 32)
    built, weights = _built(LLAMA_GQA)
    rt.quantize(built, config)
    want, want_info = gen.compile_cached(built, weights)
    built, weights = _built(LLAMA_GQA)
    got = compiler_build.compile_cached(built.graph, weights, built.info, PipelineOptions(quantize=config))
    assert "tessera.quantize" not in _meta(want)
    assert json.loads(_meta(got.model)["tessera.quantize"]) == {"scheme": "int4", "block_size": 32, "head": False,
                                                               "activations": "int8"}
    assert _without(got.model, "tessera.quantize") == want.SerializeToString()
    assert got.info.to_json() == want_info.to_json()
    assert any(n.op_type == "MatMulNBits" for n in got.model.graph.node)


def test_seq2seq_compile_is_byte_identical_to_the_runtime():
    built, weights = _built(TRANSFORMER)
    enc, dec, info, boundary = gen.compile_seq2seq(built, weights, "tgt", max_positions=128)
    built, weights = _built(TRANSFORMER)
    got = compiler_build.compile_seq2seq(built.graph, weights, PipelineOptions(decoder_input="tgt", max_positions=128))
    assert got.encoder.SerializeToString() == enc.SerializeToString()
    assert got.decoder.SerializeToString() == dec.SerializeToString()
    assert got.info.to_json() == info.to_json()
    assert got.boundary == boundary
    # 2 layers x (cross-attention K and V) + the source mask both sides read
    assert len(boundary) == 5 and "src_mask" in boundary


def test_every_export_records_the_same_metadata():
    built, weights = _built(TRANSFORMER)
    got = compiler_build.compile_seq2seq(built.graph, weights, PipelineOptions(decoder_input="tgt"), built.info)
    enc, dec = _meta(got.encoder), _meta(got.decoder)
    assert enc["tessera.model"] == dec["tessera.model"] == "Transformer"
    assert json.loads(enc["tessera.hyperparams"])["layers"] == 2
    assert CacheInfo.METADATA_KEY not in enc
    assert CacheInfo.from_json(json.loads(dec[CacheInfo.METADATA_KEY])).to_json() == got.info.to_json()
    meta = compiler_build.model_metadata(built.info)
    assert rt.metadata(built) == meta  # the full model's export (runtime/pipeline.py) writes the same


def test_each_named_pipeline_lists_its_passes_in_order():
    o = PipelineOptions(target=Target("cpu", "fp16"), quantize=QuantConfig("int4"), decoder_input="tgt")
    cache = "kv-cache-inputs -> kv-cache-positions -> kv-cache-layers -> kv-cache-kernels -> last-position-logits"
    optimize = "fuse-attention -> eliminate-dead-nodes -> choose-attention-kernels -> sparse-experts " \
               "-> choose-recurrence-lowering"
    assert list(PIPELINES) == ["full", "cached_decoder", "encoder_decoder", "report"]
    assert pipeline("full", o).describe() == "fuse-attention -> eliminate-dead-nodes -> choose-attention-kernels " \
        "-> quantize-weights -> sparse-experts -> choose-recurrence-lowering"
    assert pipeline("full", PipelineOptions(target=Target("cpu", "fp16"), lower_precision=True)).describe() == \
        build_pipeline(Target("cpu", "fp16"), lower_precision=True).describe() == \
        "fuse-attention -> eliminate-dead-nodes -> choose-attention-kernels -> sparse-experts -> lower-precision " \
        "-> choose-recurrence-lowering"
    assert pipeline("cached_decoder", o).describe() == \
        f"quantize-weights -> {optimize} -> {cache} -> fuse-linears -> lower-precision"
    assert pipeline("cached_decoder", PipelineOptions(last_only=False, fuse_linears=False)).describe() == \
        f"{optimize} -> {cache.replace(' -> last-position-logits', '')}"
    assert pipeline("encoder_decoder", o).describe() == f"quantize-weights -> {optimize} -> split-encoder -> {cache}"
    assert pipeline("report", o).describe() == "sparse-experts"


def test_bad_options_and_uncacheable_graphs_raise_pass_errors():
    with pytest.raises(PassError, match="unknown pipeline 'nope'"):
        pipeline("nope")
    with pytest.raises(CacheError, match="unknown cache mode 'ring'"):
        pipeline("cached_decoder", PipelineOptions(cache="ring"))
    with pytest.raises(PassError, match="per phase itself"):
        pipeline("cached_decoder", PipelineOptions(attention="block"))
    with pytest.raises(PassError, match="needs the decoder's input"):
        pipeline("encoder_decoder")
    built, weights = _built(("bert", ["layers=1"]))
    with pytest.raises(CacheError, match="decoder-only"):
        compiler_build.compile_cached(built.graph, weights, built.info)
    built, weights = _built(TRANSFORMER)
    with pytest.raises(PassError, match="the model has no input 'target'"):
        compiler_build.compile_seq2seq(built.graph, weights, PipelineOptions(decoder_input="target"))


def test_a_kv_cache_pass_out_of_order_is_refused_by_its_contract():
    from tessera.compiler.passes.kv_cache import AddCacheLayers, CacheOptions

    built, _ = _built(GPT2)
    pipeline("full")(built.graph)
    with pytest.raises(PassError, match="run kv-cache-inputs first"):
        AddCacheLayers(CacheOptions())(built.graph)


def test_report_pipeline_rewrites_a_copy():
    built, _ = _built(MIXTRAL)
    ops_before = [n.op for n in built.graph.nodes.values()]
    result = run_report(built.graph, PipelineOptions())
    assert [n.op for n in built.graph.nodes.values()] == ops_before  # the graph as written is untouched
    assert sum(n.op == "sparse_moe" for n in result.graph.nodes.values()) == 2  # one per layer
    assert sum(n.op == "topk_gates" for n in result.graph.nodes.values()) == 0
    dense = run_report(built.graph, PipelineOptions(sparse_moe=False))
    assert sum(n.op == "sparse_moe" for n in dense.graph.nodes.values()) == 0
    quantised = run_report(built.graph, PipelineOptions(quantize=QuantConfig("int8")))
    assert [s.sparse for s in quantised.notes("sparse-experts")] == [False, False]
