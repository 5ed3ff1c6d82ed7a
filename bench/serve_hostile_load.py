"""issue 38's load check: a real `tessera serve` (a tiny GPT-2 over one-byte tokens, random weights,
so completions often end inside a character) under a mixed load of good requests (each sent
unstreamed and streamed) and hostile ones (lone surrogates, 401-digit numbers, unknown
stream_options, 50,000-deep JSON, a 5 MB body). Reported as one JSON line: 5xx (must be 0),
4xx, streamed answers that do not join to the unstreamed text (must be 0), how many ended inside a
character, the server's RSS before and after (flat), a sample of greedy answers against
`tessera generate`, the exit status after SIGTERM and tracebacks in its log (0).

    python bench/serve_hostile_load.py --requests 2000 --clients 12

Not a test: it takes minutes; binds 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_stream_join import tokenizer  # noqa: E402  (the one-byte tokenizer of the property test)

SETS = ["--set", "layers=1", "--set", "d=32", "--set", "heads=2", "--set", "vocab=256", "--set", "ctx=64"]
HOSTILE = ['{"prompt": "\\ud800", "max_tokens": 2}', '{"prompt": [1], "temperature": 1%s}' % ("0" * 400),
           '{"prompt": [1], "stream": true, "stream_options": {"x": 1}}', '{"prompt": [1], "stop": "\\udfff"}',
           '{"prompt": [1], "model": "\\ud800"}', '{"prompt": ' + "[" * 50000 + "]" * 50000 + "}",
           '{"prompt": "' + "a" * (5 * 1024 * 1024) + '"}']


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--hostile", type=float, default=0.2, help="the share of hostile requests")
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="tessera-load-"))
    tok_path = folder / "tokenizer.json"
    tokenizer("bytes").save(str(tok_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from tessera.runtime.cli import main; sys.exit(main())",
                             "serve", "gpt2", *SETS, "--seed", "3", "--tokenizer", str(tok_path), "--port", str(port),
                             "--threads", "1", "--max-batch", "8"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)

    def rss() -> int:
        return int(open(f"/proc/{proc.pid}/status").read().split("VmRSS:")[1].split()[0])

    rng = random.Random(0)
    items = []
    for i in range(args.requests):
        if rng.random() >= args.hostile:
            items.append(("good", {"prompt": [rng.randrange(256) for _ in range(rng.randrange(1, 8))],
                                   "max_tokens": rng.randrange(1, 20), "temperature": rng.choice([0, 0.7, 1e-40]),
                                   "seed": i}))
        else:
            items.append(("bad", rng.choice(HOSTILE)))

    def run(item):
        kind, body = item
        with httpx.Client(timeout=120) as c:
            if kind == "bad":
                r = c.post(url + "/v1/completions", content=body.encode(), headers={"content-type": "application/json"})
                return r.status_code, None
            r = c.post(url + "/v1/completions", json=body)
            if r.status_code >= 400:
                return r.status_code, None
            whole = r.json()["choices"][0]
            r2 = c.post(url + "/v1/completions", json={**body, "stream": True})
            events = [line[6:] for line in r2.text.splitlines() if line.startswith("data: ")]
            chunks = [json.loads(e) for e in events if e != "[DONE]"]
            joined = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
            return r2.status_code, (body, whole["text"], joined, whole["token_ids"])

    before, start = rss(), time.time()
    with ThreadPoolExecutor(args.clients) as ex:
        out = list(ex.map(run, items))
    after = rss()
    res = {"requests": args.requests, "5xx": sum(s >= 500 for s, _ in out), "4xx": sum(400 <= s < 500 for s, _ in out),
           "answered": sum(d is not None for _, d in out),
           "stream_mismatch": sum(d is not None and d[1] != d[2] for _, d in out),
           "ended_inside_a_character": sum(d is not None and d[1].endswith("\ufffd") for _, d in out),
           "seconds": round(time.time() - start, 1), "rss_kb_before": before, "rss_kb_after": after}
    from tessera.runtime.cli import main as cli

    checked = mismatched = 0
    for _, d in out:
        if d is None or d[0]["temperature"] != 0 or checked >= 15:
            continue
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            cli(["generate", "gpt2", *SETS, "--seed", "3", "--tokenizer", str(tok_path), "--input",
                 f"tokens={json.dumps([d[0]['prompt']])}", "--max-new-tokens", str(d[0]["max_tokens"]), "--format",
                 "json", "-q"])
        checked += 1
        mismatched += json.loads(buf.getvalue())["outputs"][0]["tokens"] != d[3]
    proc.send_signal(signal.SIGTERM)
    res.update(generate_checked=checked, generate_mismatch=mismatched, exit=proc.wait(60),
               tracebacks=(folder / "server.log").read_text().count("Traceback"))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
