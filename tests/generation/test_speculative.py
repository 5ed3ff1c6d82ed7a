"""Speculative decoding gives plain greedy decoding's tokens, token for token.

The references are independent of the code under test: transformers' ``generate(do_sample=False)``
on the same checkpoint (a left-padded batch), and Tessera's plain cached loop (test_generate.py
checks it against transformers and a full recomputation). Each case is a GPT-2 and a Llama with
grouped-query attention (4 query heads, 2 key/value heads), made by transformers from a seed and
saved as Hugging Face checkpoint folders, with prompts that repeat themselves so the drafters have
something to find; both drafting methods run (prompt lookup, and draft models that agree always --
the same model -- or rarely -- another seed, fewer layers), so both the accepting and the
rejecting paths of the verifier and the per-row rollback are taken. The test also checks that
drafting happened (drafted > 0) where it must, and that the drafts saved calls when they are right.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import tessera
from conftest import MODELS, cli, cli_error, hf_greedy
from tessera.runtime.generation import drafting, rollback
from tessera.runtime.pipeline import UsageError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW = 40


def _gpt2(seed: int, layers: int = 2):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=300, n_positions=256,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _llama(seed: int, layers: int = 2, vocab: int = 300):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                   rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _perturbed(model):
    """Weights further from the initialisation, so the greedy output is not one repeated token."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.08)
    return model


FAMILIES = {"gpt2": _gpt2, "llama_gqa": _llama}


def _prompts(vocab: int) -> list[list[int]]:
    """Two prompts of uneven lengths, each quoting a passage of its own twice."""
    rng = np.random.default_rng(1)
    a, b = rng.integers(1, vocab, 14).tolist(), rng.integers(1, vocab, 6).tolist()
    return [a + a + a[:5], b + [7] + b]


_hf_greedy = hf_greedy


class Case:
    """A family's target checkpoint and two draft checkpoints (another seed with one layer; the same)."""

    def __init__(self, family, root):
        make = FAMILIES[family]
        self.hf = _perturbed(make(0))
        self.folder = root / "target"
        self.hf.save_pretrained(self.folder, safe_serialization=True)
        self.other = root / "draft"
        _perturbed(make(5, layers=1)).save_pretrained(self.other, safe_serialization=True)
        self.vocab = self.hf.config.vocab_size
        self.model = tessera.load(self.folder)
        self.prompts = _prompts(self.vocab)
        self.reference = _hf_greedy(self.hf, self.prompts, NEW)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            made[family] = Case(family, tmp_path_factory.mktemp(f"spec_{family}"))
        return made[family]
    return get


def _run(model, prompts, **kw):
    """The API's tokens and the generation's stats (through the driver, as the CLI runs it)."""
    from tessera.runtime import driver
    from tessera.runtime.options import GenerateOptions

    o = GenerateOptions(max_new_tokens=kw.pop("max_new_tokens", NEW), **kw).for_api()
    o.check()
    run = driver.generate(model.ref, o, prompts, model.weights, model._models)
    out = [[] for _ in prompts]
    for emitted in run.steps():
        for r, t in enumerate(emitted):
            if t is not None:
                out[r].append(t)
    return out, run.stats


