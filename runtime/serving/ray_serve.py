"""`tessera serve MODEL --ray`: the same engine and the same OpenAI routes, one engine per Ray Serve
replica, scaled over a Ray cluster.

How it reuses `tessera serve`: a replica builds exactly what the local server builds
(``server.build_server``: tokenizer, chat template, the cached decoder, the engine) in its
``__init__`` -- on the replica's node, from the model's path or spec, because onnxruntime sessions
do not pickle -- and its HTTP ingress is ``app.create_app`` over that server, so every route,
error shape, streaming and admission rule is the local server's. Serve's ``serve.ingress`` takes a
builder function that it calls in the replica after ``__init__``; the builder reads the server the
replica just built from ``_replica`` (one replica per actor process). The builder also wraps the
app so that every response names the replica and node that answered (``x-tessera-replica``,
``x-tessera-node``), which is how a client (and the tests) see requests spread over replicas.

Deployment settings and why:
- ``max_ongoing_requests`` = max_batch: Serve's default (5) would cap a replica below its slots
  (ray#43288); no more, because Serve's router sends a request to a replica on its own node first
  and moves on only when that replica is at ``max_ongoing_requests`` -- had a replica taken its
  engine's queue too, requests would wait in one engine's queue while other replicas sat idle.
  So the waiting happens in Serve's router instead, bounded by ``max_queued_requests`` = max_queue
  (past it Serve answers 503), and every request a replica takes gets a slot at once.
- each replica reserves ``threads`` CPUs (``--threads``, default 1) and runs that many onnxruntime
  intra-op threads (onnxruntime ignores OMP_NUM_THREADS).
- ``--replicas N``, or ``--min-replicas A --max-replicas B`` for Serve's autoscaling (target
  ongoing requests per replica = max_batch).
- ``graceful_shutdown_timeout_s`` = ``--drain-timeout``: a replica that stops lets its running
  requests finish first.

For ``serve run``: ``app`` is an application builder taking ``key=value`` arguments, e.g.
``serve run tessera.runtime.serving.ray_serve:app model=gpt2 set=layers=2,d=64 replicas=2``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import dataclass, fields

from tessera.runtime.errors import UsageError
from tessera.runtime.options import Options

from .ray_support import connected, require_ray
from .server import ServeOptions, require_extra

APP_NAME = "tessera"
REPLICA_HEADER, NODE_HEADER = "x-tessera-replica", "x-tessera-node"


@dataclass(kw_only=True)
class RayOptions(Options):
    """The Ray side of `tessera serve --ray`."""

    replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    address: str | None = None

    def check(self) -> None:
        for name in ("replicas", "min_replicas", "max_replicas"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (0 if "min" in name else 1)):
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= {0 if 'min' in name else 1}, "
                                 f"got {v}")
        autoscaled = self.min_replicas is not None or self.max_replicas is not None
        if autoscaled and self.replicas is not None:
            raise UsageError("give --replicas N, or --min-replicas A --max-replicas B (autoscaling), not both")
        if autoscaled and (self.min_replicas is None or self.max_replicas is None):
            raise UsageError("autoscaling needs both --min-replicas and --max-replicas")
        if autoscaled and self.min_replicas > self.max_replicas:
            raise UsageError(f"--min-replicas {self.min_replicas} is more than --max-replicas {self.max_replicas}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`tessera serve`'s --ray options (registered by serving/cli.py's parser)."""
    g = parser.add_argument_group("Ray Serve (--ray; the serve extra)")
    g.add_argument("--ray", action="store_true", help="serve on Ray Serve: one engine per replica")
    g.add_argument("--replicas", type=int, metavar="N", help="replicas (default 1)")
    g.add_argument("--min-replicas", type=int, metavar="A", help="autoscaling: at least A replicas")
    g.add_argument("--max-replicas", type=int, metavar="B", help="autoscaling: at most B replicas")
    g.add_argument("--address", metavar="ADDR", help="a running Ray cluster: 'auto' (this machine's `ray start "
                   "--head`), HOST:PORT, or ray://HOST:10001; default: start a local Ray")


