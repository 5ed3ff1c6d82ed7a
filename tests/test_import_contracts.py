"""The import contracts of pyproject.toml ([tool.importlinter]) hold: spec -> compiler -> runtime,
ops/ imports no backend, analysis or pass, the compiler's sub-packages stand in layers and no
package of the compiler or the spec has an import cycle among its modules.

lint-imports reads the imports statically (function-level ones included), so a contract breaks
the moment a wrong-way import is written, whether or not a test happens to run it."""

from __future__ import annotations

import tomllib

import pytest
from conftest import ROOT

importlinter_cli = pytest.importorskip("importlinter.cli", reason="the test extra installs import-linter")

CONFIG = ROOT / "pyproject.toml"


def test_the_contracts_cover_the_layers_the_docs_promise():
    contracts = tomllib.loads(CONFIG.read_text())["tool"]["importlinter"]["contracts"]
    by_type = {}
    for c in contracts:
        by_type.setdefault(c["type"], []).append(c)
    assert ["tessera.runtime", "tessera.compiler", "tessera.spec"] in [c["layers"] for c in by_type["layers"]]
    ops_rule = [c for c in by_type["forbidden"] if c["source_modules"] == ["tessera.compiler.ops"]]
    assert ops_rule and set(ops_rule[0]["forbidden_modules"]) == {
        "tessera.compiler.backends", "tessera.compiler.analysis", "tessera.compiler.passes"}
    assert {"tessera.compiler", "tessera.spec"} <= set(by_type["acyclic_siblings"][0]["ancestors"])


def test_every_import_contract_is_kept(capsys):
    code = importlinter_cli.lint_imports(config_filename=str(CONFIG), no_cache=True)
    report = capsys.readouterr().out
    assert code == 0, report
    assert "0 broken" in report
