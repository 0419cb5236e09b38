"""The benchmarks and studies run by hand from a checkout, ``python kvsim/bench/scripts/NAME.py`` (each
answers ``--help``): timings, checks on a GPU, the studies whose figures docs/ quotes. They import kvsim as
installed or as PYTHONPATH names it and refuse another checkout's (``checkout.this_checkout``); nothing in
the package imports them, and the built wheel leaves them out (pyproject.toml)."""
