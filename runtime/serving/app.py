"""The OpenAI-compatible HTTP routes over the engine (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (server-sent events when
``stream`` is true), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Why the body is parsed by hand (json.loads, then a pydantic model with unknown fields forbidden and
strict types) rather than by FastAPI's signature binding: every malformed request must get a 4xx
in OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``, not FastAPI's 422
detail list, and nothing a client sends may reach a traceback. Admission: the engine refuses past
its bounds with Overloaded (429) and while draining with Unavailable (503).

The engine runs in its own thread; a route waits for its request's tokens through an asyncio Event
the engine's listener sets (``_updates``). A streaming client that goes away is noticed when the
next chunk cannot be sent (the response generator is closed) and a waiting non-streaming one by
polling; either way the request is cancelled and its slot is free at the next step.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal, Union

import numpy as np
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tessera.runtime.generation.constraints import Grammar

from . import tools as tool_calls
from .embeddings import EmbeddingError
from .engine import Engine, Handle, Overloaded, Request, RequestError, Unavailable
from .http import MAX_HEADER_BYTES
from .model import ChatTemplate, ChatTemplateError, Sampling, StopStrings, UsageError, encode_prompts, stop_token_ids

MAX_BODY_BYTES = 4 * 1024 * 1024  # a request body, checked as it is read (413 past it): 4 MiB holds a
# 128k-token prompt as text or ids many times over; a 100 MB body held 6 GiB while tokenized
BODY_TIMEOUT_S = 60.0  # reading a request's body, once its headers are in (408 past it: a client sending it a
# byte at a time holds nothing for long)
PREPARE_THREADS = 2  # requests tokenized or rendered at once, off the event loop (Server.prepare)
MAX_FIELD_PATH = 64  # characters of a refused field's path quoted in an error


def _finite_float(v):
    """A number field as a float: a 401-digit integer (past float's range) or a non-finite value
    (json's NaN, Infinity) is the client's error, not an OverflowError later."""
    try:
        f = float(v)
    except OverflowError:
        raise ValueError("the number is too large") from None
    if f != f or f in (float("inf"), float("-inf")):
        raise ValueError("the number must be finite")
    return f


Number = Annotated[Union[StrictInt, StrictFloat], AfterValidator(_finite_float)]


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` only (unknown keys and wrong types are 400s)."""
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = None


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's name, description, schema and strict."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: StrictStr
    description: StrictStr | None = None
    schema_: dict | StrictBool | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text (no constraint), json_object (any JSON object) or json_schema."""
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number = 1.0  # OpenAI's default; 0 is greedy
    top_p: Number = 1.0
    top_k: StrictInt = 0  # an extension (as vLLM and llama.cpp take it)
    repetition_penalty: Number = 1.0  # an extension
    seed: StrictInt | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    user: StrictStr | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    ignore_eos: StrictBool = False  # an extension
    min_p: Number = 0.0  # extensions, as vLLM takes them (generation/sampling.py)
    no_repeat_ngram_size: StrictInt = 0
    min_tokens: StrictInt = 0  # vLLM's name for min_new_tokens
    # structured output (generation/constraints.py): OpenAI's response_format, and vLLM's extensions
    response_format: ResponseFormat | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_grammar: StrictStr | None = None  # a Lark grammar (llguidance's dialect)

    def grammar(self):
        """The Grammar the request asks for (None: free text), and the field that asked for it."""
        asked = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", Grammar.json_object()))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ApiError(400, "response_format of type json_schema needs json_schema.schema",
                               param="response_format")
            asked.append(("response_format", Grammar.json_schema(rf.json_schema.schema_)))
        if self.guided_json is not None:
            asked.append(("guided_json", Grammar.json_schema(self.guided_json)))
        if self.guided_regex is not None:
            asked.append(("guided_regex", Grammar.regex(self.guided_regex)))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", Grammar.lark(self.guided_grammar)))
        if len(asked) > 1:
            raise ApiError(400, f"give one of response_format (json), guided_json, guided_regex and guided_grammar, "
                                f"not {' and '.join(n for n, _ in asked)}", param=asked[1][0])
        return asked[0] if asked else (None, None)

    def top_logprobs_wanted(self) -> int | None:
        """The alternatives per token asked for (None: no logprobs)."""
        return None


class CompletionBody(_Body):
    logprobs: StrictInt | None = None  # the legacy completions' field: alternatives per token

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    prompt: StrictStr | list[StrictInt] | Annotated[list[StrictStr], Field(min_length=1, max_length=1)] | \
        Annotated[list[list[StrictInt]], Field(min_length=1, max_length=1)]
    echo: Literal[False] = False
    suffix: None = None
    best_of: Literal[1, None] = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict] | None = None  # None: an assistant's turn that only called tools
    name: StrictStr | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, as this server returned them
    tool_call_id: StrictStr | None = None  # a tool's answer: the call it answers


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(strict=True, min_length=1, max_length=64)]
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    def functions(self) -> list[dict]:
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    def calls_tools(self) -> bool:
        """Whether the reply is parsed for tool calls (tools given and tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_functions(self) -> list[dict] | None:
        """The functions one of which the reply must call (tool_choice "required" or named), else None."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return None
        fns = self.functions()
        if self.tool_choice == "required":
            return fns
        return [f for f in fns if f["name"] == self.tool_choice.function.name]

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class EmbeddingBody(BaseModel):
    """OpenAI's /v1/embeddings request."""
    model_config = ConfigDict(extra="forbid")

    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _printable(text):
    """``text`` encodable as UTF-8 (a lone surrogate a client sent, echoed in a message, escaped)."""
    if not isinstance(text, str):
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _error_response(e: ApiError):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": _printable(e.message), "type": e.type, "param": _printable(e.param),
                                   "code": e.code}}, status_code=e.status)


