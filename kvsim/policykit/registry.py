"""The one registry of eviction policies. The CLI, the app, the views, the engine and the contract
tests all read it: every table of policies (the engine's kernels, the curve's styles, the scores'
names, the app's warm-up, the CLI's choices, the app's lists) is derived from the classes here, each of
which carries its own parameters, display and engine binding. ``register`` adds one more; nothing else
needs editing (docs/architecture.md, "Adding a policy").

What a policy can do beyond the interface (its window parameter, a score a serving layout can sum, a score
adakv can pool, the meta it reads, the future, a fast path, a tensor step) each class declares once
(``Capabilities``); the queries below (``capabilities``, ``window_param``, ``layout_ready``, ``can_pool``,
``reads_meta``, ``is_offline``, ``is_optimum``, ``has_engine``, ``tensor_step``, ``needs_model``) are how every other
package asks, and ``missing`` is the one line that refuses a run needing what a policy lacks. A prompt scorer that
needs the model (``needs_model``: KVzip's context reconstruction) is registered apart (``register_scorer``,
``SCORERS``): it is a deployed cache's ``prefill_policy`` only, in no list of decode-time policies.

``tunables`` lists each policy's integer parameters with their defaults and bounds, which is what
the CLI's flags and the app's controls are made from; ``kvsim.policykit.spec`` validates a choice of
them once (``PolicySpec``) and builds the policy from it (``make_policy``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import re
import sys
from pathlib import Path

from .base import Capabilities, Display, EngineBinding, Param, Policy

#: every registered policy by name, in the order the lists show them (``Policy.order``, then load order);
#: filled by ``load_policies``, which ``kvsim.policies`` runs once on import
POLICIES: dict[str, type[Policy]] = {}

#: the prompt scorers that need the model itself (``needs_model``: their scores come from a pass of the model, as
#: KVzip's context reconstruction): registered by ``register_scorer``, kept out of ``POLICIES`` so that no list of
#: decode-time policies (the CLI's ``--policy``, the app, ``table``) offers them; ``policy_class`` finds them
SCORERS: dict[str, type[Policy]] = {}

#: the entry-point group an installed package declares its policy modules in (``[project.entry-points."kvsim.policies"]``)
ENTRY_POINT_GROUP = "kvsim.policies"
#: comma-separated module names or ``.py`` paths, imported after the shipped policies and the entry points
PLUGIN_ENV = "KVSIM_PLUGINS"
#: the package whose every module is a policy (its support is this package, kvsim.policykit)
POLICY_PACKAGE = "kvsim.policies"
#: one line per plugin (or policy module) that failed to load, as said on stderr; the app shows them too
PROBLEMS: list[str] = []
_loaded = False


_NAME = re.compile(r"[a-z][a-z0-9_]*")


def register(cls: type[Policy]) -> type[Policy]:
    """Add a policy class to the registry (usable as a class decorator): from then on the CLI's
    ``--policy`` choices, the app's lists, the curve's styles and the engine (its kernel when it
    declares ``engine_binding``, the reference harness otherwise) all know it. A ``ValueError`` names
    what is wrong: not a ``Policy``, a name that is no lower-case identifier or is taken by another
    class, a ``display`` or ``engine_binding`` of the wrong type."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"register: {cls!r} is not a subclass of kvsim.policies.Policy")
    name = cls.name
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"register: {cls.__name__}.name {name!r} is not a lower-case identifier (the CLI's --policy value)")
    if POLICIES.get(name, cls) is not cls:
        raise ValueError(f"register: the name {name!r} is taken by {POLICIES[name].__module__}.{POLICIES[name].__name__}")
    if name in SCORERS:
        raise ValueError(f"register: the name {name!r} is taken by the prompt scorer {SCORERS[name].__module__}.{SCORERS[name].__name__}")
    if cls.needs_model is True:
        raise ValueError(f"register: {cls.__name__} declares needs_model (its scores come from a pass of the model): "
                         "register it with register_scorer; no decode-time list can run it")
    for field, kind in (("display", Display), ("engine_binding", EngineBinding)):
        value = getattr(cls, field)
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"register: {cls.__name__}.{field} must be a {kind.__name__} or None, got {value!r}")
    if cls.display is not None:
        colour = cls.display.colour.lower()
        other = next((n for n, c in POLICIES.items() if n != name and c.display is not None
                      and c.display.colour.lower() == colour), None)
        if other is not None:
            raise ValueError(f"register: {cls.__name__}.display's colour {cls.display.colour} is {other}'s; "
                             "give it a colour no other policy has")
    _check_capabilities(cls)
    POLICIES[name] = cls
    return cls


