"""kvsim.hf: kvsim's eviction policies as a transformers KV cache that really drops what they evict.

    import kvsim.hf
    cache = kvsim.hf.cache(model, "h2o", 256, recent_window=32)           # or windows="tune.json"
    cache = kvsim.hf.cache(model, "h2o", 256, allocate="pyramidkv")      # or {(layer, kv_head): budget}, "split.json"
    cache = kvsim.hf.cache(model, "h2o", 256, allocate="adakv")          # a layer's KV heads share one pool
    cache = kvsim.hf.cache(model, "h2o", 256, block_size=16, shared_selection=True)  # pages, one table a layer
    out = model.generate(ids, cache=cache, max_new_tokens=200, do_sample=False)  # past_key_values= before 5.x

Every decoder layer holds at most ``budget`` positions per KV head (or each (layer, KV head) its own
budget, ``allocate``: the cache's bytes follow the split), chosen by one policy per (layer, KV
head) from the registry's online policies, fed the attention the model computes (``kvsim.hf.cache``,
docs/domain.md, "The deployed cache", docs/deploy.md). The model is put on kvsim's attention function (eager
arithmetic, which exposes the weights); with transformers' own caches it still computes eager
attention. Under a serving layout (``block_size``, ``shared_selection``, ``evict_every``; docs/serving.md) the
cache is held in whole blocks as a paged engine holds it (``kvsim.hf.layout``).

Importing this package needs torch and transformers (the model extra); ``import kvsim``, the CLI and
the app never import it until a command or a measurement decodes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..policies import POLICIES, ParamError, PolicySpec, policy_class
from ..policykit import registry
from ..policykit.base import WINDOW
from ..policykit.rope import rope_meta
from ..sim.prefill import DEFAULT_SCORER, GROW, Prefill, PrefillError
from .attention import ATTN, attach
from .cache import PREFILL, EvictingCache, EvictingLayer, HFError, LayerMeta
from .conversation import converse
from .reconstruction import reconstruction_scores
from .tensor import CHUNK, TensorLayer, refusal
from .windows import WindowsError, check_model, read_tune, tune_windows


def model_layout(model) -> tuple[list[str], int, int | None]:
    """The model's attention per decoder layer (``global`` / ``sliding``), its KV heads and its sliding
    window; HFError when a layer is not attention kvsim can hold (linear attention, shared KV)."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    n = cfg.num_hidden_layers
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)[:n]
    kinds = {"full_attention": "global", "sliding_attention": "sliding"}
    odd = sorted({t for t in types if t not in kinds})
    if odd or getattr(cfg, "kv_sharing_modes", None):
        raise HFError(f"{type(model).__name__} has no eager-compatible attention in every layer "
                      f"({', '.join(odd) or 'shared KV'}); kvsim.hf holds full and sliding attention layers only")
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    window = getattr(cfg, "sliding_window", None) if "sliding_attention" in types else None
    return [kinds[t] for t in types], int(kv_heads), window