@pytest.mark.parametrize("family", list(FAMILIES))
def test_plain_greedy_is_transformers_greedy(cases, family):
    """The reference the speculative runs are held to: plain decoding equals transformers."""
    case = cases(family)
    assert case.model.generate(case.prompts, NEW) == case.reference


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("drafter", ["ngram", "other", "same"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_speculative_greedy_equals_plain_greedy_for_a_batch_of_two(cases, family, drafter, k):
    case = cases(family)
    spec = {"ngram": "ngram", "other": str(case.other), "same": case.model}[drafter]
    out, stats = _run(case.model, case.prompts, speculative=spec, draft_tokens=k)
    assert out == case.reference
    assert stats.new_tokens == 2 * NEW
    assert stats.drafted > 0 and 0 <= stats.accepted <= stats.drafted
    assert stats.round_tokens == 2 * NEW - 2  # the first token of each row comes from the prompt's logits
    if drafter == "same":  # the target drafting for itself: every draft is accepted, k + 1 tokens a call
        assert stats.accepted == stats.drafted
        assert stats.rounds <= -(-(NEW - 1) // (k + 1)) + 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_speculative_greedy_equals_plain_greedy_for_one_prompt(cases, family):
    case = cases(family)
    for r, prompt in enumerate(case.prompts):
        for spec in ("ngram", str(case.other)):
            out, _ = _run(case.model, [prompt], speculative=spec, draft_tokens=3)
            assert out == [case.reference[r]], spec


def test_drafts_are_accepted_when_the_output_repeats_the_prompt(cases):
    """Prompt lookup on a model that continues a repeated passage: most drafts are accepted, and the
    target is called fewer times than tokens are generated (counted, not timed)."""
    case = cases("gpt2")
    prompt = [case.reference[0][:12] * 3]  # the model's own greedy continuation, quoted three times
    plain = case.model.generate(prompt, NEW)
    out, stats = _run(case.model, prompt, speculative="ngram", draft_tokens=4)
    assert out == plain
    assert stats.rounds < NEW - 1


def test_default_draft_lengths_are_ten_for_prompt_lookup_and_four_for_a_draft_model(cases, monkeypatch):
    """Without draft_tokens, prompt lookup may draft 10 tokens a round (docs/generate.md: a hit copies a
    run) and a draft model 4: the budgets the verifier hands each drafter. Tokens stay plain's."""
    from tessera.runtime.generation import drafting

    budgets = {}
    for cls in (drafting.NgramDrafter, drafting.ModelDrafter):
        real = cls.propose
        monkeypatch.setattr(cls, "propose", lambda self, h, b, real=real: (
            budgets.setdefault(self.name, []).extend(b), real(self, h, b))[1])
    case = cases("gpt2")
    prompt = [case.reference[0][:12] * 3]
    plain = case.model.generate(prompt, NEW)
    for spec in ("ngram", str(case.other)):
        out, _ = _run(case.model, prompt, speculative=spec)
        assert out == plain
    assert max(budgets["ngram"]) == 10 and max(budgets["model"]) == 4


def test_rollback_compaction_keeps_the_tokens(cases, monkeypatch):
    """A cache with almost no spare columns compacts its rows (masked holes packed away) many times;
    the tokens stay plain greedy's."""
    case = cases("llama_gqa")
    monkeypatch.setattr(rollback, "slack", lambda k: k + 1)
    calls = []
    real = rollback.RollbackCache.compact
    monkeypatch.setattr(rollback.RollbackCache, "compact", lambda self: (calls.append(1), real(self)))
    for spec in ("ngram", str(case.other)):  # rows accepting different counts leave holes
        out, _ = _run(case.model, case.prompts, speculative=spec, draft_tokens=4)
        assert out == case.reference
    assert calls


def test_repetition_penalty_and_stop_tokens_are_kept(cases):
    case = cases("gpt2")
    plain = case.model.generate(case.prompts, NEW, repetition_penalty=1.3)
    out, _ = _run(case.model, case.prompts, speculative="ngram", repetition_penalty=1.3)
    assert out == plain
    stop = case.reference[0][7]
    plain = case.model.generate(case.prompts, NEW, stop_tokens=[stop])
    out, _ = _run(case.model, case.prompts, speculative=str(case.other), stop_tokens=[stop])
    assert out == plain
    assert out[0][-1] == stop and len(out[0]) == case.reference[0].index(stop) + 1


def test_compiled_draft_model_file(cases, tmp_path):
    case = cases("gpt2")
    draft = tessera.load(case.other)
    files = draft.compile(tmp_path / "draft.onnx", kv_cache=True)
    onnx_file = next(f for f in files if str(f).endswith(".onnx"))
    out, stats = _run(case.model, case.prompts, speculative=str(onnx_file), draft_tokens=3)
    assert out == case.reference and stats.drafted > 0


def test_ngram_lookup_by_hand():
    d = drafting.NgramDrafter()  # n-grams of 3, else 2 tokens
    assert d.lookup([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]          # the 3-gram [1, 2, 3] at 0
    assert d.lookup([1, 2, 8, 1, 2, 9, 4, 1, 2], 3) == [9, 4, 1]  # the latest [1, 2] (at 3), not the first
    assert d.lookup([7, 1, 2, 5, 9, 1, 2, 6, 3, 1, 2], 2) == [6, 3]  # 2-gram: [3, 1, 2] occurs nowhere before
    assert d.lookup([5, 6, 7], 4) == []                          # no suffix occurs before
    assert d.lookup([4, 9, 4], 3) == []                          # a 1-gram match is not used by default
    one = drafting.NgramDrafter(min_ngram=1)
    assert one.lookup([4, 9, 4], 3) == [9, 4, 9]                 # copied forward past the end
    assert one.lookup([4, 4], 3) == [4, 4, 4]                    # a period-1 pattern, copied forward
    assert d.lookup([8, 1, 2, 3, 1, 2, 3], 5) == [1, 2, 3, 1, 2]  # period 3: past the end the copy repeats
    assert d.propose([[1, 2, 1, 2], [1, 2, 1, 2]], [2, 0]) == [[1, 2], []]


def test_cli_json_counts_and_explain(cases, capsys):
    case = cases("gpt2")
    ids = json.dumps(case.prompts)
    rc, out, err = cli(capsys, "generate", case.folder, "-i", f"tokens={ids}", "--max-new-tokens", NEW,
                       "--format", "json", "-q", "--speculative", "ngram", "--draft-tokens", 3, "--explain")
    assert rc == 0, err
    data = json.loads(out)
    assert [row["tokens"] for row in data["outputs"]] == case.reference
    s = data["stats"]
    assert s["drafted_tokens"] > 0 and 0 <= s["accepted_tokens"] <= s["drafted_tokens"]
    assert s["acceptance_rate"] == round(s["accepted_tokens"] / s["drafted_tokens"], 4)
    assert f"{s['accepted_tokens']} of {s['drafted_tokens']} drafted tokens accepted" in err


SMALL = ["--set", "layers=1", "--set", "d=32", "--set", "heads=4", "--set", "vocab=50", "--set", "ctx=64"]
GPT2 = str(MODELS / "gpt2.tsr")


@pytest.mark.parametrize("args, message", [
    (["--speculative", "ngram", "--draft-tokens", "0"], "--draft-tokens must be at least 1"),
    (["--speculative", "ngram", "--draft-tokens", "-3"], "--draft-tokens must be at least 1"),
    (["--draft-tokens", "2"], "--draft-tokens applies with --speculative"),
    (["--speculative", "ngram", "--temperature", "0.8"], "greedy only"),
    (["--speculative", "ngram", "--cache", "concat"], "needs the buffer cache"),
    (["--speculative", "nosuch.tsr"], "--speculative nosuch.tsr: not 'ngram', and no draft model"),
])
def test_bad_values_are_clear_errors(capsys, args, message):
    err = cli_error(capsys, "generate", GPT2, *SMALL, "-i", "tokens=[[1, 2, 3]]", *args)
    assert message in err


def test_draft_vocabulary_must_be_the_targets(capsys, tmp_path):
    # the draft: GPT-2's own vocabulary (50257 tokens, the spec's default), one narrow layer, compiled
    # (the bundled small GPT-2 itself cost 8 s of its 124M seeded weights for the same refusal)
    draft = tmp_path / "draft.onnx"
    rc, _, err = cli(capsys, "compile", GPT2, "--set", "layers=1", "--set", "d=32", "--set", "heads=4", "--set",
                     "ctx=64", "--kv-cache", "-o", draft)
    assert rc == 0, err
    err = cli_error(capsys, "generate", GPT2, *SMALL, "-i", "tokens=[[1, 2, 3]]", "--speculative",
                    draft)  # the draft has 50257 tokens, the target 50
    assert "vocabulary of 50257 tokens, the target 50" in err


def test_api_bad_values_raise_usage_error(cases):
    m = tessera.load(GPT2, layers=1, d=32, heads=4, vocab=50, ctx=64)
    with pytest.raises(UsageError, match="draft_tokens must be at least 1"):
        m.generate([1, 2, 3], 5, speculative="ngram", draft_tokens=0)
    with pytest.raises(UsageError, match="speculative must be"):
        m.generate([1, 2, 3], 5, speculative=3)
    other = tessera.load(GPT2, layers=1, d=32, heads=4, vocab=60, ctx=64)
    with pytest.raises(UsageError, match="vocabulary of 60 tokens, the target 50"):
        m.generate([1, 2, 3], 5, speculative=other)


def test_target_compiled_with_last_logits_only_is_refused(tmp_path, capsys):
    out = tmp_path / "t.onnx"
    rc, _, err = cli(capsys, "compile", GPT2, *SMALL, "--kv-cache", "-o", out)
    assert rc == 0, err
    err = cli_error(capsys, "generate", out, "-i", "tokens=[[1, 2, 3]]", "--speculative", "ngram")
    assert "logits of the last position only" in err


def test_a_sliding_window_model_is_refused(capsys):
    """Its window counts cache columns, so it uses the concat cache, which cannot be rolled back per row."""
    from conftest import ROOT

    spec = ROOT / "tests" / "specs" / "mistral_window.tsr"
    sets = ["vocab=50", "d=32", "layers=1", "heads=4", "kv_heads=2", "d_ff=48", "window=4"]
    err = cli_error(capsys, "generate", spec, *[a for s in sets for a in ("--set", s)], "-i", "tokens=[[1, 2, 3]]",
                    "--speculative", "ngram")
    assert "speculative decoding needs the buffer cache" in err and "uses the concat cache" in err


def test_processors_the_verify_loop_does_not_apply_are_refused():
    """no_repeat_ngram_size, min_new_tokens and logprobs change or add to what plain decoding gives;
    the verify loop does not compute them, so asking for them with speculative decoding is an error."""
    m = tessera.load(GPT2, layers=1, d=32, heads=4, vocab=50, ctx=64)
    for kw, named in (({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size 2"),
                      ({"min_new_tokens": 3}, "min_new_tokens 3"), ({"logprobs": 2}, "logprobs 2")):
        with pytest.raises(UsageError, match=f"speculative does not apply {named}"):
            m.generate([[1, 2, 3]], 4, speculative="ngram", **kw)
    assert len(m.generate([1, 2, 3], 4, speculative="ngram", no_repeat_ngram_size=0)) == 4
