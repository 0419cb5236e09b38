"""A selectable chart's figure sent with the selection modes already in its layout (issue 56 item 3).

Streamlit's chart element (1.67, its ``PlotlyChart`` chunk) sets ``layout.clickmode``, ``hovermode`` and
``dragmode`` on a chart with ``on_select`` once the figure is drawn, where they differ from what the
selection mode asks for, and hands the changed figure to ``Plotly.react``. ``clickmode`` is an
``editType: "plot"`` attribute: changing it draws the whole figure a second time. A figure that arrives
with those values already is drawn once (``kvsim/bench/scripts/chart_mount.py`` times both). The values are
the ones Streamlit would set, so the chart looks and answers the same.
"""

from __future__ import annotations

from collections.abc import Mapping


def selection_layout(layout: Mapping, modes: tuple[str, ...]) -> dict[str, str]:
    """The ``clickmode``, ``hovermode`` and ``dragmode`` Streamlit's element leaves a chart with, given the
    figure's ``layout`` and the chart's ``selection_mode`` (``"points"``, ``"box"``, ``"lasso"``)."""
    points = "points" in modes
    drag = layout.get("dragmode") or ("pan" if points else "select" if "box" in modes else "lasso" if "lasso" in modes
                                      else "pan")
    # the element's second effect: a select or lasso drag clicks as ``event``, else points select on click
    click = "event" if drag in ("select", "lasso") else "event+select" if points else "none"
    return {"clickmode": click, "hovermode": layout.get("hovermode") or "closest", "dragmode": drag}


def selectable(fig, *modes: str):
    """``fig`` (a ``go.Figure``) with the selection modes ``modes`` set in its layout as Streamlit would set
    them after drawing it: for ``st.plotly_chart(fig, on_select=..., selection_mode=modes)``."""
    lay = fig.layout
    fig.update_layout(selection_layout({"dragmode": lay.dragmode, "hovermode": lay.hovermode}, modes))
    return fig
