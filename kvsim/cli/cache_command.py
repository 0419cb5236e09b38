"""``kvsim cache list`` and ``kvsim cache clear``: what the cache directory holds, by kind, and deleting
it (``kvsim.data.caches``; every cache is described in docs/caches.md)."""

from __future__ import annotations

import argparse

from ..data import caches


def add_cache(sub) -> None:
    p = sub.add_parser("cache", help="what the cache directory holds (traces, models, quality, optimal, recordings) and clearing it",
                       description="The cache directory is $KVSIM_CACHE_DIR, else $XDG_CACHE_HOME/kvsim, else "
                       "~/.cache/kvsim; docs/caches.md says what each kind is and how big it gets.")
    which = p.add_subparsers(dest="cache_command", metavar="ACTION", parser_class=type(p))
    which.required = True
    kinds = ", ".join(caches.KINDS)
    q = which.add_parser("list", help=f"each kind of entry ({kinds}, other) with its file count and size")
    q.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")
    q = which.add_parser("clear", help="delete the cache's entries of one kind, or of every kind (never other files)")
    q.add_argument("--kind", choices=[*caches.KINDS, "all"], default="all", metavar="KIND", help="what to delete (default: all: "
                   f"{kinds}; files the cache did not write are kept)")
    q.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")


def cmd_cache(args: argparse.Namespace) -> dict:
    if args.cache_command == "list":
        root, rows = caches.usage()
        return {"action": "list", "cache_dir": str(root), "kinds": [r.to_dict() for r in rows],
                "bytes": sum(r.bytes for r in rows)}
    root, rows = caches.clear(args.kind)
    return {"action": "clear", "cache_dir": str(root), "kind": args.kind, "cleared": [r.to_dict() for r in rows],
            "bytes": sum(r.bytes for r in rows)}