def layer_specs(model, policy: str, budget: int | None, windows=None, by: str = "layer", allocate=None,
                **params) -> list[list[PolicySpec]]:
    """One validated spec per (layer, KV head): ``params`` everywhere, ``recent_window`` per layer or per
    (layer, KV head) from ``windows`` (``{layer: w}``, ``{(layer, head): w}``, or a tune file's path,
    read by ``by``), the budget per (layer, KV head) from ``allocate`` (``kvsim.allocation.deployed.split``:
    ``uniform`` or ``pyramidkv`` at ``budget``, an allocation file, or ``{(layer, kv_head): budget}``, with
    which ``budget`` may be None). HFError / WindowsError, one line, for anything that cannot run."""
    try:
        policy_class(policy)  # an unknown name: one line
    except ValueError as e:
        raise HFError(str(e)) from None
    if registry.needs_model(policy):
        raise HFError(f"{policy} scores a prompt by a pass of the model (needs_model): it is a prefill_policy, not a "
                      "decode-time policy")
    if registry.is_offline(policy):
        deployable = ", ".join(registry.online())  # registered later too
        raise HFError(f"{policy} is an offline reference (it reads the future); deployable: {deployable}")
    kinds, kv_heads, model_window = model_layout(model)
    if isinstance(windows, (str, Path)):
        doc = read_tune(windows)
        check_model(doc, kinds, kv_heads, model_window, source=str(windows), model=type(model).__name__)
        if doc.get("policy") not in (None, policy):
            raise WindowsError(f"{windows}: tuned for {doc['policy']}, --policy is {policy}")
        windows = tune_windows(doc, by, source=str(windows))
    windows = dict(windows or {})
    outside = [k for k in windows if (k[0] if isinstance(k, tuple) else k) not in range(len(kinds))
               or (isinstance(k, tuple) and k[1] not in range(kv_heads))]
    if outside:
        raise HFError(f"windows for {outside[0]}: the model has layers 0-{len(kinds) - 1} and {kv_heads} KV head(s)")
    if windows and registry.window_param(policy) != WINDOW:
        raise HFError(f"{policy} has no {WINDOW}; windows are for a policy that takes one")
    budgets = None
    if allocate is not None:
        from ..allocation.deployed import split

        try:
            budgets = split(allocate, policy, budget, len(kinds), kv_heads, params, model=type(model).__name__,
                            windows=windows)
        except (ParamError, ValueError) as e:
            raise HFError(" ".join(str(e).split())) from None
    elif budget is None:
        raise HFError("a budget is needed (or allocate={(layer, kv_head): budget})")
    specs = []
    for layer in range(len(kinds)):
        row = []
        for head in range(kv_heads):
            w = windows.get((layer, head), windows.get(layer))
            extra = {} if w is None else {WINDOW: w}
            b = budget if budgets is None else budgets[(layer, head)]
            try:
                row.append(PolicySpec.of(policy, b, **{**params, **extra}))
            except ParamError as e:
                where = f"layer {layer}{f' KV head {head}' if (layer, head) in windows else ''}: " if w is not None else ""
                if budgets is not None:
                    where = f"layer {layer} KV head {head} (budget {b}): "
                raise HFError(f"{where}{e}") from None
            except ValueError as e:
                raise HFError(str(e)) from None
        specs.append(row)
    return specs


