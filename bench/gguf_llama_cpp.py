"""One GGUF file through Tessera and through llama.cpp's own tools, side by side (issue 42).

    python bench/gguf_llama_cpp.py SmolLM2-135M-Instruct.Q4_1.gguf --llama-cpp-bin DIR \
        --text seeds.txt --tokens 4104 --context 512 --rounds 3 --threads 2 \
        --tessera fp32= --tessera "int4-asym=--quantize int4-asym --quantize-head"

Two measurements on the same file:

- **perplexity**: ``llama-perplexity -m FILE -f TEXT -c CONTEXT`` (llama.cpp's kernels on the file's
  own blocks) against ``tessera perplexity FILE --text TEXT --context CONTEXT`` (llama.cpp's
  convention: windows of CONTEXT tokens, the second half of each scored), the text first cut after
  ``--tokens`` tokens of the file's tokenizer (so both score the same windows); the ratio is
  Tessera ÷ llama.cpp, the issue's check being within 0.5 %;
- **decoding speed**: ``llama-bench -m FILE -p 0 -n NEW -d PROMPT`` (NEW tokens generated after a
  context of PROMPT tokens, the rate llama-bench reports) against ``tessera generate FILE`` with a
  PROMPT-token prompt and NEW new tokens, ``--ignore-eos``, its ``decode_tokens_per_s``; both at
  ``--threads``. The cases alternate round by round in fresh processes; min and median of each and
  of the ratios (Tessera ÷ llama.cpp tokens/s, > 1: Tessera faster) are printed, with each process's
  CPU time ÷ wall time (a loaded machine shows it below the thread count).

``DIR`` holds llama.cpp's ``llama-perplexity`` and ``llama-bench`` (build them from the
``vendor/llama.cpp`` folder of llama-cpp-python's source distribution: ``pip download --no-deps
--no-binary :all: llama-cpp-python``, then ``cmake -B build -DLLAMA_CURL=OFF && cmake --build build
--target llama-perplexity llama-bench``). Each ``--tessera NAME=ARGS`` is one Tessera configuration
(its extra ``generate``/``perplexity`` arguments; empty for the file as read). Each ``--llama NAME=FILE`` is one
llama.cpp case decoding FILE (default: the model itself, named ``llama.cpp``): llama.cpp's Q4_0 and Q8_0 files made
by ``llama-quantize`` from an f32 GGUF of the same weights, beside Tessera's ``--quantize`` of the model, time the
issue's comparison (each Tessera configuration's ratio is printed against every llama.cpp case).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import run_timed as timed  # noqa: E402

TESSERA = [sys.executable, "-c", "import sys; from tessera.runtime.cli import main; sys.exit(main())"]


def cut(model: str, text: str, tokens: int, out: Path) -> Path:
    """The text cut after ``tokens`` tokens of the file's own tokenizer (Tessera's reading of it)."""
    from tessera.runtime.io import gguf_file
    from tokenizers import Tokenizer

    folder = gguf_file.folder_for(Path(model))
    enc = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False)
    kept = text if len(enc.ids) <= tokens else text[:enc.offsets[tokens - 1][1]]
    out.write_text(kept)
    return out


def llama_perplexity(bin_dir: Path, model: str, text: Path, context: int, threads: int) -> float:
    out, _, _ = timed([str(bin_dir / "llama-perplexity"), "-m", model, "-f", str(text), "-c", str(context),
                       "-t", str(threads)])
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    if not m:
        sys.exit(f"llama-perplexity printed no final estimate:\n{out[-2000:]}")
    return float(m.group(1))


def tessera_perplexity(model: str, text: Path, context: int, threads: int, extra: list[str]) -> float:
    out, _, _ = timed(TESSERA + ["perplexity", model, "--text", str(text), "--context", str(context),
                                 "--format", "json", "-q"] + extra)
    return json.loads(out[out.index("{"):out.rindex("}") + 1])["perplexity"]


def llama_decode(bin_dir: Path, model: str, prompt: int, new: int, threads: int) -> tuple[float, float]:
    out, wall, cpu = timed([str(bin_dir / "llama-bench"), "-m", model, "-p", "0", "-n", str(new), "-d", str(prompt),
                            "-t", str(threads), "-r", "1", "-o", "json"])
    rows = json.loads(out[out.index("["):out.rindex("]") + 1])
    return float(rows[0]["avg_ts"]), cpu / wall


def tessera_decode(model: str, prompt: int, new: int, threads: int, extra: list[str]) -> tuple[float, float]:
    ids = ",".join(str(100 + (i * 37) % 5000) for i in range(prompt))
    out, wall, cpu = timed(TESSERA + ["generate", model, "--input", f"tokens=[[{ids}]]", "--max-new-tokens", str(new),
                                      "--ignore-eos", "--threads", str(threads), "--format", "json", "-q"] + extra)
    return float(json.loads(out[out.index("{"):out.rindex("}") + 1])["stats"]["decode_tokens_per_s"]), cpu / wall


def summary(values: list[float]) -> str:
    return f"min {min(values):.3f} / med {statistics.median(values):.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="the GGUF file")
    p.add_argument("--llama-cpp-bin", required=True, type=Path, help="folder of llama-perplexity and llama-bench")
    p.add_argument("--text", type=Path, help="text file for the perplexity (none: no perplexity)")
    p.add_argument("--tokens", type=int, default=4104, help="cut the text after this many tokens (default 4104)")
    p.add_argument("--context", type=int, default=512, help="perplexity window (default 512)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens before decoding (default 128)")
    p.add_argument("--new", type=int, default=128, help="tokens decoded (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the decoding cases (default 3)")
    p.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    p.add_argument("--tessera", action="append", default=[], metavar="NAME=ARGS",
                   help="a Tessera configuration: its name and extra arguments (repeatable; default fp32=)")
    p.add_argument("--llama", action="append", default=[], metavar="NAME=FILE",
                   help="a llama.cpp decoding case: its name and GGUF file (repeatable; default llama.cpp=MODEL)")
    p.add_argument("--skip-decode", action="store_true", help="perplexity only")
    a = p.parse_args()
    configs = [(c.split("=", 1)[0], shlex.split(c.split("=", 1)[1] if "=" in c else "")) for c in a.tessera or ["fp32="]]
    llamas = [tuple(c.split("=", 1)) for c in a.llama] or [("llama.cpp", a.model)]
    for name, file in llamas:
        if not Path(file).is_file():
            sys.exit(f"--llama {name}={file}: no such file")
    result = {"model": a.model, "threads": a.threads}
    if a.text:
        with tempfile.TemporaryDirectory() as tmp:
            text = cut(a.model, a.text.read_text(encoding="utf-8"), a.tokens, Path(tmp) / "text.txt")
            ref = llama_perplexity(a.llama_cpp_bin, a.model, text, a.context, a.threads)
            result["perplexity"] = {"llama.cpp": ref}
            print(f"perplexity, llama.cpp on the file: {ref:.4f}")
            for name, extra in configs:
                ppl = tessera_perplexity(a.model, text, a.context, a.threads, extra)
                result["perplexity"][name] = ppl
                print(f"perplexity, Tessera {name}: {ppl:.4f} (x llama.cpp {ppl / ref:.5f})")
    if not a.skip_decode:
        for name, extra in configs:  # compile once before timing (the compile cache keeps it)
            tessera_decode(a.model, 8, 2, a.threads, extra)
        cases = [(name, ("llama", file)) for name, file in llamas] + [(name, ("tessera", extra)) for name, extra in configs]
        rates: dict[str, list[float]] = {name: [] for name, _ in cases}
        load: dict[str, list[float]] = {k: [] for k in rates}
        for r in range(a.rounds):
            for name, (engine, arg) in (cases if r % 2 == 0 else cases[::-1]):
                ts, ratio = (llama_decode(a.llama_cpp_bin, arg, a.prompt, a.new, a.threads) if engine == "llama"
                             else tessera_decode(a.model, a.prompt, a.new, a.threads, arg))
                rates[name].append(ts)
                load[name].append(ratio)
                print(f"round {r + 1}: {name} {ts:.2f} tokens/s, {1000 / ts:.2f} ms a token (CPU/wall {ratio:.2f})",
                      flush=True)
        result["decode_tokens_per_s"] = rates
        result["cpu_per_wall"] = load
        for name, _ in cases:
            ms = [1000 / t for t in rates[name]]
            print(f"decode, {name}: tokens/s {summary(rates[name])}; ms a token {summary(ms)}")
        for name, _ in configs:
            for lname, _ in llamas:
                ratios = [t / l for t, l in zip(rates[name], rates[lname])]
                print(f"decode tokens/s, Tessera {name} / {lname}: round by round {summary(ratios)}; "
                      f"of the medians {statistics.median(rates[name]) / statistics.median(rates[lname]):.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
