"""Weights: a seeded initialiser, and import from safetensors checkpoints.

The initialiser follows GPT-2's scheme: weight matrices and embeddings from
N(0, 0.02), biases zero, norm scales one. Each parameter draws from its own
generator seeded by (seed, path), so a parameter's values do not depend on
which other parameters exist or in what order they were created.

A checkpoint's tensors are matched by name. If the names are not Tessera's
own paths, a mapping file beside the spec (``<spec>.hf.toml``) translates
them: plain renames with ``{i}`` placeholders, plus splits (a fused QKV
matrix, side by side or laid out per head: ``groups``), transposes (GPT-2's
Conv1D layout) and unstacking (a 3-D ``[experts, ...]`` tensor, gpt-oss's and
Llama 4's, into one parameter per expert: ``unstack = "e"``). Its ``[config]`` table maps a checkpoint folder's config.json to
hyperparameters (runtime/io/checkpoint_config.py). A folder of MXFP4 tensors (gpt-oss's released
experts) shows each blocks/scales pair as the float tensor it dequantises to (runtime/io/mxfp4.py). Any mismatch is reported as one
error listing the missing, unexpected and mis-shaped tensors.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tessera.compiler.ir.graph import Graph, numpy_dtype

from tessera.runtime.files import stat_or_raise
from tessera.runtime.io import mxfp4


class WeightsError(Exception):
    """A weights file that does not fit the model; the message lists every problem."""


class SeededWeights(Mapping):
    """The seeded initialiser as a mapping by parameter path, each tensor drawn when it is read.

    Why: a writer that takes one tensor at a time (compiler/backends/onnx/stream.py) then never
    holds more than one of them; nothing is drawn for a model that is only analysed. Reading a
    path twice draws it twice, with the same values. The parameters are those of the graph when
    the mapping is made (later passes may rename or lower them; their values come from these)."""

    def __init__(self, graph: Graph, seed: int = 0):
        self.seed = seed
        self._params = {path: (tuple(int(s) for s in p.shape), p.init, p.std, np.dtype(numpy_dtype(p.dtype) or np.float32))
                        for path, p in graph.params.items()}

    def __getitem__(self, path: str) -> np.ndarray:
        shape, init, std, dtype = self._params[path]
        if init == "zeros":
            return np.zeros(shape, dtype=dtype)
        if init == "ones":
            return np.ones(shape, dtype=dtype)
        rng = np.random.default_rng([self.seed, zlib.crc32(path.encode())])
        out = rng.standard_normal(shape, dtype=np.float32)
        out *= np.float32(std)  # in place: the values of (x * std) without a second array
        return out if dtype == np.float32 else out.astype(dtype)

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def init_weights(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Every parameter drawn now, as a dict (tests change some of them); export takes SeededWeights."""
    return dict(SeededWeights(graph, seed))


# ------------------------------------------------------------------ checkpoint import
@dataclass
class _Rule:
    pattern: "NamePattern"
    targets: list[str]
    split_axis: int | None = None
    transpose: bool = False
    groups: int | str | None = None   # the split axis is [groups, parts...]: per head (or kv group)
    unstack: str | None = None        # a placeholder of the targets only: item {unstack} of axis 0


