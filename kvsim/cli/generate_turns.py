"""``kvsim generate --conversation FILE``: a conversation on one evicting cache (docs/domain.md, "A conversation").

The context goes in first (as ``generate`` takes a prompt: ``--prefill``), then each turn's question; after it the
model writes its answer, greedy, at most ``--max-new-tokens`` tokens (fewer if it ends the text or breaks the line,
where the format's next question would start: that token is written, fed, and ends the turn), and the next
question follows what it wrote, on the same cache, which keeps evicting all along. The file's reference answers,
where it has them, are not fed: they are printed beside the model's, for the reader. The questions and answers
are written around their text as ``kvsim.models.conversation_tokens`` writes them (``Q: ... A:``).
"""

from __future__ import annotations

import argparse
import time

from .errors import InputError


def check(args: argparse.Namespace):
    """The conversation file, read before the model loads; refused beside a prompt (one line)."""
    from .conversation_command import read

    if args.prompt_file is not None:
        from .errors import CLIError

        raise CLIError(f"--conversation {args.conversation}: the file holds the context and the questions; "
                       f"leave out --prompt-file {args.prompt_file}")
    return read(args, "prompt", needs_answers=False)


def run(args: argparse.Namespace, run, conv, model, tokenizer, cache_of, say) -> dict:
    """Every turn, decoded on the one cache ``cache_of(prompt tokens)`` makes; the document ``generate --json`` prints."""
    import torch

    from ..models.conversation import ConversationError, check_lengths
    from ..models.conversation_tokens import context_ids, model_context, question_ids

    head = context_ids(tokenizer, conv.context)
    questions = [question_ids(tokenizer, t.question) for t in conv.turns]
    limit = model_context(model)
    if limit is not None:  # each turn: the previous answer's last token, the question, and the answer's tokens
        try:
            check_lengths(conv, len(head), [len(q) + args.max_new_tokens + (i > 0) for i, q in enumerate(questions)], limit)
        except ConversationError as e:
            raise InputError(f"--conversation {e}") from None
    cache = cache_of(len(head))
    eos = tokenizer.eos_token_id
    eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    turns, t0 = [], time.perf_counter()
    with torch.no_grad():
        model(torch.tensor([head]), cache=cache, use_cache=True, logits_to_keep=1)
        pending: list[int] = []
        for i, (turn, q) in enumerate(zip(conv.turns, questions, strict=True), 1):
            out = model(torch.tensor([pending + q]), cache=cache, use_cache=True, logits_to_keep=1)
            tokens: list[int] = []
            while True:
                nxt = int(out.logits[0, -1].argmax())
                tokens.append(nxt)
                if len(tokens) == args.max_new_tokens or nxt in eos or "\n" in tokenizer.decode([nxt]):
                    break
                out = model(torch.tensor([[nxt]]), cache=cache, use_cache=True)
            pending = tokens[-1:]  # written but not yet fed: the next question's call feeds it first
            turns.append({"turn": i, "question": turn.question, "question_tokens": len(q), "token_ids": tokens,
                          "answer": tokenizer.decode(tokens, skip_special_tokens=True).strip(), "reference": turn.answer})
            say(None, f"turn {i}: {len(tokens)} tokens written")
    return {"model": args.model, "policy": run.policy, "budget": run.budget, "params": run.params, "prefill": args.prefill,
            "conversation": conv.source, "context_tokens": len(head), "max_new_tokens": args.max_new_tokens, "turns": turns,
            "positions_seen": cache.get_seq_length(), "peak_positions": cache.peak_positions, "cache_bytes": cache.nbytes,
            "seconds": time.perf_counter() - t0}


def render(doc: dict) -> str:
    """Each turn's question and the model's answer (the file's reference answer beside it, where there is one)."""
    lines = []
    for t in doc["turns"]:
        lines += [f"Q{t['turn']}: {t['question']}", f"A{t['turn']}: {t['answer']}"]
        if t["reference"] is not None:
            lines.append(f"   (reference, not fed: {t['reference']})")
        lines.append("")
    return "\n".join(lines) + (
        f"[{len(doc['turns'])} turns after a {doc['context_tokens']}-token context, {doc['positions_seen']} positions in "
        f"all; {doc['policy']} at budget {doc['budget']}: at most {max(doc['peak_positions'])} positions per layer, cache "
        f"{doc['cache_bytes'] / (1 << 20):.1f} MiB; {doc['seconds']:.1f} s]")


__all__ = ["check", "render", "run"]
