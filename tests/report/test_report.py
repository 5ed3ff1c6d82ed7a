"""The static cost report: the seed's numbers, MoE, KV cache, formulas, devices, formats, CLI.

Every expected number here is derived in a comment from the model's shape, not
copied from the report.
"""

from __future__ import annotations

import csv
import io
import json
from fractions import Fraction
from pathlib import Path

import pytest

from conftest import MODELS, build
from tessera.compiler.analysis import cost, costreport, roofline
from tessera.compiler.ir import dims
from tessera.runtime.cli import main

GPT2 = MODELS / "gpt2.tsr"


def report(spec, variant=None, *, batch=1, seq=1024, dtype="fp32", device="h200", **overrides):
    g = build(spec, variant, **overrides)
    dev = roofline.get_device(device) if device else None
    return costreport.build_report(g, g.name, variant, overrides, batch=batch, seq=seq, dtype=dtype, device=dev)


@pytest.fixture(scope="module")
def gpt2_small():
    return report("gpt2", "small")


# ---------------------------------------------------------------- GPT-2 small, the seed's numbers
def test_gpt2_small_parameters_and_the_seed_table(gpt2_small):
    p = gpt2_small["params"]
    assert p["total"] == 124_439_808
    assert p["active_per_token"] == p["total"] and p["moe"] is None
    # the seed's table, line for line: attention 4D²+4D, MLP 8D²+5D, two norms 4D, one layer, 12 layers,
    # token embeddings 50,257 x 768, position embeddings 1,024 x 768, final norm 2D, total
    assert [r["params"] for r in p["table"]] == [2_362_368, 4_722_432, 3_072, 7_087_872, 85_054_464,
                                                 38_597_376, 786_432, 1_536, 124_439_808]
    labels = [r["label"] for r in p["table"]]
    assert labels[0] == "layers.0.attn (causal self-attention)"
    assert labels[2] == "layers.0.ln_1 + ln_2 (2 norms)"
    assert labels[4] == "12 layers (layers.0–11)"
    assert labels[5] == "wte (embedding 50,257 × 768)"
    assert p["tied"] == {"wte.weight": ["wte", "head"]}
    assert "tied: wte.weight is shared by wte, head (counted once)" in gpt2_small["notes"]


def test_gpt2_small_multiply_adds(gpt2_small):
    m = gpt2_small["macs"]
    d, n, layers, vocab = 768, 1024, 12, 50257
    weights = layers * 12 * d * d * n            # q, k, v, o (4D²) and MLP (8D²) per token
    attention = layers * 2 * n * n * d           # scores and weighting, every pair
    head = n * d * vocab                         # tied head at every position
    assert (m["weights"], m["attention"], m["head"]) == (weights, attention, head)
    assert (weights, attention, head) == (86_973_087_744, 19_327_352_832, 39_523_713_024)
    assert m["total"] == 145_824_153_600 == weights + attention + head
    assert m["per_token"] == 142_406_400         # the seed's "about 142 million per token"
    assert m["without_head"] == weights + attention
    pairs = n * (n + 1) // 2                     # causal: query i sees keys 0..i
    assert m["attention_causal"] == layers * 2 * pairs * d
    assert m["causal"] == weights + layers * 2 * pairs * d + head
    assert m["per_layer"]["layers.0"] == {"total": 12 * d * d * n + 2 * n * n * d, "weights": 12 * d * d * n,
                                          "attention": 2 * n * n * d, "attention_causal": 2 * pairs * d}
    assert len(m["per_layer"]) == 12
    assert m["uncounted_ops"] == []


def test_gpt2_small_formulas_and_crossover(gpt2_small):
    f = gpt2_small["macs"]["formulas"]
    # a = 12 layers x 12D² + V·D per token, b = 12 layers x 2D per N²
    a, b = 12 * 12 * 768 * 768 + 50257 * 768, 12 * 2 * 768
    assert f["total"] == f"B·({a}·N + {b}·N²)" == "B·(123532032·N + 18432·N²)"
    assert f["attention_causal"] == "B·(9216·N + 9216·N²)"
    assert f["per_token"] == f"{a} + {b}·N"
    # the N² part equals the rest where b·N = a
    assert gpt2_small["macs"]["crossover_seq"] == round(a / b, 2) == 6702.04
    # causal: b/2·N(N+1) = a·N  ->  N = 2a/b - 1
    assert gpt2_small["macs"]["crossover_seq_causal"] == round(2 * a / b - 1, 2)


