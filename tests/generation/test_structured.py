"""Structured output (runtime/generation/constraints.py, issue 41): a per-request grammar mask in the
serving engine. A tiny seeded GPT-2 over a byte-level BPE tokenizer of 300 ids trained here: every
output of a request with a JSON schema, regex or Lark grammar parses / matches, sampled (many seeds)
and greedy; greedy output under a grammar equals greedy decoding over logits masked by hand (the
allowed tokens computed in the test from the tokenizer's own token texts, not by llguidance); with
``--speculative ngram`` drafts outside the grammar are rejected and the tokens stay the same.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("llguidance")
tokenizers = pytest.importorskip("tokenizers")

from tessera.runtime.generation.constraints import Grammar  # noqa: E402
from tessera.runtime.generation.sampling import Sampling  # noqa: E402
from tessera.runtime.serving import model as serving_model  # noqa: E402
from tessera.runtime.serving.engine import Engine, Request, RequestError  # noqa: E402

VOCAB = 300
SETS = ["layers=1", "d=32", "heads=2", f"vocab={VOCAB}", "ctx=256"]
CORPUS = ['{"name": "ab", "age": 12, "ok": true}', '[1, 2, 3]', 'hello world', '{"a": [null, false]}',
          'abc-123 xyz-9', '2026-12-07', 'yes no maybe'] * 20
EOS = 0


def make_tokenizer(folder=None):
    """A byte-level BPE of VOCAB ids (every byte a token, so any text can be written), <|endoftext|> id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"],
        show_progress=False))
    assert tok.get_vocab_size() <= VOCAB and tok.token_to_id("<|endoftext|>") == EOS
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "eos_token": "<|endoftext|>",
            "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                             "{% if add_generation_prompt %}assistant: {% endif %}"}))
    return tok


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def gpt2():
    return serving_model.load("gpt2", sets=SETS, threads=1)


def _engine(model, tok, **kw):
    return Engine(model, max_batch=8, capacity=256, tokenizer=tok, eos_ids=[EOS], **kw)


def _run(engine, reqs):
    handles = [engine.submit(r) for r in reqs]
    for _ in range(5000):
        if not engine.step():
            break
    assert all(h.finished for h in handles)
    return handles


def _text(tok, h):
    ids = [t for t in h.tokens if t != EOS]
    return tok.decode(ids)


SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
     "required": ["name", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["x", "y", 3]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"t": {"enum": ["red", "green"]},
                                      "n": {"type": ["null", "boolean"]}}, "required": ["t", "n"],
     "additionalProperties": False},
]


def _valid(schema, value) -> bool:
    jsonschema = pytest.importorskip("jsonschema")
    try:
        jsonschema.validate(value, schema)
        return True
    except jsonschema.ValidationError:
        return False


@pytest.mark.parametrize("which", range(len(SCHEMAS)))
def test_sampled_outputs_follow_the_schema(gpt2, tok, which):
    schema = SCHEMAS[which]
    engine = _engine(gpt2, tok)
    prompt = tok.encode('{"name": ').ids
    reqs = [Request(list(prompt), 120, Sampling(temperature=1.0, seed=seed), grammar=Grammar.json_schema(schema))
            for seed in range(24)]
    for h in _run(engine, reqs):
        assert h.finish_reason == "stop", (h.finish_reason, _text(tok, h))
        value = json.loads(_text(tok, h))
        assert _valid(schema, value), (schema, value)


def test_regex_and_lark(gpt2, tok):
    engine = _engine(gpt2, tok)
    prompt = tok.encode("hello").ids
    regex = r"[a-c]{1,4}-[0-9]{2,3}"
    lark = 'start: "yes" | "no" | "maybe" " " NUM\nNUM: /[0-9]{1,2}/'
    reqs = [Request(list(prompt), 40, Sampling(temperature=1.0, seed=s), grammar=Grammar.regex(regex))
            for s in range(16)]
    reqs += [Request(list(prompt), 40, Sampling(temperature=1.0, seed=s), grammar=Grammar.lark(lark))
             for s in range(16)]
    hs = _run(engine, reqs)
    for h in hs[:16]:
        assert h.finish_reason == "stop" and re.fullmatch(regex, _text(tok, h)), _text(tok, h)
    for h in hs[16:]:
        assert h.finish_reason == "stop" and re.fullmatch(r"yes|no|maybe [0-9]{1,2}", _text(tok, h)), _text(tok, h)


