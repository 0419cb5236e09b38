"""The views' download buttons: files named after the trace, built only when clicked."""

from __future__ import annotations

import streamlit as st

import kvsim


def stem(trace: kvsim.Trace) -> str:
    """The trace's name as a file-name prefix for downloads."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in trace.name) or "trace"


def html_button(label: str, fig, filename: str, key: str) -> None:
    st.download_button(
        label, data=lambda: fig.to_html(include_plotlyjs=True, full_html=True), file_name=filename,
        mime="text/html", key=key,
    )


def csv_button(label: str, table, filename: str, key: str) -> None:
    """``table()``: the pandas table, made only when the button is clicked."""
    st.download_button(label, data=lambda: table().to_csv(index=False), file_name=filename, mime="text/csv", key=key)
