"""The hardware description every benchmark JSON carries (backend, MLX device info, nvidia-smi)."""

from __future__ import annotations

import platform
import subprocess

import custom_kernels
import mlx.core as mx


def hardware_info() -> dict:
    info: dict = {"backend": custom_kernels.backend(), "machine": platform.machine(), "system": platform.system()}
    try:
        info["mlx_device_info"] = {k: (v if isinstance(v, (int, float, str)) else str(v))
                                   for k, v in mx.device_info().items()}  # fmt: skip
    except Exception:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10)  # fmt: skip
        if out.returncode == 0:
            info["nvidia_smi"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info