def _token_bytes(tok) -> list[bytes]:
    """Each id's bytes, from the byte-level alphabet (not from llguidance)."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's bytes_to_unicode, inverted
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_of = {chr(c): b for b, c in zip(bs, cs)}
    assert set(byte_of) == set(alphabet)
    vocab = {i: t for t, i in tok.get_vocab().items()}
    return [bytes(byte_of[c] for c in vocab[i]) if i != EOS else b"" for i in range(tok.get_vocab_size())]


def _logits(engine, ids):
    """The last position's logits of ``ids`` run as one prompt against an empty cache."""
    info, t = engine.info, len(ids)
    feeds = {info.tokens: np.array([ids], dtype=np.int64), "attention_mask": np.ones((1, t), dtype=np.int64),
             "position_ids": np.arange(t, dtype=np.int64)[None], **engine.empty}
    if info.length_input:
        feeds[info.length_input] = np.array([0], dtype=np.int64)
    return engine.model.run(feeds)[info.logits][0, -1]


def test_greedy_equals_hand_masked_greedy(gpt2, tok):
    """The grammar ``[0-9]{3}-(ab|xyz)``: the allowed next tokens are those whose bytes keep the text a
    prefix of some match (EOS once it is a full match), computed here by brute force over the vocabulary;
    greedy decoding over the model's logits with that mask must give the engine's tokens."""
    regex = r"[0-9]{3}-(ab|xyz)"
    full = re.compile(regex)
    words = _token_bytes(tok)

    def is_prefix(text: bytes) -> bool:  # some completion matches: brute force over this small language
        s = text.decode("latin-1")
        return any(m.startswith(s) for m in _LANG)

    _LANG = [f"{a}{b}{c}-{t}" for a in "0123456789" for b in "0123456789" for c in "0123456789"
             for t in ("ab", "xyz")]
    engine = _engine(gpt2, tok)
    for prompt_text in ("hello", "2026-12", '{"a": 1'):
        prompt = tok.encode(prompt_text).ids
        (h,) = _run(engine, [Request(list(prompt), 20, Sampling(temperature=0.0), grammar=Grammar.regex(regex))])
        # by hand: each step's logits from the whole sequence run afresh, the mask from the token bytes
        ids, text, expected = list(prompt), b"", []
        for _ in range(20):
            allowed = np.array([is_prefix(text + w) if w else bool(full.fullmatch(text.decode("latin-1")))
                                for w in words] + [False] * (VOCAB - len(words)))
            if allowed[EOS] and allowed.sum() == 1:  # the grammar has ended: the request stops without EOS
                break
            t = int(np.argmax(np.where(allowed, _logits(engine, ids), -np.inf)))
            expected.append(t)
            if t == EOS:
                break
            text += words[t]
            ids.append(t)
        assert h.tokens == expected, (h.tokens, expected)
        assert full.fullmatch(_text(tok, h))


def test_speculation_rejects_drafts_outside_the_grammar(tok):
    from tessera.runtime.serving.speculation import Speculation

    model = serving_model.load("gpt2", sets=SETS, threads=1, last_only=False)
    prompt = tok.encode('{"name": "ab", "age": 12, "ok": true} {"name": "ab", "age": 12, "ok": true}').ids
    schema = SCHEMAS[1]
    plain = _engine(model, tok)
    spec = _engine(model, tok)
    s = Speculation(4).attach(spec)
    reqs = lambda: [Request(list(prompt), 60, Sampling(temperature=0.0), grammar=Grammar.json_schema(schema)),
                    Request(list(prompt), 30, Sampling(temperature=0.0), grammar=Grammar.regex(r'\{"name": "ab+"'))]
    a = _run(plain, reqs())
    b = _run(spec, reqs())
    assert [h.tokens for h in a] == [h.tokens for h in b]
    assert s.calls > 0  # drafts were checked
    assert _valid(schema, json.loads(_text(tok, b[0])))


def test_bad_grammars_are_request_errors(gpt2, tok):
    engine = _engine(gpt2, tok)
    for g in (Grammar.regex("(ab"), Grammar.lark("start: foo"), Grammar.json_schema("{not json"),
              Grammar.json_schema([1]), Grammar("xml", "x")):
        with pytest.raises(RequestError):
            engine.submit(Request([1, 2], 4, grammar=g))
    with pytest.raises(RequestError, match="min_tokens"):
        engine.submit(Request([1, 2], 4, Sampling(min_new_tokens=2), grammar=Grammar.json_object()))
    no_tok = Engine(gpt2, max_batch=2, capacity=64)
    with pytest.raises(RequestError, match="tokenizer"):
        no_tok.submit(Request([1, 2], 4, grammar=Grammar.json_object()))


# ------------------------------------------------------------------ tessera generate, the API, tessera batch
@pytest.fixture(scope="module")
def tok_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    make_tokenizer(folder)
    return folder


CLI_SETS = [a for s in SETS for a in ("--set", s)]