@dataclass
class NameMap:
    """Checkpoint names -> Tessera paths, read from a ``.hf.toml`` file."""

    rules: list[_Rule] = field(default_factory=list)
    ignore: list["NamePattern"] = field(default_factory=list)
    source: str = ""
    # config.json key (dotted for nested) -> hyperparameter name, ("expect", allowed values) or
    # ("fallback", hyperparameter name, the config key read instead, the value meaning "unset")
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
        except RecursionError:  # tomllib recurses per nested array or inline table
            raise WeightsError(f"{path}: not a mapping file: arrays or tables nested too deep") from None
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
                bad = set(spec) - {"split", "axis", "transpose", "to", "groups", "unstack"}
                if bad:
                    raise WeightsError(f"{where} has unknown key(s) {sorted(bad)}; expected to, split, axis, "
                                       f"groups, transpose, unstack")
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
                unstack = spec.get("unstack")
                if unstack is not None and not (isinstance(unstack, str) and re.fullmatch(r"[a-z_]+", unstack)):
                    raise WeightsError(f"{where}: 'unstack' must be a placeholder name such as \"e\" (the targets' "
                                       f"{{e}}: item e of the tensor's first axis), got {unstack!r}")
                m.rules.append(_Rule(_compile(src, where), list(split or [to]), axis if split else None, transpose,
                                     groups, unstack))
            else:
                raise WeightsError(f"{where} must be a string or a table")
        for rule in m.rules:
            captured = set(rule.pattern.groupindex)
            if rule.unstack is not None:
                if rule.unstack in captured:
                    raise WeightsError(f"{path}: rule for '{rule.pattern.text}': unstack = \"{rule.unstack}\" names a "
                                       f"placeholder of the source; it must be one of the targets' only (the index "
                                       f"into the tensor's first axis)")
                without = [t for t in rule.targets if rule.unstack not in _target_fields(t, f"{path}: target '{t}'")]
                if without:
                    raise WeightsError(f"{path}: rule for '{rule.pattern.text}' unstacks into {{{rule.unstack}}}, "
                                       f"which target '{without[0]}' does not use (every item would land on it)")
                captured = captured | {rule.unstack}
            for target in rule.targets:
                missing = _target_fields(target, f"{path}: target '{target}'") - captured
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
            elif isinstance(target, dict) and set(target) == {"expect"}:
                if not isinstance(target["expect"], list) or not target["expect"]:
                    raise WeightsError(f"{where}: a table must be {{ expect = [allowed values] }}, got {target!r}")
                m.config[key] = ("expect", list(target["expect"]))
            elif isinstance(target, dict) and set(target) == {"name", "null"}:
                # { name = "q_rank", null = 0 }: a key present and null gives this value (DeepSeek's
                # q_lora_rank null: no query bottleneck), where a plain entry would leave the default
                name, null = target["name"], target["null"]
                if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_]\w*", name):
                    raise WeightsError(f"{where}: '{name}' is not a hyperparameter name")
                m.config[key] = ("null", name, null)
            elif isinstance(target, dict) and "name" in target:
                # { name = "max_rel", fallback = "max_position_embeddings", unset = -1 }: when the key is
                # absent, null or equal to `unset`, the fallback key's value (DeBERTa's "-1: the context")
                bad = set(target) - {"name", "fallback", "unset"}
                name, fallback = target["name"], target.get("fallback")
                if bad or not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_]\w*", name) or \
                        not isinstance(fallback, str) or not fallback:
                    raise WeightsError(f"{where}: a table must be {{ expect = [...] }}, {{ name = \"hyperparameter\", "
                                       f"fallback = \"config key\", unset = value }} or {{ name = \"hyperparameter\", "
                                       f"null = value }}, got {target!r}")
                m.config[key] = ("fallback", name, fallback, target.get("unset"))
            else:
                raise WeightsError(f"{where} must be a hyperparameter name, {{ expect = [allowed values] }}, "
                                   f"{{ name = ..., fallback = ..., unset = ... }} or {{ name = ..., null = ... }}, "
                                   f"got {target!r}")
        return m

    def plan(self, shapes: dict[str, tuple[int, ...]], native=frozenset(), model_shapes: dict | None = None,
             hyper: dict | None = None) -> tuple[dict[str, "Piece"], list[str]]:
        """Translate names, from the checkpoint's shapes alone: returns (Tessera path -> the Piece of
        a checkpoint tensor it is read from, names no rule matched). Nothing is read here.
        ``model_shapes`` (the model's parameter shapes) sizes the pieces of a split, which may then
        differ (q, k and v of grouped-query attention); ``hyper`` resolves a ``groups`` given as a
        hyperparameter name."""
        out, unmatched = {}, []
        for name, shape in shapes.items():
            # a name that is a parameter of this model is used even when `ignore` names it: one mapping
            # serves a spec whose choice adds the parameter (T5's lm_head.weight: v1.1's own head, and a
            # copy of the shared table in v1.0's checkpoints, where the spec has no such parameter)
            if name in native:  # already a Tessera path
                out[name] = Piece(name, tuple(shape))
                continue
            if any(p.fullmatch(name) for p in self.ignore):
                continue
            if len(name) > MAX_NAME:  # matched against patterns, a hostile name would cost quadratic time
                unmatched.append(name[:80] + "...")
                continue
            for rule in self.rules:
                m = rule.pattern.fullmatch(name)
                if not m:
                    continue
                if rule.unstack is not None and len(shape) < 2:
                    raise WeightsError(f"{name} has shape {list(shape)}; its mapping rule unstacks it along its "
                                       f"first axis into {{{rule.unstack}}}, which needs a rank of 2 or more")
                items = [None] if rule.unstack is None else range(shape[0])
                fields = [dict(m.groupdict(), **({} if j is None else {rule.unstack: str(j)})) for j in items]
                if native and not all(t.format(**f) in native for f in fields for t in rule.targets):
                    unmatched.append(name)  # maps to no parameter of this model (e.g. a layer it does not have)
                    break
                item_shape = tuple(shape) if rule.unstack is None else tuple(shape[1:])
                for j, f in zip(items, fields):
                    targets = [t.format(**f) for t in rule.targets]
                    if rule.split_axis is None:
                        out[targets[0]] = Piece(name, tuple(shape), transpose=rule.transpose, item=j)
                        continue
                    sizes, groups = _split_plan(name, item_shape, rule, targets, model_shapes or {}, hyper or {})
                    for index, target in enumerate(targets):
                        out[target] = Piece(name, tuple(shape), index, sizes, rule.split_axis, rule.transpose,
                                            groups, j)
                break
            else:
                unmatched.append(name)
        return out, unmatched


