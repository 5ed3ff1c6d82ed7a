"""Speculative decoding against plain greedy decoding, on a model that has learnt something.

    python bench/speculative.py                      # train (~2 min), then time plain / ngram
    python bench/speculative.py --draft              # also train a 1-layer draft model and time it
    python bench/speculative.py --train-seconds 300 --rounds 5 --threads 2

Why train: drafts are accepted only when the target's greedy choice is predictable, and a seeded
model's choices are noise. So the setup trains, with PyTorch on CPU for ``--train-seconds``, a small
GPT-2 (transformers' GPT2LMHeadModel: 2 layers, hidden 128, a 512-token BPE vocabulary trained
with ``tokenizers`` on the same text; one PyTorch thread, small enough to learn in minutes on a
shared CPU) on the text of the seed chapters in /work/shared/seeds/ (or
``--text FILE``), saves it as a Hugging Face checkpoint folder, and loads that folder with
``tessera.load``. ``--draft`` trains a one-layer, hidden-64 draft model with the same tokenizer the same way.

The task is repetitive on purpose, the case speculative decoding is for: the prompt holds a passage
of the text (``--passage`` tokens), a line asking for it again, and the passage's first 8 tokens;
the model continues it (``--new`` tokens). Prompt lookup then drafts the passage's next tokens.

Timing: every case (plain, ngram, draft) runs in this one process, the cases alternating for
``--rounds`` rounds after a warm-up; each time is the generation itself, prefill (with the draft
model's) and decoding, over the same prompt, greedy, ``--draft-tokens`` K -- not the request's
set-up (the driver parses the spec per request: ~0.5 s, the same for every case, which would
otherwise hide the decoding on a model this small). Reported per case: tokens/s (new tokens ÷
wall time, min and median over the rounds, as the best and the median time), the speed-up over plain
decoding, the acceptance rate (accepted ÷ drafted tokens) and the target's verifying calls. The
tokens of every case are compared with plain decoding's (they must be equal: it is greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEEDS = Path("/work/shared/seeds")


def _text(path: str | None) -> str:
    files = [Path(path)] if path else sorted(SEEDS.glob("*.txt"))
    if not files:
        sys.exit("no training text: give --text FILE (the seed chapters are not in /work/shared/seeds)")
    return "\n\n".join(f.read_text() for f in files)


def _tokenizer(text: str, folder: Path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    return tok


def _train(ids, layers: int, d: int, vocab: int, ctx: int, seconds: float, folder: Path, seed: int) -> dict:
    """A GPT-2 trained on ``ids`` for ``seconds`` (AdamW, batches of 16 windows of ``ctx``), saved."""
    import torch
    import transformers

    torch.manual_seed(seed)
    torch.set_num_threads(1)  # on a loaded 2-core machine two threads ran a step ~4x slower than one
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=d, n_head=max(d // 64, 1), vocab_size=vocab,
                                  n_positions=2 * ctx + 256, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    data = torch.tensor(ids, dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    start, steps, loss = time.perf_counter(), 0, float("nan")
    model.train()
    while time.perf_counter() - start < seconds:
        at = torch.randint(0, len(data) - ctx - 1, (16,))
        x = torch.stack([data[i:i + ctx] for i in at])
        out = model(input_ids=x, labels=x)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        steps, loss = steps + 1, float(out.loss.detach())
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    return {"layers": layers, "d": d, "params": params, "steps": steps, "loss": round(loss, 3),
            "train_s": round(time.perf_counter() - start, 1)}


def _generate(model, prompt, new: int, threads: int | None, speculative=None, k: int | None = None):
    """One generation through the driver (as the CLI runs it): tokens, wall seconds and the stats."""
    from tessera.runtime import driver
    from tessera.runtime.options import GenerateOptions

    o = GenerateOptions(max_new_tokens=new, ignore_eos=True, threads=threads, speculative=speculative,
                        draft_tokens=k if speculative is not None else None).for_api()
    run = driver.generate(model.ref, o, [prompt], model.weights, model._models)
    start = time.perf_counter()  # the request's set-up (the same for every case: it reads the spec) is not timed
    out = []
    for emitted in run.steps():
        if emitted[0] is not None:
            out.append(emitted[0])
    return out, time.perf_counter() - start, run.stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", help="training text (default: the seed chapters in /work/shared/seeds)")
    ap.add_argument("--train-seconds", type=float, default=150.0)
    ap.add_argument("--draft", action="store_true", help="also train and time a one-layer draft model")
    ap.add_argument("--passage", type=int, default=160, help="tokens of the passage in the prompt")
    ap.add_argument("--new", type=int, default=128, help="new tokens per generation")
    ap.add_argument("--draft-tokens", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--keep", metavar="FOLDER", help="train into FOLDER and keep it (default: a temporary folder)")
    args = ap.parse_args()

    import tessera

    text = _text(args.text)
    tmp = tempfile.TemporaryDirectory(prefix="tessera-spec-")
    root = Path(args.keep or tmp.name)
    target_dir, draft_dir = root / "target", root / "draft"
    for f in (target_dir, draft_dir):
        f.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(text, target_dir, 512)
    ids = tok.encode(text).ids
    vocab = tok.get_vocab_size()
    trained = {"target": _train(ids, 2, 128, vocab, 128, args.train_seconds, target_dir, 0)}
    if args.draft:
        trained["draft"] = _train(ids, 1, 64, vocab, 128, args.train_seconds / 2, draft_dir, 1)
    print(json.dumps({"trained": trained, "text_tokens": len(ids), "vocab": vocab}), file=sys.stderr)

    model = tessera.load(target_dir)
    start = len(ids) // 3
    passage = ids[start:start + args.passage]
    ask = tok.encode("\n\nThe same passage again, word for word:\n\n").ids
    prompt = passage + ask + passage[:8]
    cases = {"plain": None, "ngram": "ngram"}
    if args.draft:
        cases["draft"] = tessera.load(draft_dir)
    times = {c: [] for c in cases}
    stats, outs = {}, {}
    for c, spec in cases.items():  # warm-up: compiles each decoder once, outside the timing
        _generate(model, prompt, 8, args.threads, spec, args.draft_tokens)
    for _ in range(args.rounds):
        for c, spec in cases.items():
            out, secs, st = _generate(model, prompt, args.new, args.threads, spec, args.draft_tokens)
            times[c].append(secs)
            stats[c], outs[c] = st, out
    plain_best, plain_med = min(times["plain"]), statistics.median(times["plain"])
    rows = {}
    for c in cases:
        best, med = min(times[c]), statistics.median(times[c])
        st = stats[c]
        row = {"tokens_per_s": [round(args.new / best, 1), round(args.new / med, 1)],
               "speedup": [round(plain_best / best, 2), round(plain_med / med, 2)],
               "equal_to_plain": outs[c] == outs["plain"]}
        if st.drafted is not None:
            row.update(drafted=st.drafted, accepted=st.accepted, verify_calls=st.rounds,
                       acceptance=round(st.accepted / st.drafted, 3) if st.drafted else 0.0)
        rows[c] = row
    report = {"cases": rows, "new": args.new, "prompt_tokens": len(prompt), "draft_tokens": args.draft_tokens,
              "rounds": args.rounds, "threads": args.threads or os.cpu_count(), "machine": platform.processor()
              or platform.machine(), "cpus": os.cpu_count(), "trained": trained,
              "continuation": tok.decode(outs["plain"][:40])}
    print(json.dumps(report, indent=1))
    tmp.cleanup()


if __name__ == "__main__":
    main()
