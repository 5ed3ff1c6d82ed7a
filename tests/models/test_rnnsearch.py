"""models/rnnsearch.tsr against a PyTorch RNNsearch written here from the paper (Bahdanau, Cho,
Bengio 2015, appendix A; the seed's eq. 9.2-9.4): nn.GRU encoder, additive attention, nn.GRUCell
decoder, maxout readout. Teacher forcing and 20 greedy steps; the reference's state_dict loads
through models/rnnsearch.hf.toml; parameter counts from the paper's sizes, counted by hand."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MODELS, build, ort_run
from tessera.compiler.analysis import cost
from tessera.compiler.analysis.poly import Poly
from tessera.compiler.passes.pipeline import attention_sites, build_pipeline
from tessera.compiler.ops import interpret
from tessera.runtime.io.weights import load_weights, name_map_for

torch = pytest.importorskip("torch")
nn = torch.nn

SMALL = dict(vocab_src=40, vocab_tgt=30, emb=8, hidden=6, dec=7, d_att=5, maxout_units=4)


class Ref(nn.Module):
    """RNNsearch in plain PyTorch: h = [fwd GRU; bwd GRU](E_x x), s_0 = tanh(W_s h<-_1),
    e_tj = v_a^T tanh(W_a s_{t-1} + U_a h_j), a = softmax_j(e), c_t = sum_j a_tj h_j,
    t~ = U_o s_{t-1} + V_o E y_{t-1} + C_o c_t, maxout over pairs, logits = W_o t,
    s_t = GRUCell([E y_{t-1}; c_t], s_{t-1})."""

    def __init__(self, vocab_src, vocab_tgt, emb, hidden, dec, d_att, maxout_units):
        super().__init__()
        self.l = maxout_units
        self.src_emb, self.tgt_emb = nn.Embedding(vocab_src, emb), nn.Embedding(vocab_tgt, emb)
        self.encoder = nn.GRU(emb, hidden, batch_first=True, bidirectional=True)
        self.init = nn.Linear(hidden, dec)
        self.U_a = nn.Linear(2 * hidden, d_att, bias=False)
        self.W_a = nn.Linear(dec, d_att, bias=False)
        self.v_a = nn.Linear(d_att, 1, bias=False)
        self.cell = nn.GRUCell(emb + 2 * hidden, dec)
        self.U_o = nn.Linear(dec, 2 * maxout_units)
        self.V_o = nn.Linear(emb, 2 * maxout_units, bias=False)
        self.C_o = nn.Linear(2 * hidden, 2 * maxout_units, bias=False)
        self.out = nn.Linear(maxout_units, vocab_tgt)
        self.hidden = hidden

    def encode(self, src):
        h, _ = self.encoder(self.src_emb(src))
        s = torch.tanh(self.init(h[:, 0, self.hidden:]))
        return h, self.U_a(h), s

    def step(self, s, y_prev, h, keys):
        y = self.tgt_emb(y_prev)
        e = self.v_a(torch.tanh(self.W_a(s)[:, None, :] + keys))[..., 0]     # eq. 9.2
        a = torch.softmax(e, dim=-1)                                          # eq. 9.3
        c = torch.bmm(a[:, None, :], h)[:, 0]                                 # eq. 9.4
        t = self.U_o(s) + self.V_o(y) + self.C_o(c)
        t = t.view(*t.shape[:-1], self.l, 2).max(-1).values
        return self.cell(torch.cat([y, c], -1), s), self.out(t), a

    def forward(self, src, tgt_in):
        h, keys, s = self.encode(src)
        logits, aligns = [], []
        for t in range(tgt_in.shape[1]):
            s, lg, a = self.step(s, tgt_in[:, t], h, keys)
            logits.append(lg)
            aligns.append(a)
        return torch.stack(logits, 1), torch.stack(aligns, 1)


@pytest.fixture(scope="module")
def ref():
    torch.manual_seed(0)
    m = Ref(**SMALL)
    for p in m.parameters():  # larger than PyTorch's default init, so the attention is not uniform
        nn.init.normal_(p, std=0.5)
    return m.eval()


@pytest.fixture(scope="module")
def ckpt(ref, tmp_path_factory):
    """The reference's state_dict under its own names, as safetensors."""
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("ckpt") / "rnnsearch.safetensors"
    save_file({k: v.detach().numpy().copy() for k, v in ref.state_dict().items()}, str(path))
    return path