def test_gpt2_small_memory(gpt2_small):
    mem = gpt2_small["memory"]
    assert mem["kv_cache_bytes"] == 75_497_472 == 2 * 12 * 12 * 64 * 1024 * 4   # K and V, layers, heads, hd, N, fp32
    assert mem["kv_cache_bytes_per_token"] == 73_728
    assert mem["kv_cache_attentions"] == 12
    assert mem["weights_bytes"] == 124_439_808 * 4
    assert mem["weights_bytes_by_dtype"] == {"fp32": 497_759_232, "fp16": 248_879_616, "bf16": 248_879_616}
    t = mem["training"]
    assert t["weights"] + t["gradients"] + t["optimizer"] + t["master_weights"] == 16 * 124_439_808
    # N x N probabilities of 12 heads in 12 layers are kept only without fusion
    assert mem["formulas"]["training.activations"].endswith("576·N²)")
    assert "N²" not in mem["formulas"]["training.activations_fused"]
    # the logits (B·N·V) dominate inference at N = 1024; the N x N scores take over at longer N
    assert mem["activations_peak_bytes"]["unfused"] == 1024 * (50257 + 768) * 4
    long = report("gpt2", "small", seq=8192, device=None)["memory"]["activations_peak_bytes"]
    assert long["unfused"] > long["fused"]


def test_per_token_kv_cache_respects_grouped_query_heads():
    # 2 (K, V) x 32 layers x kv_heads x 128 x 4 bytes
    assert report("llama", "llama2_7b", device=None)["memory"]["kv_cache_bytes_per_token"] == 2 * 32 * 32 * 128 * 4
    assert report("llama", "llama3_8b", device=None)["memory"]["kv_cache_bytes_per_token"] == 2 * 32 * 8 * 128 * 4


# ---------------------------------------------------------------- mixture of experts
def test_mixtral_total_and_active_parameters():
    rep = report("mixtral", "8x7b", device=None)
    p = rep["params"]
    assert p["total"] == 46_702_792_704
    expert = 3 * 4096 * 14336                     # gate, up, down of one SwiGLU expert
    assert p["moe"]["params_per_expert"] == expert
    assert p["moe"]["experts"] == 8 and p["moe"]["top"] == 2 and p["moe"]["blocks"] == 32
    assert p["active_per_token"] == 46_702_792_704 - 32 * 6 * expert == 12_879_925_248
    m = rep["macs"]
    assert m["per_token"] - m["active_per_token"] == 32 * 6 * expert   # one MAC per unused weight per token
    assert any("computes all 8 experts" in n for n in rep["notes"])


# ---------------------------------------------------------------- the seed's problems as small specs
SPECS = Path(__file__).resolve().parents[1] / "specs"
SINGLE_HEAD = (SPECS / "problem_12_2_single_head.tsr").read_text()

STACK = (SPECS / "problem_12_6_stack.tsr").read_text()

PATCHES = """
model Patches(image = 224, patch = 16, d = 768, heads = 12) {
  let n = (image / patch) * (image / patch)
  in pixels: f32[B, 3, image, image]
  out y: f32[B, n, d]
  p = conv2d(pixels, d, patch, stride=patch, name="patch")
  h = transpose(reshape(p, [B, d, n]))
  y = attention(h, heads, name="attn")
}
"""


def _spec(tmp_path: Path, text: str) -> str:
    path = tmp_path / "spec.tsr"
    path.write_text(text)
    return str(path)


def test_problem_12_2_single_head_parameters_do_not_depend_on_n(tmp_path):
    spec = _spec(tmp_path, SINGLE_HEAD)
    r1, r2 = report(spec, seq=1024, device=None), report(spec, seq=2048, device=None)
    assert r1["params"]["total"] == r2["params"]["total"] == 2 * 64 * 512 + 512**2 + 2 * 64 + 512 == 328_320
    assert r1["settings"]["sequence_symbols"] == ["N"]
    # the attention products (N² Dq + N² D) grow four-fold, the projections two-fold
    assert r2["macs"]["attention"] == 4 * r1["macs"]["attention"]
    assert r2["macs"]["weights"] == 2 * r1["macs"]["weights"]


def test_problem_12_6_twenty_four_layers_of_width_1024(tmp_path):
    rep = report(_spec(tmp_path, STACK), device=None)
    d = 1024
    assert rep["params"]["per_layer"]["layers.0"]["total"] == 12 * d * d + 13 * d
    assert rep["params"]["total"] == 24 * (12 * d * d + 13 * d) == 302_309_376


def test_problem_12_7_smaller_patches(tmp_path):
    spec = _spec(tmp_path, PATCHES)
    r16 = report(spec, patch=16, device=None)
    r14 = report(spec, patch=14, device=None)
    assert r16["settings"]["tokens_per_sequence"] == 196
    assert r14["settings"]["tokens_per_sequence"] == 256 == 16**2
    ratio = Fraction(r14["macs"]["attention"], r16["macs"]["attention"])
    assert ratio == Fraction(256, 196) ** 2
    assert round(float(ratio), 2) == 1.71
    assert any("no sequence symbol" in n for n in r14["notes"])