def cache(model, policy: str | None = None, budget: int | None = None, *, plan=None, windows=None, by: str = "layer",
          allocate=None, prefill: str = "exact", seed: int | None = None, progress=None, prefill_budget=None,
          prefill_policy: str = DEFAULT_SCORER, prefill_params: dict | None = None, block_size: int = 1,
          shared_selection: bool = False, evict_every: int = 1, tensor: bool | None = None, chunk: int | None = None,
          prefill_scores=None, **params) -> EvictingCache:
    """An ``EvictingCache`` for ``model``: ``policy`` at ``budget`` in every layer with ``params``, and
    ``windows`` (see ``layer_specs``) per layer; ``allocate`` (see ``layer_specs``) gives each (layer,
    KV head) its own budget, and each head's storage is that budget plus one spare slot; ``allocate="adakv"``
    (h2o, a model with several KV heads per layer) makes each layer's KV heads share one pool of ``budget x
    KV heads`` positions in one store (``kvsim.hf.pooled``), the pool plus one spare slot per head. Puts
    ``model`` on kvsim's attention function. Every
    check runs here, before any token: an unknown or offline policy, a parameter out of bounds (a
    window not below the budget), a tune file for another model, a model without eager-compatible
    attention. ``prefill``: ``exact`` (a prompt stepped position by position, as decoding would) or
    ``fast`` (prefill-then-evict). ``seed``: the generator the random policy draws from. ``progress``
    (``kvsim.progress``) hears of each layer as an exact prefill steps it through a prompt.

    ``prefill="compress"`` (docs/deploy.md, "Compression at the prompt's end"): the prompt, in one forward
    pass, attends in full; then each (layer, KV head) keeps ``prefill_budget`` of its positions (an integer,
    or a ratio in (0, 1) of the prompt), chosen once by ``prefill_policy``'s score (``snapkv`` by default, at
    its defaults updated by ``prefill_params``), and decoding goes on from them: ``policy`` ``"none"`` lets the
    cache grow, any online policy runs at ``budget`` from the kept set (``kvsim.sim.prefill``).
    ``prefill_policy="reconstruction"`` (KVzip, query-agnostic) chooses from a pass of the model repeating the
    prompt: ``prefill_scores``, ``reconstruction_scores(model, ids, tokenizer)`` of the prompt, or, left out, the
    scores ``kvsim.hf.decoding.prefill`` computes from the prompt it feeds (``kvsim.hf.reconstruction``).

    ``block_size``, ``shared_selection``, ``evict_every``: the serving layout (docs/serving.md, "The deployed
    cache under a layout"; ``kvsim.hf.layout``): the cache in physical blocks of ``block_size`` positions (the
    budget rounded down to whole blocks is the memory), one block table for a layer's KV heads under shared
    selection, decisions every ``evict_every`` steps, decided by the simulator's own layout code. The cache's
    ``notes`` say what the layout rounded or made a no-op; ``kvsim.hf.layout.memory(cache)`` its blocks.

    ``plan``: a run's plan (``kvsim.policykit.plan.Plan``, or the path of its JSON, e.g. ``kvsim replay ...
    --save-plan FILE`` or the app's download) in place of the policy, budget, parameters, ``allocate``, the
    compression and the layout, which are then not given here.

    ``tensor``: the tensor path (``kvsim.hf.tensor``: every row and KV head of a layer stepped at once as tensor
    operations on the model's device, an exact prompt ``chunk`` positions at a time, 512 or the model's context
    by default) where the policy declares a tensor step and the cache is plain (no layout, adakv or compressed
    prompt); ``None`` (the default) takes it wherever it can and says in the cache's ``notes``, once, when it
    cannot; ``True`` refuses (HFError) where it cannot; ``False`` runs the reference path (one Python policy per
    (row, KV head)), the authority the tensor path is held to."""
    from ..policykit.layouts import Layout, LayoutError

    chunk = _chunk(model, chunk, tensor)

    try:
        layout = Layout(block_size, shared_selection, evict_every)
    except (ParamError, LayoutError) as e:
        raise HFError(str(e)) from None
    if plan is not None:
        if not layout.plain:
            raise HFError("plan= gives the layout: give block_size, shared_selection and evict_every there, not here too")
        policy, budget, extra = _from_plan(plan, policy, budget, allocate, prefill, prefill_budget, params)
        layout, allocate, prefill_budget = extra.pop("layout"), extra.pop("allocate"), extra.pop("prefill_budget")
        prefill = extra.pop("prefill", prefill)
        prefill_policy, prefill_params = extra.pop("prefill_policy", prefill_policy), extra.pop("prefill_params", None)
        params = extra
    if policy is None:
        raise HFError("a policy is needed (or plan=)")
    scorer = _prefill_scorer(prefill, prefill_budget, prefill_policy, prefill_params, prefill_scores)
    if policy == GROW:
        specs = _grown(model, prefill, budget, windows, allocate, params)
    elif isinstance(allocate, str) and allocate == "adakv":
        from .pooled import PooledLayer

        if tensor:
            raise HFError("tensor=True: allocate='adakv' pools a layer's heads on the reference path")
        specs, pool, floors = _adakv(model, policy, budget, windows, by, params)
        attach(model)
        return EvictingCache([PooledLayer(row, pool, floor, prefill=prefill) for row, floor in zip(specs, floors, strict=True)],
                             progress=progress)
    elif not layout.plain:
        if tensor:
            raise HFError(f"tensor=True: a serving layout ({layout.label}) runs on the reference path")
        return _under_layout(model, layout, policy, budget, windows, by, allocate, prefill, seed, progress, params)
    else:
        specs = layer_specs(model, policy, budget, windows, by, allocate, **params)
    return _plain(model, specs, policy, scorer, prefill, prefill_budget, prefill_scores, seed, tensor, chunk, progress)


def _grown(model, prefill: str, budget, windows, allocate, params: dict) -> list[list[None]]:
    """The specs of policy ``"none"`` (the cache growing after a compressed prompt): no policy in any (layer, KV
    head); HFError when the prompt is not compressed or a budget, windows, allocate or parameters are given."""
    if prefill != "compress":
        raise HFError("policy 'none' (the cache growing) is for prefill='compress'")
    if budget is not None or windows is not None or allocate is not None or params:
        raise HFError("policy 'none' lets the cache grow after the prompt: it takes no budget, windows, allocate "
                      "or parameters")
    kinds, kv_heads, _ = model_layout(model)
    return [[None] * kv_heads for _ in kinds]


def _chunk(model, chunk, tensor) -> int:
    """``cache``'s ``chunk`` checked against the model's context (512 or the context when left out), and its
    ``tensor`` checked to be True, False or None; HFError names what is wrong."""
    context = _context(model)
    if chunk is None:
        chunk = CHUNK if context is None else min(CHUNK, context)
    elif isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise HFError(f"chunk must be an integer of at least 1, got {chunk!r}")
    elif context is not None and chunk > context:
        raise HFError(f"chunk {chunk} is above {type(model).__name__}'s context of {context} positions")
    if tensor not in (None, True, False):
        raise HFError(f"tensor must be True, False or None (where it can), got {tensor!r}")
    return int(chunk)


