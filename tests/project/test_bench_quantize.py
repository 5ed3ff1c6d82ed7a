"""bench/quantize.py's case names: ``scheme_options`` reads each as the API's compile options (the
block-size suffix ``-bN`` and ``-float`` included), and refuses a name it cannot read with the
reason, so a mistyped case fails at the command line, not after minutes of other cases."""

from __future__ import annotations

import argparse

import pytest

from conftest import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("quantize")


@pytest.mark.parametrize("name, options", [
    ("fp32", {}),
    ("w8a8", {"quantize": "w8a8"}),
    ("int4", {"quantize": "int4", "quantize_activations": "int8"}),
    ("int8-float", {"quantize": "int8", "quantize_activations": "float"}),
    ("int4-b128", {"quantize": "int4", "quantize_activations": "int8", "quantize_block": 128}),
    ("int4-b64-float", {"quantize": "int4", "quantize_activations": "float", "quantize_block": 64}),
])
def test_case_names_as_compile_options(bench, name, options):
    assert bench.scheme_options(name) == options


@pytest.mark.parametrize("name, words", [
    ("int3", "unknown scheme 'int3'"),
    ("w8a8-b64", "unknown scheme 'w8a8-b64'"),
    ("int4-x", "unknown part 'x'"),
    ("int4-b", "unknown part 'b'"),
])
def test_a_name_it_cannot_read_is_refused_with_the_reason(bench, name, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        bench.scheme_options(name)


def test_every_listed_scheme_reads(bench):
    for name in bench.SCHEMES:
        bench.scheme_options(name)
