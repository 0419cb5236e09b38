"""The command line's grammar: one sub-parser per command, the policies' parameters as flags.

Policy parameters become flags (``recent_window`` -> ``--recent-window``) from the registry itself, so
a policy that joins the registry gets its flags for free.

A command's process builds its own sub-parser alone (``build_parser(command)``), and each command's
flags import the constants their help names only when that command's sub-parser is built: a replay
compiles none of the analyses that ``table`` or ``tune`` name in their flags (no bytecode is kept on the
project's machines, so every module a process imports is compiled from source; issue 36).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from ..data.catalog import available_bundles, available_traces
from ..policies import DEFAULT_BUDGET, POLICIES, all_tunables, policy_params
from ..policykit.registry import suggest, windowed
from ..sim.harness import DEFAULT_TOP_K
from .argtypes import positive_int, size_list
from .cluster_flags import add_cluster_flags
from .conversation_command import add_flag as add_conversation_flag
from .conversation_command import add_prefill_flags as add_conversation_prefill_flags
from .errors import BAD_INPUT, USAGE, CLIError, flag
from .layout_flags import add as add_layout_flags
from .plan_flags import add_plan_flags

PROG = "kvsim"

EPILOG = f"""\
output: --json prints exactly one JSON document on stdout and nothing else; without it the same
figures print as aligned tables. On a terminal, a step that takes more than a couple of seconds
reports its progress on stderr.

exit status:
  0  done
  {USAGE}  the command line is wrong: an unknown command or flag, a value out of its bounds
     (--recent-window 32 must be below --budget 16), flags that do not go together; bare `kvsim`
  {BAD_INPUT}  the command line is fine but what it names is not: a trace, bundle, text, model, prompt or
     tune file that is missing, malformed or too short, an output that cannot be written;
     `kvsim bench --check`: a target was missed
Every error is one line on stderr, `kvsim: error: ...`, never a traceback; a missing input names
its flag first: `kvsim: error: --prompt-file: /nope.txt: no such file`.

`kvsim COMMAND --help` lists a command's flags; `kvsim policies` lists the policies."""


class _Unhyphenated:
    """A flag's help wrapped at spaces only: ``--prefill-budget`` is never cut after its hyphen."""

    def _split_lines(self, text, width):
        import textwrap

        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
    """argparse prints the usage block and the error on several lines; the contract is one line."""

    def __init__(self, *args, formatter_class=argparse.HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=type(formatter_class.__name__, (_Unhyphenated, formatter_class), {}),
                         **kwargs)

    def error(self, message: str):
        raise CLIError(message)

    def _check_value(self, action, value):
        """A value outside a flag's choices (a policy's name, a command's) is said with the nearest choice
        (``--policy h20``: did you mean 'h2o'?), on the same one line argparse's own message takes."""
        if action.choices is not None and value not in action.choices:
            names = [str(c) for c in action.choices]
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{suggest(str(value), names)}; "
                                                 f"choose from {', '.join(map(repr, names))}")


def parse_range(flag: str, text: str) -> list[int]:
    """``A:B[:STEP]`` (inclusive) or a single integer, into the list of values."""
    parts = text.split(":")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise CLIError(f"{flag}: expected an integer or A:B[:STEP], got {text!r}") from None
    if len(nums) == 1:
        return nums
    if len(nums) > 3:
        raise CLIError(f"{flag}: expected A:B[:STEP], got {text!r}")
    start, stop, step = nums[0], nums[1], nums[2] if len(nums) == 3 else 1
    if step < 1:
        raise CLIError(f"{flag}: STEP must be at least 1, got {step}")
    if stop < start:
        raise CLIError(f"{flag}: range {text!r} is empty (B < A)")
    return list(range(start, stop + 1, step))


