"""kvsim in the browser: see what each KV-cache eviction policy keeps, and choose recent_window by eye.

    streamlit run app.py

The app itself is the package ``kvsim.app`` (one module per view); this file is its entry point.
"""

from kvsim.app.main import run

run()
