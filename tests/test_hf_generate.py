"""The deployed cache's tensor path (kvsim.hf.tensor) under transformers' own ``model.generate`` (issue 54 item
3): with a budget larger than the run (nothing evicted) every token equals ``DynamicCache``'s under greedy
decoding, sampling with two return sequences, beam search and a left-padded batch, on a tiny Llama and on a
tiny Gemma 3's sliding layers; with eviction, a padded
row holds and generates what the row alone does, and a reordered batch (beam search's ``reorder_cache``) goes
on as the reordered rows would. Assisted generation records each call and crops the rejected drafts: with nothing
evicted its tokens are DynamicCache's, under eviction plain greedy decoding's, and a crop leaves the cache bit for
bit one that never saw them. The reference path refuses a padded batch, beam search and crop, in one line."""

from __future__ import annotations

import importlib.util

import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

PROMPT, NEW, LARGE, BUDGET, PADS = 12, 10, 64, 8, 4
#: every online policy with a tensor step, at parameters that evict at twice BUDGET (tests/test_hf_walk.py's list)
CROPPED = [("h2o", {"recent_window": 4}), ("h2o_normalized", {"recent_window": 4}), ("tova", {}),
           ("scissorhands", {"recent_window": 4}), ("streaming_llm", {"sinks": 2}), ("sliding_window", {}),
           ("snapkv", {"recent_window": 4, "observation_window": 3}), ("vatp", {"recent_window": 4, "sinks": 2}),
           ("critical", {"recent_window": 4}), ("keydiff", {}), ("random", {}), ("knorm", {}), ("learned", {"recent_window": 4}),
           ("expected_attention", {"sinks": 2, "query_window": 5, "refresh": 3, "future_positions": 7})]
#: every policy with a tensor step, at parameters that evict at BUDGET (tests/test_hf_tensor.py's list)
TENSOR_POLICIES = [("h2o", {"recent_window": 3}), ("tova", {}), ("streaming_llm", {"sinks": 2}), ("sliding_window", {}),
                   ("scissorhands", {"recent_window": 3}), ("h2o_normalized", {"recent_window": 3})]


@pytest.fixture(scope="module")
def llama():
    from test_hf import _tiny

    return _tiny("llama")


def _ids():
    from test_hf import _prompt

    return _prompt(PROMPT)


def _padded():
    """Two rows: the prompt, and its reverse behind PADS pads (attention_mask zeros)."""
    import torch

    ids = _ids()
    rows = torch.cat([ids, torch.cat([torch.zeros(1, PADS, dtype=ids.dtype), ids[:, : PROMPT - PADS].flip(1)], 1)])
    mask = torch.ones_like(rows)
    mask[1, :PADS] = 0
    return rows, mask


def _generate(model, ids, cache=None, seed=0, **kw):
    import torch

    torch.manual_seed(seed)
    extra = {} if cache is None else {"cache": cache}
    return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, **extra, **kw)


MODES = {"greedy": {"do_sample": False}, "sampling": {"do_sample": True, "num_return_sequences": 2},
         "beam search": {"do_sample": False, "num_beams": 2}, "beams, two returned": {"do_sample": False, "num_beams": 3,
                                                                                      "num_return_sequences": 2}}


@pytest.mark.parametrize("mode", MODES)
def test_generate_with_nothing_evicted_gives_dynamic_caches_tokens(llama, mode):
    """Greedy, sampling (transformers expands the batch; the same seed, the same draws), beam search (the cache
    reordered every step): the tensor path at a budget larger than the run gives DynamicCache's tokens."""
    import kvsim.hf as hf
    from kvsim.hf.tensor import TensorLayer

    full = _generate(llama, _ids(), **MODES[mode])
    cache = hf.cache(llama, "h2o", LARGE, recent_window=4)
    assert all(isinstance(layer, TensorLayer) for layer in cache.layers)
    assert _generate(llama, _ids(), cache, **MODES[mode]).tolist() == full.tolist()


