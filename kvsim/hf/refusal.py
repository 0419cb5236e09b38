"""``HFError``, the deployed cache's one-line refusal, in a module of its own so that every part of a
deployed layer (``kvsim.hf.storage``, ``stepping``, ``modes``, ``cache``) can raise it without importing
the layer."""

from __future__ import annotations


class HFError(ValueError):
    """kvsim.hf cannot run as asked; one line, said before any generation starts."""


__all__ = ["HFError"]
