"""Chat messages to prompt text: the tokenizer folder's chat template, rendered in jinja2's sandbox.

Why one module: ``tessera generate --chat``, the API's ``generate(chat=True)`` and the server's
``/v1/chat/completions`` must turn the same messages into the same ids (those of transformers'
``apply_chat_template``: the rendered text tokenized without the tokenizer's own special tokens,
since the template writes them itself), so the template is read, rendered and encoded here only.

Why the sandbox: a chat template is code that came with a downloaded model; jinja2's
``ImmutableSandboxedEnvironment`` lets it format messages but not reach Python objects' internals
or mutate anything, as transformers renders templates. The template is ``chat_template`` of
``tokenizer_config.json`` next to tokenizer.json (a string, or a list of named templates of which
"default" is used); ``bos_token`` and ``eos_token`` come from the same file.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from tessera.runtime.errors import UsageError

TEMPLATE_SECONDS = 2.0  # a render's time budget: a real template renders a conversation in milliseconds
MAX_RENDERED_CHARS = 16 * 1024 * 1024  # a render's output, and any string or list it builds (`'x' * 10**10`)
MAX_TEMPLATE_ITEMS = 1_000_000  # items all of a render's `range` calls may yield together
MAX_POWER_BITS = 4096  # an integer `**` result's size (`10 ** 10 ** 10`)


def _tracer(frame, event, arg):
    """sys.settrace's hook while a template renders: trace the template's own code only (jinja
    compiles it to a module named ``<template>``), checking the deadline at each of its lines, so a
    loop that calls and prints nothing (`{% for i in range(10**5) %}{% for j in range(10**5) %}`)
    still stops."""
    if frame.f_code.co_filename != "<template>":
        return None
    _check_time()
    return _line


def _line(frame, event, arg):
    _check_time()
    return _line


class ChatTemplateError(UsageError):
    """A template that cannot be read or rendered, or none where one is needed (a message for the
    user: the command line's exit status 2, the server's HTTP 400)."""


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config.json files
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class _Budget(threading.local):
    """The running render's deadline and counters (one per thread: the server renders in workers)."""
    deadline: float | None = None
    items: int = 0


_budget = _Budget()


def _over(why: str):
    raise ChatTemplateError(why)


def _check_time() -> None:
    if _budget.deadline is not None and time.monotonic() > _budget.deadline:
        _over(f"it ran past its time budget of {TEMPLATE_SECONDS:g} s")


def _sized(value, what: str):
    if isinstance(value, (str, list, tuple, bytes)) and len(value) > MAX_RENDERED_CHARS:
        _over(f"{what} would make {len(value):,} items, past the budget of {MAX_RENDERED_CHARS:,}")
    return value