@pytest.mark.parametrize("prefill", ["exact", "fast"])
@pytest.mark.parametrize(("policy", "params"), TENSOR_POLICIES, ids=[p for p, _ in TENSOR_POLICIES])
def test_a_left_padded_batch_gives_dynamic_caches_tokens_and_holds_no_padding(llama, policy, params, prefill):
    """A batch of two rows, the second left-padded: no query attends a padded position and no head holds one,
    so with nothing evicted both rows' tokens are DynamicCache's."""
    import kvsim.hf as hf

    rows, mask = _padded()
    full = _generate(llama, rows, attention_mask=mask, do_sample=False)
    cache = hf.cache(llama, policy, LARGE, prefill=prefill, tensor=True, chunk=5, **params)
    assert _generate(llama, rows, cache, attention_mask=mask, do_sample=False).tolist() == full.tolist()
    fed = PROMPT + NEW - 1
    for layer in cache.layers:
        for h in range(layer.kv_heads):
            assert layer.held(0, h).tolist() == list(range(fed))
            assert layer.held(1, h).tolist() == list(range(PADS, fed))


@pytest.mark.parametrize("prefill", ["exact", "fast"])
def test_on_sliding_layers_a_padded_batch_and_beams_give_dynamic_caches_tokens(prefill):
    """A tiny Gemma 3 whose sliding layers' window (6) the run passes: the window counts the padding as
    transformers' mask does, so a padded batch and beam search still give DynamicCache's tokens."""
    from test_hf import _tiny

    import kvsim.hf as hf

    gemma, (rows, mask) = _tiny("gemma3", window=6), _padded()
    full = _generate(gemma, rows, attention_mask=mask, do_sample=False)
    cache = hf.cache(gemma, "tova", LARGE, prefill=prefill, tensor=True, chunk=5)
    assert _generate(gemma, rows, cache, attention_mask=mask, do_sample=False).tolist() == full.tolist()
    beams = _generate(gemma, _ids(), do_sample=False, num_beams=2)
    cache = hf.cache(gemma, "h2o", LARGE, recent_window=3, prefill=prefill, tensor=True)
    assert _generate(gemma, _ids(), cache, do_sample=False, num_beams=2).tolist() == beams.tolist()


@pytest.mark.parametrize("prefill", ["exact", "fast"])
@pytest.mark.parametrize(("policy", "params"), TENSOR_POLICIES, ids=[p for p, _ in TENSOR_POLICIES])
def test_with_eviction_a_padded_row_holds_and_generates_what_the_row_alone_does(llama, policy, params, prefill):
    """At a budget the run passes, the padded row steps as the row alone does: the same tokens, and in every
    layer and KV head the same held set, PADS positions later."""
    import kvsim.hf as hf

    rows, mask = _padded()
    cache = hf.cache(llama, policy, BUDGET, prefill=prefill, tensor=True, chunk=5, **params)
    both = _generate(llama, rows, cache, attention_mask=mask, do_sample=False)
    alone = hf.cache(llama, policy, BUDGET, prefill=prefill, tensor=True, chunk=5, **params)
    one = _generate(llama, rows[1:, PADS:], alone, do_sample=False)
    assert both[1, PADS:].tolist() == one[0].tolist()
    for padded, single in zip(cache.layers, alone.layers, strict=True):
        for h in range(padded.kv_heads):
            assert (padded.held(1, h) - PADS).tolist() == single.held(0, h).tolist()
            assert len(padded.held(1, h)) == BUDGET


def _step(model, cache, ids):
    """One forward over ``ids`` with ``cache``; the greedy next tokens ``(batch, 1)``."""
    import torch

    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)


def _held(cache, row: int):
    return [[layer.held(row, h).tolist() for h in range(layer.kv_heads)] for layer in cache.layers]


