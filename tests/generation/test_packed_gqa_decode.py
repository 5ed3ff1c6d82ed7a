"""The packed decoding step (backends/onnx/cached_attention.py ``packed_qkv``): one GroupQueryAttention on
the fused q+k+v projection, rotary inside the kernel (do_rotary, cos/sin caches, the position ids).

References: transformers' Llama (grouped-query: 4 heads, 2 kv heads) greedy ``generate`` with the same
weights, token for token; the unpacked step (``--decode gqa-unpacked``: the q/k/v slices, head splits and
RotaryEmbedding nodes before GroupQueryAttention, as before) logits at every step within fp32
tolerance; at B = 1 and at B = 2 with uneven, left-padded prompts; plain rope, Llama 3.1's scaled
rope and linear scaling; an int4-quantised decoder against its own unpacked step.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import MODELS, hf_greedy

from tessera.compiler.backends.onnx import cached_attention
from tessera.compiler.backends.onnx.bound_step import general_graph
from tessera.runtime import pipeline
from tessera.runtime.generation.cached import CachedModel, compile_cached, generate

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW = 24
BASE = ["vocab=256", "d=64", "layers=2", "heads=4", "kv_heads=2", "d_ff=96", "eps=1e-5", "theta=500000.0"]
ROPES = {
    "plain": (None, "llama3_8b", []),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}, "llama3_1_8b", ["rope_original_ctx=16"]),
    "linear": ({"rope_type": "linear", "factor": 4.0}, "llama3_8b", ["rope_type=linear", "rope_factor=4.0"]),
}


class Case:
    def __init__(self, rope: str, folder):
        scaling, self.variant, extra = ROPES[rope]
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=96, rope_theta=500000.0,
                                       rms_norm_eps=1e-5, max_position_embeddings=128, attention_bias=False,
                                       mlp_bias=False, tie_word_embeddings=False, hidden_act="silu",
                                       **({"rope_scaling": scaling} if scaling else {}))
        self.hf = transformers.LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            for p in self.hf.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        self.hf.save_pretrained(folder, safe_serialization=True)
        self.ckpt, self.sets = folder / "model.safetensors", BASE + extra

    def cached(self, packed: bool, **kw) -> tuple[CachedModel, object]:
        built = pipeline.build(MODELS / "llama.tsr", self.variant, self.sets)
        model, info = compile_cached(built, pipeline.weights_for(built, str(self.ckpt), 0),
                                     **({} if packed else {"decode": "gqa-unpacked"}), **kw)
        return CachedModel(model.SerializeToString(), info), model

    def hf_generate(self, prompts, new):
        return hf_greedy(self.hf, prompts, new)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def get(rope):
        if rope not in made:
            made[rope] = Case(rope, tmp_path_factory.mktemp(f"packed_{rope}"))
        return made[rope]
    return get


def _run(model, prompts):
    steps = []
    tokens = generate(model, prompts, NEW, on_logits=lambda step, logits: steps.append(np.array(logits))).tokens
    return tokens, steps


def _top_level(model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in general_graph(model).node:  # the graph with the per-layer Ifs (bound_step.py keeps it whole)
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("lengths", [(9,), (11, 5)])
def test_packed_step_equals_transformers_and_the_unpacked_step(cases, rope, lengths):
    case = cases(rope)
    packed, _ = case.cached(True)
    unpacked, _ = case.cached(False)
    prompts = [np.random.default_rng(len(lengths)).integers(1, 256, n).tolist() for n in lengths]
    ours, ours_logits = _run(packed, prompts)
    ref, ref_logits = _run(unpacked, prompts)
    assert ours == case.hf_generate(prompts, NEW)
    assert ours == ref
    worst = max(float(np.abs(a - b).max()) for a, b in zip(ours_logits, ref_logits))
    assert worst <= 1e-4, worst
    assert len({t for row in ours for t in row}) > 5, "degenerate test: the model repeats one token"


def test_the_packed_graph_reads_the_fused_projection_and_has_fewer_nodes(cases):
    case = cases("plain")
    _, packed = case.cached(True)
    _, unpacked = case.cached(False)
    ifs = [n for n in general_graph(packed).node if n.op_type == "If"]
    assert len(ifs) == 2 and all(n.doc_string == cached_attention.PACKED_MARK for n in ifs)
    for n in ifs:
        then = next(a.g for a in n.attribute if a.name == "then_branch")
        (gqa,) = [m for m in then.node if m.op_type == "GroupQueryAttention"]
        attrs = {a.name: a.i for a in gqa.attribute if a.type == a.INT}
        assert attrs["do_rotary"] == 1 and attrs["rotary_interleaved"] == 0
        assert gqa.input[0].endswith("attn.q+k+v") and gqa.input[1] == gqa.input[2] == ""
        assert gqa.input[9] == "position_ids"
    a, b = _top_level(packed), _top_level(unpacked)
    assert "RotaryEmbedding" not in a and b["RotaryEmbedding"] == 4  # q and k of two layers
    # per layer: the head splits of q, k, v and the merge after attention, all moved into the prefill branch
    assert b["Transpose"] == 2 * 4 and "Transpose" not in a
    readers = [n.op_type for n in general_graph(packed).node
               if any(i.endswith("attn.q+k+v") for i in cached_attention._graph_reads([n]))]
    assert readers == ["If", "If"]  # the slices moved into the prefill branches
    print(f"top-level nodes: {sum(a.values())} packed, {sum(b.values())} unpacked")
    assert sum(a.values()) < sum(b.values())


def test_without_the_fused_projection_the_step_stays_unpacked(cases):
    case = cases("plain")
    cached, proto = case.cached(True, fuse_linears=False)
    assert not any(n.doc_string == cached_attention.PACKED_MARK for n in general_graph(proto).node)
    prompts = [[5, 9, 13, 2]]
    assert generate(cached, prompts, 8).tokens == case.hf_generate(prompts, 8)


def test_int4_packed_step_equals_its_unpacked_step(cases):
    from tessera.compiler.passes.quantize import QuantConfig

    case = cases("plain")
    q = QuantConfig("int4", block_size=32)
    packed, proto = case.cached(True, quantize=q)
    unpacked, _ = case.cached(False, quantize=q)
    assert any(n.doc_string == cached_attention.PACKED_MARK for n in general_graph(proto).node)
    assert any(n.op_type == "MatMulNBits" for n in general_graph(proto).node)
    prompts = [[5, 9, 13, 2, 77, 41, 8], [100, 3]]
    ours, a = _run(packed, prompts)
    ref, b = _run(unpacked, prompts)
    assert ours == ref
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) <= 1e-4


DECODER = """
model D(vocab = 64, d = 64, heads = 4, kv_heads = 2, bias = true, layout = "half") {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  h = embedding(tokens, vocab, d, name="embed")
  h = h + attention(h, heads, kv_heads=kv_heads, causal=true, rope_theta=10000.0, rope_max_ctx=64,
                    qkv_bias=bias, o_bias=false, rope_layout=layout, name="attn")
  logits = linear(h, vocab, bias=false, name="head")
}
"""


@pytest.mark.parametrize("sets", [["bias=true"], ["layout=interleaved", "bias=false"]])
def test_q_k_v_biases_and_interleaved_rotary_give_the_unpacked_step(tmp_path, sets):
    """A Qwen2-style q/k/v bias (inside the fused projection) and GPT-J's interleaved pairs
    (``rotary_interleaved``): the packed step's tokens and logits equal the unpacked step's."""
    spec = tmp_path / "d.tsr"
    spec.write_text(DECODER)

    def compiled(packed):
        built = pipeline.build(spec, None, sets)
        rng = np.random.default_rng(0)
        weights = {k: rng.standard_normal(v.shape).astype(np.float32) * 0.3
                   for k, v in pipeline.weights_for(built, None, 0).items()}
        model, info = compile_cached(built, weights, **({} if packed else {"decode": "gqa-unpacked"}))
        return CachedModel(model.SerializeToString(), info), model

    packed, proto = compiled(True)
    unpacked, _ = compiled(False)
    assert any(n.doc_string == cached_attention.PACKED_MARK for n in general_graph(proto).node)
    prompts = [[5, 9, 13, 2, 33, 41, 8], [60, 3]]
    ours, a = _run(packed, prompts)
    ref, b = _run(unpacked, prompts)
    assert ours == ref
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) <= 1e-4
    assert len({t for row in ours for t in row}) > 5


def test_compile_decode_gqa_unpacked_is_a_typed_choice(tmp_path, capsys):
    """`compile --kv-cache --decode gqa-unpacked` keeps the unpacked step, and --explain says why;
    the default packs. Counted on the written graphs: GroupQueryAttention with do_rotary only when packed."""
    import onnx

    from conftest import cli

    sets = ["--set", "layers=1", "--set", "d=64", "--set", "heads=2", "--set", "kv_heads=1", "--set", "vocab=40",
            "--set", "ctx=64", "--set", "d_ff=96"]

    def rotary_gqa(decode):
        out = tmp_path / f"{decode}.onnx"
        rc, _, err = cli(capsys, "compile", "llama", *sets, "--kv-cache", "--decode", decode, "--explain", "-o", out)
        assert rc == 0, err
        model = onnx.load(str(out), load_external_data=False)
        nodes = [n for n in model.graph.node] + [n for g in model.graph.node for a in g.attribute if a.g
                                                   for n in a.g.node]
        return err, [n for n in nodes if n.op_type == "GroupQueryAttention"
                     and any(a.name == "do_rotary" and a.i == 1 for a in n.attribute)]

    err, packed = rotary_gqa("auto")
    assert packed
    err, unpacked = rotary_gqa("gqa-unpacked")
    assert not unpacked and "--decode gqa-unpacked" in err


def test_a_huge_context_keeps_the_unpacked_step(tmp_path, capsys):
    """The cos/sin caches hold every trained position: a context of 10^8 positions (6.4 GB of tables at
    head size 16) is refused for packing with its size, and the step stays unpacked."""
    from conftest import cli

    sets = ["--set", "layers=1", "--set", "d=64", "--set", "heads=4", "--set", "kv_heads=2", "--set", "vocab=40",
            "--set", f"ctx={10 ** 8}", "--set", "d_ff=96"]
    rc, _, err = cli(capsys, "compile", "llama", *sets, "--kv-cache", "--explain", "-o", tmp_path / "big.onnx")
    need = 10 ** 8 * 16 * 4
    assert rc == 0, err
    assert f"cos/sin caches for a context of {10 ** 8:,} positions would take {need:,} bytes" in err
