"""The cost report as a Python value: the same dict that ``tessera report --format json`` writes, with
a one-line ``repr`` for a REPL, ``str`` as the Markdown tables and ``_repr_html_`` for notebooks.

Why a dict subclass and not a class of its own: every caller of ``Model.report`` (and json.dumps)
keeps working unchanged, while a REPL or a notebook no longer prints a 300-line dict.
"""

from __future__ import annotations

from html import escape

from tessera.runtime.report import format as fmt


class Report(dict):
    """A cost report: ``rep["params"]["total"]`` as before; ``print(rep)`` gives the tables."""

    def __repr__(self) -> str:
        p = self["params"]["total"]
        parts = [f"{p:,} parameters", f"{fmt.si(self['macs']['total'])}MACs"]
        mem = self["memory"]
        parts.append(f"weights {fmt.si(mem['weights_bytes'], 'B')}")
        if mem.get("kv_cache_bytes"):
            parts.append(f"KV cache {fmt.si(mem['kv_cache_bytes'], 'B')}")
        return f"<tessera.Report {fmt.title(self)}: {', '.join(parts)}>"

    def __str__(self) -> str:
        return fmt.markdown(self)

    def _repr_html_(self) -> str:
        """Jupyter's rich display: the report's sections as HTML tables (the formats' shared rows)."""
        out = [f"<h4>{escape(fmt.title(self))}</h4>"]
        for name, cols, rows in fmt.sections(self):
            out.append(f"<table><caption style='text-align:left'><b>{escape(name)}</b></caption><thead><tr>")
            out += [f"<th>{escape(c)}</th>" for c in cols]
            out.append("</tr></thead><tbody>")
            for row in rows:
                cells = [f"<td style='text-align:{'left' if j == 0 else 'right'}'>"
                         f"{'&nbsp;' * (len(c) - len(c.lstrip(' ')))}{escape(c.lstrip(' '))}</td>"
                         for j, c in enumerate(row)]
                out.append("<tr>" + "".join(cells) + "</tr>")
            out.append("</tbody></table>")
        out += [f"<p>note: {escape(n)}</p>" for n in fmt._notes(self)]
        return "".join(out)