def trace_help() -> str:
    traces, bundles = available_traces()[1:], available_bundles()
    return (f"canonical, a shipped trace ({', '.join(traces) or 'none here'}), a path to an .npz, or one trace of a "
            f"bundle as BUNDLE:L05 or BUNDLE:L05H1 (shipped bundles: {', '.join(bundles) or 'none here'})")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's grammar: every command's sub-parser, or with ``command`` (one of ``COMMANDS``)
    that command's alone, which parses its command line exactly as the whole grammar does."""
    parser = _Parser(prog=PROG, description="Replay attention traces through KV-cache eviction policies.",
                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    traces = functools.cache(trace_help)  # the help of every --trace: the shipped traces listed once
    for name, add in _ADD.items():
        if command is None or name == command:
            add(sub, traces)
    return parser


def _json(p: argparse.ArgumentParser, what: str = "one JSON document") -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} on stdout and nothing else")


def _common(p: argparse.ArgumentParser, traces: str, budget_default: int | None, budget_type=int) -> None:
    p.add_argument("--trace", default="canonical", help=f"{traces} (default: canonical)")
    if budget_default is not None:
        swept = ", or a range A:B[:STEP] to sweep" if budget_type is str else ""
        p.add_argument("--budget", type=budget_type, default=None, metavar="B",
                       help=f"cache budget (default: {budget_default}){swept}")
    p.add_argument("--top-k", type=positive_int, default=DEFAULT_TOP_K, help=f"k of top-k recall (default: {DEFAULT_TOP_K})")
    _json(p)


def _policy_flags(p: argparse.ArgumentParser, ranges: bool) -> None:
    # "none" is kvsim.sim.prefill.GROW, named here so that --help imports none of the simulator
    p.add_argument("--policy", choices=[*POLICIES, "none"], metavar="NAME", help="a registry policy (`kvsim policies` "
                   "lists them) or none (with --prefill-budget: the cache grows after the prompt); required unless "
                   "--plan gives it")
    for param, spec in all_tunables().items():
        owners = ", ".join(n for n, cls in POLICIES.items() if spec in cls.tunables)
        p.add_argument(flag(param), dest=f"param_{param}", type=str if ranges else int, default=None,
                       metavar="A:B[:STEP]" if ranges else "N", help=f"{spec.help} (default {spec.default}; {owners})")


def _prefill_flags(p: argparse.ArgumentParser, *, ranges: bool = False) -> None:
    """The three flags, on replay, sweep (``ranges``: --prefill-budget may be the swept range) and table."""
    swept = " or, swept, A:B[:STEP] or a comma-separated list (0.25,0.5,0.75)" if ranges else ""
    p.add_argument("--prefill-budget", default=None, metavar="N|RATIO", help="compress at the prompt's end: each head "
                   "keeps N of the prompt's positions, or a ratio in (0, 1) of them (kvpress's compression_ratio is the "
                   f"share evicted: its 0.25 is 0.75 here){swept}; then --policy decodes from that kept set at --budget, "
                   "or --policy none lets the cache grow (docs/scorers.md, prefill compression)")
    p.add_argument("--prompt-length", type=positive_int, default=None, metavar="P", help="with --prefill-budget: "
                   "positions 0 .. P - 1 are the prompt (default: the trace's meta prompt_length)")
    from ..policykit import registry
    from ..sim.prefill import DEFAULT_SCORER, rankers  # only where the command takes these flags

    p.add_argument("--prefill-policy", default=DEFAULT_SCORER, metavar="NAME[:K=V,...]", help="with --prefill-budget: "
                   f"the policy whose score chooses once (default: {DEFAULT_SCORER}, at its defaults; any online policy: "
                   f"{', '.join(rankers())}), e.g. snapkv:recent_window=8,observation_window=16; a trace has no model "
                   f"for {', '.join(registry.model_scorers())} (kvsim needle runs it)")


def _add_replay(sub, traces) -> None:
    p = sub.add_parser("replay", help="replay one policy; mean retained mass and top-k recall")
    _common(p, traces(), DEFAULT_BUDGET)
    _policy_flags(p, ranges=False)
    _proxies_flag(p)
    _allocate_flag(p)
    _prefill_flags(p)
    add_plan_flags(p, "replay")
    add_layout_flags(p)


def _add_sweep(sub, traces) -> None:
    p = sub.add_parser("sweep", help="one replay per value of a parameter given as A:B[:STEP] (inclusive)")
    _common(p, traces(), DEFAULT_BUDGET, budget_type=str)
    _policy_flags(p, ranges=True)
    _proxies_flag(p)
    _allocate_flag(p)
    _prefill_flags(p, ranges=True)
    add_plan_flags(p, "sweep")
    add_layout_flags(p)


