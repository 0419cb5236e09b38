"""expected_attention's tensor step (``kvsim.policies.expected_attention``; the deployed cache's, ``kvsim.hf.tensor``):
the policy's rule over every row and KV head of a layer at once, in float64 products on the model's device.

State, per (row, KV head): a ring of the last queries turned back before RoPE (``ring`` ``(batch, heads, W, G, d)``,
W the layer's largest query window, with the position each holds, ``qpos``, -1 for none), the statistics of the
current period (``adv``, ``Rbar mu`` per query head, and ``cols``, the centred queries turned by ``Rbar``, zero past
the window's ``count``) and, per column, the key widened to float64, its value's norm, its logits against the
statistics and the period they were taken in (``stamp``). The rotations come from NumPy, one ``Rope.turns`` call per
position as the reference makes them (torch's float64 ``sin`` and ``cos`` differ from NumPy's in the last bit for
about 0.2% of angles), a table grown on the host by the position count the layer already knows, so nothing is read
back.

A step t: t's query turned back and written to the ring (where t is at least ``sinks`` and the row is not padding);
at a period's first step (``period_of``: 1, 1 + refresh, ...) the window's mean and centred columns, turned by
``Rbar_t``; t's key and value norm into its column, unstamped. Where the cache is over its budget, the held columns
not stamped with the period get their logits (``k.adv / sqrt(d) + mean_j (k.cols_j)^2 / (2 d)``, gathered held-first
so a prompt chunk's columns cost nothing until they are held), the softmax over the held non-sink columns per query
head, the heads' mean times the value norm: the lowest goes, the sinks never.

The reference adds every sum in a stated order (its kernels); the products here add in BLAS's order, so a logit may
differ from the reference's in its last bits: the held sets and tokens are the reference's wherever two scores are not
within that rounding of each other (tests/test_hf_tensor.py holds them equal on the tiny models and the shipped one).
"""

from __future__ import annotations

import numpy as np

from .expected_math import _window, per_position, period_of
from .tensor_hooks import TensorHooks, TensorState, WalkMap, admitted, held_columns, key_norms, param, slots

#: positions of rotations the table holds at first (it doubles past them)
TABLE = 1024


def _rope(policies, head_dim: int):
    """The layer's RoPE: one for every row and KV head (a layer's meta states one), else a ValueError."""
    ropes = [p.rope(head_dim) for row in policies for p in row]
    first = ropes[0]
    if any(r.inv_freq.shape != first.inv_freq.shape or not np.array_equal(r.inv_freq, first.inv_freq) for r in ropes):
        raise ValueError("expected_attention's tensor step turns a layer's queries back by one RoPE, and this layer's "
                         "policies state several")
    return first


def turns(state, upto: int):
    """``(cos, sin)`` ``(positions, r/2)`` float64 on the device for positions ``0 .. upto`` at least: NumPy's, a
    ``Rope.turns`` call per position, grown by doubling."""
    import torch

    host = state.host
    table = host.get("turns")
    if table is None or table[0].shape[0] <= upto:
        rope, size = host["rope"], max(TABLE, 1 << int(upto).bit_length())
        pairs = [rope.turns(p) for p in range(size)]
        device = state.params["sinks"].device
        table = tuple(torch.as_tensor(np.stack([pair[i] for pair in pairs]), device=device) for i in (0, 1))
        host["turns"] = table
    return table


def _state(policies, batch, heads, width, device):
    import torch

    # ``full``: every held column's logits are due (the first ranking, or new statistics since the last); else only
    # the column admitted since, which every step after the first ranking is ranked at
    host = {"rope": None, "refresh": sorted({p.refresh for row in policies for p in row}), "full": True,
            "future": [[p.future_positions for p in row] for row in policies],
            "windows": max(p.query_window for row in policies for p in row)}
    params = {"sinks": param(policies, "sinks", device), "window": param(policies, "query_window", device),
              "refresh": param(policies, "refresh", device),
              "period": torch.full((batch, heads), -1, dtype=torch.int64, device=device),
              "count": torch.zeros(batch, heads, dtype=torch.int64, device=device)}
    return TensorState(params, {"norm": slots(batch, heads, width, device),
                                "stamp": torch.full((batch, heads, width), -1, dtype=torch.int64, device=device)},
                       host=host)


def _lazy(state, key, query):
    """The parts whose shapes the first step's vectors give: the ring, the statistics, each column's key and
    logits, and the future averages ``(cbar, sbar)`` per (row, KV head)."""
    import torch

    if "ring" in state.params:
        return
    _statistics_state(state, *key.shape, query.shape[2], key.device)
    batch, heads, d = key.shape
    width = state.slots["norm"].shape[2]
    state.slots["key"] = torch.zeros(batch, heads, width, d, dtype=torch.float64, device=key.device)
    state.slots["logit"] = torch.zeros(batch, heads, width, query.shape[2], dtype=torch.float64, device=key.device)


