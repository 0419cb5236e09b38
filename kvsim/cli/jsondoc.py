"""A command's document as ``--json`` prints it: NaN and infinities as null, NumPy scalars as Python's.

Apart from ``render`` (the readable tables, which import every command's renderer), so that a command
run with ``--json`` imports none of them.
"""

from __future__ import annotations

import json
import math

import numpy as np


def _jsonable(x):
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def as_json(doc) -> str:
    return json.dumps(_jsonable(doc), indent=2, allow_nan=False)
