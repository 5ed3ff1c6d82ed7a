"""Hyperparameters from a checkpoint folder's config.json, through the ``[config]`` table of the
spec's ``.hf.toml`` mapping file.

Why: a Hugging Face checkpoint folder already says its sizes (``hidden_size``,
``num_hidden_layers``, ...). Copying them into ``--set`` flags by hand is where a wrong head
count or eps slips in and loads without error (same shapes, other numbers). With a
``[config]`` table (``hidden_size = "d"``) ``tessera compile models/llama.tsr --weights DIR``
reads them. They never override silently: a value that contradicts a ``--set`` or the chosen
variant is an error naming both. A table entry ``{ expect = [...] }`` instead names the values
a config key may have (``rope_type``: the scalings the spec implements), so a checkpoint that
needs something else is refused rather than loaded wrong. ``{ name = "max_rel", fallback =
"max_position_embeddings", unset = -1 }`` reads another key when this one is absent, null or
``unset`` (DeBERTa's "-1 means the context"); ``{ name = "q_rank", null = 0 }`` gives 0 when the
key is present and null (DeepSeek's ``q_lora_rank``: no query bottleneck), where a plain entry would
leave the spec's default. A value may be a flat list of numbers, bools or
strings (Gemma 3's ``layer_types``), which a spec indexes per layer (``layer_types[i]``).
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

from tessera.spec import Program
from tessera.spec.ast import ListLit

from tessera.runtime.files import stat_or_raise
from tessera.runtime.io.weights import NameMap, WeightsError, _read_regular

CONFIG_FILE = "config.json"


def _lookup(config: dict, dotted: str):
    """config["a"]["b"] for "a.b"; (found, value)."""
    value = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def read_config(folder: Path) -> dict | None:
    """The folder's config.json as a dict, or None when there is none."""
    path = Path(folder) / CONFIG_FILE
    if not path.exists():
        return None
    raw = _read_regular(path, "checkpoint config", limit=16 * 1024 * 1024)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: not valid JSON: {e}") from None
    except RecursionError:  # json's decoder recurses per nested array or object
        raise WeightsError(f"{path}: not a checkpoint config: arrays or objects nested too deep") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _flat(value: list) -> bool:
    """A list a hyperparameter may hold (Gemma 3's layer_types, Llama 4's no_rope_layers): numbers,
    bools or strings, not nested, at most MAX_LIST items."""
    return len(value) <= MAX_LIST and all(isinstance(v, (int, float, str)) for v in value)


MAX_LIST = 4096


def _same(a, b) -> bool:
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or abs(a - b) <= 1e-12 * max(abs(a), abs(b))
    return a == b


def config_overrides(program: Program, name_map: NameMap | None, weights: str | Path | None,
                     variant: str | None, sets: dict) -> dict:
    """Hyperparameters to add to ``sets`` from the checkpoint folder's config.json (empty when the
    weights are not a folder, it has no config.json, or the mapping file has no [config] table)."""
    if not weights or name_map is None or not name_map.config:
        return {}
    st = stat_or_raise(Path(weights), "weights file", WeightsError)
    if not stat.S_ISDIR(st.st_mode):
        return {}
    config = read_config(Path(weights))
    if config is None:
        return {}
    where = Path(weights) / CONFIG_FILE
    model = program.main_model
    names = {p.name for p in model.params} if model is not None else set()
    # the hyperparameters a list may fill: those whose default is a list literal ([...])
    lists = {p.name for p in model.params if isinstance(p.default, ListLit)} if model is not None else set()
    fixed = _variant_values(program, variant)
    out: dict = {}
    source: dict = {}
    absent = []
    conflicts: list[tuple] = []
    for key, target in name_map.config.items():
        found, value = _lookup(config, key)
        if isinstance(target, tuple) and target[0] == "expect":  # ("expect", allowed values)
            if found and value is not None and not any(_same(value, a) for a in target[1]):
                raise WeightsError(f"{where}: {key} = {json.dumps(value)} is not supported by {program.path} "
                                   f"(the mapping {name_map.source} allows "
                                   f"{', '.join(json.dumps(a) for a in target[1])})")
            continue
        if isinstance(target, tuple) and target[0] == "null":  # ("null", name, the value a null gives)
            _, target, null = target
            if found and value is None:
                value = null
        elif isinstance(target, tuple):  # ("fallback", name, another key, the value meaning unset)
            _, target, other, unset = target
            if not found or value is None or (unset is not None and _same(value, unset)):
                shown = "absent" if not found or value is None else f"{json.dumps(value)}"
                key = f"{other} (as {key} is {shown})"
                found, value = _lookup(config, other)
        if not found or value is None:
            if "." not in key:  # a nested key (rope_parameters.factor) is an optional refinement: no note
                absent.append((key, target))
            continue
        if target not in names:
            raise WeightsError(f"{name_map.source}: [config] maps {key} to '{target}', which is not a "
                               f"hyperparameter of {model.name if model else program.path}")
        if isinstance(value, dict) or (isinstance(value, list) and not (_flat(value) and target in lists)):
            what = "a number, bool, string or flat list of those" if target in lists else "a number, bool or string"
            raise WeightsError(f"{where}: {key} is a JSON {type(value).__name__}, not {what} for hyperparameter "
                               f"'{target}'")
        if target in out and not _same(out[target], value):
            raise WeightsError(f"{where}: {source[target]} = {json.dumps(out[target])} and {key} = "
                               f"{json.dumps(value)} both give hyperparameter '{target}'")
        if target in sets and not _same(sets[target], value):
            conflicts.append((f"--set {target}={sets[target]}", target, key, value))
        elif target in fixed and not _same(fixed[target], value):
            conflicts.append((f"variant {variant} has {target} = {fixed[target]}", target, key, value))
        out[target], source[target] = value, key
    if conflicts:
        raise WeightsError(_disagreement(where, conflicts))
    unset = sorted({t for _, t in absent} - set(out) - set(sets))
    if unset:  # several keys may name one hyperparameter (old and new config layouts): only if none did
        print(f"note: {where} gives no value for {', '.join(unset)}: the spec's defaults apply", file=sys.stderr)
    return {k: v for k, v in out.items() if k not in sets}


def _disagreement(where: Path, conflicts: list[tuple]) -> str:
    """Every hyperparameter the checkpoint contradicts, and the --set values that follow it."""
    lines = [f"  {given}{',' if given.startswith('variant') else ''} contradicts {key} = {json.dumps(value)}"
             for given, _, key, value in conflicts]
    sets = " ".join(f"--set {target}={json.dumps(value) if isinstance(value, str) else value}"
                    for _, target, _, value in conflicts)
    return (f"{where} disagrees with the spec's hyperparameters:\n" + "\n".join(lines) +
            f"\nthe checkpoint's values are what its weights were trained with: drop the variant (the folder gives "
            f"every size) or the --set, or pass them: {sets}")


def _variant_values(program: Program, variant: str | None) -> dict:
    """The hyperparameters a variant sets, evaluated as the elaborator does."""
    if variant is None or variant not in program.variants:
        return {}
    from tessera.compiler.frontend.elaborate import Elaborator

    el = Elaborator(program)
    return {kw.name: el.eval(kw.value, el.globals) for kw in program.variants[variant].kwargs}
