"""The named pipelines (compiler/passes/pipeline.py) and the compiler's export entry points
(compiler/build.py): each pipeline lists its passes in order, and a cached decoder compiled by
compile_cached gives, at the prompt and at every decoding step, the logits of the uncached graph
recomputing the whole sequence (onnxruntime, the ``full`` pipeline with attention left unfused).

Covered in tests/generation/test_generate.py and not repeated here (the runtime's compile_cached and
compile_seq2seq there are thin wrappers over compiler/build.py): GPT-2 and Llama with grouped
keys/values at the default options (test_greedy_equals_transformers_and_full_recomputation), fp16
(test_fp16_cache_generates_close_to_fp32) and the encoder-decoder on the bundled transformer spec
(test_encoder_decoder_greedy_equals_torch, against torch.nn.Transformer). Here: the options those
tests leave at their defaults (quantised weights, the concat cache with every position's logits,
plain decoding with the linears unfused)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tessera.compiler import build as compiler_build
from tessera.compiler.passes import PassError
from tessera.compiler.passes.attention_kernels import Target
from tessera.compiler.passes.kv_cache import CacheError, CacheInfo
from tessera.compiler.passes.pipeline import PIPELINES, PipelineOptions, build_pipeline, pipeline, run_report
from tessera.compiler.passes.quantize import QuantConfig
from tessera.runtime.generation import cached as gen
from tessera.runtime import pipeline as rt
from tessera.compiler.backends.onnx.bound_step import general_graph

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


def _uncached_session(case, quantize=None):
    """The reference: the graph as written (attention unfused, no cache) through the ``full``
    pipeline with the same quantisation, in onnxruntime; it recomputes the whole sequence each step."""
    import onnxruntime as ort

    from tessera.compiler.backends.onnx import export as onnx_export

    built, weights = _built(case)
    pipeline("full", PipelineOptions(attention="unfused", quantize=quantize))(built.graph)
    model = onnx_export.to_onnx(built.graph, weights)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


CACHED = {  # name: (model, the options compile_cached is given)
    "llama-gqa-int4": (LLAMA_GQA, PipelineOptions(quantize=QuantConfig("int4", 32))),
    "gpt2-int8": (GPT2, PipelineOptions(quantize=QuantConfig("int8", 32))),
    "gpt2-concat-all-logits": (GPT2, PipelineOptions(cache="concat", last_only=False)),
    "llama-gqa-plain-decode-unfused-linears": (LLAMA_GQA, PipelineOptions(decode="plain", fuse_linears=False)),
}


@pytest.mark.parametrize("name", CACHED)
def test_cached_decoder_logits_equal_the_uncached_recomputation(name):
    """Prompts of 7 and 4 tokens (left-padded to one batch), then 8 greedy steps: at each, the logits
    the cached decoder chose from equal those of the uncached graph run over the row's whole sequence."""
    from conftest import Recomputation

    case, options = CACHED[name]
    built, weights = _built(case)
    done = compiler_build.compile_cached(built.graph, weights, built.info, options)
    assert len(done.info.layers) == 2  # one cache per attention layer (layers=2)
    assert [s.fused for s in done.sites] == [True, True]
    if options.quantize is not None:
        assert any(n.op_type == "MatMulNBits" for n in general_graph(done.model).node)
    model = gen.CachedModel(done.model.SerializeToString(), done.info)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 50, n).tolist() for n in (7, 4)]
    check = Recomputation(_uncached_session(case, options.quantize), prompts)
    result = gen.generate(model, prompts, 8, on_logits=check)
    assert [len(r) for r in result.tokens] == [8, 8]
    assert check.worst <= 1e-4, f"max |cached - uncached| logits: {check.worst:.2e}"


def test_a_cached_decoder_records_its_quantisation_as_the_full_export_does(tmp_path):
    """Both exports write ``tessera.quantize`` (compiler/build.py's model_metadata): the cached
    decoder now that the cached_decoder pipeline quantises as its first pass."""
    import onnx

    import tessera

    # the 8-bit head and embedding: int4's defaults
    want = {"scheme": "int4", "block_size": 32, "head": True, "head_bits": 8, "embedding_bits": 8, "activations": "int8"}
    m = tessera.load(GPT2[0], **dict(s.split("=") for s in GPT2[1]))
    for kw in ({}, {"kv_cache": True}):
        (path, *_) = m.compile(tmp_path / f"m{len(kw)}.onnx", quantize="int4", **kw)
        meta = _meta(onnx.load(str(path), load_external_data=False))
        assert json.loads(meta["tessera.quantize"]) == want
        assert meta["tessera.model"] == "GPT2"
        assert (CacheInfo.METADATA_KEY in meta) == bool(kw)


def test_seq2seq_compile_splits_the_encoder_and_caches_the_decoder():
    built, weights = _built(TRANSFORMER)
    got = compiler_build.compile_seq2seq(built.graph, weights, PipelineOptions(decoder_input="tgt", max_positions=128))
    assert len(got.info.layers) == 2
    # 2 layers x (cross-attention K and V) + the source mask both sides read
    assert len(got.boundary) == 5 and "src_mask" in got.boundary
    assert {o.name for o in got.encoder.graph.output} >= set(got.boundary) - {"src_mask"}


