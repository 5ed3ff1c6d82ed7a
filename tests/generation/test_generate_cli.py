"""``tessera generate`` and ``tessera.load(...).generate``: results, text in and out, and bad input.

The token results are checked against the decoding loop's reference behaviour
elsewhere (test_generate.py compares with transformers); here the command and
the Python API must give the same tokens as each other and as a full
recomputation with the uncached model, and every bad value must be a clear
error with exit status 2 and no traceback.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tessera
from conftest import MODELS, cli, cli_error
from tessera.runtime.pipeline import UsageError

SMALL = dict(layers=2, d=32, heads=4, vocab=50, ctx=64)
SETS = [a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")]
GPT2 = str(MODELS / "gpt2.tsr")


@pytest.fixture(scope="module")
def model():
    return tessera.load(GPT2, **SMALL)


def _greedy_by_recomputation(m, prompt, n):
    """Greedy decoding the slow way: the uncached model over the whole sequence at every step."""
    seq = list(prompt)
    for _ in range(n):
        logits = m.run(tokens=[seq])["logits"]
        seq.append(int(np.argmax(logits[0, -1])))
    return seq[len(prompt):]


def test_api_equals_recomputation_and_streams(model):
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8]]
    out = model.generate(prompts, max_new_tokens=12)
    assert out == [_greedy_by_recomputation(model, p, 12) for p in prompts]
    assert model.generate(prompts[0], max_new_tokens=12) == out[0]
    steps = list(model.generate(prompts, max_new_tokens=12, stream=True))
    assert [[s[r] for s in steps] for r in range(2)] == out


def test_cli_tokens_json_equals_api(model, capsys):
    rc, out, err = cli(capsys, "generate", GPT2, *SETS, "--input", "tokens=[[1, 2, 3, 4, 5, 6], [7, 8]]",
                       "--max-new-tokens", 12, "--format", "json")
    assert rc == 0, err
    data = json.loads(out)
    assert [row["tokens"] for row in data["outputs"]] == model.generate([[1, 2, 3, 4, 5, 6], [7, 8]], 12)
    assert data["stats"]["new_tokens"] == 24


def test_compiled_file_generates_the_same(model, tmp_path, capsys):
    path = tmp_path / "cached.onnx"
    model.compile(path, kv_cache=True)
    rc, out, err = cli(capsys, "generate", path, "--input", "tokens=[[3, 1, 4, 1, 5]]", "--max-new-tokens", 9,
                       "--format", "json", "--temperature", 0.8, "--top-k", 10, "--seed", 3)
    assert rc == 0, err
    want = model.generate([3, 1, 4, 1, 5], 9, temperature=0.8, top_k=10, seed=3)
    assert json.loads(out)["outputs"][0]["tokens"] == want
    rc, out2, _ = cli(capsys, "generate", path, "--input", "tokens=[[3, 1, 4, 1, 5]]", "--max-new-tokens", 9,
                      "--format", "json", "--temperature", 0.8, "--top-k", 10, "--seed", 3)
    assert json.loads(out2)["outputs"] == json.loads(out)["outputs"]  # same seed, same tokens


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A word-level tokenizer.json over 50 words (the small model's vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


WORDS = ["<|endoftext|>"] + [f"w{i}" for i in range(49)]


def test_text_in_text_out_and_stop_text(model, tokenizer_file, capsys):
    prompt = "w1 w2 w3 w4"
    ids = [WORDS.index(w) for w in prompt.split()]
    want = model.generate(ids, 10)
    rc, out, err = cli(capsys, "generate", GPT2, *SETS, "--tokenizer", tokenizer_file, "--prompt", prompt,
                       "--max-new-tokens", 10, "--format", "json")
    assert rc == 0, err
    row = json.loads(out)["outputs"][0]
    assert row["prompt_tokens"] == ids and row["tokens"] == want
    assert row["text"] == " ".join(WORDS[t] for t in want)
    assert model.generate(prompt, 10, tokenizer=tokenizer_file) == row["text"]
    assert "".join(model.generate(prompt, 10, tokenizer=tokenizer_file, stream=True)) == row["text"]
    # a stop text: generation of the row ends at the token that completes it, and the text is cut there
    stop = WORDS[want[3]]
    first = next(i for i in range(len(want)) if stop in " ".join(WORDS[t] for t in want[:i + 1]))
    rc, out, err = cli(capsys, "generate", GPT2, *SETS, "--tokenizer", tokenizer_file, "--prompt", prompt,
                       "--max-new-tokens", 10, "--format", "json", "--stop", stop)
    assert rc == 0, err
    row = json.loads(out)["outputs"][0]
    assert row["tokens"] == want[:first + 1]
    assert stop not in row["text"]
    # plain text output, streamed for one prompt
    rc, out, err = cli(capsys, "generate", GPT2, *SETS, "--tokenizer", tokenizer_file, "--prompt", prompt,
                       "--max-new-tokens", 10)
    assert rc == 0 and out.startswith(prompt)


@pytest.mark.parametrize("args,message", [
    (["--input", "tokens=[[]]"], "prompt 0 is empty"),
    (["--input", "tokens=[[1, 2], []]"], "prompt 1 is empty"),
    (["--input", f"tokens=[{list(range(1, 50)) + list(range(1, 20))}]"], "longer than the model's context of 64"),
    (["--max-new-tokens", "62"], "max_new_tokens=62 goes past the context"),
    (["--max-new-tokens", "0"], "must be at least 1"),
    (["--stop-token", "50"], "unknown stop token 50"),
    (["--stop-token", "-1"], "unknown stop token -1"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--temperature", "-0.5"], "temperature must be a number >= 0"),
    (["--top-k", "-3"], "top_k must be an integer >= 0"),
    (["--repetition-penalty", "0"], "repetition_penalty must be a number > 0"),
    (["--input", "tokens=[[1, 99]]"], "outside the vocabulary [0, 50)"),
    (["--input", "tokens=[[1, 2]]", "--prompt", "w1"], "either as --prompt text or as --input tokens"),
    (["--prompt", "w1"], "--prompt needs --tokenizer"),
    (["--stop", "w1"], "--stop TEXT needs --tokenizer"),
    (["--input", "ids=[[1]]"], "--input ids: the model has no such input (its inputs: tokens)"),
    (["--input", "tokens=[[1, 2"], "not a JSON list"),
])
def test_bad_input_is_a_clear_error(capsys, args, message):
    base = ["--input", "tokens=[[1, 2, 3]]"] if not any(a in ("--input", "--prompt") for a in args) else []
    if "--max-new-tokens" not in args:
        args = [*args, "--max-new-tokens", "4"]
    err = cli_error(capsys, "generate", GPT2, *SETS, *base, *args)
    assert message in err, err


def test_models_without_a_causal_decoder_are_refused(capsys, tmp_path):
    err = cli_error(capsys, "generate", MODELS / "bert.tsr", "--set", "layers=1", "--input", "tokens=[[1, 2]]",
                    "--max-new-tokens", 2)
    assert "decoder-only" in err
    plain = tmp_path / "plain.onnx"
    tessera.load(GPT2, **SMALL).compile(plain)
    err = cli_error(capsys, "generate", plain, "--input", "tokens=[[1, 2]]", "--max-new-tokens", 2)
    assert "compiled without a KV cache" in err


def test_api_bad_input_raises_usage_error(model):
    with pytest.raises(UsageError, match="top_p"):
        model.generate([1, 2], 4, top_p=0)
    with pytest.raises(UsageError, match="empty"):
        model.generate([[1], []], 4)
    with pytest.raises(UsageError, match="tokenizer"):
        model.generate("hello", 4)


TRANSFORMER = str(MODELS / "transformer.tsr")
T_SMALL = dict(layers=2, d=32, heads=4, d_ff=64, vocab=50)
T_SETS = [a for k, v in T_SMALL.items() for a in ("--set", f"{k}={v}")]


def test_cli_encoder_decoder_equals_recomputation(capsys):
    """`tessera generate` on the encoder-decoder (encoder once, cached decoder) gives the tokens of greedy
    decoding with the uncached model over the whole target at every step, for a padded source batch."""
    m = tessera.load(TRANSFORMER, seed=3, **T_SMALL)
    src, mask = [[3, 4, 5, 6], [7, 8, 0, 0]], [[1, 1, 1, 1], [1, 1, 0, 0]]
    rc, out, err = cli(capsys, "generate", TRANSFORMER, *T_SETS, "--seed", 3, "--input", f"src={src}",
                       "--input", f"src_mask={mask}", "--start-token", 1, "--max-new-tokens", 8, "--format", "json")
    assert rc == 0, err
    ours = [row["tokens"] for row in json.loads(out)["outputs"]]
    for r in range(2):
        seq = [1]
        for _ in range(8):
            logits = m.run(src=[src[r]], src_mask=[mask[r]], tgt=[seq])["logits"]
            seq.append(int(np.argmax(logits[0, -1])))
        assert ours[r] == seq[1:], f"row {r}"
    # a target prompt given as an input continues from it
    rc, out, _ = cli(capsys, "generate", TRANSFORMER, *T_SETS, "--seed", 3, "--input", f"src={src[:1]}",
                     "--input", f"src_mask={mask[:1]}", "--input", f"tgt=[[1, {ours[0][0]}]]", "--max-new-tokens", 3,
                     "--format", "json")
    assert rc == 0 and json.loads(out)["outputs"][0]["tokens"] == ours[0][1:4]


@pytest.mark.parametrize("args, message", [
    (["--input", "src=[[3, 4]]", "--input", "src_mask=[[1, 1]]"], "needs the target's first tokens"),
    (["--input", "src=[[3, 4]]", "--start-token", "1"], "needs its source inputs: give --input src_mask"),
    (["--input", "scr=[[3, 4]]", "--start-token", "1"], "did you mean 'src'"),
    (["--input", "src=[[3, 4], [5]]", "--input", "src_mask=[[1, 1], [1]]", "--start-token", "1"], "one length"),
    (["--input", "src=[[3, 99]]", "--input", "src_mask=[[1, 1]]", "--start-token", "1"], "must be in [0, 50)"),
    (["--input", "src=[[3, 4]]", "--input", "src_mask=[[1, 1]]", "--input", "tgt=[[1]]", "--start-token", "1"],
     "exclude each other"),
])
def test_cli_encoder_decoder_bad_input(capsys, args, message):
    err = cli_error(capsys, "generate", TRANSFORMER, *T_SETS, *args, "--max-new-tokens", 2)
    assert message in err


def test_cli_start_token_needs_an_encoder_decoder(capsys):
    err = cli_error(capsys, "generate", GPT2, *SETS, "--input", "tokens=[[1, 2]]", "--start-token", 1,
                    "--max-new-tokens", 2)
    assert "--start-token applies to encoder-decoders" in err


def test_cli_compile_kv_cache_then_generate(model, tmp_path, capsys):
    """`tessera compile --kv-cache` writes the cached decoder `tessera generate` loads (same tokens as the
    API); --explain names the kernel chosen per phase; --cache without --kv-cache is refused."""
    out_file = tmp_path / "cached.onnx"
    rc, _, err = cli(capsys, "compile", GPT2, *SETS, "--kv-cache", "--explain", "-o", out_file)
    assert rc == 0, err
    assert "KV cache (buffer mode): 2 cached attention sites" in err and "prefill (T > 1): portable" in err
    rc, out, err = cli(capsys, "generate", out_file, "--input", "tokens=[[1, 2, 3], [4]]", "--max-new-tokens", 6,
                       "--format", "json", "-q")
    assert rc == 0, err
    assert [r["tokens"] for r in json.loads(out)["outputs"]] == model.generate([[1, 2, 3], [4]], 6)
    assert "--cache applies with --kv-cache" in cli_error(capsys, "compile", GPT2, *SETS, "--cache", "concat",
                                                          "-o", tmp_path / "x.onnx")
    assert "takes neither --no-fuse nor --attention" in cli_error(capsys, "compile", GPT2, *SETS, "--kv-cache",
                                                                  "--no-fuse", "-o", tmp_path / "x.onnx")


LLAMA = str(MODELS / "llama.tsr")
L_SETS = ["--set", "layers=1", "--set", "d=32", "--set", "heads=4", "--set", "kv_heads=2", "--set", "d_ff=48",
          "--set", "vocab=64", "--set", "ctx=8"]


def test_rotary_models_declare_their_context(capsys, tmp_path):
    """A rotary model's ctx (its rope max_ctx) bounds run (spec and compiled file) and generate, with the
    input, the length and the limit named; up to the limit runs."""
    nine, eight = "tokens=[[1, 2, 3, 4, 5, 6, 7, 8, 9]]", "tokens=[[1, 2, 3, 4, 5, 6, 7, 8]]"
    want = "T=9 is longer than the 8 positions of 'layers.0.attn (rotary max_ctx)'"
    assert want in cli_error(capsys, "run", LLAMA, *L_SETS, "--input", nine, "--provider", "cpu")
    out_file = tmp_path / "l.onnx"
    assert cli(capsys, "compile", LLAMA, *L_SETS, "-o", out_file)[0] == 0
    assert want in cli_error(capsys, "run", out_file, "--input", nine, "--provider", "cpu")
    assert cli(capsys, "run", out_file, "--input", eight, "--provider", "cpu")[0] == 0
    err = cli_error(capsys, "generate", LLAMA, *L_SETS, "--input", "tokens=[[1, 2, 3, 4, 5]]", "--max-new-tokens", 4)
    assert "the model has 8 positions, so at most 3 new tokens" in err
    assert cli(capsys, "generate", LLAMA, *L_SETS, "--input", "tokens=[[1, 2, 3, 4, 5]]", "--max-new-tokens", 3,
               "-q")[0] == 0


def test_bundled_rotary_contexts_are_the_published_ones():
    from tessera.runtime import pipeline
    from tessera.compiler.ir.signature import input_limits

    for spec, variant, ctx in (("llama", "llama2_7b", 4096), ("llama", "llama3_8b", 8192),
                               ("llama", "llama3_1_8b", 131072), ("mixtral", "8x7b", 32768)):
        built = pipeline.build(MODELS / f"{spec}.tsr", variant, ["layers=1"])
        assert input_limits(built.graph).dims["T"][0] == ctx, (spec, variant)


def test_compile_decode_option_picks_the_decode_kernel_and_is_refused_where_it_cannot_apply(tmp_path, capsys):
    """--decode plain writes no cache_length input; --decode gqa on a head size of 12 is a usage error
    naming the attention; --decode without --kv-cache is refused."""
    import onnx

    from tessera.runtime.cli import main

    small = ["--set", "layers=1", "--set", "heads=4", "--set", "vocab=100", "--set", "ctx=64"]
    out = tmp_path / "plain.onnx"
    assert main(["compile", "gpt2", *small, "--set", "d=64", "--kv-cache", "--decode", "plain", "-o", str(out)]) == 0
    assert "cache_length" not in [i.name for i in onnx.load(str(out), load_external_data=False).graph.input]
    out = tmp_path / "gqa.onnx"
    assert main(["compile", "gpt2", *small, "--set", "d=64", "--kv-cache", "-o", str(out)]) == 0
    assert "cache_length" in [i.name for i in onnx.load(str(out), load_external_data=False).graph.input]
    capsys.readouterr()
    assert main(["compile", "gpt2", *small, "--set", "d=48", "--kv-cache", "--decode", "gqa",
                 "-o", str(tmp_path / "x.onnx")]) == 2
    assert "layers.0.attn" in capsys.readouterr().err
    assert main(["compile", "gpt2", *small, "--set", "d=64", "--decode", "plain", "-o", str(tmp_path / "y.onnx")]) == 2
    assert "--decode applies with --kv-cache" in capsys.readouterr().err
