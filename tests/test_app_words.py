"""Issue 44, item 3: the words beside the app's pictures, through AppTest: what a sentence promises
happens, and every number shown large carries its reading."""

from __future__ import annotations

from test_app import problems, run

from kvsim.app import services
from kvsim.views import support as views
from kvsim.views.quality_figures import spearman


def test_a_pending_optimum_is_watched_so_its_line_is_drawn_when_known(monkeypatch):
    """The optimum solved in the background joins what the curve view waits for, so the page draws
    itself again when it ends; it said "its line appears on the next redraw" with nothing to redraw it."""
    monkeypatch.setattr("kvsim.app.curve_tab.optimal_line", lambda trace, spec: (None, services.Status(False, 0.25, None, 30.0)))
    at = run({"policies": "h2o"}, view="Choosing recent_window")
    assert problems(at) == []
    said = " ".join(i.value for i in at.info)
    assert "The exact optimum at budget 256 is being solved in the background" in said
    assert "The page draws its line by itself when the solve ends." in said and "next redraw" not in said
    assert "Still replaying in the background: the exact optimum" in " ".join(c.value for c in at.caption)


def test_the_rank_correlation_shown_large_carries_its_reading():
    at = run({"budget": "64"}, view="Proxy against truth")  # the shipped quality runs' budget
    assert problems(at) == []
    results, _meta = views.quality_results()
    said = " ".join(m.value for m in at.markdown)
    for mode in ("closed", "open"):
        pts = [r for r in results if r["mode"] == mode]
        rho = spearman([r["retained_mass"] for r in pts], [r["delta_nll"] for r in pts])
        assert views.rho_reading(rho) in said
    assert said.count("A good proxy is near -1") == 2


def test_the_app_gives_the_readmes_install_command():
    """Issue 44: the empty views told the user `pip install -r requirements-record.txt` where the README
    installs the extra, `pip install -e '.[dev,record]'`: the app says the README's way, one way."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    assert "pip install -q -e '.[dev,record]'" in (root / "README.md").read_text(encoding="utf-8")
    app = {p.name: p.read_text(encoding="utf-8") for p in (root / "kvsim" / "app").glob("*.py")}
    assert [n for n, text in app.items() if "requirements-record.txt" in text] == []
    from kvsim.cluster import INSTALL_HINT

    assert INSTALL_HINT == "pip install -e '.[record]'"  # the one place the app's empty views take it from
    assert {n for n, text in app.items() if "INSTALL_HINT" in text} == {
        "model_tab.py", "needle_tab.py", "quality_tab.py", "truth_panel.py"}