def check_text(data, root: str = "") -> None:
    """Every string in a parsed JSON body (keys too) must be valid Unicode, encodable as UTF-8:
    json.loads takes ``"\\ud800"`` (a lone surrogate), which nothing downstream can encode (the
    tokenizer, the stop strings, the error body). Walked without recursion."""
    stack = [(root, data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            items = ()
            strings = [value]
        elif isinstance(value, dict):
            items = [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
            strings = list(value)
        elif isinstance(value, list):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
            strings = []
        else:
            continue
        for text in strings:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                where = _printable(path)[:MAX_FIELD_PATH] or "the body"
                raise ApiError(400, f"{where}: the text is not valid Unicode (a lone surrogate such as \\ud800); "
                                    f"send UTF-8 text", param=_printable(path)[:MAX_FIELD_PATH] or None) from None
        stack.extend(items)


def _validation_error(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    loc = ".".join(str(x) for x in first.get("loc", ()))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = f"unrecognized request argument supplied: {loc}"
    return ApiError(400, f"{loc}: {msg}" if loc else msg, param=loc or None)


class Server:
    """What the routes share: the engine, the tokenizer, the chat template, the served model's name."""

    def __init__(self, engine: Engine, model_name: str, tokenizer=None, chat_template: ChatTemplate | None = None,
                 chat_template_error: str | None = None, embedder=None):
        self.engine, self.model_name, self.tokenizer = engine, model_name, tokenizer
        self.embedder = embedder  # an encoder's EmbeddingEngine (serving/embeddings.py): /v1/embeddings only
        self.chat_template, self.chat_template_error = chat_template, chat_template_error
        self.created = int(time.time())
        self._pool = None

    async def prepare(self, fn, data):
        """``fn(data)`` (a route's request: tokenizing the prompt, rendering the chat template) in a
        worker thread, so that a long prompt or a slow template never holds the event loop (every
        other client, /health); at most PREPARE_THREADS at once, so their memory is bounded too."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="tessera-prepare")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, data)

    # ---------------------------------------------------------------- request -> engine Request
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def _not_encoder(self) -> None:
        if self.embedder is not None:
            raise ApiError(400, f"'{self.model_name}' is an encoder model: this server answers /v1/embeddings, not "
                                f"the generation routes", code="model_not_supported")

    def embedding_request(self, data) -> tuple["EmbeddingBody", list[list[int]]]:
        body = _parse(EmbeddingBody, data)
        self._check_model(body.model)
        if self.embedder is None:
            raise ApiError(400, f"'{self.model_name}' is a decoder: /v1/embeddings is served for encoder models "
                                f"(tessera serve bert --variant minilm_l6 --weights ...)", code="model_not_supported")
        dim = self.embedder.model.dim
        if body.dimensions is not None and body.dimensions != dim:
            raise ApiError(400, f"dimensions={body.dimensions}: this model gives {dim}-dimensional embeddings and "
                                f"cannot shorten them (it was not trained for it)", param="dimensions")
        try:
            return body, self.embedder.encode(body.input)
        except EmbeddingError as e:
            raise ApiError(400, str(e), param="input") from None

    def embed(self, rows: list[list[int]]):
        """The future of the rows' embeddings (the embeddings engine batches the waiting requests)."""
        try:
            return self.embedder.submit(rows)
        except Overloaded as e:
            raise ApiError(429, str(e), "rate_limit_exceeded", code="overloaded") from None
        except Unavailable as e:
            raise ApiError(503, str(e), "service_unavailable") from None

    def _request(self, body: _Body, prompt_ids: list[int], max_tokens: int | None) -> Request:
        """The engine's Request; ``max_tokens`` None: what the context leaves (the chat route's default)."""
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"the model '{body.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        if body.n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        if body.presence_penalty or body.frequency_penalty:
            raise ApiError(400, "presence_penalty and frequency_penalty are not supported; use repetition_penalty",
                           param="presence_penalty" if body.presence_penalty else "frequency_penalty")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if stops and self.tokenizer is None:
            raise ApiError(400, "stop strings need the server to have a tokenizer (--tokenizer)", param="stop")
        if max_tokens is None:  # as much as the context leaves, as OpenAI's chat route does
            max_tokens = max(1, self.engine.capacity - len(prompt_ids)) if prompt_ids else 1
        logprobs = body.top_logprobs_wanted()
        sampling = Sampling(float(body.temperature), body.top_k, float(body.top_p), float(body.repetition_penalty),
                            body.seed, float(body.min_p), body.no_repeat_ngram_size, body.min_tokens, logprobs)
        req = Request(prompt_ids, max_tokens, sampling, tuple(stop_token_ids(self.tokenizer, stops)),
                      tuple(s for s in stops if s), body.ignore_eos)
        field, grammar = body.grammar()
        if isinstance(body, ChatBody) and body.forced_functions() is not None:
            field = "tools"  # the grammar is the call's form, from the tools' parameters
        if grammar is not None:  # compiled here, in the worker thread: a large schema takes a while
            if self.tokenizer is None:
                raise ApiError(400, "structured output needs the server to have a tokenizer (--tokenizer)",
                               param=field)
            try:
                self.engine.check(req)  # the request's own errors first, then the grammar's
            except RequestError as e:
                raise ApiError(400, str(e), param="prompt" if "prompt" in str(e) else None) from None
            try:
                req.grammar, req.mask = grammar, self.engine.grammar_mask(grammar)
            except RequestError as e:
                raise ApiError(400, str(e), param=field) from None
        return req

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer (--tokenizer): give the prompt as token ids",
                           param="prompt")
        if not text:
            raise ApiError(400, "the prompt is empty: generation needs at least one token to start from",
                           param="prompt")
        try:
            return encode_prompts(self.tokenizer, [text])[0]
        except UsageError as e:
            raise ApiError(400, str(e), param="prompt") from None

    def _submit(self, req: Request) -> Handle:
        try:
            return self.engine.submit(req)
        except RequestError as e:
            raise ApiError(400, str(e), param="prompt" if "prompt" in str(e) else None) from None
        except Overloaded as e:
            raise ApiError(429, str(e), "rate_limit_exceeded", code="overloaded") from None
        except Unavailable as e:
            raise ApiError(503, str(e), "service_unavailable") from None

    def completion_request(self, data) -> tuple[CompletionBody, Request]:
        self._not_encoder()
        body = _parse(CompletionBody, data)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], list):
            p = p[0]
        elif isinstance(p, list) and p and isinstance(p[0], str):
            p = p[0]
        ids = self._encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise ApiError(400, "the prompt is empty: generation needs at least one token to start from",
                           param="prompt")
        return body, self._request(body, ids, 16 if body.max_tokens is None else body.max_tokens)  # OpenAI's default

    def chat_request(self, data) -> tuple[ChatBody, Request]:
        self._not_encoder()
        body = _parse(ChatBody, data)
        if self.chat_template is None:
            why = self.chat_template_error or ("this model has no chat template (no chat_template in the "
                                               "tokenizer folder's tokenizer_config.json); use /v1/completions")
            raise ApiError(400, why, param="messages", code="no_chat_template")
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                           for part in content):
                    raise ApiError(400, "only text content parts are supported", param="messages")
                content = "".join(part["text"] for part in content)
            if content is None and not (m.role == "assistant" and m.tool_calls):
                raise ApiError(400, f"messages[{i}].content is missing (only an assistant's turn with tool_calls "
                                    f"may have none)", param=f"messages[{i}].content")
            if m.tool_calls and m.role != "assistant":
                raise ApiError(400, f"messages[{i}]: only an assistant's message has tool_calls",
                               param=f"messages[{i}].tool_calls")
            if m.role == "tool" and m.tool_call_id is None:
                raise ApiError(400, f"messages[{i}]: a tool message needs tool_call_id (the call it answers)",
                               param=f"messages[{i}].tool_call_id")
            msg = {"role": m.role, "content": content, **({"name": m.name} if m.name else {})}
            if m.tool_calls:
                msg["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            messages.append(msg)
        if body.tool_choice is not None and not body.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        names = [t.function.name for t in body.tools or []]
        if len(set(names)) < len(names):
            raise ApiError(400, "tools: two functions have the same name", param="tools")
        if isinstance(body.tool_choice, NamedToolChoice) and body.tool_choice.function.name not in names:
            raise ApiError(400, f"tool_choice names the function '{body.tool_choice.function.name}', which is not "
                                f"among the tools", param="tool_choice")
        forced = body.forced_functions()
        if forced is not None and body.grammar()[1] is not None:
            raise ApiError(400, "tool_choice that requires a call and a response_format or guided_* constraint "
                                "exclude each other", param="tool_choice")
        try:  # the template is read only beside a tokenizer: self.tokenizer is there
            ids = self.chat_template.encode(self.tokenizer, tool_calls.template_messages(messages),
                                            [t.model_dump(exclude_none=True) for t in body.tools] if body.tools
                                            else None)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        if forced is not None:  # the reply is held to a call's form (serving/tools.py)
            g = tool_calls.forced_grammar(forced, body.parallel_tool_calls, getattr(self.chat_template, "source", ""))
            if g.kind == "lark":
                body.guided_grammar = g.source
            else:
                body.guided_json = g.source
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return body, self._request(body, ids, limit)

    # ---------------------------------------------------------------- tokens -> text
    def text_tokens(self, handle: Handle, final: bool, count: int | None = None) -> list[int]:
        """The first ``count`` tokens that make text: a last stop or end-of-sequence token is left out
        (held back while the request runs: it may be the one that stops it)."""
        req = handle.request
        tokens = handle.tokens[:count] if count is not None else list(handle.tokens)
        if tokens and (tokens[-1] in req.stop_tokens or tokens[-1] in self.engine.eos_ids) and (
                not final or handle.finish_reason == "stop"):
            tokens = tokens[:-1]
        return tokens

    @staticmethod
    def visible(handle: Handle, text: str, final: bool) -> str:
        """``text`` trimmed at a stop string; while not final, without the tail that could still become
        a stop string or is an incomplete character."""
        return StopStrings(handle.request.stop_strings).visible(text, final)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer is not None else str(token)

    def completion_logprobs(self, handle: Handle) -> dict | None:
        """OpenAI's legacy completions ``logprobs`` over the tokens that make the text: tokens,
        token_logprobs, top_logprobs (token text -> log-probability) and text_offset."""
        if handle.request.sampling.logprobs is None:
            return None
        return self.completion_logprobs_of(handle.logprobs[:len(self.text_tokens(handle, True))])

    def completion_logprobs_of(self, entries: list[dict], offset: int = 0) -> dict:
        """The completions ``logprobs`` of some tokens' entries (engine Handle.logprobs), the first
        ``offset`` characters into the completion (a stream's chunk carries its own tokens')."""
        texts = [self._token_text(e["token"]) for e in entries]
        offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{self._token_text(a["token"]): a["logprob"] for a in e["top"]} for e in entries],
                "text_offset": offsets}

    def chat_logprobs(self, handle: Handle) -> dict | None:
        """OpenAI's chat ``logprobs``: content, per token its text, logprob, bytes and top_logprobs."""
        if handle.request.sampling.logprobs is None:
            return None
        return self.chat_logprobs_of(handle.logprobs[:len(self.text_tokens(handle, True))])

    def chat_logprobs_of(self, entries: list[dict]) -> dict:
        """The chat ``logprobs`` of some tokens' entries (a stream's chunk carries its own tokens')."""
        def item(token: int, logprob: float) -> dict:
            text = self._token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(e["token"], e["logprob"]), "top_logprobs": [item(a["token"], a["logprob"])
                                                                               for a in e["top"]]}
                            for e in entries]}

    def chat_reply(self, body: "ChatBody", handle: Handle) -> tuple[dict, str]:
        """The assistant's message and the finish reason: with tools (tool_choice not "none") the text
        parsed for calls (serving/tools.py), ``tool_calls`` and finish_reason "tool_calls" when it has
        some; else the text as content."""
        text, finish = self.text_of(handle), _finish_reason(handle)
        if not body.calls_tools():
            return {"role": "assistant", "content": text}, finish
        content, calls = tool_calls.parse(text, body.functions())
        if not calls:
            return {"role": "assistant", "content": text}, finish
        if not body.parallel_tool_calls:
            calls = calls[:1]
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def text_of(self, handle: Handle) -> str:
        """The finished request's completion text (one decode of all its tokens)."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.text_tokens(handle, True), skip_special_tokens=True)
        return self.visible(handle, text, True)


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_byte_tokens_of: dict[int, tuple[object, frozenset]] = {}


def byte_tokens(tokenizer) -> frozenset:
    """The ids of sentencepiece's byte-fallback pieces (``<0xE2>``) in ``tokenizer``'s vocabulary:
    its ByteFallback decoder turns a run of them into text only as a whole (a run that is not valid
    UTF-8 becomes one U+FFFD per byte, so ``<0x41>`` reads "A" alone and "\ufffd\ufffd" once an
    ``<0xE2>`` follows). Found once per tokenizer."""
    hit = _byte_tokens_of.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    ids = frozenset()
    vocab = getattr(tokenizer, "get_vocab", None)
    if vocab is not None:
        try:
            ids = frozenset(i for t, i in vocab(with_added_tokens=False).items() if _BYTE_TOKEN.fullmatch(t))
        except TypeError:
            ids = frozenset()
    _byte_tokens_of[id(tokenizer)] = (tokenizer, ids)
    return ids


class Detokenizer:
    """The text of a growing token list, each update decoding a short window instead of the whole
    completion (a stream would otherwise cost O(n^2) decodes): the window starts at the tokens of
    the previous update, so word joins and spaces come out as in one decode (vLLM's prefix and read
    offsets). An update waits for the next token when its text ends in an incomplete character
    (U+FFFD) or its last token is a byte-fallback piece (the run's text is not settled). The last
    update (``final``) is one decode of all the tokens, so what a stream has shown is always
    completed to exactly the unstreamed text: a trailing incomplete character and the tokens held
    back with it are never lost."""

    def __init__(self, tokenizer):
        self.tokenizer, self.text, self.prefix, self.read = tokenizer, "", 0, 0
        self.held = byte_tokens(tokenizer) if tokenizer is not None else frozenset()

    def update(self, tokens: list[int], final: bool = False) -> str:
        if self.tokenizer is None:
            return self.text
        if final:
            self.text = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
            self.prefix = self.read = len(tokens)
            return self.text
        if len(tokens) <= self.read or tokens[-1] in self.held:
            return self.text
        before = self.tokenizer.decode(tokens[self.prefix:self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(tokens[self.prefix:], skip_special_tokens=True)
        if len(after) > len(before) and after.startswith(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(tokens)
        elif not after.startswith(before):  # a tokenizer whose windows do not join: decode it all once
            self.text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            self.prefix = self.read = len(tokens)
        return self.text


class StreamText:
    """What a stream sends: each wake ``delta(count, done)`` is the new visible text (stop strings
    cut, their possible beginnings and incomplete characters held back while running); the deltas
    joined are ``Server.text_of`` of the finished request."""

    def __init__(self, server: "Server", handle: Handle):
        self.server, self.handle = server, handle
        self.detok, self.shown = Detokenizer(server.tokenizer), ""

    def tokens(self, count: int, done: bool) -> list[int]:
        return self.server.text_tokens(self.handle, done, None if done else count)

    def delta(self, count: int, done: bool) -> str:
        tokens = self.tokens(count, done)
        text = self.server.visible(self.handle, self.detok.update(tokens, final=done), done)
        if text.startswith(self.shown) and len(text) > len(self.shown):
            new, self.shown = text[len(self.shown):], text
            return new
        return ""


def _parse(model, data):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


def _listen(handle: Handle) -> asyncio.Event:
    """An asyncio Event the engine's thread sets after each change of ``handle``."""
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    def wake():
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    handle.add_listener(wake)
    return event


async def _updates(handle: Handle, request: HttpRequest):
    """Yield (tokens so far, finished) each time the engine adds a token or finishes the request; stop
    early if the client goes away meanwhile (checked every half second: a request still queued sends
    nothing, so a failed send cannot tell)."""
    event = _listen(handle)
    while True:
        event.clear()
        done = handle.finished
        yield len(handle.tokens), done
        if done:
            return
        while True:
            try:
                await asyncio.wait_for(event.wait(), 0.5)
                break
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return


def _usage(handle: Handle) -> dict:
    p, c = len(handle.request.prompt), len(handle.tokens)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _finish_reason(handle: Handle) -> str:
    return {"stop": "stop", "length": "length"}.get(handle.finish_reason, handle.finish_reason)


class _HeaderLimit:
    """Refuse a request whose header block is past http.py's MAX_HEADER_BYTES (431, OpenAI's error
    body): uvicorn's h11 bounds a header block that arrives in pieces, this one that came whole."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ())) + \
                len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") > MAX_HEADER_BYTES:
            body = json.dumps({"error": {"message": f"the request's headers are past the server's limit of "
                                                    f"{MAX_HEADER_BYTES} bytes", "type": "invalid_request_error",
                                         "param": None, "code": "headers_too_large"}}).encode()
            await send({"type": "http.response.start", "status": 431,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------- routes
# Each route is a plain function of the request; the Server it serves is the application's state
# (``request.app.state.server``), set by create_app.


def _server(request: HttpRequest) -> Server:
    return request.app.state.server


async def _api_error(request, e: ApiError):
    return _error_response(e)


async def _http_error(request, e):
    return _error_response(ApiError(e.status_code, str(e.detail), "invalid_request_error"
                                    if e.status_code < 500 else "server_error"))


async def _validation(request, e):
    return _error_response(ApiError(400, "the request is not valid"))


async def _unexpected(request, e):  # a bug: the client gets a message, never a traceback
    return _error_response(ApiError(500, f"internal error: {type(e).__name__}", "server_error"))


async def read_json(request: HttpRequest):
    """The body as a JSON object, read with MAX_BODY_BYTES checked as it comes (413), its text
    valid Unicode (check_text)."""
    length = request.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is {int(length)} bytes, past the server's limit of {MAX_BODY_BYTES}",
                       code="body_too_large")
    parts = []

    async def read() -> None:
        size = 0
        async for part in request.stream():
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the body is past the server's limit of {MAX_BODY_BYTES} bytes",
                               code="body_too_large")
            parts.append(part)

    try:
        await asyncio.wait_for(read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the body did not arrive within {BODY_TIMEOUT_S:g} s",
                       code="request_timeout") from None
    except ClientDisconnect:  # the client went away or sent a malformed (e.g. chunked) body
        raise ApiError(400, "the body could not be read (the client disconnected or sent a malformed "
                            "body)") from None
    raw = b"".join(parts)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:  # json's decoder recurses per level: a 100,000-deep body is the client's error
        raise ApiError(400, "the body is not valid JSON: arrays or objects nested too deep") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    check_text(data)
    return data


async def health(request: HttpRequest):
    server = _server(request)
    if not server.engine.accepting:
        return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok", "running": server.engine.running, "queued": server.engine.queued}


async def metrics(request: HttpRequest):
    return PlainTextResponse(_server(request).engine.metrics.render(), media_type="text/plain; version=0.0.4")


async def models(request: HttpRequest):
    server = _server(request)
    return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                        "owned_by": "tessera"}]}


async def wait_for(handle: Handle, request: HttpRequest) -> None:
    """Until the request finishes; cancel it if the client goes away meanwhile (checked every 0.25 s)."""
    event, loop = _listen(handle), asyncio.get_running_loop()
    checked = loop.time()
    try:
        while True:
            event.clear()
            if handle.finished:
                return
            try:
                await asyncio.wait_for(event.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
            if loop.time() - checked >= 0.25:
                checked = loop.time()
                if await request.is_disconnected():
                    return
    finally:
        if not handle.finished:
            handle.cancel()


def check_outcome(handle: Handle) -> None:
    if handle.finish_reason == "error":
        raise ApiError(500, handle.error or "the model failed", "server_error")
    if handle.finish_reason == "cancelled":
        raise ApiError(503, "the request was cancelled: the server is shutting down", "service_unavailable")


def stream(server: Server, handle: Handle, request: HttpRequest, chunk, usage_wanted: bool):
    """Server-sent events: ``chunk(delta_text, finish_reason, entries=...)`` per new text, then usage,
    then [DONE]. With logprobs asked for, ``entries`` are the engine's log-probabilities of the tokens
    whose text the chunk first covers (the finish chunk gets any left, e.g. behind a stop string),
    else None."""
    wanted = handle.request.sampling.logprobs is not None
    sent = 0  # entries already in a chunk

    def entries(upto: int) -> list[dict] | None:
        nonlocal sent
        if not wanted:
            return None
        new = handle.logprobs[sent:max(sent, upto)]
        sent += len(new)
        return new

    async def events():
        text = StreamText(server, handle)
        try:
            first = chunk(None, None)
            if first is not None:
                yield f"data: {json.dumps(first)}\n\n"
            async for count, done in _updates(handle, request):
                tokens = text.tokens(count, done)
                new = text.delta(count, done)
                if new:
                    yield f"data: {json.dumps(chunk(new, None, entries=entries(len(tokens))))}\n\n"
                if done:
                    if handle.finish_reason in ("error", "cancelled"):
                        err = handle.error or "the request was cancelled: the server is shutting down"
                        yield f"data: {json.dumps({'error': {'message': err, 'type': 'server_error'}})}\n\n"
                    else:
                        last = entries(len(tokens))
                        yield f"data: {json.dumps(chunk('', _finish_reason(handle), entries=last))}\n\n"
                        if usage_wanted:
                            final = chunk(None, None, usage=_usage(handle))
                            yield f"data: {json.dumps(final)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not handle.finished:  # the client went away (or the server stops): free the slot
                handle.cancel()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def tool_stream(server: Server, body: ChatBody, handle: Handle, request: HttpRequest, chunk, usage_wanted: bool):
    """A streamed chat reply that may call tools: whether the text is a call is known only at its end,
    so the reply is held until the request finishes, then sent as one content chunk or as one
    ``tool_calls`` delta per call (index, id, type, name and the whole arguments), then the finish
    chunk ("tool_calls" when it called), usage if asked, [DONE]."""
    async def events():
        try:
            yield f"data: {json.dumps(chunk(None, None))}\n\n"
            async for _count, done in _updates(handle, request):
                if done:
                    break
            else:
                return  # the client went away
            if handle.finish_reason in ("error", "cancelled"):
                err = handle.error or "the request was cancelled: the server is shutting down"
                yield f"data: {json.dumps({'error': {'message': err, 'type': 'server_error'}})}\n\n"
                yield "data: [DONE]\n\n"
                return
            message, finish = server.chat_reply(body, handle)
            entries = handle.logprobs if handle.request.sampling.logprobs is not None else None
            if "tool_calls" in message:
                base = chunk("", None)
                for i, call in enumerate(message["tool_calls"]):
                    part = json.loads(json.dumps(base))
                    part["choices"][0]["delta"] = {"tool_calls": [{"index": i, **call}]}
                    yield f"data: {json.dumps(part)}\n\n"
            elif message["content"]:
                yield f"data: {json.dumps(chunk(message['content'], None, entries=entries))}\n\n"
                entries = None
            last = chunk("", None, entries=entries)
            last["choices"][0]["finish_reason"] = finish
            yield f"data: {json.dumps(last)}\n\n"
            if usage_wanted:
                yield f"data: {json.dumps(chunk(None, None, usage=_usage(handle)))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not handle.finished:
                handle.cancel()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def completions(request: HttpRequest):
    server = _server(request)
    body, req = await server.prepare(server.completion_request, await read_json(request))
    handle = server._submit(req)
    rid, created = f"cmpl-{handle.id}", int(time.time())
    if body.stream:
        offset = 0  # characters of the completion's token texts before this chunk's (text_offset)

        def chunk(text, finish, usage=None, entries=None):
            nonlocal offset
            if usage is not None:
                return {"id": rid, "object": "text_completion", "created": created, "model": server.model_name,
                        "choices": [], "usage": usage}
            if text is None:
                return None
            logprobs = None
            if entries is not None:
                logprobs = server.completion_logprobs_of(entries, offset)
                offset += sum(len(t) for t in logprobs["tokens"])
            return {"id": rid, "object": "text_completion", "created": created, "model": server.model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

        return stream(server, handle, request, chunk,
                      bool(body.stream_options and body.stream_options.include_usage))
    await wait_for(handle, request)
    check_outcome(handle)
    return {"id": rid, "object": "text_completion", "created": created, "model": server.model_name,
            "choices": [{"index": 0, "text": server.text_of(handle), "logprobs": server.completion_logprobs(handle),
                         "finish_reason": _finish_reason(handle), "token_ids": list(handle.tokens)}],
            "usage": _usage(handle)}


async def embeddings(request: HttpRequest):
    server = _server(request)
    body, rows = await server.prepare(server.embedding_request, await read_json(request))
    try:
        vectors = await asyncio.wrap_future(server.embed(rows))
    except Unavailable as e:
        raise ApiError(503, str(e), "service_unavailable") from None
    except RuntimeError as e:
        raise ApiError(500, str(e), "server_error") from None
    data = []
    for i, v in enumerate(vectors):
        v = np.asarray(v, dtype=np.float32)
        emb = base64.b64encode(v.tobytes()).decode("ascii") if body.encoding_format == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    tokens = sum(len(r) for r in rows)
    return {"object": "list", "data": data, "model": server.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def chat(request: HttpRequest):
    server = _server(request)
    body, req = await server.prepare(server.chat_request, await read_json(request))
    handle = server._submit(req)
    rid, created = f"chatcmpl-{handle.id}", int(time.time())
    if body.stream:
        def chunk(text, finish, usage=None, entries=None):
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": server.model_name}
            if usage is not None:
                return {**base, "choices": [], "usage": usage}
            delta = {"role": "assistant", "content": ""} if text is None else \
                ({"content": text} if text else {})
            logprobs = server.chat_logprobs_of(entries) if entries is not None else None
            return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish}]}

        usage_wanted = bool(body.stream_options and body.stream_options.include_usage)
        if body.calls_tools():
            return tool_stream(server, body, handle, request, chunk, usage_wanted)
        return stream(server, handle, request, chunk, usage_wanted)
    await wait_for(handle, request)
    check_outcome(handle)
    message, finish = server.chat_reply(body, handle)
    return {"id": rid, "object": "chat.completion", "created": created, "model": server.model_name,
            "choices": [{"index": 0, "message": message,
                         "logprobs": server.chat_logprobs(handle), "finish_reason": finish,
                         "token_ids": list(handle.tokens)}],
            "usage": _usage(handle)}


ROUTES = (("GET", "/health", health), ("GET", "/metrics", metrics), ("GET", "/v1/models", models),
          ("POST", "/v1/completions", completions), ("POST", "/v1/embeddings", embeddings),
          ("POST", "/v1/chat/completions", chat))
ERROR_HANDLERS = ((ApiError, _api_error), (StarletteHTTPException, _http_error),
                  (RequestValidationError, _validation), (Exception, _unexpected))


def create_app(server: Server):
    """The FastAPI application over ``server`` (its engine must be started): ROUTES and ERROR_HANDLERS,
    ``server`` as the application's state."""
    app = FastAPI(title="tessera serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(_HeaderLimit)
    for kind, handler in ERROR_HANDLERS:
        app.add_exception_handler(kind, handler)
    for method, path, route in ROUTES:
        app.add_api_route(path, route, methods=[method])
    return app