def register_scorer(cls: type[Policy]) -> type[Policy]:
    """Add a prompt scorer that needs the model (``needs_model``, usable as a class decorator) to ``SCORERS``: a
    ``prefill_policy`` of the deployed cache (``kvsim.hf``) and ``kvsim needle``, never a decode-time policy. A
    ``ValueError`` names what is wrong, as ``register``'s does."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"register_scorer: {cls!r} is not a subclass of kvsim.policies.Policy")
    name = cls.name
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"register_scorer: {cls.__name__}.name {name!r} is not a lower-case identifier")
    taken = POLICIES.get(name) or SCORERS.get(name, cls)
    if taken is not cls:
        raise ValueError(f"register_scorer: the name {name!r} is taken by {taken.__module__}.{taken.__name__}")
    if cls.needs_model is not True:
        raise ValueError(f"register_scorer: {cls.__name__} does not declare needs_model; a scorer that runs on a trace "
                         "is a policy: register it with register")
    if cls.needs_trace or cls.layout_score or cls.pools_heads or cls.engine_binding is not None or cls.tensor_step is not None:
        raise ValueError(f"register_scorer: {cls.__name__} declares a decode-time capability (needs_trace, layout_score, "
                         "pools_heads, engine_binding, tensor_step); a prompt scorer that needs the model has none")
    _check_capabilities(cls)
    SCORERS[name] = cls
    return cls


def _check_capabilities(cls: type[Policy]) -> None:
    """Each capability the class declares, held to the code that backs it (one line naming what is wrong)."""
    for field in ("layout_score", "pools_heads", "reads_meta", "needs_trace", "optimum", "needs_model"):
        if not isinstance(getattr(cls, field), bool):
            raise ValueError(f"register: {cls.__name__}.{field} must be True or False, got {getattr(cls, field)!r}")
    window = cls.window
    if window is not None and window not in {p.name for p in cls.tunables}:
        raise ValueError(f"register: {cls.__name__}.window {window!r} is none of its tunables")
    if cls.layout_score:
        for method in ("layout_priorities", "layout_drop"):
            if getattr(cls, method) is getattr(Policy, method):
                raise ValueError(f"register: {cls.__name__} declares layout_score but defines no {method}()")
    if cls.pools_heads and window is None:
        raise ValueError(f"register: {cls.__name__} declares pools_heads, which protects its window in every head: "
                         "declare window")
    if cls.optimum and not cls.needs_trace:
        raise ValueError(f"register: {cls.__name__} declares optimum, which is offline (needs_trace)")
    _check_walk(cls)


def _check_walk(cls: type[Policy]) -> None:
    """A tensor step's ``walk``: (slot name, engine state index[, "position"]) entries or a ``WalkMap`` of two functions,
    with an engine binding (one that names its hooks by a ``"module:name"`` path is not walked: ``walks_prompt`` takes
    ``SlotHooks`` only)."""
    from .tensor_hooks import TensorHooks, WalkMap

    walk = cls.tensor_step.walk if isinstance(cls.tensor_step, TensorHooks) else None
    if walk is None:
        return
    if cls.engine_binding is None:
        raise ValueError(f"register: {cls.__name__}.tensor_step declares walk, which steps its engine hooks: give it "
                         "an engine_binding")
    if cls.reads and cls.tensor_step.walk_rows is None:
        raise ValueError(f"register: {cls.__name__}.tensor_step declares walk, and {cls.name} reads "
                         f"{', '.join(cls.reads)}: give it walk_rows, which puts a call's rows into the engine's state")
    if isinstance(walk, WalkMap):
        if not (callable(walk.read) and callable(walk.write)):
            raise ValueError(f"register: {cls.__name__}.tensor_step.walk: a WalkMap's read and write must be functions")
        return
    if not isinstance(walk, tuple) or not all(isinstance(entry, tuple) and len(entry) in (2, 3) and isinstance(entry[0], str)
               and isinstance(entry[1], int) and entry[2:] in ((), ("position",)) for entry in walk):
        raise ValueError(f"register: {cls.__name__}.tensor_step.walk must be (slot name, engine state index) pairs, "
                         f"each with \"position\" after them where the engine's array is indexed by position, got {walk!r}")


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name``: a policy, else a prompt scorer that needs the model (``SCORERS``)."""
    try:
        return POLICIES[name] if name in POLICIES else SCORERS[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}{suggest(name)}; known: {', '.join(POLICIES)}") from None


