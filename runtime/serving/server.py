"""What `tessera serve` builds, whatever starts it: its options (``ServeOptions``), the check for the
serve extra, and the loaded model with its engine and the routes' state (``build_server``).

Why apart from cli.py: the command line (serving/cli.py) and a Ray Serve replica
(serving/ray_serve.py) both build a server from the same options, and neither may import the other.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from tessera.runtime.errors import UsageError
from tessera.runtime.options import EngineOptions, prefill_chunk_help  # noqa: F401  (prefill_chunk_help: re-exported)

EXTRA_MODULES = ("fastapi", "uvicorn", "jinja2")


@dataclass(kw_only=True)
class ServeOptions(EngineOptions):
    """Everything `tessera serve` takes: the model, its compile, tokenizer and engine bounds as `tessera
    batch` and the Ray deployment take them (options.EngineOptions: the model as `tessera generate`
    takes it, the compile options every command takes), and the server's own."""

    host: str = "127.0.0.1"
    port: int = 8000
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

        super().check()
        if self.start_token is not None:
            whole("start_token", self.start_token, 0)
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

    @property
    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        name = Path(self.spec).stem
        return f"{name}-{self.variant}" if self.variant else name


def require_extra() -> None:
    missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"`tessera serve` needs the serve extra ({', '.join(missing)} not installed): "
                         f"pip install 'tessera[serve]'")


def build_server(opts: ServeOptions):
    """The loaded model, its engine (not started) and the routes' shared state."""
    # the model's stack (the driver, the engine, the compiler, onnx) loads here, when a server is built:
    # this module is imported by the parsers (`tessera --help`), which must stay light
    from tessera.runtime import driver
    from tessera.runtime.embedding import EmbeddingModel

    from . import model as serving_model
    from .app import Server
    from .embeddings import EmbeddingEngine
    from .model import ChatTemplate, ChatTemplateError
    from .row_engine import RowEngine, engine_for
    from .row_speculation import RowSpeculation
    from .speculation import Speculation

    tokenizer, template, template_error = None, None, None
    tokenizer_path = serving_model.tokenizer_path(opts.tokenizer, opts.spec)
    if tokenizer_path:
        tokenizer = serving_model.load_tokenizer(tokenizer_path)
        try:
            template = ChatTemplate.from_tokenizer_folder(tokenizer_path)
        except ChatTemplateError as e:  # the completion route still works; the chat route says why
            template_error = str(e)
            print(f"warning: {e}; /v1/chat/completions answers 400 saying so", file=sys.stderr)
    draft_tokens = (opts.draft_tokens or Speculation.DRAFT_TOKENS) if opts.speculative else 0
    # with --speculative the drafts' checking calls (drafts + 1 tokens) give every position's logits
    model = driver.serve_model(opts.model, opts, check_tokens=draft_tokens + 1 if draft_tokens else 0)
    if isinstance(model, EmbeddingModel):  # an encoder: /v1/embeddings (serving/embeddings.py)
        if opts.speculative:
            raise UsageError("--speculative is for decoders; this model is an encoder, served for /v1/embeddings")
        engine = EmbeddingEngine(model, tokenizer, opts.max_queue)
        return engine, Server(engine, opts.served_name, tokenizer, None,
                              "this server serves an encoder model: /v1/embeddings only", embedder=engine)
    start = opts.start_token
    if start is None and hasattr(model, "s2s"):  # an encoder-decoder: the checkpoint's decoder_start_token_id
        start = serving_model.decoder_start(tokenizer_path, opts.spec, opts.weights)
    engine = engine_for(model, opts.max_batch, opts.max_queue, opts.max_context, opts.prefill_chunk,
                        tokenizer, serving_model.eos_ids(tokenizer, tokenizer_path, opts.spec, opts.weights), start,
                        prefix_cache_mb=opts.prefix_cache_mb)
    if opts.speculative and isinstance(engine, RowEngine):  # recurrent state: replayed after a rejection
        RowSpeculation.check(engine, draft_tokens)
        RowSpeculation(draft_tokens).attach(engine)
    elif opts.speculative:
        Speculation.check(model, draft_tokens)
        Speculation(draft_tokens).attach(engine)
    return engine, Server(engine, opts.served_name, tokenizer, template, template_error)