#: kvsim.allocation.allocators.ALLOCATORS, named here so that --help imports none of the simulator
ALLOCATOR_NAMES = "uniform, pyramidkv, cake, adakv, duo, optimal"


def _allocate_flag(p) -> None:
    p.add_argument("--allocate", default=None, metavar="NAME|FILE", help=f"on a bundle (--trace): split its memory "
                   f"(--budget x layers x KV heads positions) over its layers and KV heads by an allocator "
                   f"({ALLOCATOR_NAMES}) or as a JSON file's 'allocation' rows (layer, kv_head, budget) give it; the "
                   "bundle's mean retained mass beside each layer's (docs/allocation.md)")


def _proxies_flag(p) -> None:
    p.add_argument("--proxies", action="store_true", help="add the value-aware proxies (value_mass, output_error, "
                   "output_shift: docs/proxies.md) from each replay's kept sets; a trace without values says so and "
                   "has none (needs the dense rows: up to 8192 steps for a query/key trace)")


def _add_describe(sub, traces) -> None:
    from ..analysis.metrics import DEFAULT_BAND

    p = sub.add_parser("describe", help="statistics of the trace alone: sinks, recency band, concentration")
    _common(p, traces(), None)
    p.add_argument("--band", type=positive_int, default=DEFAULT_BAND, help=f"recency band width (default: {DEFAULT_BAND})")


def _add_export(sub, traces) -> None:
    p = sub.add_parser("export", help="write a trace in the interchange .npz format (float32)")
    p.add_argument("--trace", default="canonical", help=f"{traces()} (default: canonical)")
    p.add_argument("--out", required=True, help="path of the .npz to write")
    _json(p)


def _add_table(sub, traces) -> None:
    from ..analysis.table import TABLE_BUDGET

    p = sub.add_parser("table", help="the policy cards' comparison and the calibration targets")
    _common(p, traces(), TABLE_BUDGET)
    p.add_argument("--wide", action="store_true", help="every table's columns side by side, one line per row, however "
                   "wide (on a terminal the text is fitted to its width; in a file or a pipe it is always wide)")
    _proxies_flag(p)
    _allocate_flag(p)
    _prefill_flags(p)
    add_plan_flags(p, "table")
    add_layout_flags(p)


def _add_claims(sub, traces) -> None:
    p = sub.add_parser("claims", help="every checkable claim of the two policy cards, measured, with its verdict")
    p.add_argument("--trace", default="canonical", help=f"{traces()}, or all (canonical and every shipped "
                   "trace) (default: canonical)")
    _json(p, "one JSON document (a list of claim records)")


BENCH_EPILOG = """\
Each target is reported PASS or FAIL, then "overall: PASS" or "overall: FAIL (N of M ... missed)";
--json carries the same as "result" (and each target's or step's verdict).

exit status:
  0  done: the figures are printed, whatever the verdict (without --check, a missed target is a
     report)
  1  with --check: at least one target was missed (overall: FAIL); also a trace or output that
     cannot be used
  2  the command line is wrong"""