@pytest.fixture(scope="module")
def weights(ckpt):
    """The reference's weights loaded through models/rnnsearch.hf.toml."""
    path = ckpt
    g = build("rnnsearch", "small")
    loaded = load_weights(g, path, name_map_for(MODELS / "rnnsearch.tsr"))
    return {p: np.asarray(loaded[p]) for p in g.params}


def _src_tgt(rng, b=2, s=5, t=6):
    return (rng.integers(0, SMALL["vocab_src"], (b, s)).astype(np.int64),
            rng.integers(0, SMALL["vocab_tgt"], (b, t)).astype(np.int64))


def test_teacher_forcing_equals_the_pytorch_reference(ref, weights, rng):
    src, tgt = _src_tgt(rng)
    with torch.no_grad():
        want_logits, want_align = (x.numpy() for x in ref(torch.from_numpy(src), torch.from_numpy(tgt)))
    g = build("rnnsearch", "small")
    got = interpret.run(g, weights, {"src": src, "tgt_in": tgt})
    np.testing.assert_allclose(got["logits"], want_logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got["align"], want_align, atol=1e-5, rtol=0)
    for mode in ("auto", "scan"):
        gg = g.copy()
        build_pipeline(recurrence=mode)(gg)
        y = ort_run(gg, weights, {"src": src, "tgt_in": tgt})
        np.testing.assert_allclose(y["logits"], want_logits, atol=1e-5, rtol=0, err_msg=mode)
        np.testing.assert_allclose(y["align"], want_align, atol=1e-5, rtol=0, err_msg=mode)
    assert want_align.std() > 0.01  # the weights are not uniform (1/S each): a wrong score would show


def test_attention_weights_sum_to_one_over_the_source(weights, rng):
    src, tgt = _src_tgt(rng, b=3, s=9, t=4)
    align = ort_run(build("rnnsearch", "small"), weights, {"src": src, "tgt_in": tgt})["align"]
    assert align.shape == (3, 4, 9) and (align >= 0).all()
    np.testing.assert_allclose(align.sum(-1), 1.0, atol=1e-6)


def _generic(weights, recurrence="auto"):
    """The training graph in the general cached form (generate's only path since issue 24): the encoder
    part and the cached decoder, whose scan carries s from the encoder part's s_0."""
    from tessera.compiler.passes.pipeline import PipelineOptions
    from tessera.runtime import pipeline
    from tessera.runtime.generation import cached as gen

    built = pipeline.build("rnnsearch", "small", [], None)
    enc, dec, info, boundary = gen.compile_seq2seq(built, weights, "tgt_in",
                                                   options=PipelineOptions(recurrence=recurrence))
    return gen.Seq2Seq(enc.SerializeToString(), gen.CachedModel(dec.SerializeToString(), info), boundary)


def test_greedy_decoding_20_steps_equals_pytorch(ref, weights, rng):
    """20 greedy steps through the general cached form; the alignment of each step is the training
    graph's, run on the decoded tokens (teacher forcing), equal to the reference's at each step."""
    from tessera.runtime.generation import cached as gen

    src, _ = _src_tgt(rng, b=2, s=7)
    bos = 1
    with torch.no_grad():
        h, keys, s = ref.encode(torch.from_numpy(src))
        y = torch.full((2,), bos, dtype=torch.long)
        want_tokens, want_align = [], []
        for _ in range(20):
            s, lg, a = ref.step(s, y, h, keys)
            y = lg.argmax(-1)
            want_tokens.append(y.numpy())
            want_align.append(a.numpy())
    for mode in ("auto", "scan"):
        s2s = _generic(weights, mode)
        tokens = np.array(gen.generate(s2s.decoder, [[bos], [bos]], 20, extra_feeds=s2s.encode({"src": src})).tokens)
        np.testing.assert_array_equal(tokens, np.stack(want_tokens, 1), err_msg=mode)
    tgt_in = np.concatenate([np.full((2, 1), bos), tokens[:, :-1]], 1).astype(np.int64)
    align = ort_run(build("rnnsearch", "small"), weights, {"src": src, "tgt_in": tgt_in})["align"]
    np.testing.assert_allclose(align, np.stack(want_align, 1), atol=1e-5, rtol=0)
    assert len(set(tokens.ravel().tolist())) > 1  # not one token repeated: the state is carried


