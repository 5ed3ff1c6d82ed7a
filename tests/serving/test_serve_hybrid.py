"""Jamba (attention + Mamba layers), Mamba (state only) and T5 (an encoder-decoder) through the real
serving paths (issue 39 item 1): ``tessera batch`` on a JSONL file and a ``tessera serve`` process on
127.0.0.1 (test_serve_http.py's ServerProcess) answering several requests of different lengths at
once. All three are served by the row engine (runtime/serving/row_engine.py).

The reference is transformers' greedy ``generate`` with the same weights (tiny checkpoints written
here by ``save_pretrained``, served as folders), each prompt alone: no padding anywhere, so what a
served row gets in flight with the others must be what it gets alone.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import cli, perturbed, tiny_recurrent_hf  # noqa: E402

NEW = 8
PROMPTS = [[5, 17, 42, 99, 3, 7, 8], [9, 8], [61, 2, 33, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
T5_START, T5_EOS = 0, 1


def _t5():
    torch.manual_seed(1)
    cfg = transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=6,
                                dropout_rate=0.0, feed_forward_proj="relu", decoder_start_token_id=T5_START,
                                pad_token_id=0, eos_token_id=T5_EOS)
    model = perturbed(transformers.T5ForConditionalGeneration(cfg), 0.5, seed=1)
    with torch.no_grad():
        model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 3.0)
    return model


MODELS = {"jamba": partial(tiny_recurrent_hf, "jamba", 128), "mamba": partial(tiny_recurrent_hf, "mamba", 128),
          "t5": _t5}


@pytest.fixture(scope="module", params=sorted(MODELS))
def served(request, tmp_path_factory):
    """(name, transformers model, checkpoint folder, transformers' greedy tokens of each prompt alone)."""
    name = request.param
    model = MODELS[name]()
    folder = tmp_path_factory.mktemp(name) / "ckpt"
    model.save_pretrained(folder, safe_serialization=True)
    want = []
    with torch.no_grad():
        for p in PROMPTS:
            if name == "t5":  # the prompt is the source; the decoder starts from decoder_start_token_id
                out = model.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW, do_sample=False, num_beams=1)
                row = out[0, 1:].tolist()
                want.append(row[:row.index(T5_EOS) + 1] if T5_EOS in row else row)
            else:
                out = model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
                want.append(out[0, len(p):].tolist())
    assert len({tuple(w) for w in want}) == len(want) and len({t for w in want for t in w}) > 4, want
    return name, model, folder, want


def test_tessera_batch_gives_transformers_tokens_for_prompts_of_different_lengths(served, capsys, tmp_path):
    name, _, folder, want = served
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p, "max_tokens": NEW}) + "\n" for p in PROMPTS))
    rc, _, err = cli(capsys, "batch", folder, "--input", rows, "--output", tmp_path / "out.jsonl", "--max-batch", 3)
    assert rc == 0, err
    got = [json.loads(line)["tokens"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert got == want, name


def test_a_serve_process_answers_concurrent_requests_with_transformers_tokens(served, tmp_path):
    from test_serve_http import ServerProcess

    name, _, folder, want = served
    server = ServerProcess([folder, "--max-batch", 3], tmp_path / "server.log")
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # four requests at once, three slots: one joins later
            got = list(pool.map(lambda p: server.greedy_token_ids(p, NEW), PROMPTS))
    finally:
        assert server.stop() == 0, server.output()
    assert got == want, (name, server.output())
