"""The recorded pypto-lib drafter goldens (record_kernel_data.py): kernel -> {tensor: array}."""
from __future__ import annotations

import os
from functools import lru_cache

import ml_dtypes
import numpy as np

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "kernel_data.npz")


@lru_cache(maxsize=1)
def _all() -> dict:
    out = {}
    with np.load(PATH) as z:
        for key in z.files:
            if key == "source":
                continue
            name, bf = (key[:-5], True) if key.endswith("@bf16") else (key, False)
            kernel, tensor = name.split("/", 1)
            a = z[key]
            out.setdefault(kernel, {})[tensor] = a.view(ml_dtypes.bfloat16) if bf else a
    return out


def kernel(name: str) -> dict:
    return _all()[name]


def source() -> str:
    with np.load(PATH) as z:
        return str(z["source"])