def test_generate_cli_follows_the_grammar(capsys, tok_folder, tmp_path):
    from conftest import cli

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS[1]))
    lark_file = tmp_path / "g.lark"
    lark_file.write_text('start: "yes" | "no" | "maybe" " " NUM\nNUM: /[0-9]{1,2}/')
    regex = r"[a-c]{1,4}-[0-9]{2,3}"
    cases = [(["--json-schema", schema_file], lambda t: _valid(SCHEMAS[1], json.loads(t))),
             (["--regex", regex], lambda t: re.fullmatch(regex, t)),
             (["--grammar", lark_file], lambda t: re.fullmatch(r"yes|no|maybe [0-9]{1,2}", t))]
    for flags, ok in cases:
        rc, out, err = cli(capsys, "generate", "gpt2", *CLI_SETS, "--tokenizer", tok_folder / "tokenizer.json",
                           "--prompt", "hello", "--prompt", "yes no", "--temperature", 1, "--max-new-tokens", 100,
                           *flags, "--format", "json", "--quiet")
        assert rc == 0, err
        for row in json.loads(out)["outputs"]:
            assert ok(row["text"]), (flags, row["text"])


def test_generate_cli_refuses_bad_grammars(capsys, tok_folder, tmp_path):
    from conftest import cli_error

    tok = ["--tokenizer", tok_folder / "tokenizer.json"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for flags, words in ((["--regex", "(ab"], "invalid regular expression"),
                         (["--json-schema", bad], "not JSON"),
                         (["--json-schema", tmp_path / "missing.json"], "cannot read"),
                         (["--regex", "a", "--grammar", bad], "give one of"),
                         (["--regex", "a", "--speculative", "ngram"], "serve")):
        err = cli_error(capsys, "generate", "gpt2", *CLI_SETS, *tok, "--prompt", "hi", *flags)
        assert words in err, err
    err = cli_error(capsys, "generate", "gpt2", *CLI_SETS, "--input", "tokens=[[1,2]]", "--regex", "a")
    assert "--tokenizer" in err


def test_api_generate_json_schema(tok_folder):
    import tessera

    m = tessera.load("gpt2", **dict(s.split("=") for s in SETS))
    texts = m.generate(["hello", "yes"], 100, temperature=1.0, seed=3, json_schema=SCHEMAS[0],
                       tokenizer=str(tok_folder / "tokenizer.json"))
    for t in texts:
        assert _valid(SCHEMAS[0], json.loads(t)), t


def test_batch_rows_with_grammars(capsys, tok_folder, tmp_path):
    from conftest import cli

    rows = [{"prompt": "hello", "max_tokens": 100, "temperature": 1.0, "seed": s,
             "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[3]}}}
            for s in range(4)]
    rows += [{"prompt": "hello", "max_tokens": 40, "guided_regex": r"[a-c]{1,4}-[0-9]{2,3}", "seed": 1,
              "temperature": 1.0},
             {"prompt": "hello", "max_tokens": 4, "guided_regex": "(ab"}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows))
    rc, _, err = cli(capsys, "batch", "gpt2", *CLI_SETS, "--tokenizer", tok_folder / "tokenizer.json",
                     "--input", src, "--output", out, "--threads", 1)
    assert rc == 0, err
    res = [json.loads(line) for line in out.read_text().splitlines()]
    for r in res[:4]:
        assert _valid(SCHEMAS[3], json.loads(r["text"])), r
    assert re.fullmatch(r"[a-c]{1,4}-[0-9]{2,3}", res[4]["text"])
    assert "invalid regular expression" in res[5]["error"]


# ------------------------------------------------------------------ random schemas, the row engine
def _random_schema(rng, depth=0):
    """A random JSON schema whose instances are bounded (so a sampled tiny model always finishes)."""
    kinds = ["integer", "boolean", "enum", "string", "null"] + (["object", "array"] if depth < 2 else [])
    kind = kinds[rng.integers(len(kinds))]
    if kind == "integer":
        lo = int(rng.integers(-50, 50))
        return {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 200))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        pool = ["a", "bc", 1, 2.5, True, None, "xyz"]
        return {"enum": [pool[i] for i in rng.choice(len(pool), size=int(rng.integers(1, 4)), replace=False)]}
    if kind == "string":
        return {"type": "string", "minLength": 0, "maxLength": int(rng.integers(1, 6)),
                **({"pattern": "^[a-c]*$"} if rng.random() < 0.5 else {})}
    if kind == "array":
        return {"type": "array", "items": _random_schema(rng, depth + 1), "maxItems": int(rng.integers(1, 4))}
    props = {f"k{i}": _random_schema(rng, depth + 1) for i in range(int(rng.integers(1, 4)))}
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def test_random_schemas_sampled(gpt2, tok):
    """200 random schemas, two sampled requests each (temperature 1.5: far from the model's favourites):
    every output is valid JSON of its schema."""
    rng = np.random.default_rng(41)
    schemas = [_random_schema(rng) for _ in range(200)]
    engine = _engine(gpt2, tok)
    prompt = tok.encode("{").ids
    reqs = [Request(list(prompt), 200, Sampling(temperature=1.5, seed=s), grammar=Grammar.json_schema(sc))
            for sc in schemas for s in range(2)]
    for i in range(0, len(reqs), 40):
        for h, r in zip(_run(engine, reqs[i:i + 40]), reqs[i:i + 40]):
            schema = r.grammar.source
            assert h.finish_reason == "stop", (schema, _text(tok, h))
            assert _valid(schema, json.loads(_text(tok, h))), (schema, _text(tok, h))
    assert engine.combined_calls > 0  # prompts went in beside constrained rows decoding (the combined call)


