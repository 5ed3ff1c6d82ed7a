"""Stop strings, judged in one place (runtime/generation/stops.py) for generate, the engine, the
server's streamed text and batch: a stop string longer than the old 64-token window stops the row
(it used to be trimmed from the text while the row ran on to its token limit)."""

from __future__ import annotations

import numpy as np

from conftest import build  # noqa: F401  (the tests' path set-up)
from tessera.runtime.generation.stops import MIN_WINDOW, StopStrings, TextStopper


class OneCharTokens:
    """A tokenizer whose token i is the character chr(i): one token per character, decoded by joining."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_a_stop_string_longer_than_the_old_window_is_found():
    tok = OneCharTokens()
    stop = "".join(chr(ord("a") + i % 26) for i in range(3 * MIN_WINDOW))  # 192 characters, 192 tokens
    tokens = [ord(c) for c in "prefix " + stop]
    strings = StopStrings([stop])
    assert strings.hit(tok, tokens)
    assert not strings.hit(tok, tokens[:-1])  # one character short: not yet
    # what the old fixed window saw: the last 64 tokens' text, which cannot hold a 192-character string
    assert stop not in tok.decode(tokens[-MIN_WINDOW:])
    assert TextStopper(tok, [stop])(0, tokens) and TextStopper(tok, [stop]).trim("ab" + stop + "cd") == "ab"


def test_trim_visible_and_first_agree_with_str_find():
    rng = np.random.default_rng(0)
    for _ in range(200):
        text = "".join(rng.choice(list("abc\ufffd"), size=rng.integers(0, 30)))
        stops = ["".join(rng.choice(list("abc"), size=rng.integers(0, 4))) for _ in range(rng.integers(0, 3))]
        cuts = [text.find(s) for s in stops if s and s in text]
        want = text[:min(cuts)] if cuts else text
        s = StopStrings(stops)
        assert s.trim(text) == want and s.visible(text, final=True) == want
        held = s.visible(text, final=False)
        assert want.startswith(held)
        if not cuts:  # while running, the tail that could still become a stop string is held back, and so
            assert not held.endswith("\ufffd")  # is an incomplete character
            longest = max((len(x) for x in stops if x), default=0)
            assert len(held) <= max(len(text) - max(longest - 1, 0), 0)


def test_the_engine_stops_a_row_on_a_long_stop_string(tmp_path):
    """End to end in the serving engine (tiny seeded GPT-2 over a one-character tokenizer): the row's
    greedy text is computed first without stops; a stop string of 80 characters from inside it then
    ends the row with finish_reason "stop", right after the stop string's last token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tessera.runtime.serving import model as serving_model
    from tessera.runtime.serving.engine import Engine, Request
    from tessera.runtime.generation.sampling import Sampling

    vocab = {chr(ord("A") + i): i for i in range(50)}  # 50 one-character tokens: ids 0..49
    tok = Tokenizer(models.WordLevel(vocab, unk_token="A"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    model = serving_model.load("gpt2", sets=["layers=1", "d=32", "heads=2", "vocab=50", "ctx=256"], threads=1)
    engine = Engine(model, max_batch=2, tokenizer=tok).start()
    try:
        free = engine.submit(Request([1, 2, 3], 200, Sampling()))
        assert free.wait(60)
        text = tok.decode(list(free.tokens))
        stop = text[100:180]
        assert len(stop) == 80 and free.finish_reason == "length"
        stopped = engine.submit(Request([1, 2, 3], 200, Sampling(), (), (stop,)))
        assert stopped.wait(60)
        assert stopped.finish_reason == "stop"
        assert len(stopped.tokens) == text.find(stop) + len(stop)  # ended on the stop string's last token
    finally:
        engine.close()
