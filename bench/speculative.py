"""Speculative decoding against plain greedy decoding, on a target bound by reading its weights.

    python bench/speculative.py                         # generate: plain / ngram / draft model
    python bench/speculative.py --serve                 # also the server, with and without --speculative
    python bench/speculative.py --rounds 5 --threads 2 --draft-tokens 6 --serve   # K = 6 for both drafters

The target is bench/spec_target.py's (built once, ~5 min, then cached in
~/.cache/tessera/bench/spec-target-<hash>): a small Llama trained on a copy task and the seed
chapters' text, widened 8x function-preservingly and given two near-silent layers, so that it has
55.6 M parameters (222 MB, a decoding step bound by the weight read) and still continues a passage
it has seen. The draft model of the "draft" case is the small trained model itself (0.9 M
parameters), whose greedy choices the target's equal up to rounding and the two extra layers.

The task is repetitive on purpose, the case speculative decoding is for: the prompt holds a passage
of the text (``--passage`` tokens), a line asking for it again, and the passage's first 8 tokens;
the model continues it (``--new`` tokens). Prompt lookup then drafts the passage's next tokens.

Timing: the cases alternate within each of ``--rounds`` rounds, after a warm-up (each decoder
compiled once, outside the timing). A generate case's time is the generation itself (prefill,
the draft model's included, and decoding) through the driver as the CLI runs it, not the
request's set-up (parsing the spec: the same for every case). A serve case's time is one HTTP
completion (greedy, ``max_tokens`` = ``--new``, the prompt as token ids) against a server process
started once per case (``tessera serve TARGET --max-batch 1 [--speculative ngram]``), so it
includes the request's prefill and the HTTP round trip. Reported per case: tokens/s (best and
median), the speed-up over its plain case (generate: plain generate; serve: the plain server) as
min / median ratios (best ÷ best, median ÷ median), CPU ÷ wall of the timed part (this process for
generate, the server process for serve), the acceptance rate (accepted ÷ drafted tokens), and
whether the tokens equal plain decoding's (they must: it is greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jsonout import write_json  # noqa: E402

import spec_target  # noqa: E402


def _generate(model, prompt, new: int, threads: int | None, speculative=None, k: int | None = None):
    """One generation through the driver (as the CLI runs it): tokens, wall and CPU seconds, stats."""
    from tessera.runtime import driver
    from tessera.runtime.options import GenerateOptions

    o = GenerateOptions(max_new_tokens=new, ignore_eos=True, threads=threads, speculative=speculative,
                        draft_tokens=k if speculative is not None else None).for_api()
    run = driver.generate(model.ref, o, [prompt], model.weights, model._models)
    start, cpu = time.perf_counter(), time.process_time()  # the request's set-up is not timed
    out = []
    for emitted in run.steps():
        if emitted[0] is not None:
            out.append(emitted[0])
    return out, time.perf_counter() - start, time.process_time() - cpu, run.stats


class Server:
    """``tessera serve`` in a process of its own on 127.0.0.1 (a free port), stopped by ``stop``."""

    def __init__(self, target: Path, threads: int | None, extra: list[str]):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        code = "import sys; from tessera.runtime.cli import main; sys.exit(main())"
        args = ["serve", str(target), "--port", str(self.port), "--max-batch", "1", *extra]
        if threads:
            args += ["--threads", str(threads)]
        self.proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        import httpx

        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"the server ({' '.join(args)}) exited: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                sys.exit("the server did not start within 600 s")
            time.sleep(0.2)

    def cpu(self) -> float:
        """The server process's CPU seconds so far (user + system, from /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def complete(self, prompt: list[int], new: int):
        import httpx

        start, cpu = time.perf_counter(), self.cpu()
        r = httpx.post(self.url + "/v1/completions", timeout=600,
                       json={"model": "target", "prompt": prompt, "max_tokens": new, "temperature": 0,
                             "ignore_eos": True})
        wall, cpu = time.perf_counter() - start, self.cpu() - cpu
        r.raise_for_status()
        body = r.json()
        return body["choices"][0]["text"], wall, cpu, body["usage"]["completion_tokens"]

    def metric(self, name: str) -> int | None:
        import httpx

        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return int(float(line.split()[-1]))
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _ratios(times: dict, base: str, case: str) -> list[float]:
    return [round(min(times[base]) / min(times[case]), 2),
            round(statistics.median(times[base]) / statistics.median(times[case]), 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", help="training text of the target (default: the seed chapters in /work/shared/seeds)")
    ap.add_argument("--steps", type=int, default=1000, help="training steps of the target's small model")
    ap.add_argument("--passage", type=int, default=160, help="tokens of the passage in the prompt")
    ap.add_argument("--new", type=int, default=128, help="new tokens per generation")
    ap.add_argument("--draft-tokens", type=int, default=None,
                    help="tokens drafted per round (default: tessera's, 10 with ngram and 4 with a draft model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-draft", action="store_true", help="skip the draft-model case")
    ap.add_argument("--serve", action="store_true", help="also time the server with and without --speculative ngram")
    ap.add_argument("--json", metavar="FILE", help="also write the report to FILE")
    args = ap.parse_args()
    for name in ("steps", "passage", "new", "draft_tokens", "rounds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            sys.exit(f"--{name.replace('_', '-')} must be at least 1")

    import tessera

    text = spec_target.text_of(args.text)
    root = spec_target.build(text, args.steps, log=lambda m: print(m, file=sys.stderr, flush=True))
    info = json.loads((root / "info.json").read_text())
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(root / "target" / "tokenizer.json"))
    ids = tok.encode(text).ids
    start = len(ids) // 3
    passage = ids[start:start + args.passage]
    prompt = passage + tok.encode("\n\nThe same passage again, word for word:\n\n").ids + passage[:8]

    model = tessera.load(root / "target")
    cases = {"plain": None, "ngram": "ngram"}
    if not args.no_draft:
        cases["draft"] = tessera.load(root / "draft")
    servers = {}
    if args.serve:
        servers = {"serve plain": Server(root / "target", args.threads, []),
                   "serve ngram": Server(root / "target", args.threads,
                                         ["--speculative", "ngram"] + ([] if args.draft_tokens is None else
                                                                      ["--draft-tokens", str(args.draft_tokens)]))}
    times = {c: [] for c in [*cases, *servers]}
    cpus = {c: [] for c in times}
    stats, outs = {}, {}
    try:
        for c, spec in cases.items():  # warm-up: compiles each decoder once, outside the timing
            _generate(model, prompt, 8, args.threads, spec, args.draft_tokens)
        for s in servers.values():
            s.complete(prompt, 8)
        for _ in range(args.rounds):
            for c, spec in cases.items():
                out, secs, cpu, st = _generate(model, prompt, args.new, args.threads, spec, args.draft_tokens)
                times[c].append(secs)
                cpus[c].append(cpu / secs)
                stats[c], outs[c] = st, out
            for c, s in servers.items():
                text_out, secs, cpu, n = s.complete(prompt, args.new)
                if n != args.new:
                    sys.exit(f"{c}: {n} tokens, not {args.new}")
                times[c].append(secs)
                cpus[c].append(cpu / secs)
                outs[c] = text_out
        server_counts = {c: {"drafted": s.metric("tessera_speculative_drafted_tokens_total"),
                             "accepted": s.metric("tessera_speculative_accepted_tokens_total")}
                         for c, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    rows = {}
    for c in times:
        best, med = min(times[c]), statistics.median(times[c])
        row = {"tokens_per_s": [round(args.new / best, 1), round(args.new / med, 1)],
               "cpu_per_wall": round(statistics.median(cpus[c]), 2)}
        if c in cases:
            row["speedup"] = _ratios(times, "plain", c)
            row["equal_to_plain"] = outs[c] == outs["plain"]
            st = stats[c]
            if st.drafted is not None:
                row.update(drafted=st.drafted, accepted=st.accepted, verify_calls=st.rounds,
                           acceptance=round(st.accepted / st.drafted, 3) if st.drafted else 0.0)
        else:
            row["speedup"] = _ratios(times, "serve plain", c)
            row["equal_to_plain"] = outs[c] == outs["serve plain"]
            row["text_equal_to_generate"] = outs[c] == tok.decode(outs["plain"])
            counts = server_counts[c]
            if counts["drafted"] is not None:  # over the warm-up and every round
                row.update(counts, acceptance=round(counts["accepted"] / counts["drafted"], 3)
                           if counts["drafted"] else 0.0)
        rows[c] = row
    report = {"cases": rows, "new": args.new, "prompt_tokens": len(prompt), "draft_tokens": args.draft_tokens,
              "rounds": args.rounds, "threads": args.threads or os.cpu_count(),
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "load_average": [round(x, 2) for x in os.getloadavg()], "target": str(root), "built": info,
              "continuation": tok.decode(outs["plain"][:40])}
    print(json.dumps(report, indent=1))
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
