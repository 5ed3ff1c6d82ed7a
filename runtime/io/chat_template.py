"""Chat messages to prompt text: the tokenizer folder's chat template, rendered in jinja2's sandbox.

Why one module: ``tessera generate --chat``, the API's ``generate(chat=True)`` and the server's
``/v1/chat/completions`` must turn the same messages into the same ids (those of transformers'
``apply_chat_template``: the rendered text tokenized without the tokenizer's own special tokens,
since the template writes them itself), so the template is read, rendered and encoded here only.

Why the sandbox: a chat template is code that came with a downloaded model; jinja2's
``ImmutableSandboxedEnvironment`` lets it format messages but not reach Python objects' internals
or mutate anything, as transformers renders templates. The template is ``chat_template.jinja`` next
to tokenizer.json (transformers >= 4.50 saves it there), else ``chat_template`` of
``tokenizer_config.json`` (a string, or a list of named templates of which "default" is used);
``bos_token`` and ``eos_token`` come from tokenizer_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from tessera.runtime.errors import UsageError


JINJA_FILE = "chat_template.jinja"
MAX_TEMPLATE = 1024 * 1024  # bytes of a chat_template.jinja read (templates are a few kB)


class ChatTemplateError(UsageError):
    """A template that cannot be read or rendered, or none where one is needed (a message for the
    user: the command line's exit status 2, the server's HTTP 400)."""


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config.json files
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ChatTemplateError(str(message))

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template does not parse: {e}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_tokenizer_folder(cls, tokenizer_path: str | Path) -> "ChatTemplate | None":
        """The template of tokenizer_config.json beside ``tokenizer_path`` (a tokenizer.json, or the
        folder holding it); None when there is none."""
        from tessera.runtime.io.text import tokenizer_file

        folder = Path(tokenizer_file(tokenizer_path)).parent
        config = folder / "tokenizer_config.json"
        data = {}
        if config.is_file():
            try:
                data = json.loads(config.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ChatTemplateError(f"cannot read {config}: {e}") from None
        source = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(source, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja = folder / JINJA_FILE  # transformers >= 4.50 saves the template here, and it wins there too
        if jinja.is_file():
            try:
                with open(jinja, "rb") as f:
                    raw = f.read(MAX_TEMPLATE + 1)
                source = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ChatTemplateError(f"cannot read {jinja}: {e}") from None
            if len(raw) > MAX_TEMPLATE:
                raise ChatTemplateError(f"{jinja} is over {MAX_TEMPLATE:,} bytes; a chat template is a few kB")
        if not isinstance(source, str) or not source:
            return None
        if not isinstance(data, dict):
            data = {}
        return cls(source, _token_text(data.get("bos_token")), _token_text(data.get("eos_token")))

    def render(self, messages: list[dict]) -> str:
        """The prompt text for ``messages`` (role/content dicts), ending with the assistant's turn."""
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                        eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template could not render these messages: {e}") from None

    @classmethod
    def required(cls, tokenizer_path: str | Path, asked_by: str = "--chat") -> "ChatTemplate":
        """The template beside ``tokenizer_path``, or a ChatTemplateError saying where it was looked for
        (``asked_by``: the flag or keyword that wants it)."""
        template = cls.from_tokenizer_folder(tokenizer_path)
        if template is None:
            from tessera.runtime.io.text import tokenizer_file

            folder = Path(tokenizer_file(tokenizer_path)).parent
            raise ChatTemplateError(f"{folder} has no chat template (no {JINJA_FILE}, no chat_template in "
                                    f"tokenizer_config.json beside tokenizer.json); {asked_by} needs a chat model's "
                                    f"tokenizer folder, or give the prompt without {asked_by}")
        return template

    def encode(self, tokenizer, messages: list[dict]) -> list[int]:
        """The prompt ids for ``messages``: rendered, then tokenized without the tokenizer's special
        tokens (the template writes its own BOS), as transformers' apply_chat_template(tokenize=True)."""
        return list(tokenizer.encode(self.render(messages), add_special_tokens=False).ids)
