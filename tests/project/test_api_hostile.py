"""issue 25, item 1: every bad argument of the Python API raises the documented error class with a
message naming the argument -- never a TypeError, ValueError, KeyError, AttributeError or
OverflowError from deep inside. Each case below was a traceback (or, for float and bool token ids,
silently accepted) before the checks in runtime/options.py and runtime/io/inputs.py."""

from __future__ import annotations

import pytest

import tessera
from tessera.compiler.ir.signature import InputError
from tessera.runtime.pipeline import UsageError

TINY = dict(layers=1, d=32, heads=2, vocab=50, ctx=16)

LOAD = {  # keywords of tessera.load: (value, what the message must contain)
    "spec=None": (dict(spec=None), "spec must be a path"),
    "spec=123": (dict(spec=123), "spec must be a path"),
    "spec=bytes": (dict(spec=b"gpt2"), "spec must be a path"),
    "spec with NUL": (dict(spec="gp\0t2"), "without NUL"),
    "spec lone surrogate": (dict(spec="gpt\ud8002"), "not valid Unicode"),
    "variant=5": (dict(variant=5), "variant must be a string"),
    "variant=list": (dict(variant=["small"]), "variant must be a string"),
    "seed=str": (dict(seed="x"), "seed must be an integer"),
    "seed=-1": (dict(seed=-1), "seed must be at least 0"),
    "seed=1.5": (dict(seed=1.5), "seed must be an integer"),
    "seed=None": (dict(seed=None), "seed must be an integer"),
    "seed=True": (dict(seed=True), "seed must be an integer"),
}


@pytest.mark.parametrize("case", LOAD)
def test_load_refuses(case):
    kw, msg = LOAD[case]
    kw = {"spec": "gpt2", **kw}
    with pytest.raises(UsageError, match=msg):
        tessera.load(kw.pop("spec"), **kw, **TINY)


@pytest.fixture(scope="module")
def model():
    return tessera.load("gpt2", **TINY)


CALLS = {  # (method, args, keywords, error class, what the message must contain)
    "report batch=str": ("report", (), dict(batch="x"), UsageError, "batch must be an integer"),
    "report seq=1.5": ("report", (), dict(seq=1.5), UsageError, "seq must be an integer"),
    "report seq=None": ("report", (), dict(seq=None), UsageError, "seq must be an integer"),
    "report dtype=int3": ("report", (), dict(dtype="int3"), UsageError, "dtype must be one of fp32"),
    "run tokens=str": ("run", (), dict(tokens="abc"), InputError, "input 'tokens': expected numbers"),
    "run tokens=None": ("run", (), dict(tokens=None), InputError, "input 'tokens': expected numbers"),
    "run tokens=dict": ("run", (), dict(tokens={}), InputError, "input 'tokens': expected numbers"),
    "run tokens ragged": ("run", (), dict(tokens=[[1, 2], [3]]), InputError, "not rectangular"),
    "run tokens 2**70": ("run", (), dict(tokens=[[2 ** 70]]), InputError, "within int64"),
    "run tokens 1e30": ("run", (), dict(tokens=[[1e30]]), InputError, "floating-point values but expects i64"),
    "run tokens float": ("run", (), dict(tokens=[[1.5]]), InputError, "floating-point values but expects i64"),
    "run tokens whole float": ("run", (), dict(tokens=[[1.0, 2.0]]), InputError, "floating-point values"),
    "run tokens bool": ("run", (), dict(tokens=[[True, False]]), InputError, "true/false values"),
    "run tokens deep": ("run", (), dict(tokens=[[[[[[[[[[[[[1]]]]]]]]]]]]]), InputError, "tokens"),
    "run texts=None (found by test_fuzz_inputs.py)": ("run", (), dict(texts=None), UsageError,
                                                     "texts must be a list of strings"),
    "run texts=str": ("run", (), dict(texts="abc"), UsageError, "texts must be a list of strings"),
    "run unknown input": ("run", (), dict(tokenz=[[1]]), InputError, "unknown input 'tokenz'"),
    "generate prompt=None": ("generate", (None,), {}, UsageError, "prompt must be a str"),
    "generate prompt=5": ("generate", (5,), {}, UsageError, "prompt must be a str"),
    "generate prompt=[1.5]": ("generate", ([1.5],), {}, UsageError, "prompt must be a str"),
    "generate prompt=[True]": ("generate", ([True],), {}, UsageError, "prompt must be a str"),
    "generate prompt row of floats": ("generate", ([[1], [1.5]],), {}, UsageError, "prompt 1"),
    "generate prompt dict": ("generate", ({"a": 1},), {}, UsageError, "prompt must be a str"),
    "generate prompt surrogate": ("generate", ("\ud800",), dict(tokenizer="t.json"), UsageError, "not valid Unicode"),
    "generate prompt 2**70": ("generate", ([2 ** 70],), {}, UsageError, "outside the vocabulary"),
    "generate seed=-1": ("generate", ([1, 2],), dict(seed=-1), UsageError, "seed must be at least 0"),
    "generate seed=str": ("generate", ([1, 2],), dict(seed="x"), UsageError, "seed must be an integer"),
    "generate seed=1.5": ("generate", ([1, 2],), dict(seed=1.5), UsageError, "seed must be an integer"),
    "generate stop=None": ("generate", ([1, 2],), dict(stop=None), UsageError, "stop must be a list of strings"),
    "generate stop=[5]": ("generate", ([1, 2],), dict(stop=[5]), UsageError, "stop must be a list of strings"),
    "generate stop_tokens=None": ("generate", ([1, 2],), dict(stop_tokens=None), UsageError,
                                  "stop_tokens must be a list of integers"),
    "generate stop_tokens=5": ("generate", ([1, 2],), dict(stop_tokens=5), UsageError,
                               "stop_tokens must be a list of integers"),
    "generate tokenizer=123": ("generate", ([1, 2],), dict(tokenizer=123), UsageError, "tokenizer must be a path"),
    "generate threads=str": ("generate", ([1, 2],), dict(threads="x"), UsageError, "threads must be an integer"),
    "generate threads=1.5": ("generate", ([1, 2],), dict(threads=1.5), UsageError, "threads must be an integer"),
    "generate max_new_tokens=2**70": ("generate", ([1, 2],), dict(max_new_tokens=2 ** 70), UsageError,
                                      "goes past the context"),
    "compile out=None": ("compile", (None,), {}, UsageError, "out must be a path"),
    "compile out=123": ("compile", (123,), {}, UsageError, "out must be a path"),
    "compile out with NUL": ("compile", ("a\0b.onnx",), {}, UsageError, "out must be a path without NUL"),
    "compile target=tpu": ("compile", ("{out}",), dict(target="tpu"), UsageError, "target must be one of cpu"),
    "compile dtype=fp17": ("compile", ("{out}",), dict(dtype="fp17"), UsageError, "dtype must be one of fp32"),
    "compile context_length=str": ("compile", ("{dir}",), dict(genai=True, context_length="x", tokenizer="t.json"),
                                   UsageError, "context_length must be an integer"),
    "compile tokenizer=123": ("compile", ("{dir}",), dict(genai=True, tokenizer=123), UsageError,
                              "tokenizer must be a path"),
    "alignment layer=str": ("alignment", (), dict(layer="x", tokens=[[1, 2]]), UsageError, "layer must be an integer"),
    "alignment head=str": ("alignment", (), dict(head="x", tokens=[[1, 2]]), UsageError, "head must be an integer"),
}