def tunables(name: str) -> tuple[Param, ...]:
    """A policy's tunable parameters beyond budget (name, default, bounds, help)."""
    return policy_class(name).tunables


def policy_params(name: str) -> dict[str, int]:
    """The parameters a policy accepts beyond budget, with their defaults."""
    return {p.name: p.default for p in tunables(name)}


def all_tunables() -> dict[str, Param]:
    """Every tunable parameter of any registered policy, by name (the first declaration seen)."""
    out: dict[str, Param] = {}
    for cls in POLICIES.values():
        for p in cls.tunables:
            out.setdefault(p.name, p)
    return out


# --- what each policy can do: one query per capability, read off its declaration (``Capabilities``) ----------


def capabilities(name: str) -> Capabilities:
    """What policy ``name`` declares it can do (ValueError for an unknown name)."""
    cls = policy_class(name)
    return Capabilities(window=cls.window, layout_score=cls.layout_score, pools_heads=cls.pools_heads,
                        reads_meta=cls.reads_meta, offline=cls.needs_trace, optimum=cls.optimum,
                        engine=cls.engine_binding is not None, tensor=cls.tensor_step is not None,
                        needs_model=cls.needs_model, walks=walks_prompt(name) is not None)


def window_param(name: str) -> str | None:
    """The parameter policy ``name``'s recent_window curve sweeps (``"recent_window"``), None when it has none."""
    return policy_class(name).window


def layout_ready(name: str) -> bool:
    """Whether a serving layout (blocks, shared selection, intervals) can sum ``name``'s scores."""
    return policy_class(name).layout_score


def can_pool(name: str) -> bool:
    """Whether adakv can pool a layer's KV heads by ``name``'s score."""
    return policy_class(name).pools_heads


def reads_meta(name: str) -> bool:
    """Whether ``name`` reads constants of its trace's meta (built with ``trace=``; its ``check_meta`` runs)."""
    return policy_class(name).reads_meta


def is_offline(name: str) -> bool:
    """Whether ``name`` is an offline reference (it reads the whole trace, future rows included)."""
    return policy_class(name).needs_trace


def is_optimum(name: str) -> bool:
    """Whether ``name`` is the exact optimum (solved in one pass; under blocks, the block optimum)."""
    return policy_class(name).optimum


def has_engine(name: str) -> bool:
    """Whether the fast engine replays ``name`` (it declares an ``engine_binding``)."""
    return policy_class(name).engine_binding is not None


