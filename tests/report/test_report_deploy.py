"""Deployment figures of `tessera report` (parallel splits, training per device, serving, sweeps),
each against a hand formula written here from the model's published shape, not from the code."""

from __future__ import annotations

import json

import pytest

from conftest import cli, cli_error


def report(capsys, *args) -> dict:
    rc, out, err = cli(capsys, "report", *args, "--format", "json")
    assert rc == 0, err
    return json.loads(out)


# ------------------------------------------------------------------ Llama-2-7B at --tp 2 --pp 2
def test_llama2_7b_tp2_pp2(capsys):
    r = report(capsys, "llama", "--variant", "llama2_7b", "--tp", "2", "--pp", "2", "--dtype", "fp16",
               "--batch", "2", "--seq", "512")
    h, f, V, L, a, hd, t, B, N, e = 4096, 11008, 32000, 32, 32, 128, 2, 2, 512, 2
    layer = (4 * h * h + 3 * h * f) // t + 2 * h          # projections split T ways, the two norms replicated
    first = 16 * layer + V * h // t                         # stage 0: embedding (vocabulary rows split)
    last = 16 * layer + h + V * h // t                      # stage 1: final norm, untied head
    par = r["parallel"]
    assert par["plan"]["layers_per_stage"] == [16, 16] and par["plan"]["devices"] == 4
    assert par["per_device"]["params"] == max(first, last) == last
    assert par["per_device"]["weights_bytes"] == last * e
    # K and V of 16 layers, 32/2 heads of 128, at B x N
    assert par["per_device"]["kv_cache_bytes"] == 16 * 2 * (a // t) * hd * B * N * e
    c = par["comm_bytes_per_step"]
    # two ring all-reduces of B·N·h per layer, each sending 2(T-1)/T of the message; 16 layers
    assert c["tensor_parallel"] == 16 * 2 * 2 * (t - 1) * B * N * h * e // t
    assert c["pipeline"] == B * N * h * e                    # the activations to the next stage
    assert c["data_parallel"] == 0 and c["expert_parallel"] == 0
    assert c["total"] == c["tensor_parallel"] + c["pipeline"]
    # inference activations: the peak of one pass, at the SwiGLU product: the residual stream (h), the gate
    # and up projections and silu(gate) (3 x f) per token (more than the logits' 32,000), split T ways
    assert par["per_device"]["activations_bytes_fused"] == B * N * (h + 3 * f) * e // t
    # as written, the peak is at the softmax: the scores and the probabilities (2 x a x N² per sequence),
    # the residual stream and V (2 x h per token)
    assert par["per_device"]["activations_bytes"] == B * (2 * h * N + 2 * a * N * N) * e // t
    assert par["formulas"]["per_device.kv_cache_bytes"] == "131072·B·N"


# ------------------------------------------------------------------ GPT-3 training (Korthikanti et al. 2022)
GPT3 = ["gpt2", "--variant", "gpt3", "--dtype", "fp16", "--tp", "8", "--pp", "8", "--dp", "4", "--train"]


def gpt3_params_per_device():
    h, V, ctx, t = 12288, 50257, 2048, 8
    layer = (12 * h * h + 9 * h) // t + 4 * h   # q,k,v,o, fc, proj and their biases split; 2 layernorms replicated
    first = 12 * layer + -(-V * h // t) + ctx * h   # token embedding split by rows (rounded up), positions replicated
    last = 12 * layer + 2 * h + -(-V * h // t)      # final norm; the head ties the embedding: a copy on the last stage
    return max(first, last)


@pytest.mark.parametrize("recompute", ["selective", "none", "full"])
def test_gpt3_training_zero1(capsys, recompute):
    r = report(capsys, *GPT3, "--zero", "1", "--recompute", recompute, "--batch", "1", "--seq", "2048")
    s, b, h, a, L, t, d, p = 2048, 1, 12288, 96, 96, 8, 4, 8
    phi = gpt3_params_per_device()
    tr = r["memory"]["training"]["per_device"]
    assert tr["weights"] == 2 * phi and tr["gradients"] == 2 * phi          # fp16, not sharded by ZeRO-1
    assert tr["optimizer"] == -(-8 * phi // d)                              # Adam moments over D
    assert tr["master_weights"] == -(-4 * phi // d)                         # fp32 master copy over D
    # Korthikanti Table 2, tensor + sequence parallel; 1F1B: the first stage holds P micro-batches of L/P layers
    per_layer = {"none": s * b * h * (34 + 5 * a * s / h) / t, "selective": 34 * s * b * h / t,
                 "full": 2 * s * b * h / t}[recompute]
    assert tr["activations"] == pytest.approx(L * per_layer, rel=1e-12)
    if recompute == "none":  # fused attention: no scores, one fp32 log-sum-exp per query row and head
        assert tr["activations_fused"] == L * (34 * s * b * h + 4 * a * s * b) // t
    else:
        assert tr["activations_fused"] == tr["activations"]
    assert tr["total"] == tr["weights"] + tr["gradients"] + tr["optimizer"] + tr["master_weights"] + tr["activations"]
    c = r["parallel"]["comm_bytes_per_step"]
    assert c["data_parallel"] == 2 * (d - 1) * 2 * phi // d                  # ring all-reduce of fp16 gradients
    assert c["tensor_parallel"] == 12 * 4 * 2 * (t - 1) * s * b * h * 2 // t  # 2 forward + 2 backward per layer
    assert c["pipeline"] == 2 * s * b * h * 2                                # activations forward, gradients back


@pytest.mark.parametrize("zero", [2, 3])
def test_gpt3_zero_stages(capsys, zero):
    r = report(capsys, *GPT3, "--zero", str(zero), "--seq", "2048")
    tr = r["memory"]["training"]["per_device"]
    phi, d = gpt3_params_per_device(), 4
    assert tr["gradients"] == -(-2 * phi // d)
    assert tr["weights"] == (-(-2 * phi // d) if zero == 3 else 2 * phi)
    # ZeRO-2 reduce-scatters the gradients and all-gathers the updated weights: a ring all-reduce's bytes;
    # ZeRO-3 also all-gathers the weights for forward and backward: 1.5 times that (the ZeRO paper)
    factor = 3 if zero == 3 else 2
    assert r["parallel"]["comm_bytes_per_step"]["data_parallel"] == factor * (d - 1) * 2 * phi // d


# ------------------------------------------------------------------ Mixtral at --ep 8
def test_mixtral_ep8(capsys):
    r = report(capsys, "mixtral", "--ep", "8", "--dtype", "bf16", "--batch", "1", "--seq", "1024")
    h, f, V, L, E, k, kv, hd, ep, N = 4096, 14336, 32000, 32, 8, 2, 8, 128, 8, 1024
    layer_dense = 2 * h * h + 2 * h * kv * hd + E * h + 2 * h       # attention, router, two norms
    experts = E * 3 * h * f // ep                                     # one of the 8 experts per device
    params = L * (layer_dense + experts) + 2 * V * h + h
    par = r["parallel"]
    assert par["per_device"]["params"] == params
    assert par["plan"]["devices"] == 8
    # all-to-all: each token's h values to its top-2 experts and back, 7/8 of them leave the device
    assert par["comm_bytes_per_step"]["expert_parallel"] == L * 2 * k * N * h * 2 * (ep - 1) // ep
    assert par["per_device"]["kv_cache_bytes"] == L * 2 * kv * hd * N * 2


# ------------------------------------------------------------------ serving capacity
def test_serving_llama2_7b_tp2(capsys):
    ctx, t, e = 4096, 2, 2
    r = report(capsys, "llama", "--variant", "llama2_7b", "--dtype", "fp16", "--tp", "2", "--serve",
               "--context", str(ctx), "--device", "h200")
    h, f, V, L, a, hd = 4096, 11008, 32000, 32, 32, 128
    weights = (L * ((4 * h * h + 3 * h * f) // t + 2 * h) + h + 2 * V * h // t) * e
    kv = L * 2 * (a // t) * hd * ctx * e
    act = (h + 3 * f) * e // t              # one token's peak: residual, gate, up, silu(gate); split T ways
    memory = 141e9                          # H200, devices.toml
    sv = r["serving"]
    assert sv["weights_bytes"] == weights and sv["kv_cache_bytes_per_sequence"] == kv
    assert sv["activations_bytes_per_sequence"] == act
    assert sv["max_batch"] == (int(memory * 0.9) - weights) // (kv + act)
    # decoding is memory-bound: each rank reads its weights and its share of the caches once per step
    # (the roofline also moves the graph's score rows, B x a x N per layer through scale, mask and softmax,
    # about 3.5 % more here, and the small activations: so the hand figure is a lower bound within 5 %)
    step = (weights + sv["max_batch"] * kv) / 4.8e12
    assert step <= sv["decode_step_s"] <= step * 1.05
    assert sv["decode_tokens_per_s"] == pytest.approx(sv["max_batch"] / sv["decode_step_s"])
    assert sv["decode_tokens_per_s_per_sequence"] == pytest.approx(1 / sv["decode_step_s"])
    # prefill of one 4096-token prompt is compute-bound: 2 FLOPs per weight per token, plus causal attention
    flops = 2 * ctx * (L * (4 * h * h + 3 * h * f) + V * h) + L * 2 * 2 * h * ctx * (ctx + 1) // 2
    # (the roofline adds the memory-bound element-wise ops, norms, rotary, silu, residuals: about 14 % here)
    assert flops / 989.4e12 / t <= sv["ttft_s"] <= 1.2 * flops / 989.4e12 / t


# ------------------------------------------------------------------ sweeps and formats
def test_sweep_rows(capsys):
    r = report(capsys, "gpt2", "--variant", "small", "--seq", "128,1024", "--batch", "1,8")
    rows = r["sweep"]
    assert [(x["batch"], x["seq"]) for x in rows] == [(1, 128), (1, 1024), (8, 128), (8, 1024)]
    for x in rows:  # GPT-2 small: 2 x 12 layers x 768 x N x 4 bytes of K and V per sequence
        assert x["kv_cache_bytes"] == 2 * 12 * 768 * x["seq"] * x["batch"] * 4
        assert x["macs_total"] == x["batch"] * (123532032 * x["seq"] + 18432 * x["seq"] ** 2)


def test_formats_show_the_deployment_figures(capsys):
    args = ["llama", "--variant", "llama2_7b", "--tp", "2", "--pp", "2", "--dtype", "fp16", "--seq", "512"]
    r = report(capsys, *args)
    kv = r["parallel"]["per_device"]["kv_cache_bytes"]
    _, md, _ = cli(capsys, "report", *args, "--format", "md")
    assert f"| KV cache at N | {kv:,} |" in md
    _, csv, _ = cli(capsys, "report", *args, "--format", "csv")
    assert f"parallel.per_device.kv_cache_bytes,{kv},131072·B·N" in csv
    _, table, _ = cli(capsys, "report", *args)
    assert f"{kv:,}" in table


# ------------------------------------------------------------------ bad combinations
@pytest.mark.parametrize("args, message", [
    (["llama", "--variant", "llama2_7b", "--tp", "3"], "--tp 3 does not divide the 32 attention heads"),
    (["mixtral", "--tp", "16"], "--tp 16 does not divide the 8 key/value heads"),
    (["gpt2", "--variant", "small", "--pp", "13"], "--pp 13 is more pipeline stages than the model's 12 layers"),
    (["gpt2", "--variant", "small", "--train", "--zero", "2"], "--zero 2 shards over data-parallel replicas"),
    (["gpt2", "--variant", "small", "--serve", "--context", "2048"],
     "--context 2048 is longer than the 1024 positions"),
    (["gpt2", "--variant", "small", "--serve"], "--serve needs --context"),
    (["mixtral", "--ep", "3"], "--ep 3 does not divide the 8 experts"),
    (["bert", "--serve", "--context", "128"], "the model has no causal attention"),
    (["gpt2", "--variant", "small", "--ep", "2"], "the model has no mixture of experts"),
    (["gpt2", "--variant", "small", "--recompute", "full"], "add --train"),
    (["gpt2", "--variant", "small", "--tp", "0"], "--tp must be at least 1"),
])
def test_bad_plans_are_usage_errors(capsys, args, message):
    assert message in cli_error(capsys, "report", *args)


def test_bad_sweep_list_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's own usage error, exit status 2
        cli(capsys, "report", "gpt2", "--variant", "small", "--seq", "128,x")
    assert e.value.code == 2
    assert "integers separated by commas, got '128,x'" in capsys.readouterr().err


# ------------------------------------------------------------------ --plot with a plan
TINY_GPT2 = ["gpt2", "--set", "layers=2", "--set", "d=64", "--set", "heads=4", "--set", "vocab=100", "--set", "ctx=64"]


def test_plot_draws_the_largest_device(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    rc, _, err = cli(capsys, "report", *TINY_GPT2, "--seq", "32", "--tp", "2", "--pp", "2", "--plot", png)
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", err


def test_plot_curve_at_n_is_the_reported_device(capsys):
    """The plotted per-device memory at the report's own N is the sum the JSON reports (two code paths)."""
    from tessera.compiler.analysis.deployment import curves
    from tessera.runtime import pipeline

    r = report(capsys, *TINY_GPT2, "--seq", "32", "--tp", "2", "--pp", "2", "--dp", "2", "--train", "--zero", "2")
    graph = pipeline.build("gpt2", None, ["layers=2", "d=64", "heads=4", "vocab=100", "ctx=64"]).graph
    c = curves(graph, r, [16, 32])
    assert c["device_memory"][1] == r["memory"]["training"]["per_device"]["total"]
    assert c["prefill_seconds"][1] == pytest.approx(r["roofline"]["prefill_seconds"]["fused"] / 2)


# ------------------------------------------------------------------ the Python API takes the same plan
TINY_SETS = {"layers": 2, "d": 64, "heads": 4, "vocab": 100, "ctx": 64}


def test_the_api_report_takes_the_plan_and_the_sweep(capsys):
    """Model.report's keywords are the command's flags (runtime/options.ReportOptions): the same plan gives
    the same deployment sections, and lists for batch and seq sweep."""
    import tessera

    args = ["--seq", "32", "--tp", "2", "--pp", "2", "--dp", "2", "--train", "--zero", "2", "--recompute", "selective"]
    cli_rep = report(capsys, *TINY_GPT2, *args)
    model = tessera.load("gpt2", **TINY_SETS)
    py = model.report(seq=32, tp=2, pp=2, dp=2, train=True, zero=2, recompute="selective")
    assert py["parallel"] == cli_rep["parallel"]
    assert py["memory"]["training"] == cli_rep["memory"]["training"]
    assert py["parallel"]["plan"]["layers_per_stage"] == [1, 1] and py["parallel"]["plan"]["devices"] == 8
    rows = model.report(batch=[1, 3], seq=[16, 32])["sweep"]
    assert [(x["batch"], x["seq"]) for x in rows] == [(1, 16), (1, 32), (3, 16), (3, 32)]
    for x in rows:  # K and V: 2 layers x 64 wide x N x B, fp32
        assert x["kv_cache_bytes"] == 2 * 2 * 64 * x["seq"] * x["batch"] * 4
    sv = model.report(serve=True, context=64, dtype="fp16")["serving"]
    assert sv["context"] == 64 and sv["kv_cache_bytes_per_sequence"] == 2 * 2 * 64 * 64 * 2


@pytest.mark.parametrize("kwargs, message", [
    ({"train": True, "zero": 1}, "zero 1 shards over data-parallel replicas: it needs dp 2 or more"),
    ({"recompute": "full"}, "zero and recompute describe training: add train"),
    ({"serve": True}, "serve needs context N"),
    ({"context": 32}, "context is the serving context: add serve"),
    ({"train": True, "serve": True, "context": 8}, "train and serve plan different things"),
    ({"tp": 0}, "tp must be at least 1, got 0"),
    ({"tp": 1.5}, "tp must be an integer, got 1.5"),
    ({"zero": "1"}, "zero must be an integer, got '1'"),
    ({"recompute": "some"}, "recompute must be one of none, selective, full, got 'some'"),
    ({"train": "yes"}, "train must be True or False, got 'yes'"),
    ({"batch": [1, "x"]}, "batch must be an integer or a non-empty list of integers"),
    ({"seq": []}, "seq must be an integer or a non-empty list of integers"),
    ({"seq": [16, 0]}, "seq must be at least 1, got 0"),
])
def test_bad_options_are_refused_before_the_spec_is_built(kwargs, message):
    """The rules between the options (runtime/options.ReportOptions.check) name the API's keywords."""
    from tessera.runtime.options import ReportOptions, UsageError

    with pytest.raises(UsageError, match="^" + message.replace("(", r"\(")):
        ReportOptions(**kwargs).for_api().check()


def test_bad_sweep_value_is_a_usage_error(capsys):
    assert "--batch must be at least 1, got 0" in cli_error(capsys, "report", *TINY_GPT2, "--batch", "1,0")


def test_the_flags_fill_the_options():
    from tessera.runtime.cli import make_parser
    from tessera.runtime.options import ReportOptions

    ns = make_parser().parse_args(["report", "gpt2", "--seq", "128,1024", "--batch", "4", "--tp", "2", "--dp", "4",
                                   "--train", "--zero", "3", "--recompute", "full"])
    o = ReportOptions.from_args(ns)
    assert (o.seq, o.batch, o.seqs, o.batches, o.sweep) == ([128, 1024], 4, [128, 1024], [4], True)
    assert (o.plan.tp, o.plan.pp, o.plan.dp, o.plan.zero, o.plan.recompute, o.plan.train) == (2, 1, 4, 3, "full", True)
    assert ReportOptions().plan is None and not ReportOptions().sweep