def _plain(model, specs, policy, scorer, prefill: str, prefill_budget, prefill_scores, seed, tensor, chunk: int,
           progress) -> EvictingCache:
    """The cache with no layout and no pool (``cache``'s last branch): the tensor path where ``tensor`` allows and
    every (layer, KV head) can take it, the reference path otherwise, saying why in its ``notes`` when
    ``tensor`` is None; a compressed prompt's ``prefill_scores`` given to each layer."""
    metas = layer_metas(model, [s for s in (None if policy == GROW else policy, scorer and scorer.name) if s])
    why = "prefill='compress' runs on the reference path" if prefill == "compress" else \
        refusal(specs, seed, prefill)
    if tensor and why is not None:
        raise HFError(f"tensor=True: {why}")
    attach(model)
    if tensor is not False and why is None:
        return EvictingCache([TensorLayer(row, prefill=prefill, meta=meta, chunk=chunk, rng_seed=seed)
                              for row, meta in zip(specs, metas, strict=True)], progress=progress)
    out = EvictingCache([EvictingLayer(row, prefill=prefill, rng_seed=seed, prefill_budget=prefill_budget,
                                       prefill_policy=scorer, meta=meta) for row, meta in zip(specs, metas, strict=True)],
                        progress=progress)
    if prefill_scores is not None:
        scores = np.asarray(prefill_scores)
        if scores.ndim != 4 or scores.shape[0] != len(out.layers):
            raise HFError(f"prefill_scores have shape {scores.shape}, expected (layers {len(out.layers)}, batch, KV heads, "
                          "prompt positions): reconstruction_scores(model, ids, tokenizer)")
        for layer, s in zip(out.layers, scores, strict=True):
            layer.prefill_scores = s
    if tensor is None:
        device = next(model.parameters()).device.type
        out.notes = [f"{why}: the reference path steps it, one (row, KV head) at a time in Python"
                     + (f", each step waiting for the {device} device" if device != "cpu" else "")]
    return out


def _prefill_scorer(prefill: str, prefill_budget, prefill_policy: str, prefill_params: dict | None, prefill_scores):
    """``cache``'s prompt mode checked with what goes with it: the compressed prompt's scorer (``_scorer``) under
    ``prefill="compress"``, None under the others, which take no ``prefill_budget``, ``prefill_params`` or
    ``prefill_scores``; HFError names what is wrong."""
    if prefill not in PREFILL:
        raise HFError(f"prefill must be one of {', '.join(PREFILL)}, got {prefill!r}")
    scorer = None
    if prefill == "compress":
        scorer = _scorer(prefill_budget, prefill_policy, prefill_params or {})
    elif prefill_budget is not None or prefill_params:
        raise HFError("prefill_budget and prefill_params go with prefill='compress'")
    if prefill_scores is not None and (scorer is None or not registry.needs_model(scorer.name)):
        raise HFError("prefill_scores are a model scorer's (prefill='compress', prefill_policy='reconstruction')")
    return scorer


def _context(model) -> int | None:
    """The most positions the model's config says it attends over (None when it does not say, or there is no
    model yet: the policy's own checks come first)."""
    if getattr(model, "config", None) is None:
        return None
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def _from_plan(plan, policy, budget, allocate, prefill, prefill_budget, params) -> tuple:
    """``cache``'s arguments from a plan: (policy, budget, the rest by keyword); HFError when a plan and the
    arguments it sets are both given, or the plan cannot be read."""
    from ..policykit.plan import GROW as PLAN_GROW
    from ..policykit.plan import Plan, PlanError

    if not isinstance(plan, Plan):
        try:
            plan = Plan.read(plan)
        except PlanError as e:
            raise HFError(f"plan: {e}") from None
    if policy is not None or budget is not None or allocate is not None or prefill_budget is not None or params:
        raise HFError("plan= gives the policy, budget, parameters, allocate and compression: give them there, not here too")
    from ..policykit.layouts import NONE

    spec, c = plan.policy, plan.compression
    extra = {"allocate": plan.allocate if plan.allocate is not None else plan.budgets, "prefill_budget": None,
             "layout": plan.layout or NONE}
    if c is not None:
        if prefill != "exact":
            raise HFError(f"plan= compresses the prompt; prefill={prefill!r} is another prompt mode")
        extra.update(prefill="compress", prefill_budget=c.keep, prefill_policy=c.policy, prefill_params=dict(c.params))
    if spec is None:
        return PLAN_GROW, None, extra
    return spec.name, spec.budget, {**extra, **dict(spec.params)}


