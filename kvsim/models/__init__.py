"""The real-model extra (torch and transformers, ``pip install -e '.[record]'``); no module here imports
either until a function needs them, so ``import kvsim``, the CLI and the app run without them.

In the order they build on each other: ``errors`` (the two one-line errors), ``loading`` (the
models, the text, its token ids), then ``recorder`` (the blockwise attention capture) under ``record``
(``RecordConfig`` and the bundle it writes: ``kvsim record``), and ``decode`` (the attention function
of a measurement: the masked pass, the closed-loop decoder) under ``quality`` (sessions, scores, the
result cache: ``kvsim quality``).
"""