def _statistics_state(state, batch: int, heads: int, d: int, g: int, dev) -> None:
    """The ring, the statistics and the future averages, for keys of ``d`` dimensions and ``g`` query heads each."""
    import torch

    W = state.host["windows"]
    policies = state.host["policies"]
    rope = state.host["rope"] = _rope(policies, d)
    averages = {}
    for n in {n for row in state.host["future"] for n in row}:
        averages[n] = rope.future_average(n)
    cbar = np.array([[averages[n][0] for n in row] for row in state.host["future"]])
    sbar = np.array([[averages[n][1] for n in row] for row in state.host["future"]])
    state.params.update(
        ring=torch.zeros(batch, heads, W, g, d, dtype=torch.float64, device=dev),
        qpos=torch.full((batch, heads, W), -1, dtype=torch.int64, device=dev),
        adv=torch.zeros(batch, heads, g, d, dtype=torch.float64, device=dev),
        cols=torch.zeros(batch, heads, g, W, d, dtype=torch.float64, device=dev),
        cbar=torch.as_tensor(cbar, device=dev), sbar=torch.as_tensor(sbar, device=dev))


def _back(x, c, s, h):
    """``R_{-p} x``: pair f (f, f + h) of the last axis turned back by (c, s), the rest as they are."""
    import torch

    a, b = x[..., :h], x[..., h : 2 * h]
    return torch.cat([a * c + b * s, b * c - a * s, x[..., 2 * h :]], dim=-1)


def _ahead(x, c, s, h):
    """``Rbar x``: pair f turned by (c, s) per (row, KV head), ``x`` ``(batch, heads, ..., d)``."""
    import torch

    extra = x.dim() - c.dim()
    c, s = (v.reshape(*v.shape[:2], *[1] * extra, h) for v in (c, s))
    a, b = x[..., :h], x[..., h : 2 * h]
    return torch.cat([a * c - b * s, b * c + a * s, x[..., 2 * h :]], dim=-1)


def _admit(state, new, before):
    import torch

    t, now = state.t, state.now
    if state.host.get("padded"):
        raise ValueError("expected_attention turns a query back by its position, which a padded row shifts: build the "
                         "cache with tensor=False for one row at a time")
    key, query = now["keys"], now["queries"]
    _lazy(state, key, query)
    p, h = state.params, state.host["rope"].half
    cos, sin = turns(state, t)
    c, s = cos[t], sin[t]
    came = new.any(-1)  # (batch, heads): false in a padded row
    writes = came & (t >= p["sinks"])  # the press leaves the first sinks queries out of its statistics
    at = t % p["ring"].shape[2]
    u = _back(query.double(), c, s, h)  # (batch, heads, G, d)
    p["ring"][:, :, at] = torch.where(writes[..., None, None], u, p["ring"][:, :, at])
    p["qpos"][:, :, at] = torch.where(writes, t, p["qpos"][:, :, at])
    state.slots["key"] = admitted(state.slots["key"], new, key.double())
    state.slots["norm"] = admitted(state.slots["norm"], new, key_norms(now["values"]))
    state.slots["stamp"] = state.slots["stamp"].masked_fill(new, -1)
    p["newest"] = torch.where(came, new.to(torch.uint8).argmax(-1), -1)  # t's column, -1 in a padded row
    if t >= 1 and any((t - 1) % r == 0 for r in state.host["refresh"]):
        fresh = came & ((t - 1) % p["refresh"] == 0)
        _statistics(state, t, fresh, c, s, h)
        state.host["full"] = True


def _statistics(state, t: int, fresh, c, s, h) -> None:
    """The period's statistics where ``fresh`` (``(batch, heads)``): the window's queries (positions ``max(sinks,
    t - window + 1) .. t``) as ``Rbar_t mu`` and ``Rbar_t (u_j - mu)``, the turn ``Rbar_t`` from t's ``(c, s)`` and
    each row's future average."""
    import torch

    p = state.params
    qpos = p["qpos"]
    valid = (qpos >= 0) & (qpos > t - p["window"][..., None]) & (qpos >= p["sinks"][..., None])  # (b, k, W)
    count = valid.sum(-1)
    ring = p["ring"] * valid[..., None, None]
    mean = ring.sum(2) / count.clamp(min=1)[..., None, None]  # (b, k, G, d)
    cbar, sbar = p["cbar"], p["sbar"]
    ct, st = cbar * c - sbar * s, cbar * s + sbar * c  # Rbar_t per (row, KV head): (b, k, h)
    cent = (ring - mean[:, :, None]) * valid[..., None, None]  # (b, k, W, G, d)
    cols = _ahead(cent.transpose(2, 3), ct, st, h)  # (b, k, G, W, d)
    f2 = fresh[..., None, None]
    p["adv"] = torch.where(f2, _ahead(mean, ct, st, h), p["adv"])
    p["cols"] = torch.where(f2[..., None], cols, p["cols"])
    p["count"] = torch.where(fresh, count, p["count"])
    p["period"] = torch.where(fresh, t, p["period"])