def _under_layout(model, layout, policy: str, budget, windows, by: str, allocate, prefill: str, seed, progress,
                  params: dict) -> EvictingCache:
    """The cache under ``layout`` (``kvsim.hf.layout``), every check before any token: the layout against each
    head's policy and budget (``Layout.check``: a block larger than the budget, an interval that does not fit,
    an offline policy), and what it does not go with (an allocation, adakv, a compressed prompt)."""
    from .layout import LayoutLayer

    if allocate is not None:
        raise HFError(f"a serving layout ({layout.label}) holds every KV head at one budget in whole blocks; "
                      "allocate= is not taken with it")
    if prefill == "compress":
        raise HFError(f"a serving layout ({layout.label}) holds the cache while decoding; prefill='compress' "
                      "chooses each head's positions once, alone: use prefill='exact' or 'fast'")
    specs = layer_specs(model, policy, budget, windows, by, **params)
    kv_heads = len(specs[0])
    notes: list[str] = []
    for spec in dict.fromkeys(s for row in specs for s in row):
        try:
            found = layout.check(spec.name, spec.budget, spec.params, heads=kv_heads)
        except ValueError as e:
            raise HFError(f"{layout.label}: {' '.join(str(e).split())}") from None
        notes += [n for n in found if n not in notes]
    metas = layer_metas(model, [policy])
    attach(model)
    out = EvictingCache([LayoutLayer(row, layout, prefill=prefill, rng_seed=seed, meta=meta)
                         for row, meta in zip(specs, metas, strict=True)], progress=progress)
    out.notes = notes
    return out


def layer_metas(model, policies: list[str]) -> list[dict]:
    """Per decoder layer, the meta a recording of that layer states (``kvsim.policykit.rope.rope_meta``, the
    recorder's own call: the model's RoPE) when any of ``policies`` reads its trace's meta (``reads_meta``), else
    empty dicts. Each such policy's ``check_meta`` runs on every layer's now: a model whose RoPE it cannot follow
    is refused (HFError, one line naming the layer) before any token."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    n = cfg.num_hidden_layers
    readers = [POLICIES[name] for name in policies if registry.reads_meta(name)]
    if not readers:
        return [{} for _ in range(n)]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    metas = [rope_meta(model, layer, int(head_dim)) for layer in range(n)]
    for cls in readers:
        for layer, meta in enumerate(metas):
            try:
                cls.check_meta(meta, f"layer {layer}", int(head_dim))
            except ValueError as e:
                raise HFError(f"{cls.name} cannot run on {type(model).__name__}: {e}") from None
    return metas


def _adakv(model, policy: str, budget: int | None, windows, by: str, params: dict):
    """adakv's layers (``kvsim.hf.pooled``): each layer's specs at the share ``budget``, its pool (``budget x KV
    heads``) and each layer's floor (``kvsim.allocation.split.adakv_floor``); HFError, one line, before any token."""
    from ..allocation.deployed import adakv_refusal
    from ..allocation.split import adakv_floor

    kinds, kv_heads, _ = model_layout(model)
    why = adakv_refusal(policy, kv_heads, f"{type(model).__name__} has {len(kinds)} layers x 1 KV head")
    if why is not None:
        raise HFError(f"allocate=adakv: {why}")
    if budget is None:
        raise HFError(f"allocate=adakv pools budget x {kv_heads} KV heads in each layer; give the budget")
    specs = layer_specs(model, policy, budget, windows, by, **params)
    for x, row in enumerate(specs):
        if len({s.window for s in row}) != 1:
            raise HFError(f"allocate=adakv: layer {x}'s KV heads have recent_windows {[s.window for s in row]}; "
                          "a pool protects one window in all its heads (give windows per layer)")
    return specs, budget * kv_heads, [adakv_floor(row[0]) for row in specs]


def _scorer(keep, name: str, params: dict) -> PolicySpec:
    """The scorer's spec, checked as far as it can be before the prompt's length is known: ``keep``'s form (an
    integer from 1, a ratio in (0, 1)), a policy that can rank, its parameters, and an integer ``keep`` above
    the window it always keeps. HFError, one line, naming ``prefill_budget`` or ``prefill_policy``."""
    if keep is None:
        raise HFError("prefill='compress' needs prefill_budget: the positions each head keeps, or a ratio of the prompt")
    integer = isinstance(keep, (int, np.integer)) and not isinstance(keep, bool)
    try:  # a prompt as long as an integer keep (the smallest it fits), or a long one for a ratio
        return Prefill.of(max(int(keep), 2) if integer and keep >= 1 else 1 << 20, keep, name, **params).scorer
    except PrefillError as e:
        raise HFError(str(e)) from None


__all__ = ["ATTN", "EvictingCache", "EvictingLayer", "HFError", "LayerMeta", "WindowsError", "attach", "cache",
           "converse", "layer_metas", "layer_specs", "model_layout", "reconstruction_scores"]