def test_row_engine_follows_the_grammar(tok):
    from tessera.runtime.serving.row_engine import RowEngine, engine_for

    mamba = serving_model.load("mamba", sets=["layers=1", "d=32", "d_inner=64", "rank=4", f"vocab={VOCAB}"], threads=1)
    engine = engine_for(mamba, 4, 16, 128, 64, tok, [EOS], None)
    assert isinstance(engine, RowEngine)
    regex = r"[a-c]{1,4}-[0-9]{2,3}"
    reqs = [Request(tok.encode("hello").ids, 30, Sampling(temperature=t, seed=s), grammar=Grammar.regex(regex))
            for t in (0.0, 1.0) for s in range(3)]
    for h in _run(engine, reqs):
        assert h.finish_reason == "stop" and re.fullmatch(regex, _text(tok, h)), _text(tok, h)


def test_logprobs_are_the_models_under_a_grammar(gpt2, tok):
    """Log-probabilities stay the model's (log_softmax of its logits), not the masked distribution's."""
    engine = _engine(gpt2, tok)
    prompt = tok.encode("hello").ids
    (h,) = _run(engine, [Request(list(prompt), 6, Sampling(temperature=0.0, logprobs=2),
                                 grammar=Grammar.regex(r"[a-c]{1,4}-[0-9]{2,3}"))])
    raw = _logits(engine, prompt).astype(np.float64)
    logp = raw - raw.max() - np.log(np.exp(raw - raw.max()).sum())
    assert abs(h.logprobs[0]["logprob"] - logp[h.tokens[0]]) < 1e-4


def test_a_failing_matcher_ends_its_request_alone(gpt2, tok):
    from tessera.runtime.generation.constraints import GrammarError

    engine = _engine(gpt2, tok)
    prompt = tok.encode("hello").ids
    bad = Request(list(prompt), 10, Sampling(temperature=0.0), grammar=Grammar.regex("[a-c]{1,9}"))
    good = Request(list(prompt), 10, Sampling(temperature=0.0), grammar=Grammar.regex("[a-c]{1,9}"))
    plain = Request(list(prompt), 10, Sampling(temperature=0.0))
    hb = engine.submit(bad)

    def fail(logits):
        raise GrammarError("the matcher failed")

    bad.mask.apply = fail
    hg, hp = engine.submit(good), engine.submit(plain)
    for _ in range(100):
        if not engine.step():
            break
    assert hb.finish_reason == "error" and "matcher failed" in hb.error and hb.tokens == []
    assert hg.finish_reason in ("stop", "length") and re.fullmatch("[a-c]{1,9}", _text(tok, hg))
    assert hp.finish_reason == "length" and len(hp.tokens) == 10


def test_apply_is_the_allowed_logits_and_minus_inf_elsewhere(tok):
    """TokenMask.apply (one add of the worker's 0 / -inf mask) equals np.where(allowed, logits, -inf) in
    float32 and float64, logits wider than the vocabulary get -inf past it, and a copy is returned."""
    from tessera.runtime.generation.constraints import GrammarCompiler

    mask = GrammarCompiler(tok, VOCAB, [EOS]).mask(Grammar.regex(r"[a-c]{1,4}-[0-9]{2}"))
    allowed = mask.allowed()
    assert allowed.dtype == bool and allowed.shape == (VOCAB,) and 0 < allowed.sum() < VOCAB
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        logits = rng.standard_normal((1, VOCAB + 5)).astype(dtype)
        before = logits.copy()
        out = mask.apply(logits)
        assert out.dtype == dtype and out.shape == logits.shape
        want = np.where(allowed, logits[:, :VOCAB], -np.inf)
        assert np.array_equal(out[:, :VOCAB], want) and np.all(out[:, VOCAB:] == -np.inf)
        assert np.array_equal(logits, before)  # the caller's logits are left alone
    narrow = rng.standard_normal((1, VOCAB - 3)).astype(np.float32)
    assert np.array_equal(mask.apply(narrow), np.where(allowed[:VOCAB - 3], narrow, -np.inf))
