"""``kvsim generate``: greedy generation with kvsim.hf's evicting cache, every layer held to the budget.

Every check that needs no model runs before the model loads (the policy, its parameters against the
budget, the prompt, the tune file's own form, an allocation's name or file and each head's budget against
the policy's minimum); the checks that need it (a tune file or an allocation for another model, attention
that is not eager-compatible) run when it has loaded, before the first token.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from ..policies import POLICIES, ParamError, PolicySpec
from ..policykit.base import WINDOW
from ..policykit.registry import is_offline, suggest, window_param
from . import generate_turns
from .errors import CLIError, InputError, flag, input_error, read_input

#: the shipped model, spelt as needle, tune, quality and proxies spell it; the old "gemma" still means it
SHIPPED = "gemma3-270m"
OLD_SPELLINGS = ("gemma",)


@dataclass
class _Run:
    """What generate deploys, from ``--plan FILE`` (``kvsim.cli.run_plan.make``) or the flags, checked once: the
    policy, the budget (None: a split given as rows is the memory), the parameters, and ``allocate`` (an allocator's
    name or the file holding the rows) with ``allocation`` (the name, or the budgets per (layer, KV head))."""

    policy: str
    budget: int | None
    params: dict
    allocate: str | None = None
    allocation: object = None
    #: a split's rows handed over already (a plan's), with whether --budget was typed beside them
    rows: dict | None = None
    budget_given: bool = False
    #: the serving layout (``kvsim.policykit.layouts.Layout``), None for none
    layout: object = None


def _of(args: argparse.Namespace) -> _Run:
    plan = getattr(args, "run_plan", None)
    if plan is None:
        return _Run(args.policy, args.budget, None, args.allocate, budget_given=getattr(args, "budget_given", False))
    spec = plan.policy
    if plan.allocation is not None:  # a plan with rows is an allocation file itself: the split is the memory
        return _Run(spec.name, None, dict(spec.params), str(args.plan), rows=plan.budgets, layout=plan.layout)
    return _Run(spec.name, spec.budget, dict(spec.params), plan.allocate, layout=plan.layout)


def _params(args: argparse.Namespace, policy: str) -> dict:
    taken = {p.name for p in POLICIES[policy].tunables}
    given = {k[len("param_"):]: v for k, v in vars(args).items() if k.startswith("param_") and v is not None}
    foreign = sorted(set(given) - taken)
    if foreign:
        raise CLIError(f"{policy} does not take {', '.join(flag(k) for k in foreign)}")
    return given


def _prompt(args: argparse.Namespace) -> str:
    if (args.prompt is None) == (args.prompt_file is None):
        raise CLIError("give the prompt as text or --prompt-file F, one of them")
    if args.prompt_file is None:
        if not args.prompt.strip():
            raise CLIError("the prompt is empty")
        return args.prompt
    return read_input("--prompt-file", args.prompt_file)


def _allocation(args: argparse.Namespace, run: _Run):
    """``--allocate``'s name, or its file's budgets (a plan's rows), checked as far as the model is not needed; a
    file given without --budget sets ``run.budget`` to None (the split is what it holds)."""
    from ..allocation.allocators import ALLOCATORS
    from ..allocation.deployed import POOLED, adakv_refusal, check_minimum, pooled_file, read_file, refusal
    from ..hf.cache import HFError

    name = run.allocate.strip()
    if name in ALLOCATORS:
        why = refusal(name) or (adakv_refusal(run.policy) if name in POOLED else None)
        if why is not None:
            raise CLIError(f"--allocate {name}: {why}")
        return name
    try:
        budgets, made_for = read_file(name) if run.rows is None else (run.rows, run.policy)
        if (why := pooled_file(name)) is not None:
            raise HFError(why)
        if made_for is not None and made_for != run.policy:
            raise HFError(f"{name}: a split made for {made_for}, --policy is {run.policy}")
        if args.windows is None:  # with a tune file each head's window sets its minimum: checked with the split
            check_minimum(budgets, run.policy, run.params, name)
    except HFError as e:
        raise input_error("--allocate", e) from None
    if not run.budget_given:
        run.budget = None  # the split is the memory
    elif sum(budgets.values()) != run.budget * len(budgets):
        raise CLIError(f"--allocate {name}: the split holds {sum(budgets.values())} positions, not --budget {run.budget} "
                       f"x {len(budgets)} heads; leave out --budget to deploy the split as it is")
    return budgets


def check(args: argparse.Namespace) -> tuple[_Run, str]:
    """Everything that needs no model: the parameters and the prompt (raises, one line)."""
    run = _of(args)
    if run.policy not in POLICIES:
        raise CLIError(f"--policy {run.policy!r}: unknown{suggest(run.policy)}; known: {', '.join(POLICIES)}")
    if is_offline(run.policy):
        raise CLIError(f"--policy {run.policy} is an offline reference (it reads the future) and cannot be deployed")
    if run.params is None:
        run.params = _params(args, run.policy)
    run.allocation = None if run.allocate is None else _allocation(args, run)
    if args.windows is None:
        if args.by != "layer":
            raise CLIError("--by applies with --windows")
        if run.budget is not None:
            PolicySpec.of(run.policy, run.budget, **run.params)  # a ParamError says it in the flags' terms
    else:
        _check_windows(args, run)
    if args.model in OLD_SPELLINGS:
        args.model = SHIPPED
    if args.model != SHIPPED and not (Path(args.model) / "config.json").is_file():
        raise InputError(f"--model: {args.model}: not a local Hugging Face model folder (no config.json), nor {SHIPPED}")
    _check_layout(args, run)
    return run, None if getattr(args, "conversation", None) is not None else _prompt(args)


def _check_layout(args: argparse.Namespace, run: _Run) -> None:
    """The serving layout (a plan's, or ``--block-size``, ``--shared-selection``, ``--evict-every``; ``args.layout``,
    None for none), checked against the policy and the budget before the model loads; its notes said on stderr."""
    from . import layout_flags

    if getattr(args, "run_plan", None) is None:
        run.layout = layout_flags.of(args)
    args.layout = layout = run.layout
    layout_flags.refuse_with(args, layout, split=run.allocate is not None)
    if layout is not None:
        heads = 1 if args.model == SHIPPED else _kv_heads(Path(args.model) / "config.json")
        layout_flags.check(layout, run.policy, [(run.budget, run.params)], heads=heads)


def _kv_heads(config: Path) -> int | None:
    """A model folder's KV heads per layer, from its config.json (None where it does not say)."""
    from ..data import jsontext

    try:
        doc = jsontext.loads(config.read_text(encoding="utf-8"))
        doc = doc.get("text_config", doc)
        heads = doc.get("num_key_value_heads") or doc.get("num_attention_heads")
    except (OSError, ValueError, AttributeError):
        return None
    return heads if type(heads) is int else None


def _check_windows(args: argparse.Namespace, run: _Run) -> None:
    """The tune file's own form and every window in it against the budget (the model is checked later)."""
    from ..hf.windows import WindowsError, read_tune, tune_windows

    if WINDOW in run.params:
        raise CLIError(f"{flag(WINDOW)} and --windows exclude each other (the file sets it per layer)")
    if window_param(run.policy) != WINDOW:
        raise CLIError(f"--windows: {run.policy} has no {WINDOW}")
    if not Path(args.windows).exists():
        raise InputError(f"--windows: {args.windows}: no such file")
    try:
        windows = tune_windows(read_tune(args.windows), args.by, source=args.windows)
    except WindowsError as e:
        raise input_error("--windows", e) from None
    if run.allocate is not None:  # each head's own budget bounds its window: checked when the split is known
        return
    for where, w in windows.items():
        try:
            PolicySpec.of(run.policy, run.budget, **run.params, **{WINDOW: w})
        except ParamError:
            layer = f"layer {where[0]} KV head {where[1]}" if isinstance(where, tuple) else f"layer {where}"
            raise CLIError(f"--windows {args.windows}: {layer}'s {WINDOW} {w} must be below --budget {run.budget}") from None


def cmd_generate(args: argparse.Namespace) -> dict:
    conv = None if getattr(args, "conversation", None) is None else generate_turns.check(args)
    run, text = check(args)
    from .. import progress as protocol
    from ..models.loading import load_hf_model, load_model, token_ids

    say = protocol.stderr("generate")  # stderr whatever stdout is (--json, a pipe): a long prompt must not look hung
    model, tokenizer = load_model(say) if args.model == SHIPPED else load_hf_model(args.model, progress=say)
    import kvsim.hf as hf
    from kvsim.hf.decoding import greedy

    if conv is not None:  # turn by turn on one cache (kvsim.cli.generate_turns)
        return generate_turns.run(args, run, conv, model, tokenizer, lambda n: hf.cache(
            model, run.policy, run.budget, windows=args.windows, by=args.by, allocate=run.allocation, prefill=args.prefill,
            seed=args.seed, progress=say if args.prefill == "exact" and n > 1 else None, **_layout_kwargs(args.layout),
            **run.params), say)

    ids = token_ids(tokenizer, text)
    n = ids.shape[1]
    cache = hf.cache(model, run.policy, run.budget, windows=args.windows, by=args.by, allocate=run.allocation,
                     prefill=args.prefill, seed=args.seed, progress=say if args.prefill == "exact" and n > 1 else None,
                     **_layout_kwargs(args.layout), **run.params)
    if run.budget is not None and n > run.budget:
        say(None, f"the prompt's {n} tokens exceed the budget {run.budget}: "
            + ("each layer takes them one position at a time, as decoding would show them to the policy"
               if args.prefill == "exact" else "they attend with nothing evicted, then each layer's cache is cut to the budget"))
    t0 = time.perf_counter()
    out = greedy(model, ids, cache, args.max_new_tokens, tokenizer.eos_token_id)
    steps = len(out["tokens"]) - 1
    return {"model": args.model, "policy": run.policy, "budget": run.budget, "params": run.params,
            "windows": args.windows, "by": args.by if args.windows else None, "prefill": args.prefill,
            # what was deployed, whatever it came from: a tune file's deploy rows, --recent-window, the default
            "recent_window_per_layer": _deployed_windows(cache),
            "prompt_tokens": n, "token_ids": out["tokens"], "text": tokenizer.decode(out["tokens"], skip_special_tokens=True),
            "peak_positions": cache.peak_positions, "cache_bytes": cache.nbytes,
            "prefill_seconds": out["prefill_seconds"], "decode_seconds": out["decode_seconds"],
            "tokens_per_second": steps / out["decode_seconds"] if steps and out["decode_seconds"] > 0 else None,
            "seconds": time.perf_counter() - t0, **_blocks(args.layout, cache),
            **(_allocated(run, cache, cache.get_seq_length()) if run.allocate is not None else {})}


def _layout_kwargs(layout) -> dict:
    return {} if layout is None else layout.to_dict()


def _blocks(layout, cache) -> dict:
    """Under a serving layout: the layout and what the cache allocated, in whole blocks (``kvsim.hf.layout.memory``)."""
    if layout is None:
        return {}
    from kvsim.hf.layout import memory

    return {"layout": layout.to_dict(), "blocks": memory(cache)}


def _allocated(run: _Run, cache, seen: int) -> dict:
    """What ``--allocate`` deployed: each head's budget and peak, and the heads whose budget reaches past the
    positions processed (nothing was evicted there; their slots beyond them were allocated for nothing)."""
    budgets, peaks = cache.budgets, cache.head_peaks
    rows = [{"layer": x, "kv_head": h, "budget": b, "peak_positions": peaks[(x, h)]} for (x, h), b in sorted(budgets.items())]
    pools = [{"layer": x, "pool": layer.pool, "floor": layer.floor, "peak_positions": layer.pool_peak}
             for x, layer in enumerate(cache.layers) if hasattr(layer, "pool")]  # adakv: each layer's heads share one
    return {"allocate": run.allocate, "allocation": rows, "positions": sum(budgets.values()), "positions_seen": seen,
            "unevicted_heads": sum(b >= seen for b in budgets.values()), **({"pools": pools} if pools else {})}


def _deployed_windows(cache) -> list | None:
    """Each layer's recent_window as deployed (a list per layer when its KV heads differ); None for a
    policy without one."""
    out = []
    for layer in cache.layers:
        per_head = [spec.window for spec in layer.specs]
        out.append(per_head[0] if len(set(per_head)) == 1 else per_head)
    return None if all(w is None for w in out) else out


def render_generate(doc: dict) -> str:
    if "turns" in doc:  # generate --conversation
        return generate_turns.render(doc)
    tps = f"{doc['tokens_per_second']:.1f} tokens/s" if doc["tokens_per_second"] else "one token"
    held = f"at budget {doc['budget']}"
    note = ""
    if doc.get("allocation"):
        heads = len(doc["allocation"])
        held = f"split by {doc['allocate']} ({doc['positions']} positions over {heads} KV heads)"
        if doc["unevicted_heads"]:
            note = (f"; {doc['unevicted_heads']} of {heads} heads' budgets reach the {doc['positions_seen']} positions "
                    "processed: nothing was evicted there")
    cache = f"{doc['cache_bytes'] / (1 << 20):.1f} MiB"
    if doc.get("blocks"):
        m = doc["blocks"]
        tables = "one block table per layer" if m["block_tables"] == 1 else f"{m['block_tables']} block tables per layer"
        held += f" under {m['layout']}"
        cache = (f"{m['blocks']} blocks of {m['block_size']} positions in {tables} ({m['block_peak']} held at most) and one "
                 f"staging position, {cache}")
    return (f"{doc['text']}\n\n[{len(doc['token_ids'])} tokens after a {doc['prompt_tokens']}-token prompt; {doc['policy']} "
            f"{held}: at most {max(doc['peak_positions'])} positions per layer, cache {cache}; "
            f"prompt {doc['prefill_seconds']:.1f} s ({doc['prefill']}), {tps}{note}]")
