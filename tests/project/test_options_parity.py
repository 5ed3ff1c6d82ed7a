"""The command line, the Python API, the server, `tessera batch` and the Ray deployment take the same
options (runtime/options.py).

Every flag of every subcommand (read from the argparse parser itself) and every keyword of the
API's methods (read from their signatures) must name a field of that command's option class,
and every field must be reachable from both sides, except the deliberate exceptions listed
below, each with its reason. `serve` and `batch` have no API method: their flags are compared
with their option classes (ServeOptions, BatchOptions: options.EngineOptions' model, compile
options, tokenizer and engine bounds, and their own), and the Ray app's arguments with ServeOptions
and RayOptions. Then the compile options themselves (options.BuildOptions): every one is a field
of every command that compiles, a flag of each of their parsers, a keyword of each API method that
compiles and an argument of the Ray app, and every entry point compiles through
``BuildOptions.build_fields()`` (checked by running each one up to its compile): so a compile
option added once reaches the command line, the API, the server, `batch` and Ray, or this fails.
The last tests add a flag and a keyword that have no field and check that the comparison reports
them, so this test can fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import pickle

import pytest

from tessera.runtime import api
from tessera.runtime.cli import make_parser
from tessera.runtime.options import (BuildOptions, CompileOptions, EngineOptions, GenerateOptions, ModelRef,
                                     PerplexityOptions, ReportOptions, RunOptions, UsageError, flag_fields)
from tessera.runtime.serving import ray_serve
from tessera.runtime.serving.batch import BatchOptions
from tessera.runtime.serving.ray_serve import RayOptions
from tessera.runtime.serving.server import ServeOptions

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
               quantize_block=None, quantize_head=False, quantize_embedding="auto", quantize_activations=None,
               tp=1, pp=1, dp=1, ep=1,
               train=False, zero=0, recompute="none", serve=False, context=None, measure=False, repeats=5,
               calibrated=False, calibration=None, kv_cache_dtype="auto", gguf_weights="codes", bogus=0):
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


# ------------------------------------------------------------------ serve, batch and Ray
# each serving command's option classes (serve's Ray flags fill RayOptions)
SERVING = {"serve": (ServeOptions, RayOptions), "batch": (BatchOptions,)}
# flags that fill no field, deliberately
SERVING_CLI_EXTRA = {"serve": {"ray": "--ray picks the Ray Serve path (serving/ray_serve.py): how to run, no option "
                                      "of the server"}}


def serving_mismatches(command: str, sub: argparse.ArgumentParser) -> list[str]:
    classes = SERVING[command]
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    dests = {a.dest for a in sub._actions if not isinstance(a, argparse._HelpAction)}
    extra = set(SERVING_CLI_EXTRA.get(command, {}))
    out = [f"{command}: flag {d} fills no field of {', '.join(c.__name__ for c in classes)}"
           for d in sorted(dests - names - extra)]
    out += [f"{command}: {n} has no command-line flag" for n in sorted(names - dests)]
    out += [f"{command}: {n} is listed as an exception but is a field" for n in sorted(extra & names)]
    return out


@pytest.mark.parametrize("command", sorted(SERVING))
def test_every_flag_of_serve_and_batch_is_an_option_and_every_option_a_flag(command):
    assert serving_mismatches(command, _subparsers(make_parser())[command]) == []


def test_the_serving_comparison_reports_a_field_without_a_flag():
    sub = _subparsers(make_parser())["batch"]
    sub.add_argument("--bogus-flag", action="store_true")
    assert serving_mismatches("batch", sub) == ["batch: flag bogus_flag fills no field of BatchOptions"]


@pytest.mark.parametrize("command,argv", [
    ("serve", ["serve", "gpt2"]), ("batch", ["batch", "gpt2", "-i", "in.jsonl", "-o", "out.jsonl"])])
def test_the_serving_flags_defaults_are_the_options_defaults(command, argv):
    ns = make_parser().parse_args(argv)
    extra = {"input": "in.jsonl", "output": "out.jsonl"} if command == "batch" else {}
    cls = SERVING[command][0]
    assert cls.from_args(ns) == cls(spec="gpt2", **extra)
    assert ModelRef.from_args(ns) == ModelRef(spec="gpt2")
    if command == "serve":
        assert RayOptions.from_args(ns) == RayOptions()


def test_the_ray_app_takes_every_option_of_the_server_and_converts_its_text():
    known = ray_serve.app_arguments()
    got = {f.name for _, f in known.values()}
    fields = {f.name for cls in (ServeOptions, RayOptions) for f in dataclasses.fields(cls)}
    assert got == fields - set(ray_serve.APP_EXCLUDED)
    assert set(ray_serve.APP_EXCLUDED) <= fields, "an exception that names no field"
    samples = {bool: ("true", True), int: ("3", 3), float: ("2.5", 2.5)}
    for key, (cls, f) in known.items():
        kind = str(f.type).replace(" ", "").split("|")
        if "list[str]" in kind:
            assert ray_serve._from_text(key, "a=1,b=2", str(f.type)) == ["a=1", "b=2"]
        for t, (text, value) in samples.items():
            if t.__name__ in kind and not (t is int and "bool" in kind):
                assert ray_serve._from_text(key, text, str(f.type)) == value, key


def test_every_compile_option_reaches_every_command_that_compiles():
    """options.BuildOptions: a field of every option class that compiles, a flag of each of their
    parsers (generated from the field), a keyword of each API method that compiles, an argument
    of the Ray app."""
    build = {f.name for f in dataclasses.fields(BuildOptions)}
    assert set(flag_fields(BuildOptions)) == build, "a compile option declared without its flag(...)"
    for cls in (CompileOptions, RunOptions, GenerateOptions, EngineOptions, ServeOptions, BatchOptions):
        assert issubclass(cls, BuildOptions), cls
    subs = _subparsers(make_parser())
    for command in ("compile", "run", "generate", "serve", "batch"):
        dests = {a.dest for a in subs[command]._actions}
        assert build <= dests, (command, build - dests)
    for command, method in (("compile", api.Model.compile), ("run", api.Model.run),
                            ("generate", api.Model.generate)):
        keywords = {API_NAMES[command].get(k, k) for k in inspect.signature(method).parameters}
        assert build <= keywords, (method.__name__, build - keywords)
    assert build <= {f.name for _, f in ray_serve.app_arguments().values()}


# commands that take the model without its weights, and why
REF_PARTIAL = {"report": "the report counts the graph: no weights, so no --weights, --seed or --allow-large",
               "ir": "the graph alone: no weights"}
# commands that take no model at all, and why
NO_MODEL = {"cache": "lists or clears the compile cache's folder"}


def test_the_model_options_reach_every_command_that_loads_a_model():
    ref = {f.name for f in dataclasses.fields(ModelRef)}
    assert set(flag_fields(ModelRef)) == ref
    for command, sub in _subparsers(make_parser()).items():
        if command in NO_MODEL:
            continue
        dests = {a.dest for a in sub._actions}
        want = {"spec", "variant", "sets"} if command in REF_PARTIAL else ref
        assert want <= dests, (command, want - dests)
    assert ref <= {f.name for _, f in ray_serve.app_arguments().values()}
    assert issubclass(EngineOptions, ModelRef)


# ------------------------------------------------------------------ every entry point compiles through build_fields
TINY = ["layers=1", "d=32", "heads=2", "vocab=50", "ctx=32"]
SETS = [a for s in TINY for a in ("--set", s)]


class Reached(Exception):
    """Raised where the compile starts: the entry point got that far with the options it was given."""


@pytest.fixture
def compiled_with(monkeypatch):
    """Every compile (the full pipeline: runtime/pipeline.optimize; the cached decoder:
    compiler/build.compile_cached) records whether its PipelineOptions came through
    BuildOptions.build_fields() -- which here adds a marker -- and stops."""
    from tessera.compiler import build as compiler_build
    from tessera.compiler.passes.pipeline import PipelineOptions
    from tessera.runtime import pipeline

    mark = object()
    original = BuildOptions.build_fields
    monkeypatch.setattr(BuildOptions, "build_fields", lambda self: {**original(self), "skip_norm": mark})
    seen = []

    def capture(*args, **kwargs):
        (options,) = [a for a in (*args, *kwargs.values()) if isinstance(a, PipelineOptions)]
        seen.append(options.skip_norm is mark)
        raise Reached

    monkeypatch.setattr(compiler_build, "compile_cached", capture)
    monkeypatch.setattr(pipeline, "optimize", capture)
    return seen


def _main(*argv):
    from tessera.runtime.cli import main

    main([str(a) for a in argv])


def _ray_replica(tmp_path, flags, keywords, app):
    from tessera.runtime.serving.ray_serve import TesseraReplica

    opts, _ = ray_serve.options_from_args({"model": "gpt2", "set": ",".join(TINY), **app})  # the `serve run` app's
    TesseraReplica(pickle.loads(pickle.dumps(opts)))  # Ray pickles the options to the replica


def _ray_replica_from_the_command(tmp_path, flags, keywords, app):
    from tessera.runtime.serving.ray_serve import TesseraReplica

    ns = make_parser().parse_args(["serve", "gpt2", *SETS, "--ray", "--replicas", "2", *flags])
    TesseraReplica(pickle.loads(pickle.dumps(ServeOptions.from_args(ns))))


def _ray_data_actor(tmp_path, flags, keywords, app):
    from tessera.runtime.serving.ray_batch import EngineActor

    ns = make_parser().parse_args(["batch", "gpt2", *SETS, "-i", "in.jsonl", "-o", "out.jsonl", "--ray", *flags])
    EngineActor(pickle.loads(pickle.dumps(BatchOptions.from_args(ns))), 1)


def _batch(tmp_path, flags, keywords, app):
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"prompt": [1, 2]}\n')
    _main("batch", "gpt2", *SETS, "-i", rows, "-o", tmp_path / "out.jsonl", *flags)


def _api(method):
    def go(tmp_path, flags, keywords, app):
        import tessera

        m = tessera.load("gpt2", **dict(s.split("=") for s in TINY))
        {"compile": lambda: m.compile(tmp_path / "m.onnx", **keywords),
         "compile kv": lambda: m.compile(tmp_path / "m.onnx", kv_cache=True, **keywords),
         "run": lambda: m.run(tokens=[[1, 2]], **keywords),
         "generate": lambda: m.generate([1, 2], max_new_tokens=2, **keywords)}[method]()
    return go


# every way to compile a model: each runs until its compile starts (Reached), with a compile option given
# as its flags (the command line, `serve --ray` and `batch --ray`), keywords (the API) or app arguments (Ray's
# `serve run` app); tests/project/test_recipes.py runs them with the recipe's throwaway option
ENTRY_POINTS = {
    "tessera compile": lambda t, f, k, a: _main("compile", "gpt2", *SETS, "-o", t / "m.onnx", "-q", *f),
    "tessera compile --kv-cache": lambda t, f, k, a: _main("compile", "gpt2", *SETS, "-o", t / "m.onnx", "-q",
                                                           "--kv-cache", *f),
    "tessera run": lambda t, f, k, a: _main("run", "gpt2", *SETS, "--input", "tokens=[[1, 2]]", *f),
    "tessera generate": lambda t, f, k, a: _main("generate", "gpt2", *SETS, "--input", "tokens=[[1, 2]]", "-q", *f),
    "tessera serve": lambda t, f, k, a: _main("serve", "gpt2", *SETS, "--explain", *f),
    "tessera batch": _batch,
    "Ray Serve replica (serve run app)": _ray_replica,
    "Ray Serve replica (serve --ray)": _ray_replica_from_the_command,
    "Ray Data actor (batch --ray)": _ray_data_actor,
    "Model.compile": _api("compile"), "Model.compile(kv_cache=True)": _api("compile kv"),
    "Model.run": _api("run"), "Model.generate": _api("generate"),
}


def reach(entry: str, tmp_path, flags=(), keywords=None, app=None) -> None:
    """Run one entry point until its compile starts (the caller has made the compile raise Reached)."""
    if entry == "tessera serve":
        pytest.importorskip("fastapi", reason="the serve extra")
    with pytest.raises(Reached):
        ENTRY_POINTS[entry](tmp_path, list(flags), keywords or {}, app or {})


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_compiles_through_build_fields(entry, compiled_with, tmp_path):
    reach(entry, tmp_path)
    assert compiled_with == [True], f"{entry} compiled with PipelineOptions not made by BuildOptions.build_fields()"


# ------------------------------------------------------------------ every entry point reads the compile cache
def test_every_entry_point_that_loads_a_model_reads_the_compile_cache_it_is_given(compiled_with, tmp_path,
                                                                                  monkeypatch):
    """--compile-cache DIR (a compile option: options.CompileCacheOptions, a base of BuildOptions) given as a
    flag, a keyword or an app argument reaches the compile cache's lookup (runtime/compile_cache.folder_for)
    at every entry point that loads a model; compile writes its output afresh and never looks."""
    from tessera.runtime import compile_cache

    asked = []

    def folder_for(given=None, disabled=False):
        asked.append((given, disabled))
        return None, "off (this test)"

    monkeypatch.setattr(compile_cache, "folder_for", folder_for)
    folder = str(tmp_path / "cc")
    for entry in sorted(ENTRY_POINTS):
        asked.clear()
        reach(entry, tmp_path, ["--compile-cache", folder], {"compile_cache": folder}, {"compile_cache": folder})
        if entry.startswith(("tessera compile", "Model.compile")):
            assert asked == [], entry
        else:
            assert asked and all(str(given) == folder and not off for given, off in asked), (entry, asked)
    asked.clear()
    reach("tessera generate", tmp_path, ["--no-compile-cache"])
    assert asked == [(None, True)]
