"""A replay's summary kept beside its trace's cache entry (``kvsim.sim.summaries``): what the app's curve
lines read, so that a fresh server does not replay expected_attention for most of a minute again."""

from __future__ import annotations

import pytest

import kvsim
from kvsim.data import canonical
from kvsim.data.store import file_trace
from kvsim.data.trace import load_npz, save_npz
from kvsim.sim import simulate, summaries


@pytest.fixture
def on_disk(tmp_path, monkeypatch):
    """A small trace read through the disk cache (an entry of its own in an empty cache directory)."""
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "small.npz"
    save_npz(canonical.generate(canonical.CanonicalConfig(steps=120)), path)
    return file_trace(path, load_npz)


def _replays(monkeypatch) -> list:
    calls = []
    real = simulate.replay

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(simulate, "replay", counted)
    return calls


@pytest.mark.parametrize("name, params", [("h2o", {"recent_window": 8}), ("tova", {}), ("optimal", {})])
def test_a_summary_is_the_replays_and_a_second_process_reads_it(on_disk, monkeypatch, name, params):
    spec = kvsim.PolicySpec.of(name, 24, **params)
    expected = kvsim.replay(on_disk, spec, top_k=8).summary()
    calls = _replays(monkeypatch)
    assert summaries.stored(on_disk, spec, 8) is None
    assert summaries.summary(on_disk, spec, 8) == expected and len(calls) == 1
    kept = list(on_disk.derived.disk_stem.parent.glob(f"{on_disk.derived.disk_stem.name}-summary-*.json"))
    assert len(kept) == 1
    assert summaries.summary(on_disk, spec, 8) == expected and len(calls) == 1  # read, not replayed
    assert summaries.stored(on_disk, spec, 8) == expected
    # another budget, top-k or parameter is another summary
    for other in (spec.replace(budget=32), *((spec.replace(recent_window=4),) if params else ())):
        assert summaries.summary(on_disk, other, 8) == kvsim.replay(on_disk, other, top_k=8).summary()
    assert summaries.summary(on_disk, spec, 4) == kvsim.replay(on_disk, spec, top_k=4).summary()


def test_edited_code_measures_again(on_disk, monkeypatch):
    spec = kvsim.PolicySpec.of("h2o", 24, recent_window=8)
    summaries.summary(on_disk, spec, 8)
    calls = _replays(monkeypatch)
    monkeypatch.setattr(summaries, "_package_digest", lambda: "an-edited-engine")
    assert summaries.stored(on_disk, spec, 8) is None
    summaries.summary(on_disk, spec, 8)
    assert len(calls) == 1


def test_the_digest_covers_the_engine_the_policies_the_data_and_the_policys_own_module():
    version = summaries.code_version("h2o")
    assert version != summaries.code_version("tova")  # each policy's own module
    files = {p.relative_to(summaries._PACKAGE).parts[0] for d in summaries._CODE for p in (summaries._PACKAGE / d).rglob("*.py")}
    assert files == {"sim", "policies", "policykit", "data"}


def test_a_trace_without_a_cache_entry_is_replayed_every_time(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    trace = canonical.generate(canonical.CanonicalConfig(steps=80))
    spec = kvsim.PolicySpec.of("h2o", 16, recent_window=4)
    calls = _replays(monkeypatch)
    for _ in range(2):
        assert summaries.summary(trace, spec, 8) == kvsim.replay(trace, spec, top_k=8).summary()
    assert summaries.stored(trace, spec, 8) is None and len(calls) == 2 and not list(tmp_path.iterdir())