def test_every_export_records_the_same_metadata():
    built, weights = _built(TRANSFORMER)
    got = compiler_build.compile_seq2seq(built.graph, weights, PipelineOptions(decoder_input="tgt"), built.info)
    enc, dec = _meta(got.encoder), _meta(got.decoder)
    assert enc["tessera.model"] == dec["tessera.model"] == "Transformer"
    assert json.loads(enc["tessera.hyperparams"])["layers"] == 2
    assert CacheInfo.METADATA_KEY not in enc
    assert CacheInfo.from_json(json.loads(dec[CacheInfo.METADATA_KEY])).to_json() == got.info.to_json()


def test_each_named_pipeline_lists_its_passes_in_order():
    o = PipelineOptions(target=Target("cpu", "fp16"), quantize=QuantConfig("int4"), decoder_input="tgt")
    cache = "kv-cache-inputs -> kv-cache-position-bias -> kv-cache-position-factor -> kv-cache-positions " \
            "-> kv-cache-layers -> kv-cache-kernels -> last-position-logits"
    optimize = "fuse-attention -> eliminate-dead-nodes -> choose-attention-kernels -> sparse-experts " \
               "-> choose-recurrence-lowering"
    assert list(PIPELINES) == ["full", "cached_decoder", "encoder_decoder", "report"]
    # stored-codes first (a GGUF file's own codes, compiler/passes/stored_codes.py); --gguf-weights dequantize: none
    assert pipeline("full", o).describe() == "stored-codes -> fuse-attention -> eliminate-dead-nodes " \
        "-> choose-attention-kernels -> quantize-weights -> sparse-experts -> choose-recurrence-lowering"
    assert pipeline("full", PipelineOptions(target=Target("cpu", "fp16"), lower_precision=True)).describe() == \
        build_pipeline(Target("cpu", "fp16"), lower_precision=True).describe() == \
        "stored-codes -> fuse-attention -> eliminate-dead-nodes -> choose-attention-kernels -> sparse-experts " \
        "-> lower-precision -> choose-recurrence-lowering"
    assert pipeline("full", PipelineOptions(gguf_weights="dequantize")).describe() == \
        "fuse-attention -> eliminate-dead-nodes -> choose-attention-kernels -> sparse-experts " \
        "-> choose-recurrence-lowering"
    onnx = "prune-dead-nodes -> settle-packed -> settle-mixed"
    assert pipeline("cached_decoder", o).describe() == \
        f"stored-codes -> quantize-weights -> {optimize} -> {cache} -> fuse-linears -> lower-precision | after export: {onnx} " \
        f"-> fuse-skip-norms -> split-bound-step"
    assert pipeline("cached_decoder", PipelineOptions(last_only=False, fuse_linears=False, skip_norm=False,
                                                      bound_step=False)).describe() == \
        f"stored-codes -> {optimize} -> {cache.replace(' -> last-position-logits', '')} | after export: {onnx}"
    # an encoder-decoder at --dtype fp16 on the CPU is lowered too (it once compiled fp32 there, silently)
    lowered = optimize.replace("-> choose-recurrence-lowering", "-> lower-precision -> choose-recurrence-lowering")
    assert pipeline("encoder_decoder", o).describe() == \
        f"stored-codes -> quantize-weights -> {lowered} -> split-encoder -> {cache} | after export: {onnx}"
    assert pipeline("report", o).describe() == "sparse-experts"
    # the serving engine's CUDA variant derives its attention mask after export (backends/onnx/prefix_mask.py);
    # every CUDA cached decoder moves its branches' shape arithmetic to the main graph (backends/onnx/hoist.py)
    cuda = PipelineOptions(target=Target("cuda", "fp16"), prefix_keys=True)
    assert pipeline("cached_decoder", cuda).describe().endswith(
        f"{onnx} -> derive-prefix-mask -> hoist-dataless -> fuse-skip-norms")
    assert pipeline("cached_decoder", PipelineOptions(target=Target("cuda", "fp16"))).describe().endswith(
        f"{onnx} -> hoist-dataless -> fuse-skip-norms")


def test_a_model_pass_that_leaves_a_value_read_before_it_is_written_is_refused():
    """The model passes' default contract (passes/model_passes.py ModelPass.ensures)."""
    from onnx import TensorProto, helper

    from tessera.compiler.passes.model_passes import Exported, ModelPass, PassResult

    class Swap(ModelPass):
        name = "swap"

        def run(self, exported):
            nodes = list(exported.model.graph.node)
            del exported.model.graph.node[:]
            exported.model.graph.node.extend(reversed(nodes))
            return PassResult(exported.graph, True)

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["h"]),
                                                 helper.make_node("Relu", ["h"], ["y"])], "g", [x], [y]))
    with pytest.raises(PassError, match="swap left Relu  reading h before it is written"):
        Swap()(Exported(model, None))


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
