"""``tessera serve MODEL``: the engine behind an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Registered in runtime/cli/__init__.py by ``add_parser(sub)``; ``cmd_serve`` runs it. The options are the
dataclass ``ServeOptions`` (serving/server.py; ``check()`` refuses bad values with a UsageError before anything
loads): the model, its compile options, the tokenizer and the engine's bounds are options.EngineOptions'
fields, whose flags are generated from them (``add_engine_arguments``), as `tessera batch`'s are. SIGTERM drains: new requests get 503, running and queued ones finish (up to
``--drain-timeout`` seconds), then the process exits 0. Without the ``serve`` extra the command
says which extra to install.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from tessera.runtime.errors import UsageError
from tessera.runtime.options import GenerateOptions, add_engine_arguments

from .server import ServeOptions, build_server, require_extra

EXAMPLES = """examples:
  tessera serve models/gpt2.tsr -V small --weights gpt2/model.safetensors --tokenizer gpt2/tokenizer.json
  tessera serve out/llama-cached.onnx --tokenizer llama/tokenizer.json --port 8000 --max-batch 16
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"prompt": "Hello", "max_tokens": 20, "temperature": 0}'
"""

def add_parser(sub) -> argparse.ArgumentParser:
    d = ServeOptions(spec="")
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (continuous batching)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
                       description="Compile a spec with a KV cache (or load a file compiled with "
                                   "--kv-cache) and serve it: POST /v1/completions, "
                                   "/v1/chat/completions (streaming with stream=true), GET /v1/models, /health, "
                                   "/metrics. Requests share each decoding step (continuous batching). "
                                   "Needs the serve extra: pip install 'tessera[serve]'. See docs/serve.md.")
    add_engine_arguments(s)  # the model, its compile, the tokenizer, the engine (options.EngineOptions)
    s.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host}: this machine only)")
    s.add_argument("--port", type=int, default=d.port, help=f"port (default {d.port})")
    s.add_argument("--drain-timeout", type=float, default=d.drain_timeout, metavar="S",
                   help=f"on SIGTERM, seconds to let running requests finish (default {d.drain_timeout:g})")
    s.add_argument("--start-token", type=int, default=None, metavar="ID",
                   help="an encoder-decoder's decoder start token (default: the checkpoint's "
                        "decoder_start_token_id); the prompt is then the source")
    s.add_argument("--model-name", metavar="NAME", help="the model's id in /v1/models (default: the spec's name)")
    s.add_argument("--speculative", default=None, metavar="ngram",
                   help="speculative decoding for greedy requests: prompt lookup drafts tokens that one step checks "
                        "(output unchanged; faster when the output repeats the prompt). See docs/serve.md")
    s.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                   help=f"tokens drafted per request and step with --speculative "
                        f"(default {GenerateOptions.NGRAM_DRAFT_TOKENS})")
    s.add_argument("--explain", action="store_true",
                   help="print the engine's plan (slots, memory budget, decoding kernel and why) and exit")
    from .ray_serve import add_arguments as add_ray_arguments  # --ray, --replicas, ... (serving/ray_serve.py)

    add_ray_arguments(s)
    return s


def cmd_serve(args) -> int:
    if getattr(args, "ray", False):
        from .ray_serve import cmd_serve_ray

        return cmd_serve_ray(args)
    opts = ServeOptions.from_args(args)
    opts.check()
    require_extra()
    sock = None if opts.explain else _listening_socket(opts.host, opts.port)  # a taken port fails before loading
    try:
        engine, server = build_server(opts)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    print(engine.describe(), file=sys.stderr)
    if opts.explain:
        return 0
    import uvicorn

    from .app import create_app

    class DrainingServer(uvicorn.Server):
        """SIGTERM: refuse new requests, let the running ones finish (up to --drain-timeout), then
        stop (exit status 0). Whatever still runs then -- or at once on a second SIGTERM or on Ctrl-C
        -- ends as cancelled: a stream gets an error event and ``data: [DONE]``, a waiting request
        503, before the connections close (never a stream cut mid-way)."""

        def stop_now(self) -> None:
            def close():
                engine.close()  # every request ends ("cancelled"): the routes answer and return
                self.should_exit = True

            threading.Thread(target=close, daemon=True).start()

        def handle_exit(self, sig, frame):
            if self.should_exit:
                return super().handle_exit(sig, frame)
            if sig != signal.SIGTERM:  # Ctrl-C: no waiting for the running requests; status 130 after
                captured = getattr(self, "_captured_signals", None)  # uvicorn re-raises it once stopped
                if captured is not None:
                    captured.append(sig)
                self.stop_now()
                return
            if not engine.accepting:
                self.stop_now()  # a second SIGTERM: stop now
                return
            print("SIGTERM: draining (new requests get 503)", file=sys.stderr, flush=True)
            engine.drain()

            def finish():
                if not engine.wait_idle(opts.drain_timeout):
                    print(f"SIGTERM: --drain-timeout {opts.drain_timeout:g} s passed; ending the requests still "
                          f"running", file=sys.stderr, flush=True)
                self.stop_now()

            threading.Thread(target=finish, daemon=True).start()

    from .http import uvicorn_limits

    config = uvicorn.Config(create_app(server), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=max(1, int(opts.drain_timeout)), **uvicorn_limits())
    engine.start()
    port = sock.getsockname()[1]
    print(f"serving {opts.served_name} on http://{opts.host}:{port} (POST /v1/completions, "
          f"/v1/chat/completions; GET /v1/models, /health, /metrics)", file=sys.stderr, flush=True)
    try:
        DrainingServer(config).run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
    return 0


def _listening_socket(host: str, port: int):
    """The server's socket, bound here so that a taken port or an unknown host is a clear UsageError
    (uvicorn would log it and exit 1)."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock
