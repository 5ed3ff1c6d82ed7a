"""What `tessera serve` builds, whatever starts it: its options (``ServeOptions``), the check for the
serve extra, and the loaded model with its engine and the routes' state (``build_server``).

Why apart from cli.py: the command line (serving/cli.py) and a Ray Serve replica
(serving/ray_serve.py) both build a server from the same options, and neither may import the other.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from tessera.runtime.options import QuantOptions, add_quant_arguments

from .model import UsageError

EXTRA_MODULES = ("fastapi", "uvicorn", "jinja2")


@dataclass
class ServeOptions(QuantOptions):
    """Everything `tessera serve` takes (the model as `tessera generate` takes it, its quantisation
    included, and the server's)."""

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
    start_token: int | None = None  # an encoder-decoder's decoder start token (row_engine.py)
    speculative: str | None = None  # "ngram": prompt-lookup drafting for greedy requests (serving/speculation.py)
    draft_tokens: int | None = None

    def check(self) -> None:
        def whole(name, value, low):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value}")

        QuantOptions.check(self)
        whole("max_batch", self.max_batch, 1)
        whole("max_queue", self.max_queue, 0)
        whole("prefill_chunk", self.prefill_chunk, 1)
        if self.threads is not None:
            whole("threads", self.threads, 1)
        if self.start_token is not None:
            whole("start_token", self.start_token, 0)
        if self.max_context is not None:
            whole("max_context", self.max_context, 2)
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise UsageError(f"--port must be in [0, 65535], got {self.port}")
        if not (self.drain_timeout >= 0):
            raise UsageError(f"--drain-timeout must be >= 0 seconds, got {self.drain_timeout}")
        if not self.host:
            raise UsageError("--host is empty")
        if self.speculative is not None and self.speculative != "ngram":
            raise UsageError(f"--speculative {self.speculative}: the server drafts by prompt lookup only "
                             f"(--speculative ngram); a draft model is `tessera generate --speculative`'s")
        if self.draft_tokens is not None:
            if self.speculative is None:
                raise UsageError("--draft-tokens applies with --speculative ngram")
            whole("draft_tokens", self.draft_tokens, 1)

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


def require_extra() -> None:
    import importlib.util

    missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"`tessera serve` needs the serve extra ({', '.join(missing)} not installed): "
                         f"pip install 'tessera[serve]'")


def build_server(opts: ServeOptions):
    """The loaded model, its engine (not started) and the routes' shared state."""
    from . import model as serving_model
    from .app import Server
    from .model import ChatTemplate, ChatTemplateError
    from .row_engine import engine_for

    tokenizer, template, template_error = None, None, None
    tokenizer_path = serving_model.tokenizer_path(opts.tokenizer, opts.spec)
    if tokenizer_path:
        tokenizer = serving_model.load_tokenizer(tokenizer_path)
        try:
            template = ChatTemplate.from_tokenizer_folder(tokenizer_path)
        except ChatTemplateError as e:  # the completion route still works; the chat route says why
            template_error = str(e)
            import sys

            print(f"warning: {e}; /v1/chat/completions answers 400 saying so", file=sys.stderr)
    model = serving_model.load(opts.spec, opts.variant, opts.sets, opts.weights, opts.seed, opts.threads,
                               last_only=opts.speculative is None, quantize=opts.quant_config())
    start = opts.start_token
    if start is None and hasattr(model, "s2s"):  # an encoder-decoder: the checkpoint's decoder_start_token_id
        start = serving_model.decoder_start(tokenizer_path, opts.spec, opts.weights)
    engine = engine_for(model, opts.max_batch, opts.max_queue, opts.max_context, opts.prefill_chunk,
                        tokenizer, serving_model.eos_ids(tokenizer, tokenizer_path, opts.spec, opts.weights), start)
    if opts.speculative:
        from .row_engine import RowEngine
        from .speculation import Speculation

        if isinstance(engine, RowEngine):  # its steps are its own: no drafts checked in them
            raise UsageError("--speculative serves decoder-only models with a KV cache; this model is served by "
                             "the row engine (recurrent state or an encoder-decoder): drop --speculative")
        Speculation.check(model)
        Speculation(opts.draft_tokens or Speculation.DRAFT_TOKENS).attach(engine)
    return engine, Server(engine, opts.served_name, tokenizer, template, template_error)


def prefill_chunk_help(default: int) -> str:
    """--prefill-chunk's help, as `tessera serve` and `tessera batch` give it (engine.py ``chunk_for``; its
    512 is engine.py's IDLE_PREFILL_CHUNK, written out: the parsers import no numpy, tests check the two agree)."""
    return (f"the iteration's token budget: each decoding row takes one, a prompt's chunk the rest (at least 16), so "
            f"at most N prompt tokens run between two decoding steps; a prompt with no stream decoding goes in "
            f"by up to max(N, 512) tokens a call (default {default})")


def add_model_arguments(p: argparse.ArgumentParser, seed_default: int, tokenizer_help: str) -> None:
    """The model as `tessera serve` and `tessera batch` take it (as `tessera generate` does): MODEL,
    --variant, --set, --weights, --seed, --tokenizer, --quantize and its details."""
    p.add_argument("spec", metavar="MODEL", help="a .tsr spec (or a bundled spec's name), a checkpoint folder, or "
                   "an .onnx file compiled with --kv-cache")
    p.add_argument("--variant", "-V", help="a variant defined in the spec file (e.g. small)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                   help="override a hyperparameter (repeatable)")
    p.add_argument("--weights", metavar="FILE", help="a .safetensors file or folder of shards (else seeded weights)")
    p.add_argument("--seed", type=int, default=seed_default, help="seed of the weight initialiser without --weights")
    p.add_argument("--tokenizer", metavar="tokenizer.json", help=tokenizer_help)
    add_quant_arguments(p)