def _environment():
    """jinja2's immutable sandbox with budgets: every call, `range` item and string or list
    operation counted against the render's deadline and sizes (``_budget``)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%", "//"])

        def call_binop(self, context, operator, left, right):
            _check_time()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_RENDERED_CHARS:
                        _over(f"`*` would make {len(seq) * n:,} items, past the budget of {MAX_RENDERED_CHARS:,}")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    abs(left) > 1 and right * max(1, abs(left).bit_length()) > MAX_POWER_BITS:
                _over(f"`**` would make an integer of more than {MAX_POWER_BITS} bits")
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) and \
                    len(left) + len(right) > MAX_RENDERED_CHARS:
                _over(f"`+` would make {len(left) + len(right):,} items, past the budget of {MAX_RENDERED_CHARS:,}")
            return _sized(super().call_binop(context, operator, left, right), f"`{operator}`")

        def call(self, context, obj, /, *args, **kwargs):  # positional: a template may pass obj=
            _check_time()
            return _sized(super().call(context, obj, *args, **kwargs), "a call")

    def budget_range(*args):
        r = range(*args)
        _budget.items += len(r)
        if _budget.items > MAX_TEMPLATE_ITEMS:
            _over(f"its `range` calls yield more than {MAX_TEMPLATE_ITEMS:,} items")
        return r

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["range"] = budget_range
    return env


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "the chat template"):
        from jinja2 import TemplateError

        def raise_exception(message):
            raise ChatTemplateError(f"{self.origin}: {message}")

        self.origin = origin
        env = _environment()
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"{origin} does not parse: {e}") from None
        except (RecursionError, MemoryError, SyntaxError, ValueError, OverflowError) as e:
            # 2,000 nested ifs: jinja's compiler (or Python's, on its code) runs out of depth
            raise ChatTemplateError(f"{origin} does not parse: {type(e).__name__}: "
                                    f"{str(e)[:200] or 'nested too deep'}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_tokenizer_folder(cls, tokenizer_path: str | Path) -> "ChatTemplate | None":
        """The template of tokenizer_config.json beside ``tokenizer_path`` (a tokenizer.json, or the
        folder holding it); None when there is none."""
        from tessera.runtime.io.text import tokenizer_file

        config = Path(tokenizer_file(tokenizer_path)).parent / "tokenizer_config.json"
        if not config.is_file():
            return None
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ChatTemplateError(f"cannot read {config}: {e}") from None
        except RecursionError:
            raise ChatTemplateError(f"cannot read {config}: JSON nested too deep") from None
        source = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(source, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        return cls(source, _token_text(data.get("bos_token")), _token_text(data.get("eos_token")),
                   origin=f"the chat template of {config.parent.name}/{config.name}")

    def render(self, messages: list[dict]) -> str:
        """The prompt text for ``messages`` (role/content dicts), ending with the assistant's turn;
        within TEMPLATE_SECONDS and MAX_RENDERED_CHARS (a ChatTemplateError naming the template past
        either, and for anything the template raises)."""
        _budget.deadline, _budget.items = time.monotonic() + TEMPLATE_SECONDS, 0
        previous = sys.gettrace()
        sys.settrace(_tracer)  # every line the template's own code runs checks the deadline
        try:
            out, size = [], 0
            for piece in self.template.generate(messages=messages, add_generation_prompt=True,
                                                bos_token=self.bos_token, eos_token=self.eos_token):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    _over(f"its output is past the budget of {MAX_RENDERED_CHARS:,} characters")
                _check_time()
                out.append(piece)
            return "".join(out)
        except ChatTemplateError as e:
            message = str(e)
            if message.startswith(self.origin):
                raise
            raise ChatTemplateError(f"{self.origin} could not render these messages: {message}") from None
        except RecursionError:
            raise ChatTemplateError(f"{self.origin} could not render these messages: it recursed too deep "
                                    f"(a recursive macro?)") from None
        except MemoryError:
            raise ChatTemplateError(f"{self.origin} could not render these messages: it ran out of "
                                    f"memory") from None
        except Exception as e:  # noqa: BLE001 -- the template is untrusted code: anything it raises is its error
            raise ChatTemplateError(f"{self.origin} could not render these messages: {type(e).__name__}: "
                                    f"{str(e)[:200]}") from None
        finally:
            sys.settrace(previous)
            _budget.deadline = None

    @classmethod
    def required(cls, tokenizer_path: str | Path, asked_by: str = "--chat") -> "ChatTemplate":
        """The template beside ``tokenizer_path``, or a ChatTemplateError saying where it was looked for
        (``asked_by``: the flag or keyword that wants it)."""
        template = cls.from_tokenizer_folder(tokenizer_path)
        if template is None:
            from tessera.runtime.io.text import tokenizer_file

            folder = Path(tokenizer_file(tokenizer_path)).parent
            raise ChatTemplateError(f"{folder} has no chat template (no chat_template in tokenizer_config.json "
                                    f"beside tokenizer.json); {asked_by} needs a chat model's tokenizer folder, or "
                                    f"give the prompt without {asked_by}")
        return template

    def encode(self, tokenizer, messages: list[dict]) -> list[int]:
        """The prompt ids for ``messages``: rendered, then tokenized without the tokenizer's special
        tokens (the template writes its own BOS), as transformers' apply_chat_template(tokenize=True)."""
        return list(tokenizer.encode(self.render(messages), add_special_tokens=False).ids)
