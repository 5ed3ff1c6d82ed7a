"""Weights: a seeded initialiser, and import from safetensors checkpoints.

The initialiser follows GPT-2's scheme: weight matrices and embeddings from
N(0, 0.02), biases zero, norm scales one. Each parameter draws from its own
generator seeded by (seed, path), so a parameter's values do not depend on
which other parameters exist or in what order they were created.

A checkpoint's tensors are matched by name. If the names are not Tessera's
own paths, a mapping file beside the spec (``<spec>.hf.toml``) translates
them: plain renames with ``{i}`` placeholders, plus splits (a fused QKV
matrix) and transposes (GPT-2's Conv1D layout). Any mismatch is reported as
one error listing the missing, unexpected and mis-shaped tensors.
"""

from __future__ import annotations

import re
import tomllib
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tessera.compiler.ir.graph import DTYPES, Graph


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


@dataclass
class NameMap:
    """Checkpoint names -> Tessera paths, read from a ``.hf.toml`` file."""

    rules: list[_Rule] = field(default_factory=list)
    ignore: list[re.Pattern] = field(default_factory=list)
    source: str = ""

    @classmethod
    def load(cls, path: Path) -> "NameMap":
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise WeightsError(f"{path}: not valid TOML: {e}") from None
        unknown = set(data) - {"names", "ignore"}
        if unknown:
            raise WeightsError(f"{path}: unknown section(s) {sorted(unknown)}; expected [names] and ignore = [...]")
        m = cls(source=str(path))
        for src, spec in data.get("names", {}).items():
            if isinstance(spec, str):
                m.rules.append(_Rule(_compile(src), [spec]))
            elif isinstance(spec, dict):
                bad = set(spec) - {"split", "axis", "transpose", "to"}
                if bad:
                    raise WeightsError(f"{path}: rule for '{src}' has unknown key(s) {sorted(bad)}")
                if ("split" in spec) == ("to" in spec):
                    raise WeightsError(f"{path}: rule for '{src}' needs exactly one of 'to' or 'split'")
                targets = spec.get("split") or [spec["to"]]
                m.rules.append(_Rule(_compile(src), list(targets), spec.get("axis", 0) if "split" in spec else None,
                                     bool(spec.get("transpose", False))))
            else:
                raise WeightsError(f"{path}: rule for '{src}' must be a string or a table")
        for rule in m.rules:
            captured = set(rule.pattern.groupindex)
            for target in rule.targets:
                missing = set(re.findall(r"\{([a-z_]+)\}", target)) - captured
                if missing:
                    raise WeightsError(f"{path}: target '{target}' uses {{{', '.join(sorted(missing))}}}, which its "
                                       f"source pattern does not capture")
        m.ignore = [_compile(p) for p in data.get("ignore", [])]
        return m

    def apply(self, tensors: dict[str, np.ndarray], native=frozenset()) -> tuple[dict[str, np.ndarray], list[str]]:
        """Translate names; returns (translated tensors, names no rule matched)."""
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
                if rule.split_axis is not None:
                    size = value.shape[rule.split_axis] if value.ndim > rule.split_axis else 0
                    if size % len(rule.targets):
                        raise WeightsError(f"{name} has shape {list(value.shape)}: axis {rule.split_axis} "
                                           f"({size}) does not split into {len(rule.targets)} equal parts "
                                           f"for {', '.join(t.format(**m.groupdict()) for t in rule.targets)}")
                pieces = [value] if rule.split_axis is None else np.split(value, len(rule.targets), axis=rule.split_axis)
                for target, piece in zip(rule.targets, pieces):
                    piece = piece.T if rule.transpose else piece
                    out[target.format(**m.groupdict())] = np.ascontiguousarray(piece)
                break
            else:
                unmatched.append(name)
        return out, unmatched


def _compile(pattern: str) -> re.Pattern:
    parts = re.split(r"(\{[a-z_]+\})", pattern)
    rx = "".join(f"(?P<{p[1:-1]}>\\d+)" if p.startswith("{") else re.escape(p).replace(r"\*", ".*")
                 for p in parts)
    return re.compile(rx)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Read a .safetensors file or a folder of shards (never pickle)."""
    from safetensors.numpy import load_file

    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"no .safetensors files in {path}")
    elif path.exists():
        files = [path]
    else:
        raise WeightsError(f"weights file not found: {path}")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise WeightsError(f"cannot read {f} as safetensors: {e}") from None
    return tensors


def load_weights(graph: Graph, path: Path, name_map: NameMap | None = None) -> dict[str, np.ndarray]:
    """Load and check a checkpoint against the graph's parameters."""
    tensors = read_safetensors(path)
    unexpected: list[str] = []
    if name_map is not None and not set(tensors) <= set(graph.params):
        tensors, unexpected = name_map.apply(tensors, frozenset(graph.params))
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