# ---------------------------------------------------------------- other shapes of model
def test_encoder_decoder_binds_both_sequences_and_caches_cross_attention():
    rep = report("transformer", "base", device=None)
    assert rep["settings"]["sequence_symbols"] == ["S", "T"]
    # decoder self-attention and cross-attention, 6 layers each, K and V of width 512, fp32
    assert rep["memory"]["kv_cache_attentions"] == 12
    assert rep["memory"]["kv_cache_bytes_per_token"] == 12 * 2 * 512 * 4
    assert any("S, T are all bound to N" in n for n in rep["notes"])


def test_worked_example_has_no_batch_and_no_parameters():
    rep = report(str(MODELS / "worked_example.tsr"), "causal", seq=3, device=None)
    assert rep["params"]["total"] == 0
    # q, k, v: 3 x (N x 2 x 2); scores and weighting: 2 x N² x 2; causal: 2 x 6 pairs x 2
    assert rep["macs"]["weights"] == 3 * 3 * 2 * 2
    assert rep["macs"]["attention"] == 2 * 9 * 2
    assert rep["macs"]["attention_causal"] == 2 * 6 * 2
    assert rep["macs"]["formulas"]["total"] == "12·N + 4·N²"
    assert any("no batch symbol" in n for n in rep["notes"])


def test_an_unknown_op_is_listed_as_uncounted_not_fatal():
    """A later pass may add ops the report has no rule for; it counts them as 0 and says so."""
    g = build("gpt2", None, layers=1, d=32, heads=4, vocab=50, ctx=16)
    x = g.values["layers.0.attn/split_heads"]
    g.add_node("mystery_kernel", [x.name, x.name], [x.type], {}, "layers.0.attn", None)
    rep = costreport.build_report(g, "GPT2", None, {}, device=roofline.get_device("h100"))
    assert rep["macs"]["uncounted_ops"] == [{"op": "mystery_kernel", "nodes": ["layers.0.attn/mystery_kernel"]}]
    assert any("uncounted ops" in n and "mystery_kernel" in n for n in rep["notes"])


@pytest.mark.parametrize("spec,overrides", [
    ("gpt2", dict(layers=2, d=64, heads=4, vocab=100, ctx=64)),
    ("llama", dict(layers=2, d=64, heads=4, kv_heads=2, vocab=100, d_ff=96)),
    ("transformer", dict(layers=2, d=64, heads=4, vocab=100, d_ff=96)),
])
def test_fusing_attention_changes_no_count(spec, overrides):
    """After the fusion pass (fused_attention nodes) the work is the same; the graph as written now
    holds no N x N scores, so its peak is the unfused graph's fused figure."""
    from tessera.compiler.passes.pipeline import optimize

    g = build(spec, None, **overrides)
    before = costreport.build_report(g, spec, None, {}, seq=64)
    assert any(s.fused for s in optimize(g))
    assert any(n.op == "fused_attention" for n in g.nodes.values())
    after = costreport.build_report(g, spec, None, {}, seq=64)
    for section, keys in [("params", ["total"]), ("macs", ["total", "causal", "attention", "attention_causal",
                                                           "weights", "head"]),
                          ("flops", ["total", "causal"]), ("memory", ["kv_cache_bytes"])]:
        for k in keys:
            assert after[section][k] == before[section][k], (section, k)
    assert after["macs"]["uncounted_ops"] == []
    assert after["memory"]["activations_peak_bytes"]["unfused"] == before["memory"]["activations_peak_bytes"]["fused"]
    assert after["memory"]["training"]["activations"] == before["memory"]["training"]["activations_fused"]


def test_costs_stay_symbolic():
    g = build("gpt2", "small")
    costs, _ = cost.node_costs(g)
    total = cost.total(costs)
    b, t = dims.symbol("B"), dims.symbol("T")
    expected = b * (123_532_032 * t + 18_432 * t**2)
    assert (total.to_sympy() - expected).expand() == 0
    assert total.evaluate({"B": 3, "T": 100}) == 3 * (123_532_032 * 100 + 18_432 * 100**2)


def test_a_non_polynomial_dimension_is_a_clear_error():
    from tessera.compiler.analysis.poly import Poly

    with pytest.raises(ValueError, match="not a polynomial"):
        Poly.from_dim(dims.symbol("T") ** -1)


# ---------------------------------------------------------------- devices
def test_device_file_has_sources_and_datasheet_figures():
    table = roofline.load_devices()
    assert {"h200", "h100", "a100"} <= set(table)
    for name, d in table.items():
        assert d["source"].strip() and d["bandwidth"] > 0 and d["flops"]["bf16"] > 0, name
    h200, h100, a100 = (roofline.get_device(n) for n in ("h200", "h100", "a100"))
    assert (h200.flops["bf16"], h200.bandwidth) == (989.4e12, 4.8e12)
    assert (h100.flops["bf16"], h100.bandwidth) == (989.4e12, 3.35e12)
    assert (a100.flops["bf16"], a100.bandwidth) == (312e12, 2.039e12)