def tensor_step(name: str):
    """``name``'s tensor step (``kvsim.policykit.tensor_hooks.TensorHooks``), None when the deployed cache steps it
    on the reference path."""
    return policy_class(name).tensor_step


def walks_prompt(name: str):
    """How ``name``'s engine hooks walk a deployed prompt on a CPU (``kvsim.hf.walk``): its tensor step's ``walk``
    (which engine state array each tensor slot is, or a ``WalkMap``), or None where its tensor step declares none or its engine binding
    gives no ``SlotHooks`` to walk with (``register`` refuses a walk without an engine binding)."""
    from .slot_hooks import SlotHooks
    from .tensor_hooks import TensorHooks

    cls = policy_class(name)
    walk = cls.tensor_step.walk if isinstance(cls.tensor_step, TensorHooks) else None
    binding = cls.engine_binding
    return walk if walk is not None and binding is not None and isinstance(binding.kernel, SlotHooks) else None


def needs_model(name: str) -> bool:
    """Whether ``name`` is a prompt scorer whose scores a pass of the model computes (not a trace's rows)."""
    return policy_class(name).needs_model


def keeps_scores(name: str) -> bool:
    """Whether ``name`` keeps a score per held position (the app's cumulative-score view draws it)."""
    return policy_class(name).keeps_scores


def score_keepers() -> list[str]:
    """The policies that keep a score per held position (``keeps_scores``), in registration order."""
    return [n for n, cls in POLICIES.items() if cls.keeps_scores]


def display_of(name: str) -> Display | None:
    """How the views draw ``name`` (its declared ``display``); None for one that declares none, or for a name no
    policy is registered under (a bound's line, a plugin that was skipped)."""
    cls = POLICIES.get(name)
    return None if cls is None else cls.display


def model_scorers() -> list[str]:
    """The prompt scorers that need the model (``SCORERS``), in registration order."""
    return list(SCORERS)


def missing(name: str, capability: str, what: str) -> str:
    """The one line that refuses ``what`` (a layout, a pool, a split, a deployment) for ``name``, which lacks
    ``capability`` (a field of ``Capabilities``)."""
    return f"{name} declares {Capabilities.MISSING[capability]}: {what} cannot run it"


def windowed(names=None) -> list[str]:
    """Of ``names`` (default: every policy), those with a window parameter (a recent_window curve)."""
    return [n for n in (POLICIES if names is None else names) if POLICIES[n].window is not None]


def poolers() -> list[str]:
    """The policies adakv can pool a layer's KV heads under (``pools_heads``)."""
    return [n for n, cls in POLICIES.items() if cls.pools_heads]


def optimum() -> str | None:
    """The registered exact optimum's name (``optimal``), None when none is registered."""
    return next((n for n, cls in POLICIES.items() if cls.optimum), None)


def _report(source: str, error: BaseException) -> None:
    text = " ".join(str(error).split()) or type(error).__name__
    line = f"kvsim: {source}: {text if isinstance(error, ValueError) else f'{type(error).__name__}: {text}'}; skipped"
    PROBLEMS.append(line)
    print(line, file=sys.stderr)


def _import_path(path: Path):
    """A ``.py`` file as a module of its own (``kvsim_plugin_<stem>``), once per resolved path."""
    name = "kvsim_plugin_" + re.sub(r"\W", "_", path.stem)
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _load(source: str, do) -> None:
    try:
        do()
    except Exception as e:  # a broken plugin is one line; the shipped policies and the other plugins still work
        _report(source, e)


def plugin_sources(value: str | None = None) -> list[str]:
    """The items of ``KVSIM_PLUGINS`` (or ``value``): module names or ``.py`` paths, blanks dropped."""
    value = os.environ.get(PLUGIN_ENV, "") if value is None else value
    return [item.strip() for item in value.split(",") if item.strip()]


