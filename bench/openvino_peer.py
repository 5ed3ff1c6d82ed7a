"""Decoding against OpenVINO GenAI's LLMPipeline on the same checkpoint, side by side (issue 40).

    python bench/openvino_peer.py FOLDER --ov-model OV_FOLDER --ov-python /work/venvs/ov/bin/python \
        --prompt 128 --new 128 --rounds 3 --threads 2

FOLDER is a Hugging Face checkpoint folder Tessera reads (config.json, safetensors, tokenizer.json);
OV_FOLDER the same checkpoint exported by optimum-intel (``optimum-cli export openvino --model FOLDER
--task text-generation-with-past --weight-format fp32 OV_FOLDER``), run by ``openvino_genai.LLMPipeline``
on the CPU in the environment ``--ov-python`` names (``pip install openvino-genai "optimum-intel[openvino]"
torch``; uninstall torchvision if its version does not match torch's, or optimum-cli fails to import).
Both decode greedily ``--new`` tokens after the same ``--prompt`` token ids at ``--threads`` threads, end
of sequence ignored; each case runs in a fresh process, the cases alternating round by round. Reported:
decode tokens/s (Tessera's ``decode_tokens_per_s``; OpenVINO's 1000 / mean time per output token from its
perf metrics, which excludes the first token as Tessera's figure excludes the prefill), min and median,
the ratio Tessera ÷ OpenVINO per round (> 1: Tessera faster), CPU/wall of each process, and whether the
two greedy continuations agree (the same weights in fp32: they should, up to near-ties). OpenVINO's CPU
plugin computes in bf16 by default on a CPU with AVX512-BF16 or AMX even from fp32 weights, so
``--ov-precision f32`` (the default here) asks it for fp32, the precision Tessera computes in.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import run_timed  # noqa: E402

OV_SCRIPT = r"""
import json, sys
import numpy as np, openvino as ov, openvino_genai as ovg
folder, threads, new, precision = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
ids = json.loads(sys.argv[4])
extra = {} if precision == "default" else {"INFERENCE_PRECISION_HINT": precision}
pipe = ovg.LLMPipeline(folder, "CPU", INFERENCE_NUM_THREADS=threads, **extra)
cfg = ovg.GenerationConfig(); cfg.max_new_tokens = new; cfg.do_sample = False; cfg.ignore_eos = True
inp = ovg.TokenizedInputs(ov.Tensor(np.array([ids], dtype=np.int64)), ov.Tensor(np.ones((1, len(ids)), dtype=np.int64)))
r = pipe.generate(inp, cfg)
print(json.dumps({"tokens": list(map(int, r.tokens[0])), "tpot_ms": r.perf_metrics.get_tpot().mean,
                  "ttft_ms": r.perf_metrics.get_ttft().mean}))
"""
TESSERA = [sys.executable, "-c", "import sys; from tessera.runtime.cli import main; sys.exit(main())"]


def timed(cmd: list[str]) -> tuple[dict, float]:
    """(the JSON the process printed last, its CPU time ÷ wall time)."""
    text, wall, cpu = run_timed(cmd)
    return json.loads(text[text.index("{"):text.rindex("}") + 1]), cpu / wall


def openvino(a, ids) -> tuple[float, list[int], float]:
    res, load = timed([a.ov_python, "-c", OV_SCRIPT, a.ov_model, str(a.threads), str(a.new), json.dumps(ids),
                       a.ov_precision])
    return 1000.0 / res["tpot_ms"], res["tokens"], load


def tessera(a, ids) -> tuple[float, list[int], float]:
    res, load = timed(TESSERA + ["generate", a.folder, "--input", f"tokens=[{ids}]", "--max-new-tokens", str(a.new),
                                 "--ignore-eos", "--threads", str(a.threads), "--format", "json", "-q"])
    return float(res["stats"]["decode_tokens_per_s"]), res["outputs"][0]["tokens"], load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="the checkpoint folder Tessera reads")
    p.add_argument("--ov-model", required=True, help="the same checkpoint exported to OpenVINO IR by optimum-cli")
    p.add_argument("--ov-python", required=True, help="a Python with openvino-genai installed")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new", type=int, default=128, help="tokens decoded (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    p.add_argument("--ov-precision", default="f32",
                   help="OpenVINO's INFERENCE_PRECISION_HINT: f32 computes in fp32 as Tessera does; 'default' lets "
                        "the CPU plugin choose (bf16 on a CPU with AVX512-BF16 or AMX, whatever the IR's weights) "
                        "(default f32)")
    a = p.parse_args()
    ids = [100 + (i * 37) % 5000 for i in range(a.prompt)]
    tessera(a, ids[:8])  # compile once (the compile cache keeps it) before timing
    rates = {"tessera": [], "openvino": []}
    tokens = {}
    for r in range(a.rounds):
        for name in (("tessera", "openvino") if r % 2 == 0 else ("openvino", "tessera")):
            ts, toks, load = (tessera if name == "tessera" else openvino)(a, ids)
            rates[name].append(ts)
            tokens[name] = toks
            print(f"round {r + 1}: {name} {ts:.2f} tokens/s (CPU/wall {load:.2f})", flush=True)
    ratios = [t / o for t, o in zip(rates["tessera"], rates["openvino"])]
    same = next((i for i, (x, y) in enumerate(zip(tokens["tessera"], tokens["openvino"])) if x != y), None)
    for name, values in rates.items():
        print(f"{name}: decode tokens/s min {min(values):.2f} / med {statistics.median(values):.2f}")
    print(f"Tessera / OpenVINO: min {min(ratios):.3f} / med {statistics.median(ratios):.3f}")
    print("greedy tokens: " + ("equal" if same is None else f"first differ at {same}"))
    print(json.dumps({"rates": rates, "ratios": ratios, "first_difference": same}))


if __name__ == "__main__":
    main()
