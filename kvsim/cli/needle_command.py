"""``kvsim needle``: the pass-key test (issue 35, docs/needle.md). A five-digit key at each depth of
filler text, each length, each trial, decoded through ``kvsim.hf`` by every policy at every budget and
by the full cache (the control); per policy the accuracy grid (depth x length) over the trials the
control got right, and per trial the step at which each layer's cache lost the key.

Everything that needs no weights is checked first, each one line (``FLAG: VALUE: problem``, exit 1):
the policies and their parameters, the depths, a budget that would evict nothing, then (from the
model's config and tokenizer, before its weights load) a length beyond its context and a filler file
too short for the lengths. Nothing here imports torch until the command runs (tests/test_startup.py).
"""

from __future__ import annotations

import argparse
import statistics

from ..policies import DEFAULT_BUDGET, POLICIES, ParamError, PolicySpec, all_tunables
from ..policykit import registry
from ..policykit.registry import suggest
from .errors import CLIError, InputError, flag, param_message, read_input

DEFAULT_MODEL = "gemma3-270m"
DEFAULT_LENGTHS = "512,1024,2048,4096"
DEFAULT_DEPTHS = "0:1:0.1"


def add_needle(sub) -> None:
    p = sub.add_parser("needle", help="the pass-key test: does the model still find a key hidden in filler with its "
                       "cache held to the budget, and at which step did each layer lose it (needs the record extra)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="gemma3-270m (default), smollm2-135m or a local Hugging Face "
                   "model folder")
    from .plan_flags import add_plan_flags

    add_plan_flags(p, "needle")
    p.add_argument("--policy", dest="policies", default="streaming_llm,h2o", metavar="NAME[,NAME...]", help="online "
                   "policies, comma-separated (`kvsim policies` lists them; all: every online one; default: "
                   "streaming_llm,h2o)")
    p.add_argument("--policies", dest="policies", default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # the old spelling
    p.add_argument("--budget", default=None, metavar="B[,B...]", help="positions each layer holds per KV "
                   f"head; several give a grid each (default: {DEFAULT_BUDGET}), with --allocate FILE the file's split; "
                   "each below every length")
    p.add_argument("--allocate", default=None, metavar="NAME|FILE", help="a budget per (layer, KV head) at --budget's "
                   "memory: uniform or pyramidkv, or the allocation rows of replay --allocate NAME --json (a file), as "
                   "generate deploys it (docs/deploy.md)")
    p.add_argument("--prefill-budget", default=None, metavar="N|RATIO", help="compress the prompt at its end: each head "
                   "keeps N of the prompt's positions, or a ratio in (0, 1) of them, chosen once from the prompt's "
                   "attention (kvsim.hf prefill='compress'); then each policy decodes from that kept set at --budget")
    p.add_argument("--prefill-policy", default=None, metavar="NAME[:K=V,...]", help="with --prefill-budget: the policy "
                   "whose score chooses once (default: snapkv, at its defaults), e.g. snapkv:recent_window=8, or reconstruction "
                   "(KVzip: the attention the model's repeat of the prompt draws, query-agnostic; docs/scorers.md)")
    from .layout_flags import add as add_layout_flags

    add_layout_flags(p)
    p.add_argument("--optimum", action="store_true", help="also the exact optimum's fate of the key: the control's "
                   "attention replayed through the offline optimal at each run's budgets (per layer, when it would let "
                   "the key's tokens go); with --keys, over the whole conversation, every key; one key: not with --prefill-budget")
    p.add_argument("--attention", action="store_true", help="also keep each policy run's attention as a bundle in the "
                   "cache directory, which the app's kept-positions view opens from the needle view (a 2,048-token "
                   "trial is about 8 MB per (layer, KV head)); not with --prefill-budget")
    for param, spec in all_tunables().items():
        p.add_argument(flag(param), dest=f"param_{param}", type=int, default=None, metavar="N",
                       help=f"{spec.help} (passed to the policies that take it)")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, metavar="L[,L...]", help="prompt lengths in tokens, the start "
                   f"token, filler, needle and question together (default: {DEFAULT_LENGTHS})")
    p.add_argument("--depths", default=DEFAULT_DEPTHS, metavar="A:B:STEP|D[,D...]", help="where the needle goes, 0 (before "
                   f"the filler) to 1 (after it), snapped to the nearest sentence boundary (default: {DEFAULT_DEPTHS}); "
                   "with --keys K, exactly K depths in key order, each its own boundary")
    p.add_argument("--keys", type=int, default=1, metavar="K", help="a conversation of K turns on one cache: K numbered "
                   "keys in one context, turn i asking for key i after what turn i-1 wrote; --depths then lists K depths, "
                   "key i at the i-th (default: 1, one key and one question; with K above 1 and no --depths, evenly "
                   "spaced at i/(K+1))")
    p.add_argument("--query", choices=("aware", "agnostic"), default=None, help="with --prefill-budget: compress the "
                   "context with the first question in the scorer's window (aware, the default, as one key always ran) "
                   "or without it, the question fed after the compression (agnostic); said in every label")
    p.add_argument("--trials", type=int, default=1, help="trials per cell, each a new key (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="what the keys (and the random policy) are drawn from (default: 0)")
    p.add_argument("--filler", default=None, metavar="FILE", help="a UTF-8 text used once as the filler, which must be "
                   "long enough for the longest prompt (default: the pass-key literature's \"The grass is green. The sky "
                   "is blue. ...\", repeated)")
    p.add_argument("--needle", default=None, metavar="TEXT", help="the needle, with {key} where the key goes (default: "
                   "\"The pass key is {key}. Remember it. {key} is the pass key.\"; with --keys above 1, {name} or "
                   "{n} tells key n: \"{name}'s pass key is {key}.\", {name} Anna, Boris, ...)")
    p.add_argument("--question", default=None, metavar="TEXT", help="the prompt's end (default: \"What is the pass key? "
                   "The pass key is\"; with --keys above 1, \"What is {name}'s pass key? {name}'s pass key is\")")
    p.add_argument("--new-tokens", type=int, default=None, metavar="N", help="tokens decoded greedily (default: 8)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, default=None, help="spread the cells over this many local Dask worker "
                       "processes, as tune does (default: one after another here: each worker loads its own copy of the "
                       "model, 1.1 GB for Gemma-3-270M)")
    where.add_argument("--scheduler", default=None, metavar="ADDRESS", help="the address of a running Dask scheduler "
                       "(tcp://host:8786) whose workers share this cache directory")
    p.add_argument("--no-cache", action="store_true", help="decode again instead of reading cached trials")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")


def _ints(name: str, text: str) -> list[int]:
    out = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise InputError(f"{name}: {part.strip() or text!r}: not an integer") from None
        if value < 1:
            raise InputError(f"{name}: {value}: must be at least 1")
        out.append(value)
    return sorted(set(out))


def depths(text: str) -> list[float]:
    """``A:B:STEP`` (inclusive, steps counted so that 0:1:0.1 gives eleven) or ``D[,D...]``, each in [0, 1]."""
    try:
        if ":" in text:
            a, b, step = (float(x) for x in text.split(":"))
            if step <= 0:
                raise InputError(f"--depths: {text}: STEP must be above 0")
            values = [round(a + i * step, 6) for i in range(int(round((b - a) / step + 1e-9)) + 1)]
        else:
            values = [float(x) for x in text.split(",")]
    except ValueError:
        raise InputError(f"--depths: {text}: expected A:B:STEP or D[,D...] (numbers)") from None
    outside = [v for v in values if not 0 <= v <= 1]
    if outside or not values:
        raise InputError(f"--depths: {text}: {outside[0] if outside else 'nothing'} is outside [0, 1]")
    return sorted(set(values))


def check(args: argparse.Namespace) -> dict:
    """Everything that needs no model (raises, one line): the jobs, lengths, depths, template."""
    from ..models.needle import NEW_TOKENS, Job
    from ..models.needle_prompt import Template

    names = [x.strip() for x in args.policies.split(",") if x.strip()]
    if names == ["all"]:  # every online policy of the registry, plugins included
        names = registry.online()
    if not names:
        raise InputError("--policy: nothing listed")
    for name in names:
        if name not in POLICIES:
            raise InputError(f"--policy: {name}: unknown{suggest(name)}; known: {', '.join(POLICIES)}")
        if registry.is_offline(name):
            raise InputError(f"--policy: {name}: an offline reference (it reads the future) cannot be deployed")
    lengths = _ints("--lengths", args.lengths)
    given = {k[len("param_"):]: v for k, v in vars(args).items() if k.startswith("param_") and v is not None}
    taken = {p.name for n in names for p in POLICIES[n].tunables}
    if set(given) - taken:
        raise CLIError(f"none of {', '.join(names)} takes {', '.join(flag(k) for k in sorted(set(given) - taken))}")
    own = {name: {k: v for k, v in given.items() if k in {p.name for p in POLICIES[name].tunables}} for name in names}
    allocate, budgets = _allocation(args, names, own)
    if budgets[-1] is not None and budgets[-1] >= lengths[0]:
        raise InputError(f"--budget: {budgets[-1]}: at or above --lengths {lengths[0]}: nothing is evicted, every "
                         "policy would be the full cache; give budgets below every length")
    if isinstance(allocate, tuple):
        _nothing_evicted(allocate, lengths[0], args.allocate)
    layout = _layout(args, names, budgets, own)
    prefill = _prefill(args, lengths)
    talk = _conversation(args, prefill)
    if talk is None and prefill is not None and (args.optimum or args.attention):
        raise InputError(f"--{'optimum' if args.optimum else 'attention'} does not go with --prefill-budget: a compressed "
                         "prompt is never shown to the policy row by row")
    jobs = []
    for name in names:
        for b in budgets:
            try:
                if b is not None:
                    PolicySpec.of(name, b, **own[name])
            except ParamError as e:
                raise InputError(f"{name}: {param_message(e)}") from None
            jobs.append(Job(name, b, tuple(sorted(own[name].items())), allocate, prefill, layout))
    if args.trials < 1:
        raise InputError(f"--trials: {args.trials}: must be at least 1")
    new_tokens = NEW_TOKENS if args.new_tokens is None else args.new_tokens
    if new_tokens < 1:
        raise InputError(f"--new-tokens: {new_tokens}: must be at least 1")
    if args.workers is not None and args.workers < 1:
        raise InputError(f"--workers: {args.workers}: must be at least 1")
    fields = {"needle": args.needle, "question": args.question}
    template = Template(**{k: v for k, v in fields.items() if v is not None})
    if args.filler is not None:
        template = Template(read_input("--filler", args.filler), repeat=False, needle=template.needle,
                            question=template.question, source=args.filler)
    from ..models.needle_prompt import NeedleError

    try:
        template.check()
    except NeedleError as e:
        raise InputError(str(e)) from None
    return {"jobs": jobs, "lengths": lengths, "depths": depths(args.depths) if talk is None else talk["depths"],
            "template": template, "new_tokens": new_tokens, "conversation": talk}


def _conversation(args: argparse.Namespace, prefill) -> dict | None:
    """``--keys`` and ``--query``: a conversation (K keys, the depths in key order, the query mode, the needle and
    question with ``{n}`` or ``{name}``), or None for today's one-key needle. One line for anything that cannot run."""
    from ..models.needle_prompt import NEEDLE_NAMED, QUESTION_NAMED

    k = args.keys
    if k < 1:
        raise InputError(f"--keys: {k}: must be at least 1")
    if args.query is not None and prefill is None:
        raise InputError(f"--query {args.query} goes with --prefill-budget: an exact prompt steps every position one by "
                         "one, with or without the question")
    if k == 1 and args.query in (None, "aware"):
        return None
    if args.attention:
        raise InputError("--attention does not go with a conversation (--keys above 1 or --query agnostic) yet")
    if args.workers is not None or args.scheduler is not None:
        raise InputError(f"--{'workers' if args.workers is not None else 'scheduler'}: a conversation runs here, one "
                         "cell after another")
    if args.depths == DEFAULT_DEPTHS:
        spots = [round((i + 1) / (k + 1), 6) for i in range(k)]
    else:
        try:
            spots = [float(x) for x in args.depths.split(",")]
        except ValueError:
            raise InputError(f"--depths: {args.depths}: with --keys {k}, {k} depths D1,...,D{k} (numbers), key i at "
                             "the i-th") from None
        outside = [v for v in spots if not 0 <= v <= 1]
        if outside:
            raise InputError(f"--depths: {args.depths}: {outside[0]:g} is outside [0, 1]")
        if len(spots) != k:
            more = "more keys than depths" if k > len(spots) else "more depths than keys"
            raise InputError(f"--depths: {args.depths}: {len(spots)} depth(s) for --keys {k} ({more}); give one depth "
                             "per key, key i at the i-th")
        for i, d in enumerate(spots):
            if d in spots[:i]:
                raise InputError(f"--depths: {args.depths}: keys {spots.index(d) + 1} and {i + 1} overlap (both at "
                                 f"depth {d:g})")
    needle = NEEDLE_NAMED if args.needle is None else args.needle
    question = QUESTION_NAMED if args.question is None else args.question
    for text, name in ((needle, "--needle"), (question, "--question")):
        if not text.strip():
            what = "ask nothing" if name == "--question" else "hide nothing"
            raise InputError(f"{name}: empty: turn 1 and every later turn would {what}")
        if "{n}" not in text and "{name}" not in text:
            raise InputError(f"{name}: {text!r}: a conversation needs {{n}} (the key's number) or {{name}} (its owner's "
                             "name) to tell key n at turn n")
    return {"keys": k, "depths": spots, "query": args.query or "aware", "needle": needle, "question": question}


#: the KV heads per layer of the shipped models, for what a layout says before one loads
SHIPPED_KV_HEADS = {"gemma3-270m": 1, "smollm2-135m": 3}


def _layout(args: argparse.Namespace, names: list[str], budgets: list, own: dict):
    """``--block-size``, ``--shared-selection``, ``--evict-every``: the layout every job deploys (None: none),
    checked against every policy at every budget before the model loads, its notes said once."""
    from . import layout_flags

    layout = layout_flags.of(args)
    layout_flags.refuse_with(args, layout)
    if layout is None:
        return None
    heads = SHIPPED_KV_HEADS.get(args.model)
    layout_flags.check(layout, names[0], [(b, own[names[0]]) for b in budgets], heads=heads)  # its notes, once
    for name in names[1:]:
        for b in budgets:
            try:
                layout.check(name, b, own[name], heads=heads)
            except ValueError as e:
                raise CLIError(f"{layout_flags.layout_flags_text(layout)}: {' '.join(str(e).split())}") from None
    return layout


def _allocation(args: argparse.Namespace, names: list[str], own: dict) -> tuple:
    """``--allocate`` and the budgets: (the split, the budgets of the grids). A name (uniform,
    pyramidkv) splits each --budget; a file is one split (its rows, checked against every policy's
    minimum), deployed as it is unless --budget names its mean. One line for anything else."""
    typed = args.budget is not None
    budgets = _ints("--budget", args.budget if typed else str(DEFAULT_BUDGET))
    if args.allocate is None:
        return None, budgets
    if args.prefill_budget is not None:
        raise InputError("--allocate does not go with --prefill-budget (as replay says): give one of them")
    from ..allocation.allocators import ALLOCATORS
    from ..allocation.deployed import check_minimum, read_file, refusal
    from ..hf.cache import HFError

    name = args.allocate.strip()
    if name == "adakv":  # kvsim.hf builds the pool (generate --allocate adakv); a trial's per-head fate is not read from it yet
        raise InputError("--allocate: adakv: a trial reads each head's departures from its own block, and adakv's shared "
                         "pool has none yet; deploy a static split (uniform, pyramidkv, or a file from replay --allocate "
                         "cake|optimal --json), or run the pool with generate --allocate adakv")
    if name in ALLOCATORS:
        why = refusal(name)
        if why is not None:
            raise InputError(f"--allocate: {name}: {why}")
        return name, budgets
    try:
        split, made_for = read_file(name)
        for policy in names:
            if made_for is not None and made_for != policy:
                raise HFError(f"{name}: a split made for {made_for}, --policy has {policy}")
            check_minimum(split, policy, own[policy], name)
    except HFError as e:
        said = " ".join(str(e).split())
        raise InputError(f"--allocate: {said}") from None
    rows = tuple(sorted((x, h, b) for (x, h), b in split.items()))
    total = sum(split.values())
    if typed and (len(budgets) > 1 or total != budgets[0] * len(split)):
        raise InputError(f"--allocate: {name}: the split holds {total} positions, not --budget {args.budget} x {len(split)} "
                         "heads; leave out --budget to deploy the split as it is")
    return rows, [budgets[0] if typed else None]


def _nothing_evicted(rows, length: int, source: str) -> None:
    """A split whose largest head holds the shortest prompt whole evicts nothing there: say so."""
    x, h, b = max(rows, key=lambda r: (r[2], -r[0], -r[1]))
    if b >= length:
        raise InputError(f"--allocate: {source}: layer {x} KV head {h}'s budget {b} is at or above --lengths {length}: "
                         "nothing is evicted there; give lengths above every head's budget")


def _split_of_model(plan: dict, config, source: str) -> None:
    """The split on the model's shape, from its config (before its weights load): a named one (uniform,
    pyramidkv) computed, a file's rows checked to be this model's heads; each head's budget checked against
    the policy's minimum and the shortest length."""
    from ..allocation.deployed import split
    from ..hf.cache import HFError

    layers = config.num_hidden_layers
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for job in plan["jobs"]:
        given = job.how["allocate"]
        try:
            budgets = split(given, job.policy, job.budget, layers, kv_heads, dict(job.params),
                            model=getattr(config, "model_type", "the model"))
        except HFError as e:
            raise InputError(f"--allocate: {' '.join(str(e).split())}") from None
        _nothing_evicted([(x, h, b) for (x, h), b in budgets.items()], plan["lengths"][0], source)


def _prefill(args: argparse.Namespace, lengths: list[int]) -> tuple | None:
    """``--prefill-budget`` and ``--prefill-policy`` as a Job's ``prefill`` (keep, scorer, its parameters),
    checked against every length (kvsim.sim.prefill.Prefill: what kvsim.hf checks at the prompt)."""
    if args.prefill_budget is None:
        if args.prefill_policy is not None:
            raise InputError("--prefill-policy goes with --prefill-budget")
        return None
    from ..sim.prefill import DEFAULT_SCORER, Prefill, PrefillError, keep_count

    text = args.prefill_budget.strip()
    try:
        keep = keep_count(text, lengths[0])
    except PrefillError as e:
        raise InputError(f"--prefill-budget: {str(e).removeprefix('prefill_budget: ')}") from None
    value = keep if "." not in text and "e" not in text.lower() else float(text)
    from . import prefill_flags

    name, params = prefill_flags.scorer(args.prefill_policy or DEFAULT_SCORER, InputError)
    flags = {"prefill_budget": "--prefill-budget", "prompt_length": "--lengths", "prefill_policy": "--prefill-policy"}
    for n in lengths:
        try:
            kept = Prefill.of(n, value, name, **params).keep
        except PrefillError as e:
            said = str(e)
            raise InputError(f"{flags[e.field]}: {said.removeprefix(e.field + ': ')} (--lengths {n})") from None
        if kept >= n:
            raise InputError(f"--prefill-budget: {text}: keeps all of the {n}-token prompt (--lengths {n}): nothing is "
                             "compressed; give fewer positions or a ratio below 1")
    return value, name, tuple(sorted(params.items()))


def cmd_needle(args: argparse.Namespace) -> dict:
    plan = check(args)
    from .. import progress as protocol
    from ..models.needle import open_model, run_grid, save_grid
    from ..models.needle_prompt import Builder, NeedleError

    say = None if args.quiet else protocol.stderr("needle")
    try:
        config, tokenizer, weights, model_id = open_model(args.model, say)
    except NeedleError as e:
        raise InputError(str(e)) from None
    context = getattr(config, "max_position_embeddings", None)
    longest = plan["lengths"][-1]
    if context and longest + plan["new_tokens"] - 1 > context:
        raise InputError(f"--lengths: {longest}: beyond {args.model}'s context of {context} tokens (with the "
                         f"{plan['new_tokens']} decoded)")
    if args.allocate is not None:
        _split_of_model(plan, config, args.allocate)
    builder = Builder(tokenizer, plan["template"])
    if plan["conversation"] is not None:
        prompts = _conversations(args, plan, builder, context)
        from ..models.conversation_grid import save

        doc = _run_conversations(args, plan, prompts, weights, tokenizer, model_id, context, say)
        path = save(doc)  # for the app's Pass key view, beside the shipped conversation
        doc["saved"] = None if path is None else str(path)
        return doc
    try:
        for n in plan["lengths"]:
            builder.prompt(n, 0.5, "0" * 5)
    except NeedleError as e:
        raise InputError(str(e)) from None
    loaded = (weights(), tokenizer, model_id) if args.scheduler is None and args.workers is None else None
    scheduler = args.scheduler or ("local" if args.workers is not None else None)
    from ..cluster import ClusterError

    try:
        doc = run_grid(args.model, plan["template"], plan["jobs"], plan["lengths"], plan["depths"], args.trials,
                       args.seed, new_tokens=plan["new_tokens"], use_cache=not args.no_cache, scheduler=scheduler,
                       workers=args.workers, progress=say, loaded=loaded, optimum=args.optimum, attention=args.attention)
    except ClusterError as e:
        raise InputError(f"--{'scheduler' if args.scheduler else 'workers'}: {e}") from None
    doc = {"model": args.model, "model_id": model_id, "context": context, **doc}
    path = save_grid(doc)
    doc["saved"] = None if path is None else str(path)
    return doc


def _conversations(args: argparse.Namespace, plan: dict, builder, context: int | None) -> list:
    """Every conversation's prompt, built and checked before the weights load: keys that snap to one sentence
    boundary, and a turn longer than the model's context left (``kvsim.models.conversation.check_lengths``)."""
    from ..models.conversation import Conversation, ConversationError, Turn, check_lengths
    from ..models.needle_prompt import NeedleError, conversation, pass_keys

    talk = plan["conversation"]
    prompts = []
    for n in plan["lengths"]:
        for t in range(args.trials):
            try:
                keys = pass_keys(args.seed, n, talk["depths"], t)
                prompt = conversation(builder, n, talk["depths"], keys, t, talk["needle"], talk["question"])
            except NeedleError as e:
                raise InputError(str(e)) from None
            if context:
                decode = builder.tokenizer.decode
                turns = tuple(Turn(decode(list(q))) for q in prompt.questions)
                try:
                    conv = Conversation(decode(list(prompt.context)), turns, f"--keys {talk['keys']} --lengths {n}")
                    check_lengths(conv, len(prompt.context), [len(q) + plan["new_tokens"] + (i > 0)
                                                              for i, q in enumerate(prompt.questions)], context)
                except ConversationError as e:
                    raise InputError(str(e)) from None
            prompts.append(prompt)
    return prompts


def _run_conversations(args: argparse.Namespace, plan: dict, prompts: list, weights, tokenizer, model_id: str,
                       context: int | None, say) -> dict:
    """Each length's and trial's conversation through the control and every job (``needle_conversation``)."""
    import time

    from ..models.needle_conversation import label, run_conversation_unit

    talk = plan["conversation"]
    model = weights()
    cells = []
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        def each(j: int, r: dict, i: int = i, prompt=prompt) -> None:
            if say is not None:
                how = "from the cache" if r["cached"] else f"decoded, {r['prefill_seconds']:.1f} s prompts + " \
                    f"{r['decode_seconds']:.1f} s decoding"
                say((i + (j + 1) / (len(plan["jobs"]) + 1)) / len(prompts),
                    f"length {prompt.length} trial {prompt.trial + 1}: {r['label']} {how}")

        cells.append(run_conversation_unit(model, tokenizer, model_id, plan["template"], prompt.length, talk["depths"],
                                           prompt.trial, plan["jobs"], seed=args.seed, new_tokens=plan["new_tokens"],
                                           query=talk["query"], optimum=args.optimum, use_cache=not args.no_cache,
                                           needle=talk["needle"], question=talk["question"], on_run=each))
    found = []
    for j, job in enumerate(plan["jobs"]):
        turns = []
        for k in range(talk["keys"]):
            ok = [c for c in cells if c["control"]["found"][k]]
            turns.append({"found": sum(c["runs"][j]["found"][k] for c in ok), "counted": len(ok), "trials": len(cells)})
        found.append({"label": label(job, talk["query"]), "policy": job.policy, "budget": job.budget,
                      "params": dict(job.params), "prefill": job.how["prefill"], "turns": turns})
    control = [sum(c["control"]["found"][k] for c in cells) for k in range(talk["keys"])]
    return {"model": args.model, "model_id": model_id, "context": context, "conversation": True, "keys": talk["keys"],
            "query": talk["query"], "lengths": plan["lengths"], "depths": talk["depths"], "trials": args.trials,
            "seed": args.seed, "new_tokens": plan["new_tokens"], "needle": talk["needle"], "question": talk["question"],
            "template": plan["template"].to_dict(), "seconds": time.perf_counter() - t0,
            "control": {"found": control, "trials": len(cells)}, "grids": found, "cells": cells}


def render_conversation(doc: dict) -> str:
    """Found per turn, per job: over the trials whose control found that turn's key; with --optimum, each key held
    to the end and the retained mass beside the optimum's over the whole conversation."""
    k, n = doc["keys"], doc["control"]["trials"]
    lines = [f"a pass key per turn, {doc['model']}: {k} keys at depths {', '.join(f'{d:g}' for d in doc['depths'])} "
             f"(turn i asks for key i, on one cache), lengths {', '.join(map(str, doc['lengths']))}, {doc['trials']} "
             f"trial(s); {doc['new_tokens']} tokens decoded per turn; found over the trials the full cache found it",
             "  full cache (control): " + ", ".join(f"turn {i + 1} {c} of {n}" for i, c in enumerate(doc["control"]["found"]))]
    for j, g in enumerate(doc["grids"]):
        said = ", ".join(f"turn {i + 1} {t['found']} of {t['counted']}" for i, t in enumerate(g["turns"]))
        lines.append(f"  {g['label']}: {said}")
        runs = [c["runs"][j] for c in doc["cells"] if "optimal_retained" in c["runs"][j]]
        if runs:
            mine = statistics.mean(r["retained"] for r in runs)
            best = statistics.mean(r["optimal_retained"] for r in runs)
            after = statistics.mean(r["retained_after_prompt"] for r in runs)
            best_after = statistics.mean(r["optimal_retained_after_prompt"] for r in runs)
            held = [sum(v is None for r in runs for row in r["key_left"][i] for v in row) for i in range(k)]
            opt = [sum(v is None for r in runs for row in r["optimal_key_left"][i] for v in row) for i in range(k)]
            heads = sum(len(row) for row in runs[0]["key_left"][0]) * len(runs)
            note = " (a compressed prompt attends in full: only the second compares)" if g["prefill"] else ""
            lines.append(f"    retained mass over the conversation {mine:.3f} (the optimum over it at the same budgets "
                         f"{best:.3f}); after the first question {after:.3f} ({best_after:.3f}){note}")
            lines.append("    a key token held to the end, of " + f"{heads} (layer, KV head)s: " + ", ".join(
                f"key {i + 1} {held[i]} (optimum {opt[i]})" for i in range(k)))
    if doc.get("saved"):
        lines.append(f"saved for the app's Pass key view: {doc['saved']}")
    return "\n".join(lines)


def _cell(value) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _table(title: str, grid: list[list], lengths: list[int], depths: list[float]) -> list[str]:
    lines = [title, "  depth " + "".join(f"{n:>7}" for n in lengths)]
    for d, row in zip(depths, grid, strict=True):
        lines.append(f"  {d:5.2f} " + "".join(f"{_cell(v):>7}" for v in row))
    return lines


def _kept_to_the_end(cells: list[dict], j: int) -> str | None:
    """With --optimum: in how many (layer, KV head)s of all the trials the policy and the exact optimum
    (on the control's attention, at the same budgets) still hold a key token at the end."""
    runs = [c["runs"][j] for c in cells if "optimal_key_left" in c["runs"][j]]
    if not runs:
        return None
    heads = sum(len(row) for r in runs for row in r["key_left"])
    mine = sum(v is None for r in runs for row in r["key_left"] for v in row)
    best = sum(v is None for r in runs for row in r["optimal_key_left"] for v in row)
    block = (runs[0].get("layout") or {}).get("block_size", 1)
    which = "optimum" if block == 1 else f"optimum under the same blocks of {block}"
    return (f"  a key token held to the end: {mine} of {heads} (layer, KV head)s over {len(runs)} trial(s); the exact "
            f"{which} on the control's attention at the same budgets: {best} of {heads}")


def render_needle(doc: dict) -> str:
    if doc.get("conversation"):
        return render_conversation(doc)
    c = doc["control"]
    overall = "none" if c["overall"] is None else f"{100 * c['overall']:.0f}%"
    lines = [f"pass key in filler, {doc['model']}: {doc['trials']} trial(s) per cell, {doc['new_tokens']} tokens decoded "
             f"greedily; accuracy over the trials the full cache got right (-: the control got none right there)"]
    lines += _table(f"full cache (control): {overall} of all trials" + (" - THE CONTROL FAILS: no grid below is "
                    "counted" if c["fails"] else ""), c["accuracy"], doc["lengths"], doc["depths"])
    for j, g in enumerate(doc["grids"]):
        lines += [""] + _table(f"{g['label']} (control beside it: {overall})", g["accuracy"], doc["lengths"], doc["depths"])
        kept = _kept_to_the_end(doc["cells"], j)
        if kept is not None:
            lines.append(kept)
    runs = [r for cell in doc["cells"] for r in [cell["control"], *cell["runs"]] if not r["cached"]]
    if runs:
        pre = statistics.median(r["prefill_seconds"] for r in runs)
        dec = statistics.median(r["decode_seconds"] for r in runs)
        lines.append(f"\n{len(runs)} run(s) decoded here, median {pre:.1f} s prompt + {dec:.1f} s decoding; "
                     f"{doc['run']['executor']}, {doc['run']['seconds']:.0f} s in all")
        for label in dict.fromkeys(r["label"] for r in runs):
            mine = [r for r in runs if r["label"] == label]
            lines.append(f"  {label}: {len(mine)} run(s), median {statistics.median(r['prefill_seconds'] for r in mine):.1f} s "
                         f"prompt + {statistics.median(r['decode_seconds'] for r in mine):.1f} s decoding")
    if doc.get("saved"):
        lines.append(f"saved for the app's needle view: {doc['saved']}")
    return "\n".join(lines)