def _add_bench(sub, traces) -> None:
    p = sub.add_parser("bench", help="time the reference path against the fast engine on the canonical trace",
                       epilog=BENCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit with status 1 when any target is missed, so a "
                   "script can use the verdict (default: exit 0 and only report)")
    p.add_argument("--full-reference", action="store_true", help="replay all 255 windows on the reference path "
                   "(about a minute and a half) instead of extrapolating from 16")
    p.add_argument("--browser", action="store_true", help="instead: drive the app in headless Chromium through "
                   "its timed steps and an eight-session load, each step's median and worst against its target")
    p.add_argument("--load", type=size_list, default=None, metavar="N[,N...]", help="instead: N students at once "
                   "run a lesson against a real server (Streamlit's websocket protocol, no browser), e.g. 1,8,30")
    p.add_argument("--profile", type=Path, default=None, metavar="FILE", help="with --load: sample the last class's "
                   "server (every thread's stack) during the lesson, write the collapsed stacks to FILE, print a summary")
    p.add_argument("--serve", type=positive_int, default=None, metavar="K", help="with --load: the class through "
                   "kvsim serve --processes K (nginx in front of K Streamlit processes, each warmed by one lesson) instead "
                   "of one plain Streamlit process")
    p.add_argument("--truth", action="store_true", help="instead: what the truth costs (needs the record extra): "
                   "Gemma-3-270M open loop at 1024 steps, one configuration and a 16-window sweep")
    p.add_argument("--rounds", type=positive_int, default=3, help="with --browser: rounds, each on a fresh server; with "
                   "--deploy: prompts timed per cache, the median kept (default: 3)")
    p.add_argument("--sessions", type=positive_int, default=8, help="with --browser: concurrent sessions of the load (default: 8)")
    p.add_argument("--no-load", action="store_true", help="with --browser: skip the concurrent sessions")
    p.add_argument("--only-load", action="store_true", help="with --browser: only the concurrent sessions")
    p.add_argument("--cold-cache", action="store_true", help="with --browser: every server gets a fresh, empty "
                   "KVSIM_CACHE_DIR (the canonical trace is generated again, as on a machine that never ran it)")
    p.add_argument("--generate", action="store_true", help="instead: decode with Gemma-3-270M on one CPU thread, "
                   "transformers' full cache against kvsim.hf's at budgets 256 and 1024 (h2o, streaming_llm); long "
                   "(about an hour at the default lengths)")
    p.add_argument("--lengths", type=str, default=None, metavar="L[,L...]", help="with --generate or --deploy: "
                   "context lengths (default: 2048,4096,8192; --deploy: 1024,8000)")
    p.add_argument("--deploy", action="store_true", help="instead: the deployed cache (tensor path, and the "
                   "reference path up to 1024 tokens) against transformers' full cache under sdpa, one thread: "
                   "prefill, decode, bytes (Gemma-3-270M; SmolLM2-135M with its wheel)")
    p.add_argument("--decode", type=positive_int, default=None, metavar="G", help="with --generate: tokens decoded "
                   "after each prompt of L - G (default: 256)")
    p.add_argument("--prefill", choices=["exact", "fast"], default="exact", help="with --generate: how kvsim's cache "
                   "takes the prompt (default: exact)")
    p.add_argument("--long", action="store_true", help="instead: query/key traces at length (4k-32k steps): h2o replays "
                   "at budget 1024, a 64-window sweep, tune of the whole bundle serial and on Dask, storage")
    p.add_argument("--trace", help="with --long: a bundle of query/key traces (default: the shipped one of 32768 steps)")
    p.add_argument("--no-tune", action="store_true", help="with --long: skip tuning the whole bundle")
    p.add_argument("--study", action="store_true", help="with --long: instead, what length changes: the best window and "
                   "sink share of the global layers at 1k-32k steps, and whether the per-layer windows of 1024 steps hold")
    _json(p)


