"""The speculative-decoding benchmark's target model: trained small, then widened, built once and cached.

    python bench/spec_target.py                # build (or find) it; prints the folder
    python bench/spec_target.py --steps 200    # a quicker, weaker one (another cache entry)

Why a model of its own: drafts are accepted only when the target's greedy choice is predictable,
so a seeded model (whose choices are noise) says nothing about speculative decoding; and the speed-up
it promises -- k tokens checked for one read of the weights -- shows only on a model large enough
for a decoding step to be bound by reading its weights, not by Python and kernel launches. Training
such a model on a shared CPU would take hours. So:

1. a small Llama-shaped decoder (2 layers, hidden 128, 4 heads, MLP 384, a 512-token byte-level BPE
   trained with ``tokenizers`` on the text) is trained with PyTorch on CPU (one thread, AdamW,
   ``--steps`` steps, 1000 by default: ~6 min on a loaded 2-core machine; windows of 384 tokens)
   on half copy task (runs of 24..180 random or text tokens repeated after a separator: it learns
   to continue a passage it has seen, the repetitive task the benchmark times) and half the seed
   chapters' text (``/work/shared/seeds``, or ``--text``);
2. it is widened 8x *function-preservingly* (``widen``): the residual stream becomes 8 equal copies
   of the small one (RMSNorm of the copies is the copy of the RMSNorm, since the mean square is the
   same), every head and MLP unit is copied 8 times, and every matrix that reads the stream or the
   copied units reads them tiled and divided by 8, so it sums the copies back to the small model's
   value. The logits are the small model's to rounding (tests/spec/test_spec_target.py checks it);
3. two more layers with random weights are appended whose output projections (o_proj, down_proj)
   are scaled by 1e-3: they add almost nothing to the stream, so the learnt behaviour is kept, while
   their weights are read at every step like any layer's.

The result: hidden 1024, 32 heads, MLP 3072, 4 layers, 55.6 M parameters (222 MB in fp32), a
decoding step bound by the weight read, that still continues a passage it has seen. Both models are
saved as Hugging Face checkpoint folders (config.json, model.safetensors, tokenizer.json) that
``tessera.load`` reads: ``<cache>/target`` and ``<cache>/draft`` (the small model, the draft model of
bench/speculative.py). Reproducible: one PyTorch thread, fixed seeds and a fixed step count; the cache
folder's name hashes everything that decides the weights (``~/.cache/tessera/bench/spec-target-<hash>``),
and it is written to a temporary folder and renamed into place (atomic).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

SEEDS = Path("/work/shared/seeds")
VERSION = 2  # bump when the recipe below changes: it is part of the cache key
SMALL = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 4, "mlp": 384, "vocab": 512, "ctx": 1024}
WIDEN, EXTRA_LAYERS, EXTRA_SCALE = 8, 2, 1e-3


def text_of(path: str | None) -> str:
    files = [Path(path)] if path else sorted(SEEDS.glob("*.txt"))
    if not files:
        sys.exit(f"no training text: give --text FILE (no seed chapters in {SEEDS})")
    return "\n\n".join(f.read_text() for f in files)


def cache_root() -> Path:
    return Path(os.environ.get("TESSERA_CACHE", Path.home() / ".cache" / "tessera")) / "bench"


def key(text: str, steps: int, seed: int) -> str:
    h = hashlib.sha256(json.dumps({"v": VERSION, "small": SMALL, "widen": WIDEN, "extra": EXTRA_LAYERS,
                                   "scale": EXTRA_SCALE, "steps": steps, "seed": seed}, sort_keys=True).encode())
    h.update(text.encode())
    return h.hexdigest()[:12]


def tokenizer_for(text: str, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    return tok


def small_config():
    import transformers

    s = SMALL
    return transformers.LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                                    num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                                    intermediate_size=s["mlp"], max_position_embeddings=s["ctx"], rms_norm_eps=1e-5,
                                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)


def _batch(torch, ids, vocab: int, ctx: int, gen):
    """16 windows: 8 of the text, 8 of the copy task (a random run of 24..180 tokens, a separator, the
    run again, repeated to fill the window: copying from up to 180 positions back, as the benchmark's
    prompt asks); the loss is on every position."""
    rows = []
    for _ in range(8):
        at = int(torch.randint(0, len(ids) - ctx - 1, (1,), generator=gen))
        rows.append(ids[at:at + ctx])
    for _ in range(8):
        n = int(torch.randint(24, min(181, ctx // 2), (1,), generator=gen))
        if int(torch.randint(0, 2, (1,), generator=gen)):  # a run of the text, else random tokens
            at = int(torch.randint(0, len(ids) - n, (1,), generator=gen))
            run = ids[at:at + n]
        else:
            run = torch.randint(1, vocab, (n,), generator=gen)
        pattern = torch.cat([run, torch.tensor([0])])
        rows.append(pattern.repeat(ctx // len(pattern) + 1)[:ctx])
    return torch.stack(rows)


def train_small(ids, steps: int, seed: int, ctx: int = 384, log=None):
    """The small model after ``steps`` AdamW steps (one thread: reproducible, and on a loaded 2-core
    machine two threads ran ~4x slower than one)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    model = transformers.LlamaForCausalLM(small_config())
    data = torch.tensor(ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 100) * max(0.1, 1 - i / steps))
    start, loss = time.perf_counter(), float("nan")
    model.train()
    for i in range(steps):
        x = _batch(torch, data, SMALL["vocab"], ctx, gen)
        out = model(input_ids=x, labels=x)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss = float(out.loss.detach())
        if log and (i % 100 == 0 or i == steps - 1):
            log(f"step {i + 1}/{steps}: loss {loss:.3f}, {time.perf_counter() - start:.0f} s")
    model.eval()
    return model, {"steps": steps, "loss": round(loss, 3), "train_s": round(time.perf_counter() - start, 1)}


