"""The Streamlit app: ``streamlit run app.py`` runs ``kvsim.app.main.run``.

One module per view (``kept``, ``scores``, ``curve``, ``trace``, ``lab``, ``claims``, ``model``,
``quality``), the URL and session state (``state``), the sidebar (``controls``; its memory panel,
``memory_panel``), the caches the
views share (``cache``), their download buttons (``downloads``), and the work shared between
sessions (``services``: the sweep store, the background pools, the tune store, on one bounded
store). This file imports nothing of Streamlit, so the services are imported and tested without it.
"""
