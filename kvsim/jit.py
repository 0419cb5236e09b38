"""The one way kvsim compiles a kernel: ``@kernel`` (numba's ``njit``, cached on disk, releasing the
GIL) where numba is installed, the plain Python function where it is not, so every caller still
works (slower) without it. ``AVAILABLE`` says which.

``nogil``: a sweep runs its batches on several threads at once, and the app's solves and replays run
in background threads while the UI thread draws; ``cache``: the compiled code is kept beside the
module (``__pycache__``), so only the first process after an install pays for compiling.
"""

from __future__ import annotations

try:
    from numba import njit
except ImportError:  # numba is in requirements.txt; without it every kernel runs as Python
    njit = None

#: True when kernels are compiled; False means the reference paths run instead (identical results)
AVAILABLE = njit is not None


def kernel(fn):
    return njit(cache=True, nogil=True)(fn) if AVAILABLE else fn
