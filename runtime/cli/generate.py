"""``tessera generate``: text or token ids in, generated tokens out, with a KV cache.

The flags fill runtime/options.GenerateOptions; runtime/driver.generate loads the model and
checks the request (runtime/generation/loop.py); this module drives the steps and prints, live
for a single text prompt. Every bad value is a UsageError: a clear message and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tessera.runtime import options
from tessera.runtime.options import GenerateOptions, ModelRef

EXAMPLES = """examples:
  tessera generate models/gpt2.tsr -V small --weights gpt2/model.safetensors \\
      --tokenizer gpt2/tokenizer.json --prompt "The quick brown fox" --max-new-tokens 40
  tessera generate models/gpt2.tsr --set layers=2 --input 'tokens=[[464, 2068], [7586]]' --max-new-tokens 8
  tessera generate models/llama.tsr -V llama3_8b --weights llama3/ --tokenizer llama3/tokenizer.json \\
      --prompt "Hello" --max-new-tokens 64 --temperature 0.7 --top-p 0.9 --seed 1 --stop "<|eot_id|>"
  tessera generate llama3-folder/ --chat --prompt "Hello" --min-p 0.05 --temperature 0.8 \
      --no-repeat-ngram-size 3 --logprobs 5 --format json
"""

# the model's flags (options.ModelRef) as generate words them
HELPS = {"spec": "a .tsr spec, or an .onnx file (or folder) compiled with a KV cache",
         "seed": "seed of the sampler, and of the weight initialiser without --weights (default 0)",
         "allow_large": options.LOAD_ALLOW_LARGE}


def add_parser(sub) -> argparse.ArgumentParser:
    g = sub.add_parser("generate", help="generate text or tokens with a KV cache",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
                       description="Compile a decoder-only spec with a KV cache (or load one compiled so) and "
                                   "generate: prefill the prompts once, then one token per step. Prompts of "
                                   "different lengths are left-padded and masked.")
    options.add_arguments(g, ModelRef, HELPS)  # MODEL, --variant, --set, --seed, --weights, --allow-large
    g.add_argument("--tokenizer", metavar="tokenizer.json", help="a Hugging Face tokenizer.json for --prompt and "
                   "for printing text")
    g.add_argument("--prompt", dest="prompts", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeatable: a batch); needs --tokenizer")
    g.add_argument("--input", "-i", dest="inputs", action="append", default=[], metavar="NAME=JSON",
                   help="token ids as JSON, a list of lists: the prompts (tokens=..., one list per prompt, of any "
                        "lengths); for an encoder-decoder also its source inputs (e.g. src=... and src_mask=..., "
                        "rows of one length) and optionally the target prompts (e.g. tgt=...)")
    g.add_argument("--start-token", type=int, metavar="ID",
                   help="an encoder-decoder's decoder start token, when no target prompt is given")
    given = " (default: the checkpoint's generation_config.json, else %s)"
    g.add_argument("--max-new-tokens", type=int, metavar="N", help="tokens to generate per prompt" + given % 32)
    g.add_argument("--temperature", type=float, help="0 is greedy; > 0 samples" + given % "0, greedy")
    g.add_argument("--top-k", type=int, metavar="K", help="sample from the K most likely tokens (0: all)" + given % 0)
    g.add_argument("--top-p", type=float, metavar="P",
                   help="sample from the smallest set of tokens whose probability reaches P, in (0, 1]" + given % 1)
    g.add_argument("--repetition-penalty", type=float, metavar="R",
                   help="divide the scores of tokens already present by R (> 0; 1 is none)" + given % 1)
    g.add_argument("--min-p", type=float, metavar="P",
                   help="when sampling, drop tokens less likely than P times the most likely one, in [0, 1]"
                        + given % 0)
    g.add_argument("--no-repeat-ngram-size", type=int, metavar="N",
                   help="never repeat an N-gram of the prompt and the new tokens (0: no limit)" + given % 0)
    g.add_argument("--min-new-tokens", type=int, metavar="N",
                   help="no stop token (end of sequence, --stop-token) before N new tokens" + given % 0)
    g.add_argument("--logprobs", type=int, metavar="N",
                   help="with --format json or jsonl: each new token's log-probability under the model (log_softmax of "
                        "its logits, before the decoding settings) and the N most likely alternatives' (0..20)")
    g.add_argument("--chat", action="store_true",
                   help="apply the tokenizer folder's chat template (chat_template.jinja, else "
                        "tokenizer_config.json's) to each --prompt, as the user's message; the text format then "
                        "prints the reply alone")
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the checkpoint's end-of-sequence token (eos_token_id of "
                        "generation_config.json or config.json beside the model, weights or tokenizer)")
    g.add_argument("--explain", action="store_true",
                   help="print each decoding setting and where its value came from (flag, file or default); "
                        "for a GGUF file also which tensors were dequantised from which type")
    g.add_argument("--stop", dest="stops", action="append", default=[], metavar="TEXT",
                   help="end a prompt's generation at this text (repeatable; needs --tokenizer)")
    g.add_argument("--stop-token", dest="stop_tokens", action="append", default=[], type=int, metavar="ID",
                   help="end a prompt's generation at this token id (repeatable)")
    g.add_argument("--format", choices=["text", "json", "jsonl"], default="text",
                   help="output format (default text); jsonl streams one JSON object per new token as it is "
                        "decoded (prompt, token, text, and with --logprobs logprob and top), then one of stats")
    options.add_build_arguments(g)  # the compile options every command takes (--quantize ...)
    g.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: all cores)")
    g.add_argument("--provider", choices=["auto", "cpu", "cuda"], default="auto",
                   help="onnxruntime's execution provider: auto takes CUDA where the machine shows a GPU and "
                        "onnxruntime has its CUDA provider; on CUDA a spec is compiled for CUDA and its KV cache "
                        "stays on the device (docs/generate.md) (default auto)")
    g.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32",
                   help="precision a spec is compiled at (fp16 and bf16 on CUDA: GroupQueryAttention decoding "
                        "over the cache on the device; bf16 on CUDA only) (default fp32)")
    g.add_argument("--cache", choices=["auto", "buffer", "concat"], default="auto",
                   help="buffer: preallocated cache, written in place; concat: present = past + new, fed back; "
                        "auto: buffer, or concat for sliding-window models (default)")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress line on stderr")
    g.add_argument("--speculative", metavar="ngram|DRAFT_MODEL",
                   help="speculative decoding (greedy only; the output equals plain greedy decoding): draft tokens "
                        "by prompt lookup (ngram) or with a smaller draft model of the same vocabulary (a .tsr spec, "
                        "checkpoint folder or compiled .onnx), verified by the model in one call per round")
    g.add_argument("--draft-tokens", type=int, metavar="K",
                   help=f"with --speculative: tokens drafted per round (default {GenerateOptions.NGRAM_DRAFT_TOKENS} "
                        f"with ngram, {GenerateOptions.MODEL_DRAFT_TOKENS} with a draft model)")
    g.add_argument("--json-schema", metavar="FILE",
                   help="structured output: every output is JSON valid against this JSON schema file (needs "
                        "--tokenizer; llguidance, the structured extra)")
    g.add_argument("--regex", metavar="R", help="structured output: every output matches this regular expression")
    g.add_argument("--grammar", metavar="FILE.lark",
                   help="structured output: every output follows this Lark grammar (llguidance's dialect)")
    return g


def cmd_generate(ns: argparse.Namespace) -> int:
    from tessera.runtime import driver
    from tessera.runtime.generation import cached as gen
    from tessera.runtime.generation.loop import Generation

    from tessera.runtime.progress import Progress

    o = GenerateOptions.from_args(ns)
    with Progress("compiling the cached decoder", "stages", quiet=o.quiet) as progress:
        run = driver.generate(ModelRef.from_args(ns), o, progress=progress)
    prompts, tokenizer, stats = run.prompts, run.tokenizer, run.stats
    out: list[list[int]] = [[] for _ in prompts]
    live = o.format == "text" and tokenizer is not None and len(prompts) == 1
    shown = ""
    if live and not o.chat:  # a chat prompt is the template's rendering (system prompt and all): the reply alone
        print(tokenizer.decode(prompts[0], skip_special_tokens=False), end="", flush=True)
    started, last_note = time.perf_counter(), 0.0
    show_progress = not o.quiet
    lines = _JsonLines(run) if o.format == "jsonl" else None
    for emitted in run.steps():
        for r, tok in enumerate(emitted):
            if tok is not None:
                out[r].append(tok)
        if lines is not None:
            lines.step(emitted, out)
        if live:
            now = run.text(out[0])
            if now.startswith(shown):
                print(now[len(shown):], end="", flush=True)
                shown = now
        elapsed = time.perf_counter() - started
        if show_progress and elapsed > 2.0 and elapsed - last_note > 0.5 and not live:
            gen.progress(stats)
            last_note = elapsed
    if show_progress and last_note:
        print(file=sys.stderr)
    summary = {"prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens,
               "prefill_ms": round(stats.prefill_s * 1e3, 3),
               "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2), **_speculative_stats(stats)}
    if o.format == "json":
        print(json.dumps({"outputs": run.rows(out), "stats": summary}))
    elif lines is not None:
        print(json.dumps({"stats": summary}), flush=True)
    elif live:
        print()
    else:
        for r, p in enumerate(prompts):
            if tokenizer is not None:
                print(("" if o.chat else tokenizer.decode(p, skip_special_tokens=False)) + run.text(out[r]))
            else:
                print(" ".join(map(str, out[r])))
    if o.explain and run.explain():
        print(run.explain(), file=sys.stderr)
    if show_progress:
        print(f"{stats.new_tokens} new tokens; prefill {stats.prefill_s * 1e3:.1f} ms "
              f"({stats.prompt_tokens} prompt tokens), decode {stats.decode_tokens_per_s:.1f} steps/s",
              file=sys.stderr)
    return 0


class _JsonLines:
    """--format jsonl: one line per new token as soon as it is decoded -- its prompt's index, id, the
    text it adds (with a tokenizer; an incomplete character waits for the token that completes it) and,
    with --logprobs, its log-probability and the top alternatives' (the entries --format json lists)."""

    def __init__(self, run):
        self.run, self.shown = run, [""] * len(run.prompts)

    def step(self, emitted: list[int | None], out: list[list[int]]) -> None:
        run = self.run
        for r, tok in enumerate(emitted):
            if tok is None:
                continue
            line = {"prompt": r, "token": tok}
            if run.tokenizer is not None:
                text, line["text"] = run.text(out[r]), ""
                if text.startswith(self.shown[r]) and not text.endswith("\ufffd"):
                    line["text"], self.shown[r] = text[len(self.shown[r]):], text
            if run.sampling.logprobs is not None:
                entry = run.logprobs[r][len(out[r]) - 1]
                line.update(logprob=entry["logprob"], top=entry["top"])
            print(json.dumps(line), flush=True)


def _speculative_stats(stats) -> dict:
    """The JSON output's counts of speculative decoding (none when decoding plainly)."""
    if stats.drafted is None:
        return {}
    return {"drafted_tokens": stats.drafted, "accepted_tokens": stats.accepted, "verify_calls": stats.rounds,
            "acceptance_rate": round(stats.accepted / stats.drafted, 4) if stats.drafted else 0.0,
            **({"replayed_rows": stats.replayed_rows, "replay_calls": stats.replays}
               if stats.replays is not None else {})}
