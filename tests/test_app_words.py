"""Issue 44, item 3: the words beside the app's pictures, through AppTest: what a sentence promises
happens, and every number shown large carries its reading."""

from __future__ import annotations

from test_app import problems, run

from kvsim.app import services


def test_a_pending_optimum_is_watched_so_its_line_is_drawn_when_known(monkeypatch):
    """The optimum solved in the background joins what the curve view waits for, so the page draws
    itself again when it ends; it said "its line appears on the next redraw" with nothing to redraw it."""
    monkeypatch.setattr("kvsim.app.curve.optimal_line", lambda trace, spec: (None, services.Status(False, 0.25, None, 30.0)))
    at = run({"policies": "h2o"}, view="Choosing recent_window")
    assert problems(at) == []
    said = " ".join(i.value for i in at.info)
    assert "The exact optimum at budget 256 is being solved in the background" in said
    assert "The page draws its line by itself when the solve ends." in said and "next redraw" not in said
    assert "Still replaying in the background: the exact optimum" in " ".join(c.value for c in at.caption)
