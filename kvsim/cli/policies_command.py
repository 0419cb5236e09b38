"""``kvsim policies``: every registered policy, as the registry holds it in this process (the shipped
modules of kvsim/policies/, the entry points of group ``kvsim.policies`` and ``KVSIM_PLUGINS``): what it
reads, whether it is online, its parameters and whether the fast engine covers it. A plugin's author runs
it to see that their policy loaded; ``--markdown`` prints the table the README and docs/ carry."""

from __future__ import annotations

import argparse

from ..policies import POLICIES, describe_policy
from ..policykit import registry
from ..policykit.registry import PROBLEMS


def add_policies(sub) -> None:
    p = sub.add_parser("policies", help="list every registered policy (shipped and plugins): kind, what it reads, "
                       "parameters, engine; --markdown for the docs' table")
    p.add_argument("--markdown", action="store_true", help="print the policy table as Markdown (the README's and docs/'s)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")


def describe(name: str) -> dict:
    """One policy as the registry declares it."""
    cls = POLICIES[name]
    return {
        "name": name,
        "kind": "offline reference" if registry.is_offline(name) else "online",
        "reads": ["attention"] * cls.reads_attention + list(cls.reads),
        "params": {p.name: p.default for p in cls.tunables},
        "engine": "kernel" if registry.has_engine(name) else "reference",
        "module": cls.__module__,
        "summary": describe_policy(cls),
    }


def cmd_policies(args: argparse.Namespace) -> dict:
    return {"policies": [describe(n) for n in POLICIES], "problems": list(PROBLEMS), "markdown": bool(args.markdown)}


def markdown(rows: list[dict]) -> str:
    """The policy table: one row per registered policy, in the registry's order."""
    lines = ["| policy | kind | reads | parameters (defaults) | engine | what it does |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        params = ", ".join(f"`{k}={v}`" for k, v in r["params"].items())
        reads = ", ".join(r["reads"]) or "nothing"
        summary = r["summary"].replace("|", "\\|")  # a norm's bars, not a cell's
        lines.append(f"| `{r['name']}` | {r['kind']} | {reads} | {params} | {r['engine']} | {summary} |")
    return "\n".join(lines)


def render_policies(doc: dict) -> str:
    if doc.get("markdown"):
        return markdown(doc["policies"])
    from .tables import aligned

    table = aligned(["policy", "kind", "reads", "parameters", "engine", "module"],
                    [[r["name"], r["kind"], ", ".join(r["reads"]) or "nothing",
                      " ".join(f"{k}={v}" for k, v in r["params"].items()) or "-", r["engine"], r["module"]]
                     for r in doc["policies"]])
    return table  # a plugin that failed to load was said on stderr when the registry loaded