def _logits(state, at, due):
    """Columns ``at`` ``(batch, heads, n)`` given their logits against the period's statistics where ``due``,
    and stamped with it: ``k.adv / sqrt(d) + mean_j (k.cols_j)^2 / (2 d)`` per query head."""
    import torch

    p, sl = state.params, state.slots
    keys = sl["key"].gather(2, at[..., None].expand(-1, -1, -1, sl["key"].shape[-1]))
    d = keys.shape[-1]
    stale = due & (sl["stamp"].gather(-1, at) != p["period"][..., None])
    lin = torch.matmul(keys[:, :, None], p["adv"][..., None]).squeeze(-1) / np.sqrt(np.float64(d))  # (b, k, G, n)
    z = torch.matmul(keys[:, :, None], p["cols"].transpose(-1, -2))  # (b, k, G, n, W)
    quad = (z * z).sum(-1) / p["count"].clamp(min=1)[..., None, None] / (2.0 * d)
    fresh = (lin + quad).transpose(2, 3)  # (b, k, n, G)
    old = sl["logit"].gather(2, at[..., None].expand(-1, -1, -1, fresh.shape[-1]))
    sl["logit"] = sl["logit"].scatter(2, at[..., None].expand_as(old), torch.where(stale[..., None], fresh, old))
    sl["stamp"] = sl["stamp"].scatter(-1, at, torch.where(stale, p["period"][..., None], sl["stamp"].gather(-1, at)))


def _rank(state, cols):
    import torch

    p, sl = state.params, state.slots
    held = cols.held
    at = held_columns(state, cols)
    inside = held.gather(-1, at)  # (b, k, n)
    if state.host["full"]:
        _logits(state, at, inside)
        state.host["full"] = False
    else:  # only t's column is not stamped with the period
        newest = p["newest"].clamp(min=0)[..., None]
        _logits(state, newest, (p["newest"] >= 0)[..., None])
    logit = sl["logit"].gather(2, at[..., None].expand(-1, -1, -1, sl["logit"].shape[-1]))
    scored = inside & (cols.older.gather(-1, at) >= p["sinks"][..., None])  # the sinks are never evicted
    masked = logit.masked_fill(~scored[..., None], -np.inf)
    top = masked.amax(2, keepdim=True).clamp(min=torch.finfo(torch.float64).min)
    e = torch.exp(masked - top)
    share = (e / e.sum(2, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)).sum(-1)
    score = share / logit.shape[-1] * sl["norm"].gather(-1, at)
    values = torch.full_like(sl["norm"], np.inf).scatter(-1, at, torch.where(scored, score, np.inf))
    return values, values < np.inf


# --------------------------------------------------------------------------------------------
# the compiled walk (``kvsim.hf.walk``) steps the engine's hooks (``expected_attention.STEPS``), one engine state per
# (row, KV head). Its per-position rows (the keys, value norms, queries turned back and turns, from
# ``expected_math.per_position``) hold position q at row ``q - base[0]`` (``base[1]`` rows written): a call's,
# and before them the last query_window + refresh positions' queries, all a later period's window can read. Each
# held slot's key, value norm, logits and stamp, and the period's statistics, move between the engine and the
# tensor state; the statistics of the newest position's period are taken before they are handed back, as the tensor
# step takes them at the period's first step.

#: rows a walk's per-position buffer is made with past what a call needs, so decode steps append in place
SLACK = 64

_ROWS = ("keys", "vnorm", "pre", "cos", "sin")


def _walk_rows(policy, engine, t0, rows):
    """One configuration's engine state with a call's rows (positions ``t0 ..``) after the ones a later period's window
    may read: in place where they fit, else in a buffer made anew from the first such position (a call of no rows:
    the buffer cut back to those)."""
    new = per_position(policy, t0, rows)
    n = len(new["keys"])
    base = engine[21]
    b, used = int(base[0]), int(base[1])
    if n and b + used == t0 and used + n <= len(engine[0]):
        for i, name in enumerate(_ROWS):
            engine[i][used : used + n] = new[name]
        base[1] = used + n
        return None
    lo = max(0, t0 - policy.query_window - policy.refresh)
    if not n and len(engine[0]) <= t0 - lo + 2 * SLACK:  # little to let go: kept, so a decode step copies nothing
        return None
    size = t0 - lo + n
    made = []
    for i, name in enumerate(_ROWS):
        old = engine[i]
        out = np.zeros((size + (SLACK if n else 0), *old.shape[1:]), dtype=old.dtype)
        a, z = max(lo, b), min(t0, b + used)  # the old rows kept, where the old buffer has them
        if z > a:
            out[a - lo : z - lo] = old[a - b : z - b]
        out[t0 - lo : size] = new[name]
        made.append(out)
    return (*made, *engine[5:21], np.array([lo, size], dtype=np.int64))