def test_repetition_penalty_reaches_the_recurrent_loop_like_transformers(ref, weights, rng):
    """Issue 24: the recurrent loop once called the sampler with no history. The reference is
    transformers' own RepetitionPenaltyLogitsProcessor over the decoder's inputs (start token included)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from tessera.runtime.generation import cached as gen
    from tessera.runtime.generation.sampling import Sampling

    src, _ = _src_tgt(rng, b=2, s=7)
    bos, n = 1, 20
    s2s = _generic(weights)
    got = {}
    for penalty in (1.0, 3.0):
        proc = RepetitionPenaltyLogitsProcessor(penalty)
        with torch.no_grad():
            h, keys, s = ref.encode(torch.from_numpy(src))
            ids = torch.full((2, 1), bos, dtype=torch.long)
            for _ in range(n):
                s, lg, _a = ref.step(s, ids[:, -1], h, keys)
                ids = torch.cat([ids, proc(ids, lg).argmax(-1, keepdim=True)], 1)
        got[penalty] = np.array(gen.generate(s2s.decoder, [[bos], [bos]], n, Sampling(repetition_penalty=penalty),
                                             extra_feeds=s2s.encode({"src": src})).tokens)
        np.testing.assert_array_equal(got[penalty], ids[:, 1:].numpy(), err_msg=str(penalty))
    assert (got[1.0] != got[3.0]).any()  # the penalty changed the choice somewhere


def _paper_params(attention: bool, vs=30000, vt=30000, e=620, h=1000, n=1000, da=1000, lo=500) -> int:
    """Counted from the paper's architecture (appendix A) with PyTorch-style biases: a GRU has
    W [3H, in], U [3H, H] and two biases [3H]; alignment W_a, U_a, v_a and V_o, C_o without bias."""
    gru = lambda inp, hid: 3 * hid * inp + 3 * hid * hid + 2 * 3 * hid  # noqa: E731
    ctx = 2 * h if attention else h
    total = vs * e + vt * e                      # source and target embeddings
    total += (2 if attention else 1) * gru(e, h)  # encoder
    total += n * h + n                           # W_s: s_0 from the backward state (or c)
    if attention:
        total += da * 2 * h + da * n + da        # U_a, W_a, v_a
    total += gru(e + ctx, n)                     # decoder GRU on [E y; c]
    total += 2 * lo * n + 2 * lo + 2 * lo * e + 2 * lo * ctx   # U_o (+ bias), V_o, C_o
    total += vt * lo + vt                        # W_o
    return total


def test_parameter_counts_of_the_paper_models():
    assert _paper_params(True) == 80_451_000  # the sum written out: see docs/families/rnnsearch.md
    assert build("rnnsearch", "paper").param_count() == _paper_params(True)
    assert build("rnnsearch", "context").param_count() == _paper_params(False)
    assert build("rnnsearch", "small").param_count() == _paper_params(True, 40, 30, 8, 6, 7, 5, 4)


def test_report_macs_of_the_recurrent_layers_equal_a_hand_count():
    """Per source word: two encoder GRU steps; per target step: the decoder's attention over S,
    its GRU and the readout; plus the one-off U_a h and s_0, and the output layer."""
    g = build("rnnsearch", "small")
    e, h, n, da, lo, vt = 8, 6, 7, 5, 4, 30
    B, S, T = Poly.symbol("B"), Poly.symbol("S"), Poly.symbol("T")
    enc = B * S * (2 * (3 * h * e + 3 * h * h))
    once = B * h * n + B * S * 2 * h * da
    step = n * da + S * da + S * 2 * h + 3 * n * (e + 2 * h) + 3 * n * n + 2 * lo * (n + e + 2 * h)
    head = B * T * lo * vt
    costs, _ = cost.node_costs(g)
    assert cost.total(costs, "macs") == enc + once + B * T * step + head


def test_fusion_says_additive_attention_is_not_a_dot_product():
    g = build("rnnsearch", "small")
    sites = attention_sites(build_pipeline()(g))
    assert len(sites) == 1 and not sites[0].fused
    assert sites[0].reason.startswith("not a dot product"), sites[0].reason


def test_the_context_vector_model_of_eq_9_1_equals_pytorch(rng):
    """attention=false: a forward nn.GRU whose last state c is the decoder's context at every step."""
    torch.manual_seed(1)
    e, h, n, lo, vs, vt = SMALL["emb"], SMALL["hidden"], SMALL["dec"], SMALL["maxout_units"], 40, 30
    src_emb, tgt_emb = nn.Embedding(vs, e), nn.Embedding(vt, e)
    enc, init, cell = nn.GRU(e, h, batch_first=True), nn.Linear(h, n), nn.GRUCell(e + h, n)
    U_o, V_o, C_o = nn.Linear(n, 2 * lo), nn.Linear(e, 2 * lo, bias=False), nn.Linear(h, 2 * lo, bias=False)
    out = nn.Linear(lo, vt)
    mods = [src_emb, tgt_emb, enc, init, cell, U_o, V_o, C_o, out]
    for m in mods:
        for p in m.parameters():
            nn.init.normal_(p, std=0.5)
    src, tgt = _src_tgt(rng)
    with torch.no_grad():
        hs, _ = enc(src_emb(torch.from_numpy(src)))
        c = hs[:, -1]
        s = torch.tanh(init(c))
        want = []
        for t in range(tgt.shape[1]):
            y = tgt_emb(torch.from_numpy(tgt[:, t]))
            r = U_o(s) + V_o(y) + C_o(c)
            want.append(out(r.view(-1, lo, 2).max(-1).values))
            s = cell(torch.cat([y, c], -1), s)
        want = torch.stack(want, 1).numpy()
    np_ = lambda t: t.detach().numpy().copy()  # noqa: E731
    w = {"src_emb.weight": np_(src_emb.weight), "tgt_emb.weight": np_(tgt_emb.weight),
         "init.weight": np_(init.weight), "init.bias": np_(init.bias), "out.weight": np_(out.weight),
         "out.bias": np_(out.bias), "dec.U_o.weight": np_(U_o.weight), "dec.U_o.bias": np_(U_o.bias),
         "dec.V_o.weight": np_(V_o.weight), "dec.C_o.weight": np_(C_o.weight)}
    for a, b in [("weight_ih", "ih.weight"), ("bias_ih", "ih.bias"), ("weight_hh", "hh.weight"), ("bias_hh", "hh.bias")]:
        w[f"enc.cell.{b}"] = np_(getattr(enc, f"{a}_l0"))
        w[f"dec.gru.{b}"] = np_(getattr(cell, a))
    g = build("rnnsearch", "small_context")
    assert set(w) == set(g.params)
    np.testing.assert_allclose(interpret.run(g, w, {"src": src, "tgt_in": tgt})["logits"], want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ort_run(g, w, {"src": src, "tgt_in": tgt})["logits"], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode,encoder", [("auto", "GRU"), ("scan", "Scan")])
def test_compile_explains_each_lowering(capsys, tmp_path, mode, encoder):
    import onnx

    from conftest import cli

    out = tmp_path / "small.onnx"
    rc, _, err = cli(capsys, "compile", "rnnsearch", "--variant", "small", "-o", out, "--explain",
                     "--recurrence", mode)
    assert rc == 0, err
    lines = err.splitlines()
    assert "recurrences: 3" in lines
    want = "onnx GRU (the body is exactly gru_cell)" if mode == "auto" else "Scan (Scan forced (--recurrence scan))"
    assert f"  enc.fwd.cell: {want}" in lines and f"  enc.bwd.cell: {want}" in lines, err
    assert any(line.startswith("  dec: Scan (") for line in lines), err
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert ops.count(encoder) == (2 if encoder == "GRU" else 3) and "Scan" in ops


@pytest.mark.parametrize("args,message", [
    ([], "an encoder-decoder needs the target's first tokens: --start-token ID"),
    (["--start-token", "30"], "token id 30, outside the vocabulary [0, 30)"),
    # the encode/step contract (mode=encode|step) is gone with issue 24: the training graph generates
    (["--start-token", "1", "--set", "mode=step"], "mode"),
    (["--start-token", "1", "--prompt", "hi"], "--prompt needs --tokenizer"),
])
def test_generate_errors_for_the_recurrent_model(capsys, args, message):
    from conftest import cli_error

    err = cli_error(capsys, "generate", "rnnsearch", "--variant", "small", "--input", "src=[[1,2,3]]",
                    "--max-new-tokens", "3", *args)
    assert message in err, err


def test_tessera_generate_decodes_greedily_like_pytorch(capsys, ref, ckpt, rng):
    """The command line: --weights (the reference's state_dict through the mapping file), the source
    ids, a start token; 20 greedy tokens per row, as the PyTorch reference chooses them."""
    import json

    from conftest import cli

    src, _ = _src_tgt(rng, b=2, s=6)
    with torch.no_grad():
        h, keys, s = ref.encode(torch.from_numpy(src))
        y = torch.full((2,), 2, dtype=torch.long)
        want = []
        for _ in range(20):
            s, lg, _a = ref.step(s, y, h, keys)
            y = lg.argmax(-1)
            want.append(y.numpy())
    rc, out, err = cli(capsys, "generate", "rnnsearch", "--variant", "small", "--weights", ckpt, "--input",
                       f"src={json.dumps(src.tolist())}", "--start-token", "2", "--max-new-tokens", "20",
                       "--format", "json")
    assert rc == 0, err
    rows = json.loads(out)["outputs"]
    assert [r["tokens"] for r in rows] == np.stack(want, 1).tolist()


def test_generate_bans_repeated_ngrams_as_transformers_processor(capsys, ref, ckpt, rng):
    """The recurrent loop chooses through generation/sampling.py too: --no-repeat-ngram-size 2 gives the
    PyTorch reference's greedy tokens with transformers' NoRepeatNGramLogitsProcessor over the decoder's
    input (its start token and the tokens chosen so far)."""
    import json

    from conftest import cli

    processors = pytest.importorskip("transformers.generation.logits_process")
    src, _ = _src_tgt(rng, b=2, s=6)

    def reference(n):
        ban = processors.NoRepeatNGramLogitsProcessor(n) if n else None
        with torch.no_grad():
            h, keys, s = ref.encode(torch.from_numpy(src))
            seq = torch.full((2, 1), 2, dtype=torch.long)
            for _ in range(20):
                s, lg, _a = ref.step(s, seq[:, -1], h, keys)
                seq = torch.cat([seq, (ban(seq, lg) if ban else lg).argmax(-1)[:, None]], 1)
        return seq[:, 1:].tolist()

    want = reference(2)
    assert want != reference(0)  # the ban changes greedy's tokens here
    rc, out, err = cli(capsys, "generate", "rnnsearch", "--variant", "small", "--weights", ckpt, "--input",
                       f"src={json.dumps(src.tolist())}", "--start-token", "2", "--max-new-tokens", "20",
                       "--no-repeat-ngram-size", "2", "--format", "json", "-q")
    assert rc == 0, err
    assert [r["tokens"] for r in json.loads(out)["outputs"]] == want


def test_plot_attention_draws_the_pytorch_alignment(capsys, monkeypatch, tmp_path, ref, ckpt):
    """``tessera run rnnsearch --plot-attention``: the matrix drawn is the reference's alignment (target x
    source, the paper's figure 3), with the source ids on x and the target ids on y."""
    import json

    import torch

    from conftest import cli
    from tessera.runtime.report import alignment_plot

    seen = []
    real = alignment_plot.draw
    monkeypatch.setattr(alignment_plot, "draw", lambda al, path, *a, **k: (seen.append(al), real(al, path, *a, **k))[1])
    src, tgt = [[3, 4, 5, 6, 2]], [[1, 7, 2]]
    png = tmp_path / "align.png"
    rc, _, err = cli(capsys, "run", MODELS / "rnnsearch.tsr", "-V", "small", "--weights", ckpt,
                     "-i", "src=" + json.dumps(src), "-i", "tgt_in=" + json.dumps(tgt), "--plot-attention", png)
    assert rc == 0, err
    with torch.no_grad():
        _, want = ref(torch.tensor(src), torch.tensor(tgt))
    (al,) = seen
    np.testing.assert_allclose(al.matrix, want.numpy()[0], atol=1e-5)
    assert al.cols == [str(t) for t in src[0]] and al.rows == [str(t) for t in tgt[0]]
    assert png.read_bytes().startswith(b"\x89PNG")