def _split_plan(name: str, shape: tuple[int, ...], rule: _Rule, targets: list[str], shapes: dict,
                hyper: dict) -> tuple[tuple[int, ...], int]:
    """The sizes of a split's parts along its axis and its number of groups. Sizes come from the
    targets' shapes when the model is known (else equal parts). With ``groups = G`` the axis is laid
    out per group -- for each of the G heads (or key/value groups), its slice of every target in
    turn, as BLOOM's and GPT-NeoX's query_key_value [heads, 3, hd] -- and each target gathers its
    slice of every group."""
    axis = rule.split_axis
    if axis >= len(shape):
        raise WeightsError(f"{name} has shape {list(shape)} (rank {len(shape)}); its mapping rule splits it along "
                           f"axis {axis}, past its rank")
    size = shape[axis]
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
            raise WeightsError(f"{name} has shape {list(shape)}: axis {axis} ({size}) does not split "
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
    groups = int(groups or 1)
    if groups > 1 and any(s_ % groups for s_ in sizes):
        raise WeightsError(f"{name} has shape {list(shape)}: the parts {sizes} of axis {axis} for {listed} "
                           f"do not divide into {groups} groups")
    return tuple(int(x) for x in sizes), groups


@dataclass(frozen=True)
class Piece:
    """Where a parameter's values are in a checkpoint: item ``item`` of the first axis of tensor
    ``source`` (when not None; the axes below count in that item), its part ``index`` split along
    ``axis`` into parts of ``sizes`` (laid out per group when ``groups`` > 1), transposed or not."""

    source: str
    source_shape: tuple[int, ...]
    index: int = 0
    sizes: tuple[int, ...] = ()
    axis: int = 0
    transpose: bool = False
    groups: int = 1
    item: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.source_shape if self.item is None else self.source_shape[1:])
        if self.sizes:
            shape[self.axis] = self.sizes[self.index]
        return tuple(reversed(shape)) if self.transpose else tuple(shape)

    def cut(self, arr: np.ndarray) -> np.ndarray:
        """This piece of ``arr``: the whole source tensor, or with ``item`` that item alone
        (``Checkpoint.read_item``)."""
        if self.sizes and self.groups > 1:
            shape, axis, g = arr.shape, self.axis, self.groups
            per = [s_ // g for s_ in self.sizes]
            grouped = arr.reshape(shape[:axis] + (g, sum(per)) + shape[axis + 1:])
            part = np.split(grouped, np.cumsum(per)[:-1], axis=axis + 1)[self.index]
            arr = part.reshape(shape[:axis] + (g * per[self.index],) + shape[axis + 1:])
        elif self.sizes:
            arr = np.split(arr, np.cumsum(self.sizes)[:-1], axis=self.axis)[self.index]
        return arr.T if self.transpose else arr


MAX_NAME = 1024  # checkpoint tensor names are under 200 characters; a longer one is not matched against patterns


class _Found:
    """A name pattern's match: the placeholders' captured digits."""

    def __init__(self, groups: dict[str, str]):
        self.groups = groups

    def groupdict(self) -> dict[str, str]:
        return dict(self.groups)


class NamePattern:
    """A mapping file's name pattern, matched against a whole checkpoint name in time linear in
    the name for each part of the pattern (O(name x pattern), never backtracking between parts):
    the pattern's ``*`` split it into parts, each a literal with ``{name}`` placeholders (a run of
    digits, which sits between non-digits, so a part matches a given place in one way only). The
    first part must match at the start, the last at the end, and each part between two ``*`` at
    its first place after the previous one (which leaves the most room for the rest, so a name
    matches exactly when the regex with ``.*`` for each ``*`` would; only a placeholder in such a
    middle part could capture differently: its first place). One ``*`` was the limit while the
    pattern was one Python regex (``*a*a*a*a*b`` backtracked for minutes on a long name)."""

    def __init__(self, text: str, parts: list[str]):
        self.text = text
        pieces: list[list[str]] = [[]]  # the pattern's parts between '*': regex pieces each
        for i, p in enumerate(parts):
            if i % 2:
                pieces[-1].append(f"(?P<{p[1:-1]}>\\d+)")
                continue
            for j, literal in enumerate(p.split("*")):
                if j:
                    pieces.append([])
                pieces[-1].append(re.escape(literal))
        rx = ["".join(piece) for piece in pieces]
        self.single = re.compile(rx[0]) if len(rx) == 1 else None
        self.first = re.compile(rx[0])
        self.middle = [re.compile(r) for r in rx[1:-1]]
        self.last = re.compile(f"(?:{rx[-1]})\\Z")
        self.groupindex = {p[1:-1]: k + 1 for k, p in enumerate(parts[1::2])}

    def fullmatch(self, name: str):
        if self.single is not None:
            return self.single.fullmatch(name)
        m = self.first.match(name)
        if m is None:
            return None
        groups, pos = m.groupdict(), m.end()
        for part in self.middle:
            m = part.search(name, pos)
            if m is None:
                return None
            groups.update(m.groupdict())
            pos = m.end()
        m = self.last.search(name, pos)
        if m is None:
            return None
        groups.update(m.groupdict())
        return _Found(groups)


def _compile(pattern: str, where: str = "") -> NamePattern:
    """A name pattern: ``{name}`` captures digits, ``*`` any text (any number of them: NamePattern
    matches in linear time). Why the rules: stray braces, ``{0}`` or ``{I}`` would reach
    str.format; and no placeholder beside a digit, a ``*`` or another placeholder, so a part
    matches a given place in one way only."""
    parts = re.split(r"(\{[a-z_]+\})", pattern)  # literals at even indices, placeholders at odd ones
    if any("{" in p or "}" in p for p in parts[::2]):
        raise WeightsError(f"{where}: '{pattern}' has a stray brace or a placeholder that is not "
                           f"{{lowercase_name}} (e.g. {{i}})")
    seen = parts[1::2]
    if len(seen) != len(set(seen)):
        raise WeightsError(f"{where}: a placeholder appears twice in '{pattern}'")
    for i in range(1, len(parts), 2):
        before, after = parts[i - 1], parts[i + 1]
        beside = "another placeholder" if after == "" and i + 2 < len(parts) else \
            repr(after[0]) if after[:1].isdigit() or after[:1] == "*" else "'*'" if before.endswith("*") else None
        if beside:
            raise WeightsError(f"{where}: in '{pattern}', {parts[i]} is next to {beside}; a placeholder must sit "
                               f"between text that is neither a digit nor '*', so the match is unique")
    return NamePattern(pattern, parts)


def _target_fields(target: str, where: str) -> set[str]:
    """The placeholders of a target path (filled by str.format): only {lowercase_name} fields."""
    import string

    try:
        parsed = list(string.Formatter().parse(target))
    except ValueError as e:  # a stray '{' or '}'
        raise WeightsError(f"{where}: {e}; placeholders are written {{i}}") from None
    fields_ = set()
    for _, name, spec, conv in parsed:
        if name is None:
            continue
        if not re.fullmatch(r"[a-z_]+", name) or spec or conv:
            raise WeightsError(f"{where}: placeholder {{{name}{'!' + conv if conv else ''}"
                               f"{':' + spec if spec else ''}}} is not a {{lowercase_name}} the source captures")
        fields_.add(name)
    return fields_


def _read_regular(path: Path, what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (a FIFO or device would hang)."""
    st = stat_or_raise(path, what, WeightsError)
    if not stat.S_ISREG(st.st_mode):
        raise WeightsError(f"{what} {path} is not a regular file")
    if st.st_size > limit:
        raise WeightsError(f"{what} {path} is {st.st_size:,} bytes; at most {limit:,} expected")
    with open(path, "rb") as f:
        return f.read(limit + 1)


def _shard_files(path: Path) -> list[Path]:
    st = stat_or_raise(path, "weights file", WeightsError)
    if stat.S_ISDIR(st.st_mode):
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"no .safetensors files in {path}")
    else:
        files = [path]
    for f in files:
        if not stat.S_ISREG(stat_or_raise(f, "weights shard", WeightsError).st_mode):  # a dangling symlink
            raise WeightsError(f"weights {f} is not a regular file")
    return files


class Checkpoint:
    """A .safetensors file or a folder of shards (never pickle), opened lazily: names, shapes and
    dtypes come from the headers, a tensor's values are read (from the memory-mapped file) only
    when asked for. A tensor name found in two shards is an error rather than last-one-wins. In a folder
    whose config.json says ``quantization_config.quant_method = "mxfp4"``, each ``NAME_blocks`` /
    ``NAME_scales`` pair is the float tensor ``NAME`` it dequantises to (runtime/io/mxfp4.py), dtype
    "MXFP4" in ``dtypes``, listed in ``packed``."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = Path(path)
        self._handles: dict[Path, object] = {}
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        duplicates = []
        for f in _shard_files(self.path):
            try:
                handle = safe_open(str(f), framework="numpy")
                names = list(handle.keys())
                info = {n: handle.get_slice(n) for n in names}
                shapes = {n: tuple(sl.get_shape()) for n, sl in info.items()}
                dtypes = {n: sl.get_dtype() for n, sl in info.items()}
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise WeightsError(f"cannot read {f} as safetensors: {e}") from None
            self._handles[f] = handle
            for n in names:
                if n in self.where:
                    duplicates.append(f"{n} (in {self.where[n].name} and {f.name})")
                self.where[n], self.shapes[n], self.dtypes[n] = f, shapes[n], dtypes[n]
        if duplicates:
            raise WeightsError(f"tensors found in more than one shard of {path}: " + _listing(duplicates))
        # name -> (blocks, scales): MXFP4 pairs read as the float tensor they dequantise to (runtime/io/mxfp4.py)
        self.packed: dict[str, tuple[str, str]] = {}
        if mxfp4.quant_method(self.path) == mxfp4.QUANT_METHOD:
            self._pack()

    def _pack(self) -> None:
        """Each ``NAME_blocks`` / ``NAME_scales`` pair replaced by ``NAME``, dtype "MXFP4", of the shape
        it dequantises to; the pair's own names are then not the checkpoint's."""
        try:
            found = mxfp4.pairs(self.shapes, self.dtypes)
        except mxfp4.Mxfp4Error as e:
            raise WeightsError(f"{self.path}: {e}") from None
        self._raw = {}
        for name, (blocks, scales, shape) in found.items():
            for raw in (blocks, scales):
                self._raw[raw] = self.where.pop(raw)
                del self.shapes[raw], self.dtypes[raw]
            self.packed[name] = (blocks, scales)
            self.where[name], self.shapes[name], self.dtypes[name] = self._raw[blocks], shape, "MXFP4"

    def _dequantised(self, name: str, item: int | None) -> np.ndarray:
        blocks, scales = self.packed[name]
        parts = []
        for raw in (blocks, scales):
            f = self._raw[raw]
            try:
                parts.append(self._handles[f].get_tensor(raw) if item is None else self._handles[f].get_slice(raw)[item])
            except Exception as e:
                raise WeightsError(f"cannot read tensor {raw} from {f}: {e}") from None
        try:
            return mxfp4.decode(*parts)
        except mxfp4.Mxfp4Error as e:
            raise WeightsError(f"{blocks} and {scales} in {self.path}: {e}") from None

    def read(self, name: str) -> np.ndarray:
        if name in self.packed:
            return self._dequantised(name, None)
        f = self.where[name]
        try:
            return self._handles[f].get_tensor(name)
        except Exception as e:
            raise WeightsError(f"cannot read tensor {name} from {f}: {e}") from None

    def read_item(self, name: str, item: int) -> np.ndarray:
        """Item ``item`` of the tensor's first axis, read alone (an unstacked expert of a [E, ...] tensor:
        the whole tensor is not read once per expert)."""
        if name in self.packed:
            return self._dequantised(name, item)
        f = self.where[name]
        try:
            return self._handles[f].get_slice(name)[item]
        except Exception as e:
            raise WeightsError(f"cannot read item {item} of tensor {name} from {f}: {e}") from None

    def finite(self, name: str) -> bool:
        """Whether every value is finite: an MXFP4 tensor's are unless a scale is NaN (only its scales read)."""
        if name in self.packed:
            scales = self.packed[name][1]
            return not (self._handles[self._raw[scales]].get_tensor(scales) == mxfp4.E8M0_NAN).any()
        return bool(np.isfinite(self.read(name)).all())


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file or folder of shards, read now (``Checkpoint`` reads lazily)."""
    ckpt = Checkpoint(path)
    return {name: ckpt.read(name) for name in ckpt.shapes}


_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "MXFP4"}  # MXFP4: dequantised when read


class CheckpointWeights(Mapping):
    """A checkpoint's tensors as the model's parameters, by path, each read (cut, transposed and
    cast to the parameter's dtype) when it is asked for: a compile streams them to its file one
    tensor at a time (compiler/backends/onnx/stream.py) and never holds the whole checkpoint."""

    def __init__(self, ckpt: Checkpoint, pieces: dict[str, Piece], dtypes: dict[str, np.dtype]):
        self.ckpt, self.pieces, self.dtypes = ckpt, pieces, dtypes

    def __getitem__(self, path: str) -> np.ndarray:
        piece = self.pieces[path]
        whole = self.ckpt.read(piece.source) if piece.item is None else self.ckpt.read_item(piece.source, piece.item)
        arr = np.ascontiguousarray(piece.cut(whole))
        return arr.astype(self.dtypes[path], copy=False)

    def __iter__(self):
        return iter(self.pieces)

    def __len__(self) -> int:
        return len(self.pieces)


def load_weights(graph: Graph, path: Path, name_map: NameMap | None = None,
                 notes: list[str] | None = None, hyper: dict | None = None) -> CheckpointWeights:
    """Open and check a checkpoint against the graph's parameters: names, shapes, and values
    (integer or bool tensors for float parameters, NaN or infinity, are errors; f64 is cast,
    with a line appended to ``notes``). The names, shapes and dtypes are checked from the headers;
    values are checked one tensor at a time, and read again when the weights are used."""
    ckpt = Checkpoint(path)
    unexpected: list[str] = []
    if name_map is not None and not set(ckpt.shapes) <= set(graph.params):
        pieces, unexpected = name_map.plan(ckpt.shapes, frozenset(graph.params),
                                           {p: v.shape for p, v in graph.params.items()}, hyper)
    else:
        unexpected = [n for n in ckpt.shapes if n not in graph.params]
        pieces = {n: Piece(n, shape) for n, shape in ckpt.shapes.items() if n in graph.params}
    missing = [p for p in graph.params if p not in pieces]
    misshaped = [(p, pieces[p].shape, graph.params[p].shape) for p in graph.params
                 if p in pieces and tuple(pieces[p].shape) != graph.params[p].shape]
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
    sources = list(dict.fromkeys(pieces[p].source for p in graph.params))
    bad_dtype = [f"{p} is {_np_name(ckpt.dtypes[pieces[p].source])}" for p in graph.params
                 if ckpt.dtypes[pieces[p].source] not in _FLOAT_DTYPES]
    if bad_dtype:
        raise WeightsError(f"weights in {path}: float parameters given non-float tensors: " + _listing(bad_dtype))
    not_finite = {name for name in sources if not ckpt.finite(name)}  # one tensor at a time
    not_finite = [p for p in graph.params if pieces[p].source in not_finite]
    if not_finite:
        raise WeightsError(f"weights in {path}: tensors holding NaN or infinity: " + _listing(not_finite))
    wide = [p for p in graph.params if ckpt.dtypes[pieces[p].source] == "F64"]
    if wide and notes is not None:
        notes.append(f"{len(wide)} f64 tensor(s) in {path} cast to the model's precision: " + _listing(wide))
    dtypes = {p: np.dtype(numpy_dtype(param.dtype) or np.float32) for p, param in graph.params.items()}
    return CheckpointWeights(ckpt, {p: pieces[p] for p in graph.params}, dtypes)


class StoredWeights(Mapping):
    """A checkpoint's weights (CheckpointWeights) and the block-quantised codes a converted GGUF file
    keeps beside them (runtime/io/gguf_codes.py): ``stored(path, part)`` gives the packed codes or the
    scales of parameter ``path``, read from the codes of its checkpoint tensor (the derived parameters'
    ``stored`` recipe, compiler/reference/quant.py)."""

    def __init__(self, weights: CheckpointWeights, codes):
        self.weights, self.codes = weights, codes

    def __getitem__(self, path: str) -> np.ndarray:
        return self.weights[path]

    def __iter__(self):
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)

    def stored(self, path: str, part: str) -> np.ndarray:
        return self.codes.read(self.weights.pieces[path].source, part)


def stored_pieces(graph: Graph, path: Path, name_map: NameMap | None = None, hyper: dict | None = None) -> dict:
    """Each parameter's Piece of the checkpoint, from its headers alone (nothing read)."""
    ckpt = Checkpoint(path)
    if name_map is not None and not set(ckpt.shapes) <= set(graph.params):
        pieces, _ = name_map.plan(ckpt.shapes, frozenset(graph.params),
                                  {p: v.shape for p, v in graph.params.items()}, hyper)
        return pieces
    return {n: Piece(n, shape) for n, shape in ckpt.shapes.items() if n in graph.params}


def absent_params(graph: Graph, path: Path, name_map: NameMap | None = None, hyper: dict | None = None) -> list[str]:
    """The model's parameters a checkpoint has no tensor for, from its headers alone (nothing read)."""
    ckpt = Checkpoint(path)
    if name_map is not None and not set(ckpt.shapes) <= set(graph.params):
        pieces, _ = name_map.plan(ckpt.shapes, frozenset(graph.params),
                                  {p: v.shape for p, v in graph.params.items()}, hyper)
    else:
        pieces = {n: None for n in ckpt.shapes if n in graph.params}
    return [p for p in graph.params if p not in pieces]


def drop_unfed_outputs(graph: Graph, absent: list[str]) -> tuple[list[str], list[str]]:
    """Outputs computed from parameters the checkpoint lacks (BERT's pooled output of a checkpoint saved
    without its pooler: transformers' ``add_pooling_layer=False``) removed from ``graph`` with what
    only they read, as transformers leaves such heads out; returns (outputs dropped, parameters
    dropped). Nothing changes when every output needs one (the load then lists the missing ones)."""
    import networkx as nx

    if not absent:
        return [], []
    missing = {("v", p) for p in absent}
    keep, drop = [], []
    for out in graph.outputs:
        (drop if nx.ancestors(graph.nx, ("v", out)) & missing else keep).append(out)
    if not drop or not keep:
        return [], []
    graph.outputs = keep
    graph.eliminate_dead_nodes()
    unread = [p for p in graph.params if graph.nx.out_degree(("v", p)) == 0 and p not in graph.outputs]
    for p in unread:
        graph.remove_param(p)
    return drop, unread


def _np_name(st_dtype: str) -> str:
    """A safetensors dtype as numpy names it (I64 -> int64), for messages."""
    return {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
            "U32": "uint32", "I64": "int64", "U64": "uint64"}.get(st_dtype, st_dtype.lower())


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


def name_map_for(spec_path: Path) -> NameMap | None:
    """The mapping file beside a spec (gpt2.tsr -> gpt2.hf.toml), if there is one."""
    candidate = Path(spec_path).with_suffix(".hf.toml")
    return NameMap.load(candidate) if candidate.exists() else None
