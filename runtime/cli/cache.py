"""``tessera cache list|clear``: the compile cache's entries (runtime/compile_cache.py), listed or removed.

The flags fill runtime/options.CacheOptions; runtime/driver.cache finds the folder as the commands that
load a model find it and does the work; this module prints.
"""

from __future__ import annotations

import argparse
import json

from tessera.runtime.options import CACHE_ACTIONS, CacheOptions


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("cache", help="list or clear the compile cache",
                       description="The compile cache keeps the models that run, generate, serve, batch and "
                                   "perplexity compile, keyed by the spec's elaborated graph, the weights files "
                                   "(path, size, modification time), the compile options and the versions, so a "
                                   "second load of the same model skips the compile (docs/cli.md, the compile "
                                   "cache). `list` shows its entries, most recently used first; `clear` removes "
                                   "them all. Its folder: --compile-cache DIR, else $TESSERA_COMPILE_CACHE, else "
                                   "compiled/ in Tessera's cache folder ($TESSERA_CACHE_DIR, "
                                   "$XDG_CACHE_HOME/tessera or ~/.cache/tessera); it keeps at most "
                                   "$TESSERA_COMPILE_CACHE_MAX_GB (default 20) GiB, evicting the least recently "
                                   "used entries.")
    p.add_argument("action", choices=list(CACHE_ACTIONS), help="list the entries, or clear them all")
    p.add_argument("--compile-cache", metavar="DIR", help="the cache folder (default as above)")
    p.add_argument("--format", choices=["text", "json"], default="text", help="output format (default text)")
    return p


def cmd_cache(ns: argparse.Namespace) -> int:
    from tessera.runtime import driver

    got = driver.cache(CacheOptions.from_args(ns))
    if ns.format == "json":
        print(json.dumps(got, indent=1))
        return 0
    if got["folder"] is None:
        print(f"compile cache: {got['source']}")
        return 0
    entries = got["entries"]
    if ns.action == "clear":
        print(f"removed {got['removed']} entr{'y' if got['removed'] == 1 else 'ies'} "
              f"({got['freed_bytes'] / 1e6:,.1f} MB) from {got['folder']}")
        return 0
    total = sum(e["bytes"] for e in entries)
    print(f"compile cache {got['folder']} ({got['source']}): {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, "
          f"{total / 1e6:,.1f} MB of at most {got['max_bytes'] / 1e6:,.0f} MB")
    for e in entries:
        what = f"{e['model']} {e['what']}" if e["complete"] else "incomplete (no manifest: removed when next looked up)"
        print(f"  {e['last_used']}  {e['bytes'] / 1e6:10,.1f} MB  {what}  {e['entry']}")
    return 0
