"""Serving: many callers, one model (docs/serve.md).

- ``engine.py``: the continuous-batching engine over the KV-cached decoder -- requests join and
  leave at every decoding step, prompts are prefilled in bounded chunks between steps, the cache is
  allocated once. Usable from Python without any web framework::

      from tessera.runtime.serving.engine import Engine, Request
      engine = Engine(model, max_batch=8)          # model: serving.model.load("gpt2", sets=[...])
      engine.start()                               # the scheduling loop, in a thread of its own
      handle = engine.submit(Request(prompt=[464, 2068], max_tokens=20))
      print(list(handle))                          # the new token ids as they come
      engine.close()

- ``model.py``: what the engines take from the rest of the runtime (the model, loaded by runtime/driver.py's
  ``serve_model`` from options.EngineOptions; token choice, tokenizers).
- ``app.py`` (FastAPI), ``chat.py``, ``metrics.py``, ``server.py`` (the options and the build),
  ``cli.py`` (the command): ``tessera serve``'s OpenAI-compatible HTTP server; they need the ``serve``
  extra (fastapi, uvicorn, jinja2). ``ray_serve.py``: the same server on Ray Serve replicas.
- ``batch.py`` (the work), ``batch_cli.py`` (the command), ``ray_batch.py`` (on Ray Data): ``tessera batch``.
"""