@pytest.mark.parametrize("case", CALLS)
def test_api_call_refuses(model, case, tmp_path):
    method, args, kw, error, msg = CALLS[case]
    args = tuple(a.format(out=tmp_path / "m.onnx", dir=tmp_path / "g") if isinstance(a, str) and "{" in a else a
                 for a in args)
    with pytest.raises(error, match=msg):
        getattr(model, method)(*args, **kw)


def test_integer_ids_as_floats_are_not_truncated(model):
    """run(tokens=[[1.5]]) used to run on token 1: the float is refused, the int list still runs."""
    out = model.run(tokens=[[1, 2]])
    assert out["logits"].shape == (1, 2, 50)
    with pytest.raises(InputError):
        model.run(tokens=[[1.0, 2.0]])


def test_input_json_nested_deep_is_a_clean_error(capsys):
    """--input's JSON nested 100,000 deep was a RecursionError traceback in run and in generate."""
    from conftest import cli_error

    deep = "tokens=" + "[" * 100_000 + "]" * 100_000
    sets = ["--set", "layers=1", "--set", "d=32", "--set", "heads=2", "--set", "vocab=50", "--set", "ctx=16"]
    assert "nested too deep" in cli_error(capsys, "run", "gpt2", *sets, "--input", deep)
    assert "nested too deep" in cli_error(capsys, "generate", "gpt2", *sets, "--input", deep, "--max-new-tokens", "2")


def test_genai_output_with_a_name_too_long(capsys, tmp_path):
    """compile --genai -o DIR/<300 characters>/g was an OSError traceback (the disk check's is_dir)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from conftest import cli_error

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    sets = ["--set", "layers=1", "--set", "d=32", "--set", "heads=2", "--set", f"vocab={tok.get_vocab_size()}",
            "--set", "ctx=16"]
    err = cli_error(capsys, "compile", "gpt2", *sets, "--genai", "--tokenizer", tmp_path / "tokenizer.json",
                    "-o", tmp_path / ("a" * 300) / "g")
    assert "File name too long" in err