def _add_tune(sub, traces) -> None:
    from ..analysis.tune import BEST_PROXY as TUNE_BEST_PROXY
    from ..analysis.tune import BY as TUNE_BY
    from ..analysis.tune import DEFAULT_BY as TUNE_DEFAULT_BY

    tunable = windowed()
    p = sub.add_parser("tune", help="the recent_window to deploy on a recorded model, one recommendation by --by's "
                       "rule, beside each layer's and KV head's window by retained mass")
    p.add_argument("--trace", required=True, help="a bundle (a shipped bundle's name or a folder with a manifest.json), "
                   f"or any one trace ({traces()})")
    p.add_argument("--policy", default="h2o", choices=tunable, metavar="NAME", help="a policy with a recent_window: "
                   f"{', '.join(tunable)} (default: h2o)")
    p.add_argument("--budget", type=positive_int, default=DEFAULT_BUDGET, metavar="B", help=f"cache budget (default: {DEFAULT_BUDGET}); "
                   "recent_window is swept over 1 .. budget - 1")
    p.add_argument("--top-k", type=positive_int, default=DEFAULT_TOP_K, help=f"k of top-k recall (default: {DEFAULT_TOP_K})")
    p.add_argument("--tolerance", type=float, default=0.005, help="retained mass's rule: the smallest window within "
                   "this much of the best retained mass (default: 0.005)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--serial", action="store_true", help="sweep here, one trace after another (the default "
                       "when Dask is not installed)")
    where.add_argument("--scheduler", default=None, metavar="ADDRESS", help="the address of a running Dask "
                       "scheduler (tcp://host:8786); default: local Dask processes on every core")
    p.add_argument("--workers", type=positive_int, default=None, help="local Dask worker processes (default: one "
                   "per core)")
    p.add_argument("--curves", action="store_true", help="with --json, add every trace's curve over the windows")
    p.add_argument("--by", default=TUNE_DEFAULT_BY, choices=list(TUNE_BY), metavar="FIGURE", help="the rule of the "
                   "run's one recommendation, the window for the whole model (model_window): the truth (kl, delta_nll: "
                   "measured by the model, open loop, cached; needs the record extra) or a proxy ("
                   f"{', '.join(b for b in TUNE_BY if b not in ('auto', 'kl', 'delta_nll'))}). Default: auto, the truth "
                   f"(kl) when the recording's model and text are at hand, else {TUNE_BEST_PROXY}, the proxy study's best "
                   "(docs/proxies.md)")
    p.add_argument("--model", default=None, help="with --by kl/delta_nll/auto: the model (gemma3-270m, smollm2-135m or a "
                   "local folder; default: the one the recording names)")
    p.add_argument("--text", default=None, help="with --by kl/delta_nll/auto: the text file (default: the one the recording "
                   "names, found by its sha256)")
    p.add_argument("--no-cache", action="store_true", help="with --by kl/delta_nll/auto: measure again instead of reading "
                   "cached results")
    p.add_argument("--per-layer", action="store_true", help="deploy a window per layer (the tune file's deploy rows): "
                   "by the truth, searched from model_window over the model's groups of layers (its runs of sliding and "
                   "global layers, at most 6), each tried a budget/8 step down and up and moved only when the model's "
                   "KL falls: at most 1 + 2 x 6 open-loop measurements of the whole model, each cached; by "
                   "retained_mass, each layer's window by its rule. Default: model_window in every layer")
    p.add_argument("--allocate", default=None, choices=["auto"], help="on a bundle: choose the allocator too (uniform, "
                   "pyramidkv, cake, optimal), at model_window, by --by's figure (retained_mass, or the truth: kl, "
                   "delta_nll); the tune file then also deploys the split (generate --allocate tune.json) "
                   "(docs/allocation.md)")
    add_layout_flags(p)
    p.add_argument("--search-layout", default=None, metavar="FIELD[=V,...]", help="which serving layout costs least: "
                   "a whole tune under each candidate (block_size: 1, 8, 16, 32; evict_every: 1, 2, 4, 8, 16; or the "
                   "values given, block_size=8,16,32), the other layout flags held, the best model_window's figure by "
                   "--by chosen; --save-plan writes it (docs/serving.md, 'Tuning under a layout')")
    add_plan_flags(p, "tune")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    _json(p)


RECORD_EPILOG = """\
stores (--store): qk keeps, per (layer, KV head), the post-norm, post-RoPE queries of its query
heads, its keys and values and the attention's constants (O(T x head_dim)); every row is computed
from them on demand, equal to the dense rows within float16 rounding. dense keeps the rows (a packed
lower triangle, O(T^2), at most 16384 steps). auto (the default) is dense up to 4096 steps, as every
shipped trace (its compressed files are the smaller there: Gemma-3-270M's 18 layers at 4096 steps
are 94 MB dense, 227 MB qk), and qk above where its file is the smaller (always for Gemma-3-270M: a
dense global layer grows as T^2, 1 GB at 32k steps against 100 MB qk, and the dense format stops at
16384 steps).

cache: without --out the bundle goes to the cache directory, keyed by the text's sha256, the model
and the settings, and is recorded only when it is not there yet (kvsim cache list / clear --kind
recordings). --preset long is Gemma-3-270M over its whole 32,768-token context, every layer, as qk
traces, on the shipped text traces/long/ (CPython 3.11.7 standard library, PSF licence); flags
given beside it win.

vectors: every trace stores its values, and its meta the layer's rotary constants (rope_theta,
rope_layout, head_dim). A qk trace also holds the queries, keys and per-head output norms
|W_O^h v| (out_norms); a dense one only with --vectors (at 4096 steps they add about 10 MB to a
global Gemma-3-270M layer's 15.8 MB).
"""


