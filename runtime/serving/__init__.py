"""Serving: many callers, one model (docs/serve.md).

- ``engine.py``: the continuous-batching engine over the KV-cached decoder -- requests join and
  leave at every decoding step, prompts are prefilled in bounded chunks between steps, the cache is
  allocated once. Usable from Python without any web framework::

      from tessera.runtime.serving.engine import Engine, Request
      engine = Engine(model, max_batch=8)          # model: serving.model.load(...)
      engine.start()                               # the scheduling loop, in a thread of its own
      handle = engine.submit(Request(prompt=[464, 2068], max_tokens=20))
      print(list(handle))                          # the new token ids as they come
      engine.close()

- ``model.py``: the one bridge to the rest of the runtime (loading the cached decoder, tokenizers).
- ``app.py`` (FastAPI), ``chat.py``, ``metrics.py``, ``cli.py``: ``tessera serve``'s OpenAI-compatible
  HTTP server; they need the ``serve`` extra (fastapi, uvicorn, jinja2).
"""
