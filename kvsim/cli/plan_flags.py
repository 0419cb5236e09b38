"""``--plan FILE`` and ``--save-plan FILE``, the flags: which commands take them and what their help says. The
run's plan itself is made in ``kvsim.cli.run_plan`` (apart, so that the grammar imports none of the commands'
checks)."""

from __future__ import annotations

import argparse

#: the commands that take --plan, and those that also take --save-plan (one decode policy, not a grid)
TAKES_PLAN = ("replay", "sweep", "table", "quality", "generate", "needle", "tune")
SAVES_PLAN = ("replay", "generate", "tune")


def add_plan_flags(p: argparse.ArgumentParser, command: str) -> None:
    if command == "tune":
        p.add_argument("--plan", default=None, metavar="FILE", help="tune within a run's plan: its policy, budget, "
                       "other parameters and split (an allocator's name: its split at the tuned window; rows: kept) "
                       "(docs/deploy.md, 'Tune, then run what you tuned')")
        p.add_argument("--save-plan", default=None, metavar="FILE", help="write what was tuned as a plan (model_window "
                       "in every layer, and the split chosen or given) to FILE, for generate --plan FILE or "
                       "kvsim.hf.cache(plan=FILE)")
        return
    p.add_argument("--plan", default=None, metavar="FILE", help="a run's plan (JSON: the policy, budget and parameters, "
                   "the split over layers and KV heads, the prompt's compression; docs/architecture.md, 'One plan per "
                   "run'): its settings as if given as flags")
    if command in SAVES_PLAN:
        p.add_argument("--save-plan", default=None, metavar="FILE", help="write this run's plan (made from the flags) "
                       "to FILE, for --plan elsewhere or kvsim.hf.cache(plan=FILE)")
