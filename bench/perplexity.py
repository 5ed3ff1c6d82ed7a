"""Perplexity of one model under each quantisation scheme, side by side (docs/real-models.md).

    python bench/perplexity.py SmolLM2-135M-Instruct.Q4_1.gguf --text a.txt --text b.txt \
        --tokens 4096 --context 512 [--perturb 0.25] [--schemes fp32,int8,int4,int4-asym,...]

The texts are joined (a blank line between them) and cut after ``--tokens`` tokens (at a token's
end, so the cut text tokenizes to them), then scored as ``tessera perplexity`` scores it
(llama.cpp's convention: windows of ``--context``, the second half of each scored). The model is
loaded once (``tessera.load``) and compiled per scheme. ``--perturb F`` adds to every matrix
Gaussian noise of F times its rows' quantisation step at int4 block 32 (max - min over 15 per block
of 32), seeded: weights dequantised from a 4-bit file lie on a 4-bit grid that an asymmetric block-32
quantiser reproduces exactly, so quantisers are also judged on weights off that grid (issue 42).
A scheme is ``fp32``, ``int8``, ``int4``, ``int4-asym``, ``w8a8`` (the head float: ``--quantize-head
float``, as these rows were first measured), and ``+head`` after one quantises the head too at the
scheme's head bits (the old ``--quantize-head``: ``int4+head`` 4 bits, ``int4-asym+head`` 8), ``+head8``
or ``+head4`` at those bits (``int4+head8``: ``--quantize int4``'s default now); ``+embfloat`` or ``+emb8``
after those sets ``--quantize-embedding`` (without it, the rows before the 8-bit embedding keep the
table float, as they were measured: ``int4+head8+emb8`` is ``--quantize int4``'s default now); ``+blockN`` sets
``--quantize-block N`` (``int8+head8+emb8+block128``); ``llama.cpp-q4_0`` and ``llama.cpp-q4_1`` are
llama.cpp's reference quantisers (quantize_row_q4_0_ref, quantize_row_q4_1_ref, written here) applied
to the same linears as Tessera's schemes (the embedding and the head kept in float), the model then
run in fp32 on the weights they dequantise to: their rounding, not llama.cpp's kernels (which also
round the activations to 8 bits per block of 32, as MatMulNBits' int8 activations do).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def cut_text(tokenizer_path: Path, texts: list[str], tokens: int) -> str:
    from tokenizers import Tokenizer

    text = "\n\n".join(texts)
    enc = Tokenizer.from_file(str(tokenizer_path)).encode(text, add_special_tokens=False)
    if len(enc.ids) <= tokens:
        return text
    return text[:enc.offsets[tokens - 1][1]]


def perturbed_folder(folder: Path, factor: float, out: Path) -> Path:
    """A copy of checkpoint ``folder`` with every 2-D tensor moved off its 4-bit grid."""
    import shutil

    from safetensors.numpy import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    rng = np.random.default_rng(42)
    for f in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name, w in tensors.items():
            if w.ndim == 2 and w.shape[1] % 32 == 0:
                b = w.reshape(w.shape[0], -1, 32)
                step = (b.max(-1, keepdims=True) - b.min(-1, keepdims=True)) / 15
                tensors[name] = (b + rng.standard_normal(b.shape).astype(np.float32) * step * factor
                                 ).reshape(w.shape).astype(np.float32)
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    return out


def q4_0(w: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q4_0_ref then dequantize_row_q4_0: d = (the value of largest |x|) / -8,
    q = min(15, trunc(x / d + 8.5)) (1 / d before d is stored in fp16), w = (q - 8) * fp16(d)."""
    b = w.reshape(w.shape[0], -1, 32).astype(np.float32)
    at = np.abs(b).argmax(-1)[..., None]
    d = np.take_along_axis(b, at, -1) / np.float32(-8)
    inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0).astype(np.float64)
    q = np.clip(np.trunc(b.astype(np.float64) * inv + 8.5), 0, 15)
    return ((q - 8) * d.astype(np.float16).astype(np.float32)).reshape(w.shape).astype(np.float32)


