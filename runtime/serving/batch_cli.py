"""``tessera batch MODEL --input prompts.jsonl --output results.jsonl [--ray]``: the sub-parser and the
command. The work is serving/batch.py's (one local engine) or serving/ray_batch.py's (Ray Data, one
engine per actor); this module only chooses between them, so neither imports the other's caller.
"""

from __future__ import annotations

import argparse
import sys

from tessera.runtime.options import add_engine_arguments

from .batch import ROW_FIELDS, BatchOptions, Journal, check_output, read_rows, run_local, write_atomically

# the engine's flags as batch words them (the rest is EngineOptions' own help)
HELPS = {"tokenizer": "a Hugging Face tokenizer.json (or its folder): text prompts, stop strings, text in the results; "
                      "its folder gives the end-of-sequence token",
         "max_batch": "sequences decoded together per engine (default 8)",
         "max_queue": "rows waiting for a slot per engine (default 64)",
         "threads": "onnxruntime intra-op threads (default: all cores; with --ray: 1), and with --ray the CPUs each "
                    "actor reserves",
         "max_context": "positions per slot, prompt and new tokens together (default: the model's context)"}

EXAMPLES = """examples:
  tessera batch models/gpt2.tsr -V small --weights gpt2/model.safetensors --tokenizer gpt2/tokenizer.json \\
      --input prompts.jsonl --output results.jsonl
  tessera batch gpt2 --set layers=2 --input ids.jsonl --output out.jsonl --ray --concurrency 4
input lines:  {"prompt": "Hello", "max_tokens": 20, "temperature": 0}   {"prompt": [464, 2068], "stop": ["."]}
output lines: {"text": " world", "tokens": [995, ...], "finish_reason": "length"}   {"error": "..."}
"""


def add_parser(sub) -> argparse.ArgumentParser:
    d = BatchOptions(spec="")
    b = sub.add_parser("batch", help="generate for a JSON-lines file of prompts (continuous batching; Ray Data "
                       "with --ray)", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
                       description="Run every prompt of --input through the serving engine (rows share each "
                                   "decoding step) and write one result per line to --output, in input order, "
                                   "atomically. A row that fails gets an error on its line. With --ray, "
                                   "Ray Data runs --concurrency engines (one per actor). See docs/serve.md.")
    b.add_argument("--input", "-i", required=True, metavar="FILE.jsonl",
                   help=f"one JSON object a line: prompt (text or token ids) and optionally "
                        f"{', '.join(ROW_FIELDS[1:])}")
    b.add_argument("--output", "-o", required=True, metavar="FILE.jsonl",
                   help="one JSON object a line: text, tokens, finish_reason (or error)")
    add_engine_arguments(b, HELPS)  # the model, its compile, the tokenizer, the engine (options.EngineOptions)
    b.add_argument("--max-tokens", type=int, default=d.max_tokens, metavar="N",
                   help=f"new tokens for a row without max_tokens (default {d.max_tokens}, as OpenAI's completions)")
    b.add_argument("--resume", action="store_true",
                   help="continue an interrupted run: rows already in its journal (--output's name + .journal, "
                        "written as rows finish) are not run again")
    b.add_argument("--ray", action="store_true", help="run on Ray Data: one engine per actor (the serve extra)")
    b.add_argument("--concurrency", type=int, default=d.concurrency, metavar="N",
                   help="with --ray: actors, each holding one engine (default 1)")
    b.add_argument("--address", metavar="ADDR", help="with --ray: a running cluster ('auto', HOST:PORT or "
                   "ray://HOST:10001); default: start a local Ray for this run")
    return b


def cmd_batch(args) -> int:
    opts = BatchOptions.from_args(args)
    opts.check()
    rows = read_rows(opts.input)
    check_output(opts.output)  # before the model loads: a bad --output costs no work
    if opts.ray:
        from .ray_batch import run_on_ray

        results = run_on_ray(opts, rows)
        write_atomically(opts.output, results)
    else:
        journal = Journal(opts, len(rows))
        if journal.done:
            print(f"--resume: {len(journal.done)} of {len(rows)} rows already done ({journal.path})", file=sys.stderr)
        try:
            results = run_local(opts, rows, journal)
            write_atomically(opts.output, results)
        except BaseException:
            journal.close(finished=False)
            if journal.kept:
                print(f"{len(journal.done)} finished rows are kept in {journal.path}: the same command with "
                      f"--resume continues", file=sys.stderr)
            raise
        journal.close(finished=True)
    failed = sum("error" in r for r in results)
    print(f"{len(results)} rows -> {opts.output}" + (f" ({failed} failed: see their error)" if failed else ""),
          file=sys.stderr)
    return 0
