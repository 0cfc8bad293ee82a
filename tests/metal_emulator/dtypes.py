"""MLX dtype names -> Metal type spelling (MLX's get_type_string) and numpy storage dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DType:
    """One MLX dtype: its name, the Metal type MLX writes for it, and the numpy storage dtype.

    bfloat16 is stored as np.uint16 bit patterns (numpy has no bfloat16).
    """

    name: str
    metal: str
    storage: np.dtype


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float32", "float", np.dtype(np.float32)),
        DType("float16", "float16_t", np.dtype(np.float16)),
        DType("bfloat16", "bfloat16_t", np.dtype(np.uint16)),
        DType("bool", "bool", np.dtype(np.bool_)),
        DType("int8", "int8_t", np.dtype(np.int8)),
        DType("int16", "int16_t", np.dtype(np.int16)),
        DType("int32", "int32_t", np.dtype(np.int32)),
        DType("int64", "int64_t", np.dtype(np.int64)),
        DType("uint8", "uint8_t", np.dtype(np.uint8)),
        DType("uint16", "uint16_t", np.dtype(np.uint16)),
        DType("uint32", "uint32_t", np.dtype(np.uint32)),
        DType("uint64", "uint64_t", np.dtype(np.uint64)),
    )
}

_NUMPY_NAMES = {np.dtype(np.bool_): "bool"}


def dtype_name(d: Any) -> str:
    """Normalize an MLX dtype name ("float32"), an mlx.core.Dtype or a numpy dtype to a name."""
    if isinstance(d, str):
        name = d.rsplit(".", 1)[-1]
        if name == "bool_":
            name = "bool"
    elif isinstance(d, (np.dtype, type)):
        nd = np.dtype(d)
        name = _NUMPY_NAMES.get(nd, nd.name)
    else:  # mlx.core.Dtype prints as "mlx.core.float32"
        name = str(d).rsplit(".", 1)[-1]
        if name == "bool_":
            name = "bool"
    if name not in DTYPES:
        raise ValueError(f"dtype {d!r} is not supported by the Metal emulator (known: {sorted(DTYPES)})")
    return name


def get(d: Any) -> DType:
    """The DType for any spelling accepted by ``dtype_name``."""
    return DTYPES[dtype_name(d)]
