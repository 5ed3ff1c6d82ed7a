"""Model.report's value in a REPL and a notebook (issue 21 item 6): still the JSON dict, with a one-line
repr, Markdown for print() and HTML tables for Jupyter. The parameter count is checked against GPT-2
small's published count (124,439,808 with the tied head: transformers' sum(p.numel()))."""

import json
from html.parser import HTMLParser

import pytest

import tessera

GPT2_SMALL_PARAMS = 124_439_808


@pytest.fixture(scope="module")
def rep():
    return tessera.load("gpt2", variant="small").report(seq=1024)


class _Tables(HTMLParser):
    """Collects each <table>'s caption and rows of cell texts."""

    def __init__(self):
        super().__init__()
        self.tables, self._cell, self._in = [], None, None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append({"caption": "", "rows": []})
        elif tag == "tr":
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th", "caption"):
            self._in, self._cell = tag, ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1]["rows"][-1].append(self._cell.strip())
        elif tag == "caption":
            self.tables[-1]["caption"] = self._cell.strip()
        if tag == self._in:
            self._in = None

    def handle_data(self, data):
        if self._in:
            self._cell += data


def test_report_is_still_the_json_dict(rep):
    assert isinstance(rep, dict)
    assert rep["params"]["total"] == GPT2_SMALL_PARAMS
    assert json.loads(json.dumps(rep))["params"]["total"] == GPT2_SMALL_PARAMS


def test_repr_is_one_line_with_the_count(rep):
    text = repr(rep)
    assert "\n" not in text and len(text) < 300
    assert text.startswith("<tessera.Report GPT2 (small)")
    assert f"{GPT2_SMALL_PARAMS:,} parameters" in text
    assert "N=1024" in text


def test_str_is_the_markdown_tables(rep):
    text = str(rep)
    assert text.startswith("# GPT2 (small)")
    assert f"| total | {GPT2_SMALL_PARAMS:,} | 100.0% |" in text.splitlines()


def test_repr_macs_match_a_hand_count(rep):
    """MACs at N = 1024 counted by hand: per token 12 layers x (4 d^2 + 2 d 4d) plus the head d x vocab;
    per layer the scores and the weighted sum 2 N^2 d."""
    d, n, layers, vocab = 768, 1024, 12, 50257
    macs = n * (layers * (4 * d * d + 2 * d * 4 * d) + d * vocab) + layers * 2 * n * n * d
    assert rep["macs"]["total"] == macs
    assert f"{macs / 1e9:.2f} GMACs" in repr(rep)


def test_html_tables_hold_the_report(rep):
    parser = _Tables()
    parser.feed(rep._repr_html_())
    assert len(parser.tables) >= 3
    params = next(t for t in parser.tables if "param" in t["caption"].lower())
    totals = [r for r in params["rows"] if r and r[0] == "total"]
    assert totals and totals[0][1] == f"{GPT2_SMALL_PARAMS:,}"
    # every row has as many cells as its table's header
    for t in parser.tables:
        width = len(t["rows"][0])
        assert all(len(r) == width for r in t["rows"]), t["caption"]


def test_html_escapes_names():
    rep = tessera.load("gpt2", variant="small").report(seq=8)
    rep["notes"] = list(rep["notes"]) + ["a <b>bold</b> & odd note"]
    assert "a &lt;b&gt;bold&lt;/b&gt; &amp; odd note" in rep._repr_html_()
