"""The command line and the Python API take the same options (runtime/options.py).

Every flag of every subcommand (read from the argparse parser itself) and every keyword of the
API's methods (read from their signatures) must name a field of that command's option class,
and every field must be reachable from both sides, except the deliberate exceptions listed
below, each with its reason. The last tests add a flag and a keyword that have no field and
check that the comparison reports them, so this test can fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from tessera.runtime import api
from tessera.runtime.cli import make_parser
from tessera.runtime.options import (CompileOptions, GenerateOptions, ModelRef, PerplexityOptions, ReportOptions,
                                     RunOptions, UsageError)

CLASSES = {"compile": CompileOptions, "run": RunOptions, "report": ReportOptions, "generate": GenerateOptions,
           "perplexity": PerplexityOptions}
METHODS = {"compile": [api.Model.compile], "run": [api.Model.run, api.Model.alignment],
           "report": [api.Model.report], "generate": [api.Model.generate], "perplexity": [api.Model.perplexity]}
# API keyword -> option field, where the API names it otherwise (the option classes' API_NAMES, inverted)
API_NAMES = {command: {k: f for f, k in cls.API_NAMES.items()} for command, cls in CLASSES.items()}

# fields the command line has and the API deliberately lacks
CLI_ONLY = {
    "compile": {"no_fuse": "--no-fuse is the command line's second spelling of attention='unfused'",
                "quiet": "printing: the API prints no progress"},
    "run": {"no_fuse": "--no-fuse is the command line's second spelling of attention='unfused'",
            "format": "printing: the API returns the arrays",
            "full": "printing: the API returns every value",
            "inputs": "--input NAME=VALUE is text; the API takes the inputs as named arrays (**inputs)"},
    "report": {"format": "printing: the API returns the report as a dict"},
    "generate": {"format": "printing: the API returns the tokens or texts",
                 "quiet": "printing: the API prints no progress"},
    "perplexity": {"format": "printing: the API returns the figure as a dict",
                   "quiet": "printing: the API prints no progress"},
}
# fields the API has and the command line deliberately lacks
API_ONLY = {
    "compile": {}, "report": {}, "perplexity": {},
    "run": {"alignment": "the command computes the alignment when --plot-attention FILE is given; "
                         "Model.alignment() returns it without drawing"},
    "generate": {"sampling_seed": "the command's --seed seeds both the weights and the sampler; the API's "
                                  "model has its seed from load()"},
}
# fields an API method sets by being called, not by a keyword
IMPLIED = {"run": {"alignment": "Model.alignment() sets it (Model.run does not compute an alignment)"}}
# API keywords that are no option at all
API_EXTRA = {"generate": {"stream": "an iterator is a Python concern; the command prints as it decodes"}}
# load()'s keywords -> ModelRef fields
LOAD_NAMES = {"overrides": "sets"}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def cli_fields(sub: argparse.ArgumentParser, cls) -> tuple[set[str], set[str]]:
    """(the option fields the subcommand's flags fill, the dests that fill none)."""
    names = {f.name for f in dataclasses.fields(cls)} if cls else set()
    ref = {f.name for f in dataclasses.fields(ModelRef)}
    mapped, unknown = set(), set()
    for a in sub._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        name = cls.CLI_NAMES.get(a.dest, a.dest) if cls else a.dest
        if name in names:
            mapped.add(name)
        elif name not in ref:
            unknown.add(a.dest)
    return mapped, unknown


def api_fields(methods, command: str) -> tuple[set[str], set[str]]:
    """(the option fields the methods' keywords fill, the keywords that fill none)."""
    names = {f.name for f in dataclasses.fields(CLASSES[command])}
    mapped, unknown = set(), set()
    for m in methods:
        for p in list(inspect.signature(m).parameters.values())[1:]:
            if p.kind in (p.VAR_KEYWORD, p.POSITIONAL_ONLY):
                continue  # the model's named inputs
            name = API_NAMES[command].get(p.name, p.name)
            if name in names:
                mapped.add(name)
            elif p.name not in API_EXTRA.get(command, {}):
                unknown.add(p.name)
    return mapped, unknown


def mismatches(command: str, sub: argparse.ArgumentParser, methods) -> list[str]:
    cls = CLASSES[command]
    names = {f.name for f in dataclasses.fields(cls)}
    cli, cli_unknown = cli_fields(sub, cls)
    py, py_unknown = api_fields(methods, command)
    py |= set(IMPLIED.get(command, {}))
    out = [f"{command}: flag {d} fills no field of {cls.__name__}" for d in sorted(cli_unknown)]
    out += [f"{command}: API keyword {k} fills no field of {cls.__name__}" for k in sorted(py_unknown)]
    out += [f"{command}: {n} has no command-line flag" for n in sorted(names - cli - set(API_ONLY[command]))]
    out += [f"{command}: {n} has no API keyword" for n in sorted(names - py - set(CLI_ONLY[command]))]
    stale = (set(CLI_ONLY[command]) & py) | (set(API_ONLY[command]) & cli)
    out += [f"{command}: {n} is listed as an exception but both sides have it" for n in sorted(stale)]
    return out


@pytest.mark.parametrize("command", sorted(CLASSES))
def test_every_flag_and_keyword_is_an_option_of_both_sides(command):
    assert mismatches(command, _subparsers(make_parser())[command], METHODS[command]) == []


def test_ir_takes_the_model_only():
    _, unknown = cli_fields(_subparsers(make_parser())["ir"], None)
    assert unknown == set()


def test_load_takes_every_model_field():
    params = [p for p in inspect.signature(api.load).parameters.values()]
    got = {LOAD_NAMES.get(p.name, p.name) for p in params}
    assert got == {f.name for f in dataclasses.fields(ModelRef)}


@pytest.mark.parametrize("command,argv", [
    ("compile", ["compile", "gpt2", "-o", "x.onnx"]), ("run", ["run", "gpt2"]), ("report", ["report", "gpt2"]),
    ("generate", ["generate", "gpt2"]),  # --max-new-tokens is optional now (generation_config)
    ("perplexity", ["perplexity", "gpt2", "--text", "t.txt"])])
def test_the_flags_defaults_are_the_options_defaults(command, argv):
    ns = make_parser().parse_args(argv)
    cls = CLASSES[command]
    extra = {"output": "x.onnx"} if command == "compile" else {"text": "t.txt"} if command == "perplexity" else {}
    assert cls.from_args(ns) == cls(**extra)
    assert ModelRef.from_args(ns) == ModelRef(spec="gpt2")


def test_the_comparison_reports_a_flag_without_an_option():
    parser = make_parser()
    sub = _subparsers(parser)["compile"]
    assert mismatches("compile", sub, METHODS["compile"]) == []
    sub.add_argument("--bogus-flag", action="store_true")
    assert mismatches("compile", sub, METHODS["compile"]) == ["compile: flag bogus_flag fills no field of CompileOptions"]


def test_the_comparison_reports_a_keyword_without_an_option_and_an_option_without_a_keyword():
    def report(self, batch=1, seq=1024, dtype="fp32", device="h200", sparse_moe=True, quantize="none",
               quantize_block=None, quantize_head=False, quantize_activations=None, tp=1, pp=1, dp=1, ep=1,
               train=False, zero=0, recompute="none", serve=False, context=None, measure=False, repeats=5,
               calibrated=False, calibration=None, bogus=0):
        """Model.report without its plot keyword, and with one that is no option."""

    got = mismatches("report", _subparsers(make_parser())["report"], [report])
    assert got == ["report: API keyword bogus fills no field of ReportOptions", "report: plot has no API keyword"]


@pytest.mark.parametrize("cls,kwargs,name", [
    (GenerateOptions, {"sampling_seed": "x"}, "sampling_seed"),
    (GenerateOptions(sampling_seed="x").for_api, {}, "seed"),      # named as the API's keyword
    (CompileOptions(output=3).for_api, {}, "out"),
    (ReportOptions, {"batch": 1.5}, "batch"),
    (ReportOptions, {"seq": True}, "seq"),
    (CompileOptions, {"output": "o.onnx", "kv_cache": "yes"}, "kv_cache"),
    (CompileOptions, {"output": None}, "output"),
    (RunOptions, {"provider": "tpu"}, "provider"),
    (RunOptions, {"texts": "one text"}, "texts"),
    (GenerateOptions, {"stop_tokens": [1, "2"]}, "stop_tokens"),
    (GenerateOptions, {"temperature": float("nan")}, "temperature"),
    (ModelRef, {"spec": "gpt2", "seed": "x"}, "seed"),
])
def test_raw_python_values_of_the_wrong_type_name_the_argument(cls, kwargs, name):
    with pytest.raises(UsageError, match=rf"^{name} must be"):
        cls(**kwargs).check()


def test_the_api_names_its_keywords_and_the_command_line_its_flags():
    with pytest.raises(UsageError, match="^max_new_tokens must be at least 1, got 0"):
        GenerateOptions(max_new_tokens=0).for_api().check()
    with pytest.raises(UsageError, match="^--max-new-tokens must be at least 1, got 0"):
        GenerateOptions(max_new_tokens=0).check()


def test_the_api_refuses_a_bad_seed_before_loading_anything(tmp_path):
    with pytest.raises(UsageError, match="^seed must be an integer, got 'x'"):
        api.load("gpt2", seed="x", layers=1)
