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
    assert ["tessera.runtime"] in [c["ancestors"] for c in by_type["acyclic_siblings"]]
    assert ["tessera.runtime.cli"] in [c["forbidden_modules"] for c in by_type["forbidden"]]


def test_every_import_contract_is_kept(capsys):
    code = importlinter_cli.lint_imports(config_filename=str(CONFIG), no_cache=True)
    report = capsys.readouterr().out
    assert code == 0, report
    assert "0 broken" in report


def test_the_contracts_catch_a_planted_violation_of_each_kind(tmp_path):
    """The contracts can fail: in a copy of the sources, the driver imports the command line, io/
    imports runtime/pipeline.py (which imports io/: a cycle) and analysis/ imports a pass; lint-imports
    must report each of those contracts broken, and the copy without the plants must pass."""
    import os
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "tessera"
    shutil.copytree(ROOT, copy, ignore=lambda d, names: [n for n in names if n.startswith(".") or n in (
        "tests", "docs", "bench", "models", "__pycache__", "tessera.egg-info") or n.endswith((".onnx", ".data"))])
    run = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
           "sys.exit(lint_imports(config_filename='tessera/pyproject.toml', no_cache=True))"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    def lint():
        done = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        return done.returncode, done.stdout + done.stderr

    code, out = lint()
    assert code == 0 and "0 broken" in out, out  # the copy is the package lint-imports reads
    for rel, line in [("runtime/driver.py", "from tessera.runtime.cli import args"),
                      ("runtime/io/inputs.py", "import tessera.runtime.pipeline"),
                      ("compiler/analysis/quant_report.py", "from tessera.compiler.passes import quantize")]:
        with open(copy / rel, "a") as f:
            f.write(f"\n{line}  # planted\n")
    code, out = lint()
    assert code != 0, out
    assert "3 broken" in out, out
    broken = out.split("Broken contracts", 1)[1]
    for name in ("the command line is imported by nothing else in the runtime",
                 "no import cycles among the runtime's modules and sub-packages",
                 "compiler sub-packages in layers, siblings independent"):
        assert name in broken, out