def load_plugin(item: str) -> None:
    """One ``KVSIM_PLUGINS`` item: a ``.py`` path (imported as a module of its own) or a module name."""
    if item.endswith(".py") or os.sep in item or "/" in item:
        path = Path(item).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no such file {item}")
        _import_path(path)
    else:
        importlib.import_module(item)


def _declares_entry_points() -> bool:
    """Whether any installed distribution's ``entry_points.txt`` has a ``[kvsim.policies]`` section."""
    header = f"[{ENTRY_POINT_GROUP}]"
    for entry in sys.path:
        try:
            listing = os.scandir(entry or ".")
        except OSError:
            continue
        with listing:
            for item in listing:
                if item.name.endswith((".dist-info", ".egg-info")):
                    try:
                        with open(os.path.join(item.path, "entry_points.txt"), encoding="utf-8") as f:
                            if header in f.read():
                                return True
                    except OSError:
                        continue
    return False


def load_policies() -> None:
    """Register every policy, once per process: each module of ``kvsim.policies`` (none is listed anywhere: a
    module saved there is found), then the entry points of group ``kvsim.policies`` of every installed
    distribution, then ``KVSIM_PLUGINS``. A module that fails to import, or registers a taken name, is
    one line on stderr (and in ``PROBLEMS``) naming it and the problem; the rest load."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    package = Path(__file__).parent.parent / POLICY_PACKAGE.rpartition(".")[2]
    for info in sorted(pkgutil.iter_modules([str(package)]), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        _load(f"kvsim/policies/{info.name}.py", lambda n=info.name: importlib.import_module(f"{POLICY_PACKAGE}.{n}"))
    if _declares_entry_points():  # importlib.metadata reads every distribution (~60 ms): only when one declares the group
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            _load(f"entry point {ep.name} = {ep.value} ({ENTRY_POINT_GROUP})", ep.load)
    for item in plugin_sources():
        _load(f"{PLUGIN_ENV} {item}", lambda item=item: load_plugin(item))
    _sort()


def _sort() -> None:
    ordered = sorted(POLICIES.values(), key=lambda cls: cls.order)  # stable: equal orders keep load order
    POLICIES.clear()
    POLICIES.update((cls.name, cls) for cls in ordered)


# --- the lists, derived from what each policy declares ------------------------------------------------


def online() -> list[str]:
    """The policies a serving stack could run: they read nothing of the future (``needs_trace`` False)."""
    return [n for n, cls in POLICIES.items() if not cls.needs_trace]


def offline() -> list[str]:
    """The offline references: they read the whole trace, future rows included."""
    return [n for n, cls in POLICIES.items() if cls.needs_trace]


def compared() -> list[str]:
    """The online policies a study compares on attention alone: deterministic, reading no member of the
    trace beyond attention (keys, values, queries and output norms are the scorers' studies)."""
    return [n for n in online() if POLICIES[n].deterministic and not POLICIES[n].reads]


def baselines() -> list[str]:
    """The recency baselines measured beside a tuned policy: compared policies that never read attention."""
    return [n for n in compared() if not POLICIES[n].reads_attention]


def taking(param: str, names: list[str] | None = None) -> list[str]:
    """Of ``names`` (default: every policy), those with the tunable ``param``."""
    return [n for n in (POLICIES if names is None else names) if any(p.name == param for p in POLICIES[n].tunables)]


def suggest(name: str, names=None) -> str:
    """`` (did you mean 'h2o'?)`` for a near miss of a registry name, else ``""``."""
    import difflib

    close = difflib.get_close_matches(name, list(POLICIES if names is None else names), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def study_sweeps() -> list[str]:
    """The proxy study's window sweeps: the compared policies with a window parameter (``recent_window``)."""
    return windowed([n for n in compared() if not POLICIES[n].fitted])


def study_fixed() -> list[str]:
    """The proxy study's policies at their defaults in every cell: the compared ones without a ``recent_window``."""
    return [n for n in compared() if n not in study_sweeps() and not POLICIES[n].fitted]
