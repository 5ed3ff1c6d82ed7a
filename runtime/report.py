"""The ``tessera report`` command: the static cost report of a spec, rendered."""

from __future__ import annotations

import argparse
import json

from . import pipeline


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=["table", "json"], default="table", help="output format (default table)")


def cmd_report(args) -> int:
    from tessera.compiler.analysis import parameter_report

    built = pipeline.build(args.spec, args.variant, args.sets)
    params = parameter_report(built.graph)
    report = {"model": built.info.model, "variant": built.info.variant,
              "hyperparams": {k: pipeline._jsonable(v) for k, v in built.info.hyperparams.items()},
              "params": params}
    if args.format == "json":
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    title = f"{built.info.model}{' (' + built.info.variant + ')' if built.info.variant else ''}: parameters"
    table = Table(title=title)
    table.add_column("component")
    table.add_column("parameters", justify="right")
    table.add_column("share", justify="right")
    total = params["total"]
    for comp, n in params["by_component"].items():
        table.add_row(comp, f"{n:,}", f"{100 * n / total:.1f}%")
    layers = params["per_layer"]
    if layers:
        first = next(iter(layers))
        for part, n in layers[first].items():
            if part != "total":
                table.add_row(f"  {first}.{part}", f"{n:,}", "")
        table.add_row(f"  one layer ({first})", f"{layers[first]['total']:,}", "")
    table.add_row("total", f"{total:,}", "100.0%", style="bold")
    console = Console()
    console.print(table)
    for p, users in params["tied"].items():
        console.print(f"tied: {p} is shared by {', '.join(users)} (counted once)")
    return 0


