"""One pass-key trial per policy, timed and split into the prompt and the decoding (issue 35's figure: a
2,048-token trial within 30 s per policy, the exact prefill dominating):

    python kvsim/bench/scripts/needle_speed.py [--length 2048] [--budget 256] [--depth 0.5] [POLICY[:K=V,...] ...]

Gemma-3-270M as shipped, the built-in filler, seed 0; every run decoded afresh (nothing read from the
needle cache). The full cache (the control) runs first, then each policy (default: every online policy
at its default parameters). One line per run: the prompt's seconds, the decoding's, the total against the
target, whether the key was found; then one JSON line of the same. The load average is printed before and
after: the machine is shared, and one busy neighbour doubles a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from checkout import this_checkout

ROOT = this_checkout(__file__)

ONLINE = ("sliding_window", "streaming_llm", "h2o", "scissorhands", "tova", "h2o_normalized", "snapkv", "vatp",
          "critical", "expected_attention", "knorm", "keydiff", "random")
TARGET_S = 30.0


def _spec(text: str) -> tuple[str, dict]:
    """``NAME[:param=N,...]``, as ``--prefill-policy`` spells a policy (one parser: kvsim.sim.prefill's)."""
    from kvsim.policies import PolicySpec
    from kvsim.sim.prefill import PrefillError, parse_scorer

    try:
        name, params = parse_scorer(text)
        if name != "full":
            PolicySpec.of(name, **params)
    except (PrefillError, ValueError) as e:
        raise SystemExit(f"needle_speed.py: policy {text!r}: {e}") from None
    return name, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("policies", nargs="*", default=list(ONLINE))
    args = ap.parse_args()
    specs = [_spec(text) for text in args.policies]  # every name checked before the model loads

    from kvsim.models import needle, needle_prompt
    from kvsim.models.quality import load

    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    t0 = time.perf_counter()
    model, tokenizer, _ = load(None, None)
    print(f"model ready in {time.perf_counter() - t0:.1f} s")
    prompt = needle_prompt.Builder(tokenizer, needle_prompt.Template()).prompt(
        args.length, args.depth, needle_prompt.pass_key(0, args.length, args.depth, 0))
    rows = []
    for text, (name, params) in zip([needle.CONTROL, *args.policies], [(needle.CONTROL, {}), *specs], strict=True):
        t = time.perf_counter()
        run = needle.run_trial(model, prompt, name, None if name == needle.CONTROL else args.budget, params)
        total = time.perf_counter() - t
        found = needle_prompt.answer(tokenizer.decode(run["tokens"])) == prompt.key
        rows.append({"policy": text, "prompt_s": round(run["prefill_seconds"], 2),
                     "decode_s": round(run["decode_seconds"], 2), "total_s": round(total, 2), "found": found})
        verdict = "" if name == needle.CONTROL else ("  within 30 s" if total <= TARGET_S else "  OVER 30 s")
        print(f"{text:>28}  prompt {run['prefill_seconds']:6.1f} s  decoding {run['decode_seconds']:5.1f} s  "
              f"total {total:6.1f} s{verdict}  {'found' if found else 'not found'}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    print(json.dumps({"length": args.length, "budget": args.budget, "depth": args.depth, "runs": rows}))


if __name__ == "__main__":
    main()
