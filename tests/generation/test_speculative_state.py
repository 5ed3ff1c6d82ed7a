"""Speculative decoding for models with recurrent state (issue 39 item 1): Mamba and Jamba.

The verifying call runs the drafts through the scans and conv1d windows; on a rejection the state
is put back and the kept tokens run again (runtime/generation/rollback.py ``replay``). References:
transformers' greedy ``generate`` with the same weights (tiny checkpoints written here), a
left-padded batch of two prompts of different lengths, and plain greedy decoding of the same
model (``generate`` without --speculative). The prompts repeat a passage and the tiny vocabulary
makes the greedy output fall into loops, so prompt lookup drafts often: the test counts accepted
drafts AND rows replayed after a rejection, so both paths ran.
"""

from __future__ import annotations

import json

import pytest

from conftest import cli, cli_error, hf_greedy, tiny_recurrent_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, NEW = 12, 40
PASSAGE = [3, 7, 1, 9, 4, 10]
PROMPTS = [PASSAGE * 3 + [3, 7], [5, 2, 8] * 2]


@pytest.fixture(scope="module", params=["jamba", "mamba"])
def model(request, tmp_path_factory):
    hf = tiny_recurrent_hf(request.param, VOCAB)
    folder = tmp_path_factory.mktemp(request.param) / "ckpt"
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, folder


def _generate(capsys, folder, *extra):
    rc, out, err = cli(capsys, "generate", folder, "--input", f"tokens={json.dumps(PROMPTS)}", "--max-new-tokens",
                       NEW, "--format", "json", "-q", *extra)
    assert rc == 0, err
    out = json.loads(out)
    return [o["tokens"] for o in out["outputs"]], out["stats"]


@pytest.mark.parametrize("draft", [3, 6])
def test_speculative_equals_plain_greedy_and_transformers_with_drafts_accepted_and_rejected(model, capsys, draft):
    hf, folder = model
    want = hf_greedy(hf, PROMPTS, NEW)
    plain, _ = _generate(capsys, folder)
    assert plain == want
    got, stats = _generate(capsys, folder, "--speculative", "ngram", "--draft-tokens", draft)
    assert got == want
    assert stats["accepted_tokens"] > 0  # drafts kept: the state after a whole chunk was used
    assert stats["replayed_rows"] > 0  # drafts rejected: a state put back and its kept tokens run again
    assert stats["verify_calls"] < NEW - 1  # the accepted drafts saved calls


def test_the_api_takes_speculative_for_a_model_with_state(model):
    import tessera

    hf, folder = model
    m = tessera.load(str(folder))
    assert m.generate(PROMPTS, max_new_tokens=NEW, speculative="ngram", draft_tokens=4) == hf_greedy(hf, PROMPTS, NEW)


def test_a_draft_model_with_recurrent_state_is_refused_clearly(model, capsys):
    _, folder = model
    tiny = ["--set", f"vocab={VOCAB}", "--set", "layers=1", "--set", "d=16", "--set", "heads=2", "--set", "ctx=64"]
    err = cli_error(capsys, "generate", "gpt2", *tiny, "-q", "--input", f"tokens={json.dumps(PROMPTS)}",
                    "--max-new-tokens", 4, "--speculative", folder)
    assert "recurrent state cannot" in err and "draft with ngram" in err, err