@pytest.mark.parametrize(("policy", "params"), TENSOR_POLICIES[:3], ids=[p for p, _ in TENSOR_POLICIES[:3]])
def test_reorder_cache_under_eviction_goes_on_as_the_reordered_rows_would(llama, policy, params):
    """Two rows decoded past the budget, then ``reorder_cache([1, 1, 0])``-style selections: every per-row
    tensor follows, so the cache holds the reordered rows' sets and decodes on as a cache fed the reordered
    rows from the start (held sets and tokens), with beam search's duplicate rows included."""
    import torch

    import kvsim.hf as hf

    ids = _ids()
    rows = torch.cat([ids, ids.flip(1)])
    cache = hf.cache(llama, policy, BUDGET, tensor=True, **params)
    tokens = _step(llama, cache, rows)
    fed = [rows, tokens]
    for _ in range(3):
        tokens = _step(llama, cache, tokens)
        fed.append(tokens)
    before = [_held(cache, 0), _held(cache, 1)]
    order = torch.tensor([1, 1, 0])
    cache.batch_repeat_interleave(1)  # a no-op selection, exercised
    cache.batch_select_indices(torch.tensor([0, 1, 1]))  # three rows: 0, 1, 1
    cache.reorder_cache(torch.tensor([2, 1, 0]))  # beams: 1, 1, 0
    assert [_held(cache, r) for r in range(3)] == [before[int(i)] for i in order]
    again = hf.cache(llama, policy, BUDGET, tensor=True, **params)
    whole = torch.cat(fed, dim=1)[order]
    mine, theirs = tokens[order], _step(llama, again, whole[:, :-1])
    assert theirs.tolist() == mine.tolist()
    for _ in range(4):
        mine, theirs = _step(llama, cache, mine), _step(llama, again, theirs)
        assert mine.tolist() == theirs.tolist()
    assert [_held(cache, r) for r in range(3)] == [_held(again, r) for r in range(3)]


def test_reset_empties_the_cache_for_another_run(llama):
    """After ``reset`` (transformers' own: empty, reusable) a cache generates what a fresh one does, at another
    batch size too."""
    import kvsim.hf as hf

    cache = hf.cache(llama, "h2o", BUDGET, recent_window=3)
    first = _generate(llama, _ids(), cache, do_sample=False)
    cache.reset()
    assert cache.get_seq_length() == 0 and not cache.layers[0].is_initialized
    rows, mask = _padded()
    fresh = _generate(llama, rows, hf.cache(llama, "h2o", BUDGET, recent_window=3), attention_mask=mask, do_sample=False)
    assert _generate(llama, rows, cache, attention_mask=mask, do_sample=False).tolist() == fresh.tolist()
    cache.reset()
    assert _generate(llama, _ids(), cache, do_sample=False).tolist() == first.tolist()


def _draft(model, noise: float = 0.05):
    """A draft model for assisted generation: ``model`` with its weights moved by seeded noise, so that it proposes
    some of the model's tokens and not others (the verification rejects drafts, and the cache is cropped)."""
    import copy

    import torch

    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return draft


def _counting_crops(monkeypatch) -> list:
    """Every ``crop`` the layers are asked for, its count of positions to remove (negative)."""
    from kvsim.hf import rollback

    seen, crop = [], rollback.crop
    monkeypatch.setattr(rollback, "crop", lambda layer, k: (seen.append(k), crop(layer, k))[1])
    return seen


def test_assisted_generation_with_nothing_evicted_gives_dynamic_caches_tokens(llama, monkeypatch):
    """transformers asks the cache to record (``activate_past_recording``) and crops it after each verification pass:
    with a budget larger than the run, the tokens are DynamicCache's, with drafts rejected along the way."""
    import kvsim.hf as hf

    full = _generate(llama, _ids(), do_sample=False)
    crops = _counting_crops(monkeypatch)
    cache = hf.cache(llama, "h2o", LARGE, recent_window=4)
    assert _generate(llama, _ids(), cache, do_sample=False, assistant_model=_draft(llama)).tolist() == full.tolist()
    assert any(k < 0 for k in crops) and cache.layers[0].record_past


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize(("policy", "params"), CROPPED, ids=[p for p, _ in CROPPED])
def test_a_crop_leaves_the_cache_a_run_without_the_removed_positions_would(kind, policy, params):
    """A call of n positions, then ``crop(-k)``: the slot map, every policy's state and the next step's logits are
    bit for bit those of a cache that was only ever given the call's first n - k (the removed positions' queries
    are never seen again, and each kept position's step read only positions before it), at every split, a
    whole call and a one-position call included, on the walk and on the tensor operations."""
    import contextlib

    import torch
    from test_hf import _prompt, _tiny

    import kvsim.hf as hf
    from kvsim.hf import walk

    model, ids = _tiny(kind), _prompt(40)
    for n, k, walked in ((6, 2, True), (5, 5, True), (1, 1, True), (8, 1, False)):
        caches = [hf.cache(model, policy, BUDGET * 2, **params) for _ in range(2)]
        caches[0].activate_past_recording()
        with torch.no_grad(), (contextlib.nullcontext() if walked else walk.off()):
            for cache in caches:
                model(ids[:, :20], cache=cache, use_cache=True)
            model(ids[:, 20 : 20 + n], cache=caches[0], use_cache=True)
            caches[0].crop(-k)
            if n - k:
                model(ids[:, 20 : 20 + n - k], cache=caches[1], use_cache=True)
            after = [model(ids[:, 20 + n - k : 21 + n - k], cache=c, use_cache=True).logits for c in caches]
        cropped, never = caches[0].layers, caches[1].layers
        assert [x.seen for x in cropped] == [x.seen for x in never] == [21 + n - k] * len(never)
        assert all(torch.equal(x.pos, y.pos) for x, y in zip(cropped, never, strict=True)), (n, k)
        for x, y in zip(cropped, never, strict=True):
            for gx, gy in zip(x.groups, y.groups, strict=True):
                for part in ("slots", "params"):
                    mine, theirs = getattr(gx.state, part), getattr(gy.state, part)
                    assert mine.keys() == theirs.keys()
                    assert all(torch.equal(mine[s], theirs[s]) for s in mine), (n, k, part)
        assert torch.equal(after[0], after[1])