def test_cpu_is_measured_on_the_spot():
    cpu = roofline.probe_cpu(n=256, copy_mib=8)   # the same probe, smaller (the command uses 1024, 64 MiB)
    assert cpu.measured and cpu.flops["fp32"] > 0 and cpu.bandwidth > 0
    assert "measured" in cpu.source and cpu.name == "cpu"


def test_roofline_of_gpt2_small(gpt2_small):
    r = gpt2_small["roofline"]
    assert r["device"]["name"] == "h200"
    assert r["ridge_intensity"] == round(67e12 / 4.8e12, 3)
    assert 0 < r["prefill_seconds"]["fused"] < r["prefill_seconds"]["unfused"]
    assert r["decode_seconds_per_token"] > 0
    ops = {o["name"]: o for o in r["ops"]}
    assert ops["layers.*.mlp.fc"]["count"] == 12 and ops["layers.*.mlp.fc"]["bound"] == "compute"
    assert ops["layers.*.attn.sdpa/softmax"]["bound"] == "memory"
    # a decode step reads every weight once: at least weights / bandwidth
    assert r["decode_seconds_per_token"] >= 124_439_808 * 4 / 4.8e12


# ---------------------------------------------------------------- the command
TINY = ["--set", "layers=2", "--set", "d=64", "--set", "heads=4", "--set", "vocab=100", "--set", "ctx=64"]


def cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_json_has_the_documented_top_level_keys(capsys):
    rc, out, _ = cli(capsys, "report", GPT2, *TINY, "--seq", "32", "--batch", "2", "--format", "json")
    assert rc == 0
    rep = json.loads(out)
    assert list(rep) == ["schema", "model", "variant", "hyperparams", "settings", "params", "macs", "flops",
                         "memory", "roofline", "notes", "attention"]
    assert rep["settings"]["bindings"] == {"B": 2, "T": 32}
    d, n, b = 64, 32, 2
    assert rep["macs"]["attention"] == b * 2 * 2 * n * n * d


def test_cli_markdown_and_csv(capsys):
    rc, md, _ = cli(capsys, "report", GPT2, *TINY, "--format", "md")
    assert rc == 0 and md.startswith("# GPT2: B=1, N=1024, fp32, device h200")
    assert "## Multiply-adds (MACs), one forward pass" in md and "| total |" in md
    rc, text, _ = cli(capsys, "report", GPT2, *TINY, "--format", "csv", "--dtype", "bf16")
    assert rc == 0
    rows = {r["key"]: r for r in csv.DictReader(io.StringIO(text))}
    assert rows["settings.dtype"]["value"] == "bf16"
    assert rows["macs.total"]["formula"].startswith("B·(")
    assert rows["memory.kv_cache_bytes"]["formula"].endswith("·B·N")
    assert rows["memory.training.total"]["formula"]


def test_cli_table(capsys):
    rc, out, _ = cli(capsys, "report", GPT2, *TINY, "--device", "a100")
    assert rc == 0
    assert "Roofline on a100" in out and "Multiply-adds" in out


@pytest.mark.parametrize("args,message", [
    (["--device", "tpu"], "error: unknown device 'tpu' (known: h200, h100, a100, cpu)"),
    (["--seq", "0"], "error: --seq must be at least 1, got 0"),
    (["--batch", "-1"], "error: --batch must be at least 1, got -1"),
])
def test_cli_bad_values(capsys, args, message):
    rc, _, err = cli(capsys, "report", GPT2, *TINY, *args)
    assert rc == 2 and err.strip() == message


def test_cli_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    rc, _, err = cli(capsys, "report", GPT2, *TINY, "--format", "json", "--plot", png)
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in err


def test_cli_plot_without_matplotlib_says_how_to_get_it(capsys, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, _, err = cli(capsys, "report", GPT2, *TINY, "--plot", tmp_path / "p.png")
    assert rc == 2 and "pip install 'tessera[plot]'" in err


def test_report_allocates_no_weights(capsys, monkeypatch):
    import tessera.runtime.pipeline as pipeline

    def forbidden(*a, **k):
        raise AssertionError("the report must not create weights")

    monkeypatch.setattr(pipeline, "init_weights", forbidden)
    monkeypatch.setattr(pipeline, "SeededWeights", forbidden)
    monkeypatch.setattr(pipeline, "load_weights", forbidden)
    rc, out, _ = cli(capsys, "report", GPT2, "--variant", "xl", "--format", "json")
    assert rc == 0 and json.loads(out)["params"]["total"] == 1_557_611_200