# ------------------------------------------------------------------------------------ the replica

_replica: dict = {}  # the server this process's replica built (one replica per Ray actor)


class _Tagged:
    """The routes' ASGI app, with the answering replica and node in every response's headers."""

    def __init__(self, app, replica: str, node: str):
        self.app = app
        self.headers = [(REPLICA_HEADER.encode(), replica.encode()), (NODE_HEADER.encode(), node.encode())]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged_send(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        await self.app(scope, receive, tagged_send)


def _replica_app():
    """Serve's ingress builder: called in the replica after ``TesseraReplica.__init__``."""
    import ray
    from ray import serve

    from .app import create_app

    replica = serve.get_replica_context().replica_id.unique_id
    return _Tagged(create_app(_replica["server"]), replica, ray.get_runtime_context().get_node_id())


class TesseraReplica:
    """One engine, started in the replica; closed when the replica stops."""

    def __init__(self, opts: ServeOptions):
        from .server import build_server

        self.engine, server = build_server(opts)
        self.engine.start()
        _replica["server"] = server

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def deployment_options(opts: ServeOptions, ray_opts: RayOptions) -> dict:
    threads = opts.threads or 1
    out = {"name": "TesseraEngine", "max_ongoing_requests": opts.max_batch,
           "max_queued_requests": max(1, opts.max_queue),
           "ray_actor_options": {"num_cpus": threads}, "graceful_shutdown_timeout_s": opts.drain_timeout}
    if ray_opts.min_replicas is not None:
        out["autoscaling_config"] = {"min_replicas": ray_opts.min_replicas, "max_replicas": ray_opts.max_replicas,
                                     "target_ongoing_requests": opts.max_batch}
    else:
        out["num_replicas"] = ray_opts.replicas or 1
    return out


def build(opts: ServeOptions, ray_opts: RayOptions):
    """The Serve application (bound, not running) for ``opts``; each replica runs ``threads`` threads."""
    from dataclasses import replace

    from ray import serve

    opts = replace(opts, threads=opts.threads or 1)
    ingress = serve.ingress(_replica_app)(TesseraReplica)
    return serve.deployment(ingress, **deployment_options(opts, ray_opts)).bind(opts)


# ------------------------------------------------------------------------------------ serve run

# ServeOptions' fields the app does not take, and why (tests/project/test_options_parity.py reads this)
APP_EXCLUDED = {"host": "Serve's HTTP options say where it listens (serve.start / the config file)",
                "port": "Serve's HTTP options say where it listens (serve.start / the config file)",
                "explain": "the command's --explain prints the deployment and exits; an app always runs",
                "address": "the app runs on the Ray cluster it is deployed to"}
# the app's names for fields it names otherwise
APP_NAMES = {"model": "spec", "set": "sets"}


def app_arguments() -> dict[str, tuple[type, str]]:
    """The app's arguments: every field of ServeOptions (the model, its compile options, the engine, the
    server's) and of RayOptions but APP_EXCLUDED, by the app's name, with (its options class, the field)."""
    fields_of = {f.name: (cls, f) for cls in (RayOptions, ServeOptions) for f in fields(cls)
                 if f.name not in APP_EXCLUDED}
    by_field = {v: k for k, v in APP_NAMES.items()}
    return {by_field.get(name, name): value for name, value in fields_of.items()}


def _from_text(key: str, raw, kind: str):
    """A ``key=value`` argument's text as its field's type (the annotation ``kind``, a string)."""
    if not isinstance(raw, str):
        return raw
    types = kind.replace(" ", "").split("|")
    if "list[str]" in types:
        return [s for s in raw.split(",") if s]
    if "bool" in types:
        if raw.lower() not in ("true", "false", "1", "0"):
            raise UsageError(f"{key} must be true or false, got {raw!r}")
        return raw.lower() in ("true", "1")
    for name, convert, what in (("int", int, "an integer"), ("float", float, "a number")):
        if name in types:
            try:
                return convert(raw)
            except ValueError:
                if "str" in types:
                    return raw
                raise UsageError(f"{key} must be {what}, got {raw!r}") from None
    return raw


def options_from_args(args: dict) -> tuple[ServeOptions, RayOptions]:
    """``serve run ...:app key=value ...`` arguments (strings) as the command's options: ``model``
    (required), ``set`` (comma-separated NAME=VALUE) and every other field of ServeOptions and
    RayOptions by its name (``variant``, ``weights``, ``seed``, ``allow_large``, ``tokenizer``,
    ``quantize``..., ``max_batch``, ``max_queue``, ``threads``, ``max_context``, ``prefill_chunk``,
    ``drain_timeout``, ``model_name``, ``replicas``, ``min_replicas``, ``max_replicas``...) but
    APP_EXCLUDED; each text converted to its field's type (``app_arguments``)."""
    known = app_arguments()
    values: dict[type, dict] = {RayOptions: {}, ServeOptions: {}}
    for key, raw in dict(args).items():
        if key not in known:
            raise UsageError(f"unknown argument {key!r}; the app takes {', '.join(sorted(known))}")
        cls, f = known[key]
        values[cls][f.name] = _from_text(key, raw, str(f.type))
    if "spec" not in values[ServeOptions]:
        raise UsageError("the app needs model=... (a .tsr spec, a bundled spec's name or a compiled .onnx file)")
    opts, ray_opts = ServeOptions(**values[ServeOptions]), RayOptions(**values[RayOptions])
    opts.check()
    ray_opts.check()
    return opts, ray_opts


def app(args: dict):
    """The application builder for ``serve run tessera.runtime.serving.ray_serve:app model=... ...``."""
    return build(*options_from_args(args))


# ------------------------------------------------------------------------------------ the command


def replica_failure(serve) -> str | None:
    """The last line of the error a replica's constructor raised (from Serve's status), if any."""
    try:
        app_status = serve.status().applications.get(APP_NAME)
        messages = [d.message for d in app_status.deployments.values() if d.message] if app_status else []
    except Exception:  # the status is a courtesy; the caller still has Serve's own message
        return None
    lines = [line.strip() for m in messages for line in m.splitlines() if line.strip()]
    return lines[-1] if lines else None


def cmd_serve_ray(args) -> int:
    opts, ray_opts = ServeOptions.from_args(args), RayOptions.from_args(args)
    opts.check()
    ray_opts.check()
    require_ray("`tessera serve --ray`", ("ray", "ray.serve"))
    require_extra()  # the replicas run the local server's routes (fastapi, uvicorn, jinja2)
    from ray import serve

    application = build(opts, ray_opts)
    described = deployment_options(opts, ray_opts)
    print(f"Ray Serve deployment {described}", file=sys.stderr)
    if opts.explain:
        return 0
    stop = threading.Event()
    with connected(ray_opts.address) as local:
        # after connecting: ray.init installs its own SIGTERM handler, which kills the driver
        previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            serve.start(http_options={"host": opts.host, "port": opts.port})
            try:
                serve.run(application, name=APP_NAME, route_prefix="/")
            except RuntimeError as e:  # a replica failed to start (a bad spec or path): say why, no traceback
                why = replica_failure(serve) or str(e)
                serve.delete(APP_NAME)
                raise UsageError(f"the Ray Serve replicas did not start: {why}") from None
            print(f"serving {opts.served_name} on Ray Serve at http://{opts.host}:{opts.port} (POST /v1/completions, "
                  f"/v1/chat/completions; GET /v1/models, /health, /metrics per replica)", file=sys.stderr, flush=True)
            while not stop.wait(1):  # signals are handled between waits
                pass
            print("stopping: replicas finish their running requests", file=sys.stderr, flush=True)
            serve.delete(APP_NAME)  # graceful: up to --drain-timeout for running requests
            if local:
                serve.shutdown()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    return 0