def widen(small, factor: int = WIDEN, extra_layers: int = 0, extra_scale: float = EXTRA_SCALE, seed: int = 0):
    """The small LlamaForCausalLM widened ``factor`` times (same function: see the module docstring),
    with ``extra_layers`` random layers appended whose output projections are scaled by ``extra_scale``."""
    import torch
    import transformers

    c = small.config
    cfg = transformers.LlamaConfig(**{**c.to_dict(), "hidden_size": c.hidden_size * factor,
                                      "num_attention_heads": c.num_attention_heads * factor,
                                      "num_key_value_heads": c.num_key_value_heads * factor,
                                      "head_dim": c.hidden_size // c.num_attention_heads,
                                      "intermediate_size": c.intermediate_size * factor,
                                      "num_hidden_layers": c.num_hidden_layers + extra_layers})
    torch.manual_seed(seed)
    big = transformers.LlamaForCausalLM(cfg).eval()
    f = factor

    def reads(w):  # a matrix reading the copied stream/units: [out, in] -> [out, in*f] / f
        return w.repeat(1, f) / f

    def writes(w):  # a matrix writing copied units: [out, in] -> [out*f, in]
        return w.repeat(f, 1)

    with torch.no_grad():
        big.model.embed_tokens.weight.copy_(small.model.embed_tokens.weight.repeat(1, f))
        big.model.norm.weight.copy_(small.model.norm.weight.repeat(f))
        big.lm_head.weight.copy_(reads(small.lm_head.weight))
        for s, b in zip(small.model.layers, big.model.layers):
            b.input_layernorm.weight.copy_(s.input_layernorm.weight.repeat(f))
            b.post_attention_layernorm.weight.copy_(s.post_attention_layernorm.weight.repeat(f))
            for name in ("q_proj", "k_proj", "v_proj"):  # heads copied: copy c of head j is head c*H + j
                getattr(b.self_attn, name).weight.copy_(writes(reads(getattr(s.self_attn, name).weight)))
            # o_proj reads the copied heads, writes the copied stream
            b.self_attn.o_proj.weight.copy_(writes(reads(s.self_attn.o_proj.weight)))
            for name in ("gate_proj", "up_proj"):
                getattr(b.mlp, name).weight.copy_(writes(reads(getattr(s.mlp, name).weight)))
            b.mlp.down_proj.weight.copy_(writes(reads(s.mlp.down_proj.weight)))
        for b in big.model.layers[c.num_hidden_layers:]:
            b.self_attn.o_proj.weight.mul_(extra_scale)
            b.mlp.down_proj.weight.mul_(extra_scale)
    return big


def save(model, tok, folder: Path) -> None:
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))


def build(text: str | None = None, steps: int = 1000, seed: int = 0, log=None) -> Path:
    """The cache folder holding ``target/`` and ``draft/`` (built when missing) and ``info.json``."""
    text = text if text is not None else text_of(None)
    root = cache_root() / f"spec-target-{key(text, steps, seed)}"
    if (root / "info.json").exists():
        return root
    tok = tokenizer_for(text, SMALL["vocab"])
    ids = tok.encode(text).ids
    small, trained = train_small(ids, steps, seed, log=log)
    big = widen(small, extra_layers=EXTRA_LAYERS, seed=seed + 1)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    try:
        save(small, tok, tmp / "draft")
        save(big, tok, tmp / "target")
        info = {"trained": trained, "text_tokens": len(ids), "small": SMALL, "widen": WIDEN,
                "extra_layers": EXTRA_LAYERS, "extra_scale": EXTRA_SCALE,
                "target_params": sum(p.numel() for p in big.parameters()),
                "draft_params": sum(p.numel() for p in small.parameters())}
        (tmp / "info.json").write_text(json.dumps(info, indent=1))
        try:
            os.rename(tmp, root)
        except OSError:  # built meanwhile by another process: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", help="training text (default: the seed chapters in /work/shared/seeds)")
    ap.add_argument("--steps", type=int, default=1000, help="training steps of the small model (default 1000)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.steps < 1:
        sys.exit("--steps must be at least 1")
    root = build(text_of(args.text), args.steps, args.seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(root)


if __name__ == "__main__":
    main()
