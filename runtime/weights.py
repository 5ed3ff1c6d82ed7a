"""Weights: a seeded initialiser, and import from safetensors checkpoints.

The initialiser follows GPT-2's scheme: weight matrices and embeddings from
N(0, 0.02), biases zero, norm scales one. Each parameter draws from its own
generator seeded by (seed, path), so a parameter's values do not depend on
which other parameters exist or in what order they were created.

A checkpoint's tensors are matched by name. If the names are not Tessera's
own paths, a mapping file beside the spec (``<spec>.hf.toml``) translates
them: plain renames with ``{i}`` placeholders, plus splits (a fused QKV
matrix, side by side or laid out per head: ``groups``) and transposes (GPT-2's
Conv1D layout). Its ``[config]`` table maps a checkpoint folder's config.json to
hyperparameters (runtime/checkpoint_config.py). Any mismatch is reported as one
error listing the missing, unexpected and mis-shaped tensors.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tessera.compiler.ir.graph import DTYPES, Graph

from .files import stat_or_raise


class WeightsError(Exception):
    """A weights file that does not fit the model; the message lists every problem."""


def init_weights(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    out = {}
    for path, p in graph.params.items():
        dtype = DTYPES[p.dtype] or np.float32
        if p.init == "zeros":
            out[path] = np.zeros(p.shape, dtype=dtype)
        elif p.init == "ones":
            out[path] = np.ones(p.shape, dtype=dtype)
        else:
            rng = np.random.default_rng([seed, zlib.crc32(path.encode())])
            out[path] = (rng.standard_normal(p.shape, dtype=np.float32) * np.float32(p.std)).astype(dtype)
    return out


# ------------------------------------------------------------------ checkpoint import
@dataclass
class _Rule:
    pattern: re.Pattern
    targets: list[str]
    split_axis: int | None = None
    transpose: bool = False
    groups: int | str | None = None   # the split axis is [groups, parts...]: per head (or kv group)


@dataclass
class NameMap:
    """Checkpoint names -> Tessera paths, read from a ``.hf.toml`` file."""

    rules: list[_Rule] = field(default_factory=list)
    ignore: list[re.Pattern] = field(default_factory=list)
    source: str = ""
    # config.json key (dotted for nested) -> hyperparameter name, or ("expect", allowed values)
    config: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> "NameMap":
        """Read and validate a mapping file; every problem is a WeightsError naming the key."""
        try:
            text = _read_regular(Path(path), "mapping file", limit=4 * 1024 * 1024).decode("utf-8")
        except UnicodeDecodeError as e:
            raise WeightsError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise WeightsError(f"{path}: not valid TOML: {e}") from None
        unknown = set(data) - {"names", "ignore", "config"}
        if unknown:
            raise WeightsError(f"{path}: unknown section(s) {sorted(unknown)}; expected [names], [config] and "
                               f"ignore = [...]")
        names = data.get("names", {})
        if not isinstance(names, dict):
            raise WeightsError(f"{path}: 'names' must be a table of checkpoint name = Tessera path")
        ignore = data.get("ignore", [])
        if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
            raise WeightsError(f"{path}: 'ignore' must be a list of name patterns (strings)")
        m = cls(source=str(path))
        for src, spec in names.items():
            where = f"{path}: rule for '{src}'"
            if isinstance(spec, str):
                m.rules.append(_Rule(_compile(src, where), [spec]))
            elif isinstance(spec, dict):
                bad = set(spec) - {"split", "axis", "transpose", "to", "groups"}
                if bad:
                    raise WeightsError(f"{where} has unknown key(s) {sorted(bad)}; expected to, split, axis, "
                                       f"groups, transpose")
                if ("split" in spec) == ("to" in spec):
                    raise WeightsError(f"{where} needs exactly one of 'to' or 'split'")
                split, to = spec.get("split"), spec.get("to")
                if split is not None and (not isinstance(split, list) or len(split) < 2
                                          or not all(isinstance(t, str) for t in split)):
                    raise WeightsError(f"{where}: 'split' must be a list of two or more Tessera paths")
                if to is not None and not isinstance(to, str):
                    raise WeightsError(f"{where}: 'to' must be a Tessera path (a string)")
                axis = spec.get("axis", 0)
                if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
                    raise WeightsError(f"{where}: 'axis' must be a non-negative integer, got {axis!r}")
                if "axis" in spec and split is None:
                    raise WeightsError(f"{where}: 'axis' only applies to 'split'")
                transpose = spec.get("transpose", False)
                if not isinstance(transpose, bool):
                    raise WeightsError(f"{where}: 'transpose' must be true or false, got {transpose!r}")
                groups = spec.get("groups")
                if groups is not None:
                    if split is None:
                        raise WeightsError(f"{where}: 'groups' only applies to 'split'")
                    if not ((isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1)
                            or (isinstance(groups, str) and re.fullmatch(r"[A-Za-z_]\w*", groups))):
                        raise WeightsError(f"{where}: 'groups' must be a positive integer or a hyperparameter "
                                           f"name, got {groups!r}")
                m.rules.append(_Rule(_compile(src, where), list(split or [to]), axis if split else None, transpose,
                                     groups))
            else:
                raise WeightsError(f"{where} must be a string or a table")
        for rule in m.rules:
            captured = set(rule.pattern.groupindex)
            for target in rule.targets:
                missing = set(re.findall(r"\{([a-z_]+)\}", target)) - captured
                if missing:
                    raise WeightsError(f"{path}: target '{target}' uses {{{', '.join(sorted(missing))}}}, which its "
                                       f"source pattern does not capture")
        m.ignore = [_compile(x, f"{path}: ignore pattern '{x}'") for x in ignore]
        config = data.get("config", {})
        if not isinstance(config, dict):
            raise WeightsError(f"{path}: 'config' must be a table of config.json key = hyperparameter name")
        for key, target in config.items():
            where = f"{path}: [config] {key}"
            if isinstance(target, str):
                if not re.fullmatch(r"[A-Za-z_]\w*", target):
                    raise WeightsError(f"{where}: '{target}' is not a hyperparameter name")
                m.config[key] = target
            elif isinstance(target, dict):
                if set(target) != {"expect"} or not isinstance(target["expect"], list) or not target["expect"]:
                    raise WeightsError(f"{where}: a table must be {{ expect = [allowed values] }}, got {target!r}")
                m.config[key] = ("expect", list(target["expect"]))
            else:
                raise WeightsError(f"{where} must be a hyperparameter name or {{ expect = [...] }}, got {target!r}")
        return m

    def apply(self, tensors: dict[str, np.ndarray], native=frozenset(), shapes: dict | None = None,
              hyper: dict | None = None) -> tuple[dict[str, np.ndarray], list[str]]:
        """Translate names; returns (translated tensors, names no rule matched). ``shapes`` (the
        model's parameter shapes) sizes the pieces of a split, which may then differ (q, k and v of
        grouped-query attention); ``hyper`` resolves a ``groups`` given as a hyperparameter name."""
        out, unmatched = {}, []
        for name, arr in tensors.items():
            if any(p.fullmatch(name) for p in self.ignore):
                continue
            if name in native:  # already a Tessera path
                out[name] = arr
                continue
            for rule in self.rules:
                m = rule.pattern.fullmatch(name)
                if not m:
                    continue
                if native and not all(t.format(**m.groupdict()) in native for t in rule.targets):
                    unmatched.append(name)  # maps to no parameter of this model (e.g. a layer it does not have)
                    break
                value = arr
                targets = [t.format(**m.groupdict()) for t in rule.targets]
                pieces = [value] if rule.split_axis is None else \
                    _split(name, value, rule, targets, shapes or {}, hyper or {})
                for target, piece in zip(rule.targets, pieces):
                    piece = piece.T if rule.transpose else piece
                    out[target.format(**m.groupdict())] = np.ascontiguousarray(piece)
                break
            else:
                unmatched.append(name)
        return out, unmatched


def _split(name: str, value: np.ndarray, rule: _Rule, targets: list[str], shapes: dict, hyper: dict) -> list:
    """The pieces of a split. Sizes along the axis come from the targets' shapes when the model
    is known (else equal parts). With ``groups = G`` the axis is laid out per group -- for each of
    the G heads (or key/value groups), its slice of every target in turn, as BLOOM's and GPT-NeoX's
    query_key_value [heads, 3, hd] -- and each target gathers its slice of every group."""
    axis = rule.split_axis
    size = value.shape[axis] if value.ndim > axis else 0
    listed = ", ".join(targets)

    def along(t):  # a target's size along the split axis, in the checkpoint's layout
        shp = shapes.get(t)
        if shp is None:
            return None
        shp = tuple(shp)[::-1] if rule.transpose else tuple(shp)
        return shp[axis] if len(shp) > axis else None

    sizes = [along(t) for t in targets]
    if any(s_ is None for s_ in sizes) or sum(sizes) != size:
        if size % len(targets):
            raise WeightsError(f"{name} has shape {list(value.shape)}: axis {axis} ({size}) does not split "
                               f"into {len(targets)} equal parts for {listed}")
        sizes = [size // len(targets)] * len(targets)
    groups = rule.groups
    if isinstance(groups, str):
        if not hyper:  # a programming error of the caller rather than of the mapping file
            raise WeightsError(f"{name}: its split has groups = \"{groups}\"; load_weights needs the model's "
                               f"hyperparameters (hyper=) to resolve it")
        if groups not in hyper:
            raise WeightsError(f"{name}: its split has groups = \"{groups}\", which is not a hyperparameter of "
                               f"the model (it has: {', '.join(sorted(hyper)) or 'none'})")
        groups = hyper[groups]
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise WeightsError(f"{name}: groups = hyperparameter {rule.groups} = {groups!r}, not a positive int")
    if not groups or groups == 1:
        return np.split(value, np.cumsum(sizes)[:-1], axis=axis)
    if any(s_ % groups for s_ in sizes):
        raise WeightsError(f"{name} has shape {list(value.shape)}: the parts {sizes} of axis {axis} for {listed} "
                           f"do not divide into {groups} groups")
    shape = value.shape
    per = [s_ // groups for s_ in sizes]
    grouped = value.reshape(shape[:axis] + (groups, sum(per)) + shape[axis + 1:])
    cuts = np.split(grouped, np.cumsum(per)[:-1], axis=axis + 1)
    return [c.reshape(shape[:axis] + (groups * p,) + shape[axis + 1:]) for c, p in zip(cuts, per)]


def _compile(pattern: str, where: str = "") -> re.Pattern:
    parts = re.split(r"(\{[a-z_]+\})", pattern)
    seen = [p for p in parts if p.startswith("{")]
    if len(seen) != len(set(seen)):
        raise WeightsError(f"{where}: a placeholder appears twice in '{pattern}'")
    rx = "".join(f"(?P<{p[1:-1]}>\\d+)" if p.startswith("{") else re.escape(p).replace(r"\*", ".*")
                 for p in parts)
    return re.compile(rx)


def _read_regular(path: Path, what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (a FIFO or device would hang)."""
    st = stat_or_raise(path, what, WeightsError)
    if not stat.S_ISREG(st.st_mode):
        raise WeightsError(f"{what} {path} is not a regular file")
    if st.st_size > limit:
        raise WeightsError(f"{what} {path} is {st.st_size:,} bytes; at most {limit:,} expected")
    with open(path, "rb") as f:
        return f.read(limit + 1)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Read a .safetensors file or a folder of shards (never pickle). Only regular files are
    opened, and a tensor name found in two shards is an error rather than last-one-wins."""
    from safetensors.numpy import load_file

    path = Path(path)
    st = stat_or_raise(path, "weights file", WeightsError)
    if stat.S_ISDIR(st.st_mode):
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"no .safetensors files in {path}")
    else:
        files = [path]
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, Path] = {}
    duplicates = []
    for f in files:
        if not stat.S_ISREG(os.stat(f).st_mode):
            raise WeightsError(f"weights {f} is not a regular file")
        try:
            shard = load_file(str(f))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise WeightsError(f"cannot read {f} as safetensors: {e}") from None
        for name, arr in shard.items():
            if name in tensors:
                duplicates.append(f"{name} (in {origin[name].name} and {f.name})")
            tensors[name], origin[name] = arr, f
    if duplicates:
        raise WeightsError(f"tensors found in more than one shard of {path}: " + _listing(duplicates))
    return tensors


def load_weights(graph: Graph, path: Path, name_map: NameMap | None = None,
                 notes: list[str] | None = None, hyper: dict | None = None) -> dict[str, np.ndarray]:
    """Load and check a checkpoint against the graph's parameters: names, shapes, and values
    (integer or bool tensors for float parameters, NaN or infinity, are errors; f64 is cast,
    with a line appended to ``notes``)."""
    tensors = read_safetensors(path)
    unexpected: list[str] = []
    if name_map is not None and not set(tensors) <= set(graph.params):
        tensors, unexpected = name_map.apply(tensors, frozenset(graph.params),
                                             {p: v.shape for p, v in graph.params.items()}, hyper)
    else:
        unexpected = [n for n in tensors if n not in graph.params]
        tensors = {k: v for k, v in tensors.items() if k in graph.params}
    missing = [p for p in graph.params if p not in tensors]
    misshaped = [(p, tuple(tensors[p].shape), graph.params[p].shape) for p in graph.params
                 if p in tensors and tuple(tensors[p].shape) != graph.params[p].shape]
    if missing or unexpected or misshaped:
        lines = [f"weights in {path} do not fit model {graph.name}"
                 + (f" (names mapped by {name_map.source})" if name_map is not None else "") + ":"]
        if missing:
            lines.append(f"  missing ({len(missing)}): " + _listing(missing))
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): " + _listing(unexpected))
        for p, got, want in misshaped[:20]:
            lines.append(f"  mis-shaped: {p} is {list(got)}, expected {list(want)}")
        if len(misshaped) > 20:
            lines.append(f"  ... and {len(misshaped) - 20} more mis-shaped")
        raise WeightsError("\n".join(lines))
    bad_dtype = [f"{p} is {tensors[p].dtype}" for p in graph.params if tensors[p].dtype.kind not in "f"]
    if bad_dtype:
        raise WeightsError(f"weights in {path}: float parameters given non-float tensors: " + _listing(bad_dtype))
    not_finite = [p for p in graph.params if not np.isfinite(tensors[p]).all()]
    if not_finite:
        raise WeightsError(f"weights in {path}: tensors holding NaN or infinity: " + _listing(not_finite))
    wide = [p for p in graph.params if tensors[p].dtype == np.float64]
    if wide and notes is not None:
        notes.append(f"{len(wide)} f64 tensor(s) in {path} cast to the model's precision: " + _listing(wide))
    out = {}
    for p, param in graph.params.items():
        want = DTYPES[param.dtype] or np.float32
        out[p] = tensors[p].astype(want, copy=False)
    return out


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


def name_map_for(spec_path: Path) -> NameMap | None:
    """The mapping file beside a spec (gpt2.tsr -> gpt2.hf.toml), if there is one."""
    candidate = Path(spec_path).with_suffix(".hf.toml")
    return NameMap.load(candidate) if candidate.exists() else None