def q4_1(w: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q4_1_ref then dequantize_row_q4_1: d = (max - min) / 15, m = min,
    q = min(15, trunc((x - min) / d + 0.5)), w = q * fp16(d) + fp16(m)."""
    b = w.reshape(w.shape[0], -1, 32).astype(np.float32)
    lo, hi = b.min(-1, keepdims=True), b.max(-1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0).astype(np.float64)
    q = np.clip(np.trunc((b - lo).astype(np.float64) * inv + 0.5), 0, 15)
    d16, m16 = d.astype(np.float16).astype(np.float32), lo.astype(np.float16).astype(np.float32)
    return (q * d16 + m16).reshape(w.shape).astype(np.float32)


SIMULATED = {"llama.cpp-q4_0": q4_0, "llama.cpp-q4_1": q4_1}


def simulated_folder(folder: Path, fn, out: Path) -> Path:
    """A copy of checkpoint ``folder`` whose layers' linear weights are ``fn``'s dequantised values
    (the embedding, and so a tied head, untouched)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    for f in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name, w in tensors.items():
            if w.ndim == 2 and ".layers." in name and w.shape[1] % 32 == 0:
                tensors[name] = fn(w)
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--text", action="append", required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--perturb", type=float, default=0.0)
    p.add_argument("--schemes", default="fp32,int8,int4,int4+head,int4-asym,int4-asym+head")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    a = p.parse_args(argv)

    import tessera
    from tessera.runtime.io import checkpoint

    folder = Path(checkpoint.local(a.model))
    with tempfile.TemporaryDirectory() as tmp:
        if a.perturb:
            folder = perturbed_folder(folder, a.perturb, Path(tmp) / "perturbed")
        text = cut_text(folder / "tokenizer.json", [Path(t).read_text(encoding="utf-8") for t in a.text], a.tokens)
        text_file = Path(tmp) / "text.txt"
        text_file.write_text(text, encoding="utf-8")
        model = tessera.load(folder)
        rows = []
        base = None
        for scheme in a.schemes.split(","):
            name, *extras = scheme.split("+")
            heads = [x[len("head"):] for x in extras if x.startswith("head")]
            head = (heads[0] or True) if heads else False  # "8", "4", True (the scheme's) or float
            embeddings = [x[len("emb"):] for x in extras if x.startswith("emb")]
            embedding = embeddings[0] if embeddings else "float"
            blocks = [int(x[len("block"):]) for x in extras if x.startswith("block")]
            block = blocks[0] if blocks else None  # --quantize-block (None: the scheme's default, 32)
            t0 = time.perf_counter()
            if name in SIMULATED:
                sim = tessera.load(simulated_folder(folder, SIMULATED[name], Path(tmp) / name))
                r = sim.perplexity(text_file, context=a.context, provider="cpu")
            else:
                # every scheme from the fp32 weights: a GGUF file's own codes would otherwise be kept
                # (--gguf-weights codes) and leave the scheme nothing to quantise
                r = model.perplexity(text_file, context=a.context, provider="cpu", gguf_weights="dequantize",
                                     quantize="none" if name == "fp32" else name, quantize_head=head,
                                     quantize_block=block,
                                     quantize_embedding="auto" if name == "fp32" else embedding)
            base = base or r["perplexity"]
            rows.append({"scheme": scheme, "perplexity": r["perplexity"], "ratio": r["perplexity"] / base,
                         "uncertainty": r["uncertainty"], "scored": r["scored"], "seconds": time.perf_counter() - t0})
            print(f"{scheme:>16}  {r['perplexity']:8.3f}  x{r['perplexity'] / base:.3f}  "
                  f"({r['scored']} tokens, {rows[-1]['seconds']:.0f} s)", file=sys.stderr, flush=True)
    print("| scheme | perplexity | × fp32 |\n| --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['scheme']} | {r['perplexity']:.3f} | {r['ratio']:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "tokens": a.tokens, "context": a.context,
                                            "perturb": a.perturb, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
