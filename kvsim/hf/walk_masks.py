"""Which rows and columns a block of the compiled walk (``kvsim.hf.walk``) reads: the rows of each kind in a batch
(those whose class reads attention, those whose class does not), and in a fast prompt which columns each query sees,
the full cache's rows."""

from __future__ import annotations

import functools

import numpy as np
import torch


def picked(mask, batch: int):
    """How to index the rows ``mask`` (``(batch,)`` bool) picks: every row, a slice (no copy); none, None; else the
    rows' indices."""
    if bool(mask.all()):
        return slice(0, batch)
    if not bool(mask.any()):
        return None
    return torch.nonzero(mask)[:, 0]


def places(mask, heads: int):
    """For each configuration (row x KV head) of the rows ``mask`` picks, its index among theirs."""
    mine = np.repeat(mask.numpy(), heads).astype(np.int64)
    return np.cumsum(mine) - mine


def rows_of(x, at):
    """``x``'s rows ``at`` where it has one per row (a mask that broadcasts over the rows is left as it is)."""
    return x if x.shape[0] == 1 else x[at]


def sees(layer, t0: int, a: int, m: int, shift: int, hi: int, window: int):
    """A fast part's block of queries ``a .. a + m - 1``: which of the columns ``shift .. hi - 1`` each reads, the full
    cache's rows (what the call found, a slot evicted during the call still read, and the call up to the query, inside
    the model's window), ``(1 or batch, 1 or heads, m, columns)``. A first part's (no slot read) is the same in every
    layer of the call, made once (read only)."""
    if shift:
        return _first_sees(layer.pos.shape[-1], t0, a, m, hi, window)
    return _found_sees(layer, t0, a, m, hi, window)


@functools.lru_cache(maxsize=64)
def _first_sees(width: int, t0: int, a: int, m: int, hi: int, window: int):
    """``sees`` where no slot is read: the call's columns ``width .. hi - 1`` alone."""
    cols = torch.arange(width, hi)
    at = (a + torch.arange(m))[:, None]
    mine = cols[None, :] - width
    sees = ((mine >= 0) & (mine <= at))[None, None]
    if window:
        sees = sees & ((t0 - width + cols)[None, :] > t0 + at - window)
    return sees


def _found_sees(layer, t0: int, a: int, m: int, hi: int, window: int):
    """``sees`` of a part that reads the slots as the call found them (columns from 0)."""
    batch, heads, width = layer.pos.shape
    cols = torch.arange(hi)
    at = (a + torch.arange(m))[:, None]
    mine = cols[None, :] - width  # a column's index in the call, negative for a slot
    sees = ((mine >= 0) & (mine <= at))[None, None]
    calls = t0 - width + cols[cols >= width]  # the call's columns' positions
    sees = sees | torch.cat([layer.pos >= 0, torch.zeros(batch, heads, len(calls), dtype=torch.bool)], 2)[:, :, None]
    if window:
        found = torch.cat([layer.pos, calls.expand(batch, heads, -1)], 2)
        sees = sees & (found[..., None, :] > t0 + at - window)
    return sees
