"""Stop strings, judged in one place for `tessera generate`, the serving engine, the server's text and
`tessera batch`'s results: when a row stops (``StopStrings.hit``), where its text is cut (``trim``) and
how much of a streamed text is held back while a stop string could still complete (``visible``).

Why a window sized by the stop strings: the row's text is decoded from its last tokens after each new
token, and a stop string is found only if it lies inside that window. A fixed window (64 tokens, as
before) never stopped a row on a stop string longer than 64 tokens' text, although the text it
returned was trimmed at it. A character takes at most ``TOKENS_PER_CHAR`` tokens (byte-level BPE and
sentencepiece's byte fallback: one token per UTF-8 byte), so a window of that many tokens per
character of the longest stop string, plus the characters a decoder may hold back, always holds it.
"""

from __future__ import annotations

MIN_WINDOW = 64
TOKENS_PER_CHAR = 4   # UTF-8: at most 4 bytes a character, one token a byte at worst
SLACK = 16            # tokens a decoder may join into the text of the next (byte runs, prefix spaces)


class StopStrings:
    """A row's stop strings (empty strings dropped)."""

    def __init__(self, stops):
        self.stops = tuple(s for s in (stops or ()) if s)
        longest = max((len(s) for s in self.stops), default=0)
        self.window = max(MIN_WINDOW, TOKENS_PER_CHAR * longest + SLACK)  # tokens decoded to look for one

    def __bool__(self) -> bool:
        return bool(self.stops)

    def first(self, text: str) -> int:
        """Where the earliest stop string starts in ``text`` (-1: none)."""
        return min((i for s in self.stops if (i := text.find(s)) >= 0), default=-1)

    def hit(self, tokenizer, tokens) -> bool:
        """Whether the text of a row's generated ``tokens`` contains a stop string (its last ``window``
        tokens decoded: a stop string completed by the newest token lies inside them)."""
        if not self.stops or not tokens:
            return False
        text = tokenizer.decode(list(tokens[-self.window:]), skip_special_tokens=True)
        return self.first(text) >= 0

    def trim(self, text: str) -> str:
        """``text`` up to its first stop string (all of it when it has none)."""
        cut = self.first(text)
        return text[:cut] if cut >= 0 else text

    def visible(self, text: str, final: bool) -> str:
        """What of a streamed ``text`` may be sent: trimmed at a stop string; while not ``final``, without
        the tail that could still become a stop string or is an incomplete character (U+FFFD)."""
        cut = self.first(text)
        if cut >= 0:
            return text[:cut]
        if not final:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            text = text[:len(text) - hold] if hold else text
            while text.endswith("\ufffd"):
                text = text[:-1]
        return text


class TextStopper:
    """``generate``'s ``should_stop(row, tokens)`` for stop strings (generation/loop.py), and its trim."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.strings = tokenizer, StopStrings(stops)
        self.stops = list(self.strings.stops)

    def __call__(self, row: int, tokens: list[int]) -> bool:
        return self.strings.hit(self.tokenizer, tokens)

    def trim(self, text: str) -> str:
        return self.strings.trim(text)