class _PolicyOrGrid(argparse.Action):
    """``quality --policy``: one registry name (checked as a choice, its near miss named), or a comma-separated
    list or ``all``, a grid (``policies``, checked when the command reads it); ``--policies`` (the old spelling
    of the list) lands in the same place. Given twice, in either spelling, is one line."""

    def __call__(self, parser, namespace, values, option_string=None):
        if namespace.policy is not None or namespace.policies is not None:
            raise argparse.ArgumentError(self, "give the policies once (one --policy NAME[,NAME...])")
        if "," in values or values.strip() == "all" or option_string == "--policies":
            namespace.policies = values
            return
        if values not in POLICIES:
            names = list(POLICIES)
            raise argparse.ArgumentError(self, f"invalid choice: {values!r}{suggest(values, names)}; "
                                               f"choose from {', '.join(map(repr, names))}")
        namespace.policy = values


class _Given(argparse.Action):
    """Store the value and note that it was typed (``budget_given``): with an allocation file, a default
    budget is not the split's memory, a typed one must be."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _add_generate(sub, traces) -> None:
    p = sub.add_parser("generate", help="greedy generation with every layer's KV cache held to --budget by a policy "
                       "(kvsim.hf; needs the record extra)")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text (or --prompt-file)")
    p.add_argument("--prompt-file", default=None, metavar="F", help="read the prompt from a UTF-8 file")
    add_conversation_flag(p, "each turn's answer written by the model (--max-new-tokens a turn), the reference printed beside")
    p.add_argument("--model", default="gemma3-270m", metavar="DIR|gemma3-270m", help="a local Hugging Face model folder, "
                   "or gemma3-270m for the shipped Gemma-3-270M (default)")
    p.add_argument("--policy", metavar="NAME", help="an online registry policy (`kvsim policies` lists them); required "
                   "unless --plan gives it")
    p.add_argument("--budget", type=positive_int, default=DEFAULT_BUDGET, action=_Given, metavar="B", help="positions each layer "
                   f"holds per KV head (default: {DEFAULT_BUDGET}) or, with --allocate FILE, on average (by default the file's split)")
    p.add_argument("--allocate", default=None, metavar="NAME|FILE", help="a budget per (layer, KV head) at --budget's "
                   "memory: uniform or pyramidkv, adakv (h2o: each layer's KV heads share one pool), or the allocation rows of "
                   "replay --allocate NAME --json (a file)")
    for param, spec in all_tunables().items():
        p.add_argument(flag(param), dest=f"param_{param}", type=int, default=None, metavar="N",
                       help=f"{spec.help} (passed to the policies that take it)")
    p.add_argument("--windows", default=None, metavar="TUNE_JSON", help="per-layer recent_window from "
                   "python -m kvsim tune --json (recorded on this model)")
    p.add_argument("--by", choices=["layer", "head"], default="layer", help="with --windows: one window per layer "
                   "(its per_layer rows, default) or per KV head (its layers rows)")
    p.add_argument("--prefill", choices=["exact", "fast"], default="exact", help="exact (default): a prompt is fed "
                   "position by position, each layer's policy seeing it as decoding would; fast: the prompt attends "
                   "with nothing evicted, the policies are stepped through its attention, then the cache is cut")
    p.add_argument("--max-new-tokens", type=positive_int, required=True, metavar="N", help="tokens to generate "
                   "(fewer if the model ends the text)")
    p.add_argument("--seed", type=int, default=None, help="the generator the random policy draws from")
    add_layout_flags(p)
    add_plan_flags(p, "generate")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")


def _add_record(sub, traces) -> None:
    p = sub.add_parser("record", help="record a bundle of real traces from a causal LM (needs the record extra)",
                       epilog=RECORD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", nargs="?", metavar="TEXT", help="a UTF-8 text file; its first --steps + 1 tokens are read (not "
                   "with --preset)")
    p.add_argument("--preset", choices=["long"], default=None, help="a named recording (see below); into the cache")
    add_conversation_flag(p, "recorded whole, each turn's reference answer teacher-forced, the turns' positions in the meta")
    p.add_argument("--model", default=None, help="smollm2-135m (the shipped SmolLM2-135M), a local Hugging Face model "
                   "folder or a hub id already in the local cache (nothing is downloaded); default: the shipped "
                   "Gemma-3-270M")
    p.add_argument("--out", default=None, help="the bundle folder to write (traces + manifest.json); it must not exist "
                   "or be empty (default: the cache directory, reused when there)")
    p.add_argument("--steps", type=positive_int, default=None, help="decode steps per trace (default: 4096)")
    p.add_argument("--layers", default=None, help="all, global (default: the layers without a sliding window) "
                   "or comma-separated layer numbers")
    p.add_argument("--store", choices=["auto", "qk", "dense"], default=None, help="what a trace keeps: query/key "
                   "vectors or dense rows (default: auto, the smaller file; see below)")
    p.add_argument("--vectors", action="store_true", help="dense traces also store the keys, queries and per-head "
                   "output norms (what knorm, keydiff, critical and expected_attention read; qk traces always hold them)")
    p.add_argument("--dtype", choices=["float16", "float32"], default=None, help="the stored float type (default: float16)")
    p.add_argument("--gqa", choices=["mean", "max"], default=None, help="how the query heads that share a KV head "
                   "are combined (default: mean)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs (default: cpu)")
    p.add_argument("--prefix", default=None, help="file name prefix (default: gemma3-270m, or the model folder's name)")
    p.add_argument("--source", default=None, help="where the text comes from, for the traces' meta")
    p.add_argument("--licence", default=None, help="the text's licence, for the traces' meta")
    p.add_argument("--model-licence", default=None, help="the model's licence, for the traces' meta")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch (default: torch's own)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    _json(p)


def _add_quality(sub, traces) -> None:
    p = sub.add_parser("quality", help="a real model's loss and KL on a text with its KV cache evicted by a policy "
                                       "(needs the record extra)")
    p.add_argument("text", nargs="?", metavar="TEXT", help="a UTF-8 text file, or heapq for the shipped traces' text "
                   "(CPython 3.11.7 Lib/heapq.py); or --conversation FILE")
    add_conversation_flag(p, "each turn's reference answer teacher-forced, its delta NLL and KL")
    add_conversation_prefill_flags(p)
    # one of them, or --plan FILE; --policies is the old spelling of a list, still taken
    p.add_argument("--policy", action=_PolicyOrGrid, default=None, metavar="NAME[,NAME...]", help="a registry policy "
                   "(`kvsim policies` lists them); several, comma-separated, or all (every registered policy): a grid")
    p.add_argument("--policies", action=_PolicyOrGrid, default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", default=str(DEFAULT_BUDGET), metavar="B[,B...]",
                   help=f"cache budget per layer (default: {DEFAULT_BUDGET})")
    for param, spec in all_tunables().items():
        p.add_argument(flag(param), dest=f"param_{param}", type=int, default=None, metavar="N",
                       help=f"{spec.help} (passed to the policies that take it)")
    p.add_argument("--sweep", nargs=2, metavar=("PARAM", "A:B[:STEP]"), help="one measurement per value of a "
                   "policy parameter, e.g. --sweep recent_window 8:248:16")
    p.add_argument("--steps", type=positive_int, default=1024, help="decode steps N (default: 1024)")
    p.add_argument("--model", default=None, help="a local Hugging Face model folder (default: the shipped Gemma-3-270M)")
    p.add_argument("--mode", choices=["closed", "open", "both"], default="closed",
                   help="closed: token-by-token decoding with the real cache evicted (the truth); open: one "
                        "teacher-forced pass masked by the replay of the full-cache traces (default: closed)")
    p.add_argument("--batch", type=positive_int, default=8, help="closed loops decoded together, sharing each "
                   "step's read of the weights; with --allocate, splits masking one pass (default: 8)")
    p.add_argument("--no-cache", action="store_true", help="measure again instead of reading cached results")
    add_cluster_flags(p, "the grid's measurements (--batch closed loops a cell)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_plan_flags(p, "quality")
    add_layout_flags(p)
    p.add_argument("--allocate", default=None, metavar="NAME[,NAME...]", help="each layer and KV head at the budget "
                   "an allocator gives it (uniform, pyramidkv, cake, optimal), the same memory as uniform's; one --policy, "
                   "--budget and NAME: beside uniform's, --mode closed or open (adakv's pool per layer: closed); lists "
                   "(--policy A,B, --budget B,B, NAME,NAME), --mode open: the frontier's grid, every cell cached, --batch "
                   "splits in one pass (docs/allocation.md)")
    p.add_argument("--by", default=None, choices=["retained_mass", "kl", "delta_nll"], help="with --allocate optimal: "
                   "the split by retained mass (the exact optimum, the default), or searched by the truth (kl, delta_nll): "
                   "the static splits measured, then budget moved between runs of layers where the figure falls")
    p.add_argument("--measurements", type=positive_int, default=None, metavar="N", help="with --by kl/delta_nll: "
                   "the most splits the search tries after the static ones (default: 24; cached ones cost nothing)")
    _json(p)


def _add_proxies(sub, traces) -> None:
    from .proxies_command import add_proxies

    add_proxies(sub)


def _add_cache(sub, traces) -> None:
    from .cache_command import add_cache

    add_cache(sub)


def _add_needle(sub, traces) -> None:
    from .needle_command import add_needle

    add_needle(sub)


def _add_policies(sub, traces) -> None:
    from .policies_command import add_policies

    add_policies(sub)


def _add_serve(sub, traces) -> None:
    from .serve_command import add_serve

    add_serve(sub, positive_int)


def _add_learn(sub, traces) -> None:
    from .learn_command import add_learn

    add_learn(sub)


def _add_app(sub, traces) -> None:
    sub.add_parser("app", help="start the Streamlit app; any further options go to streamlit run",
                   usage=f"{PROG} app [STREAMLIT RUN OPTIONS, e.g. --server.port 8502]")


#: each command's sub-parser, in the order ``kvsim --help`` lists them; ``add(sub, traces)``, ``traces()``
#: the help of a --trace flag
_ADD = {"replay": _add_replay, "sweep": _add_sweep, "describe": _add_describe, "export": _add_export, "table": _add_table,
        "claims": _add_claims, "bench": _add_bench, "tune": _add_tune, "record": _add_record, "quality": _add_quality,
        "generate": _add_generate, "proxies": _add_proxies, "cache": _add_cache, "needle": _add_needle,
        "policies": _add_policies, "learn": _add_learn, "app": _add_app, "serve": _add_serve}
#: every command's name
COMMANDS = tuple(_ADD)


def policy_args(args: argparse.Namespace) -> dict:
    """The policy-specific flags that were given, checked against what ``args.policy`` takes."""
    accepted = policy_params(args.policy)
    given = {name[len("param_"):]: value for name, value in vars(args).items() if name.startswith("param_") and value is not None}
    for param in given:
        if param not in accepted:
            takes = ", ".join(flag(p) for p in accepted) or "nothing beyond --budget"
            raise CLIError(f"{flag(param)} does not apply to policy {args.policy} (it takes {takes})")
    return given


def sweep_ranges(args: argparse.Namespace) -> tuple[str, dict, dict, int]:
    """``sweep``'s flags read: the one parameter given as a range, every given parameter's values, the
    fixed ones (one value each) and the budget; a CLIError unless exactly one flag is a range."""
    given = policy_args(args)
    if args.budget is not None:
        given["budget"] = args.budget
    ranges = {p: parse_range(flag(p), text) for p, text in given.items()}
    swept = [p for p in ranges if ":" in given[p]]
    if len(swept) != 1:
        flags = [flag(p) for p in policy_params(args.policy)] + ["--budget"]
        what = "none was" if not swept else f"{len(swept)} were ({', '.join(flag(p) for p in swept)})"
        raise CLIError(f"sweep needs exactly one range A:B[:STEP] among {', '.join(flags)}; {what} given")
    param = swept[0]
    fixed = {p: values[0] for p, values in ranges.items() if p != param}
    budget = fixed.pop("budget", DEFAULT_BUDGET)
    return param, ranges, fixed, budget