def test_assisted_generation_under_eviction_gives_the_plain_runs_tokens(llama, monkeypatch):
    """h2o at a budget the run outgrows, the prompt exact: drafts verified and cropped give plain greedy decoding's
    tokens (a verification pass computes several positions at once, so equal within rounding, as here)."""
    import kvsim.hf as hf

    plain = _generate(llama, _ids(), hf.cache(llama, "h2o", BUDGET, recent_window=3), do_sample=False)
    crops = _counting_crops(monkeypatch)
    cache = hf.cache(llama, "h2o", BUDGET, recent_window=3)
    assisted = _generate(llama, _ids(), cache, do_sample=False, assistant_model=_draft(llama))
    assert assisted.tolist() == plain.tolist() and any(k < 0 for k in crops)
    assert max(cache.peak_positions) == BUDGET


def test_a_crop_the_cache_cannot_make_is_refused_in_one_line(llama):
    """Without recording (nothing asked for it), past the last call, twice, or with transformers' legacy positive
    count: HFError, one line, the cache unchanged; cropping nothing is nothing."""
    import kvsim.hf as hf
    from kvsim.hf import HFError

    cache = hf.cache(llama, "h2o", LARGE, recent_window=4)
    _step(llama, cache, _ids())
    cache.crop(0)
    with pytest.raises(HFError, match="cannot crop unless it recorded") as e:
        cache.crop(-1)
    assert "\n" not in str(e.value) and cache.get_seq_length() == PROMPT
    cache = hf.cache(llama, "h2o", LARGE, recent_window=4)
    cache.activate_past_recording()
    _step(llama, cache, _ids())
    for count, said in ((-(PROMPT + 1), "reaches before the last call"), (2, "negative count")):
        with pytest.raises(HFError, match=said) as e:
            cache.crop(count)
        assert "\n" not in str(e.value) and cache.get_seq_length() == PROMPT
    cache.crop(-2)
    with pytest.raises(HFError, match="no call recorded") as e:
        cache.crop(-1)
    assert cache.get_seq_length() == PROMPT - 2


@pytest.mark.parametrize("mode", ["padded", "beam search", "reset", "crop"])
def test_the_reference_path_refuses_what_it_cannot_do_in_one_line_before_any_token(llama, mode):
    """``tensor=False``: a padded batch (it would attend the padding), beam search, reset and crop are refused
    (HFError, one line); a padded batch is refused at the prompt, before any token."""
    import kvsim.hf as hf
    from kvsim.hf import HFError

    cache = hf.cache(llama, "h2o", LARGE, recent_window=4, tensor=False)
    with pytest.raises(HFError) as e:
        if mode == "padded":
            rows, mask = _padded()
            _generate(llama, rows, cache, attention_mask=mask, do_sample=False)
        elif mode == "beam search":
            _generate(llama, _ids(), cache, do_sample=False, num_beams=2)
        elif mode == "reset":
            cache.reset()
        else:
            _step(llama, cache, _ids())
            cache.crop(-1)
    assert "\n" not in str(e.value)
    if mode == "padded":
        assert cache.layers[0].seen == 0 and "padded" in str(e.value)