def _walk_read(engine, c, held, slots, params):
    """Configuration c's tensor state into the engine's: its held slots (key, value norm, logits, stamp) in position
    order (the column map the identity), the period's statistics, and the ring's queries as the rows a later period's
    window reads (a buffer made anew; the turns of those rows are never read: their periods' statistics are taken)."""
    (keys, vnorm, pre, cos, sin, sinks, windows, refresh, cbar, sbar, scores, due, adv, cols, logits, stamp, period,
     counts, slot_keys, slot_vnorm, col_of, base) = engine
    n = len(held)
    col_of[c] = np.arange(col_of.shape[1])
    slot_keys[c, :n] = slots["key"][c, held]
    slot_vnorm[c, :n] = slots["norm"][c, held]
    logits[c, :n] = slots["logit"][c, held]
    stamp[c, :n] = slots["stamp"][c, held]
    due[c] = 0
    period[c], counts[c] = params["period"][c], params["count"][c]
    adv[c] = params["adv"][c]
    w = min(cols.shape[3], params["cols"].shape[2])
    cols[c] = 0.0
    cols[c, :, :, :w] = params["cols"][c, :, :w].transpose(0, 2, 1)
    qpos = params["qpos"][c]
    there = np.nonzero(qpos >= 0)[0]
    if not len(there):
        return None
    lo, hi = int(qpos[there].min()), int(qpos[there].max()) + 1
    rows = [np.zeros((hi - lo + SLACK, *a.shape[1:]), dtype=a.dtype) for a in (keys, vnorm, pre, cos, sin)]
    rows[2][qpos[there] - lo] = params["ring"][c, there]
    return (*rows, *engine[5:21], np.array([lo, hi - lo], dtype=np.int64))


def _walk_write(engine, p, col, length, slots, params):
    """Every configuration's held slots and statistics from the engine's into the tensor state's, the newest position's
    period's statistics taken first where the engine has not yet (it takes them when it first scores), and the ring
    holding the window's last queries as the tensor step's would."""
    (keys, vnorm, pre, cos, sin, sinks, windows, refresh, cbar, sbar, scores, due, adv, cols, logits, stamp, period,
     counts, slot_keys, slot_vnorm, col_of, base) = engine
    held = np.arange(p.shape[1])[None, :] < length[:, None]
    c, i = np.nonzero(held)
    at = col[held]
    slots["key"][c, at] = slot_keys[c, col_of[c, i]]
    slots["norm"][c, at] = slot_vnorm[c, col_of[c, i]]
    slots["logit"][c, at] = logits[c, i]
    slots["stamp"][c, at] = stamp[c, i]
    last = int(base[0] + base[1]) - 1  # the newest position walked
    ring, qpos = params["ring"], params["qpos"]
    width = ring.shape[1]
    for k in range(len(length)):
        if last >= 1 and period[k] != period_of(last, int(refresh[k])):
            _window(engine, k, period_of(last, int(refresh[k])))
        qpos[k] = -1
        for q in range(max(int(sinks[k]), last + 1 - width, int(base[0])), last + 1):
            ring[k, q % width] = pre[q - base[0]]
            qpos[k, q % width] = q
    params["period"][:], params["count"][:] = period, counts
    params["adv"][:] = adv
    w = min(cols.shape[3], params["cols"].shape[2])
    params["cols"][:] = 0.0
    for k in range(len(length)):  # zero past the window's count, as the tensor step's are
        m = min(w, int(counts[k]))
        params["cols"][k, :, :m] = cols[k, :, :, :m].transpose(0, 2, 1)


def _walk_prepare(state, slots, shapes, size):
    """What the tensor step makes at its first call (the ring, the statistics, the key and logit slots), where it has
    not yet; every held column's logits marked due, since the walk may have taken a period's statistics anew."""
    import torch

    rows, heads, width = size
    g, d = shapes["queries"]
    if "ring" not in state.params:
        _statistics_state(state, rows, heads, d, g, "cpu")
    for name, last in (("key", d), ("logit", g)):
        if name not in slots:
            slots[name] = torch.zeros(rows, heads, width, last, dtype=torch.float64)
    state.host["full"] = True


#: expected_attention's tensor step, which its ``tensor_step`` names
TENSOR = TensorHooks("expected_attention", _state, _rank, admit=_admit,
                     walk=WalkMap(_walk_read, _walk_write, prepare=_walk_prepare), walk_rows=_walk_rows,
                     per_call=True)

__all__ = ["TENSOR", "turns"]
