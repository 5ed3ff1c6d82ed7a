"""OpenAI tool calls on ``/v1/chat/completions``: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

The tools go to the chat template as transformers passes them (its ``tools`` variable: a list of
``{"type": "function", "function": {name, description, parameters}}``), so the model sees them in its
own format. The reply is parsed for calls in the two forms chat templates ask for: Hermes/Qwen's
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, or a reply that is as a whole a
JSON object ``{"name": ..., "arguments"|"parameters": {...}}`` (Llama 3.1's) or a list of them. A name
that is not among the tools, or text that does not parse, is content, not a call.

Where ``tool_choice`` requires a call ("required", or a named function) the reply is constrained
(generation/constraints.py) to a call: one object ``{"name": NAME, "arguments": ARGS}`` whose NAME is
one of the allowed functions and ARGS valid against that function's ``parameters`` schema -- in
``<tool_call>`` blocks where the chat template writes that form (one or more blocks when
``parallel_tool_calls`` is true, the default), else as JSON (a list of one or more objects when
parallel) -- so it always parses into ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import secrets

from tessera.runtime.generation.constraints import Grammar

TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def forced_schema(functions: list[dict], parallel: bool) -> dict:
    """The JSON schema of a reply that must call one of ``functions`` (OpenAI's function objects)."""
    one = [{"type": "object",
            "properties": {"name": {"const": f["name"]},
                           "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    item = one[0] if len(one) == 1 else {"anyOf": one}
    return {"type": "array", "items": item, "minItems": 1} if parallel else item


def forced_grammar(functions: list[dict], parallel: bool, template_source: str = ""):
    """The grammar of a reply that must call one of ``functions``: Hermes/Qwen's ``<tool_call>`` blocks
    (each one call's JSON, several separated by a newline when ``parallel``) where the chat template
    writes that form (its source mentions ``<tool_call>``), else the JSON form (``forced_schema``)."""
    if "<tool_call>" not in template_source:
        return Grammar.json_schema(forced_schema(functions, parallel))
    one = forced_schema(functions, False)
    one = {"x-guidance": {"whitespace_flexible": False}, **one}  # JSON without free whitespace, as elsewhere
    more = ' ("\\n" call)*' if parallel else ""
    return Grammar.lark("start: call" + more + "\n"
                        + 'call: "<tool_call>\\n" call_json "\\n</tool_call>"\n'
                        + "call_json: %json " + json.dumps(one) + "\n")


def _call(obj, names: set[str]) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _calls(value, names: set[str]) -> list[dict] | None:
    items = value if isinstance(value, list) else [value]
    calls = [_call(v, names) for v in items]
    return calls if calls and all(c is not None for c in calls) else None


def parse(text: str, functions: list[dict]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply: the calls found (none: ``[]``) and the text left around them
    (None when nothing is left)."""
    names = {f["name"] for f in functions}
    blocks = TOOL_CALL_BLOCK.findall(text)
    if blocks:
        calls = []
        for b in blocks:
            try:
                found = _calls(json.loads(b), names)
            except ValueError:
                found = None
            if found is None:
                return text, []  # a block that is no call of these tools: the reply is text
            calls += found
        rest = TOOL_CALL_BLOCK.sub("", text).strip()
        return rest or None, calls
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        try:
            found = _calls(json.loads(stripped), names)
        except ValueError:
            found = None
        if found:
            return None, found
    return text, []


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for the chat template: an assistant's ``tool_calls`` with their arguments as dicts
    (transformers' templates read ``tool_call.function.arguments`` as a mapping; OpenAI sends JSON
    text), a missing content as ""."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                c = json.loads(json.dumps(c))
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out
