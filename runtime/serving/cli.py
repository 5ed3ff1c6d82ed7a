"""``tessera serve MODEL``: the engine behind an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Registered in runtime/cli.py by ``add_parser(sub)``; ``cmd_serve`` runs it. The options are the
dataclass ``ServeOptions`` (``check()`` refuses bad values with a UsageError before anything
loads). SIGTERM drains: new requests get 503, running and queued ones finish (up to
``--drain-timeout`` seconds), then the process exits 0. Without the ``serve`` extra the command
says which extra to install.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import dataclass, field, fields

from .model import UsageError

EXAMPLES = """examples:
  tessera serve models/gpt2.tsr -V small --weights gpt2/model.safetensors --tokenizer gpt2/tokenizer.json
  tessera serve out/llama-cached.onnx --tokenizer llama/tokenizer.json --port 8000 --max-batch 16
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"prompt": "Hello", "max_tokens": 20, "temperature": 0}'
"""

EXTRA_MODULES = ("fastapi", "uvicorn", "jinja2")


@dataclass
class ServeOptions:
    """Everything `tessera serve` takes (the model as `tessera generate` takes it, and the server's)."""

    spec: str
    variant: str | None = None
    sets: list[str] = field(default_factory=list)
    weights: str | None = None
    seed: int = 0
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_queue: int = 64
    threads: int | None = None
    max_context: int | None = None
    prefill_chunk: int = 256
    drain_timeout: float = 30.0
    model_name: str | None = None
    explain: bool = False

    def check(self) -> None:
        def whole(name, value, low):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value}")

        whole("max_batch", self.max_batch, 1)
        whole("max_queue", self.max_queue, 0)
        whole("prefill_chunk", self.prefill_chunk, 1)
        if self.threads is not None:
            whole("threads", self.threads, 1)
        if self.max_context is not None:
            whole("max_context", self.max_context, 2)
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise UsageError(f"--port must be in [0, 65535], got {self.port}")
        if not (self.drain_timeout >= 0):
            raise UsageError(f"--drain-timeout must be >= 0 seconds, got {self.drain_timeout}")
        if not self.host:
            raise UsageError("--host is empty")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServeOptions":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    @property
    def served_name(self) -> str:
        from pathlib import Path

        if self.model_name:
            return self.model_name
        name = Path(self.spec).stem
        return f"{name}-{self.variant}" if self.variant else name


def add_parser(sub) -> argparse.ArgumentParser:
    d = ServeOptions("")
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (continuous batching)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
                       description="Compile a decoder-only spec with a KV cache (or load a file compiled with "
                                   "--kv-cache --decode plain) and serve it: POST /v1/completions, "
                                   "/v1/chat/completions (streaming with stream=true), GET /v1/models, /health, "
                                   "/metrics. Requests share each decoding step (continuous batching). "
                                   "Needs the serve extra: pip install 'tessera[serve]'. See docs/serve.md.")
    s.add_argument("spec", metavar="MODEL", help="a .tsr spec (or a bundled spec's name), or an .onnx file compiled "
                   "with --kv-cache --decode plain")
    s.add_argument("--variant", "-V", help="a variant defined in the spec file (e.g. small)")
    s.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                   help="override a hyperparameter (repeatable)")
    s.add_argument("--weights", metavar="FILE", help="a .safetensors file or folder of shards (else seeded weights)")
    s.add_argument("--seed", type=int, default=d.seed, help="seed of the weight initialiser without --weights")
    s.add_argument("--tokenizer", metavar="tokenizer.json", help="a Hugging Face tokenizer.json: text prompts, "
                   "stop strings; its folder's tokenizer_config.json gives the chat template and the "
                   "end-of-sequence token")
    s.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host}: this machine only)")
    s.add_argument("--port", type=int, default=d.port, help=f"port (default {d.port})")
    s.add_argument("--max-batch", type=int, default=d.max_batch, metavar="N",
                   help=f"sequences decoded together, the cache's slots (default {d.max_batch})")
    s.add_argument("--max-queue", type=int, default=d.max_queue, metavar="N",
                   help=f"requests waiting for a slot; past it requests get 429 (default {d.max_queue})")
    s.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: all cores)")
    s.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="positions per slot, prompt and new tokens together (default: the model's context); "
                        "the cache is max-batch x N positions, allocated at start")
    s.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, metavar="N",
                   help=f"prompt tokens prefilled between two decoding steps at most (default {d.prefill_chunk})")
    s.add_argument("--drain-timeout", type=float, default=d.drain_timeout, metavar="S",
                   help=f"on SIGTERM, seconds to let running requests finish (default {d.drain_timeout:g})")
    s.add_argument("--model-name", metavar="NAME", help="the model's id in /v1/models (default: the spec's name)")
    s.add_argument("--explain", action="store_true",
                   help="print the engine's plan (slots, memory budget, decoding kernel and why) and exit")
    return s


def _require_extra() -> None:
    import importlib.util

    missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"`tessera serve` needs the serve extra ({', '.join(missing)} not installed): "
                         f"pip install 'tessera[serve]'")


def build_server(opts: ServeOptions):
    """The loaded model, its engine (not started) and the routes' shared state."""
    from . import model as serving_model
    from .app import Server
    from .chat import ChatTemplate, ChatTemplateError
    from .engine import Engine

    tokenizer, template, template_error = None, None, None
    if opts.tokenizer:
        tokenizer = serving_model.load_tokenizer(opts.tokenizer)
        try:
            template = ChatTemplate.from_tokenizer_folder(opts.tokenizer)
        except ChatTemplateError as e:  # the completion route still works; the chat route says why
            template_error = str(e)
    model = serving_model.load(opts.spec, opts.variant, opts.sets, opts.weights, opts.seed, opts.threads)
    engine = Engine(model, opts.max_batch, opts.max_queue, opts.max_context, opts.prefill_chunk, tokenizer,
                    serving_model.eos_ids(tokenizer, opts.tokenizer))
    return engine, Server(engine, opts.served_name, tokenizer, template, template_error)


def cmd_serve(args) -> int:
    opts = ServeOptions.from_args(args)
    opts.check()
    _require_extra()
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
        """SIGTERM: refuse new requests, let the running ones finish, then stop (exit status 0)."""

        def handle_exit(self, sig, frame):
            if sig != signal.SIGTERM or self.should_exit:
                return super().handle_exit(sig, frame)
            if not engine.accepting:
                self.should_exit = True  # a second SIGTERM: stop now
                return
            print("SIGTERM: draining (new requests get 503)", file=sys.stderr, flush=True)
            engine.drain()

            def finish():
                engine.wait_idle(opts.drain_timeout)
                self.should_exit = True

            threading.Thread(target=finish, daemon=True).start()

    config = uvicorn.Config(create_app(server), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=max(1, int(opts.drain_timeout)))
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
