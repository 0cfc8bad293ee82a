"""bench/graph_count.py on the CPU: the model takes its CUDA kernel paths (stand-in kernels) and the
decode step's primitives are counted as a GPU build would run them."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


@pytest.fixture
def graph_count(monkeypatch):
    import graph_count as gc

    import custom_kernels
    from custom_kernels import attention, quant_matvec, sampling

    for module in (custom_kernels, quant_matvec, attention, sampling):  # undone after the test
        if hasattr(module, "backend"):
            monkeypatch.setattr(module, "backend", module.backend)
    for name in ("cuda_kernel", "rms_norm", "rope"):
        monkeypatch.setattr(mx.fast, name, getattr(mx.fast, name))
    yield gc
    custom_kernels.clear_kernel_cache()


def test_counts_the_gpu_paths_primitives(graph_count):
    import decode

    # head dims 256 / 512: the decode attention kernel's sizes, so attention takes the kernel path too
    cfg = decode._tiny(head_dim=256, global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True)
    doc = graph_count.step_counts(cfg, 40)
    body, layers = doc["body"], cfg.num_hidden_layers
    # MLX norms: q, k, v per layer and the first layer's input norm (each residual add, with its
    # post-norm and the next pre-norm or the final norm, is a residual-norm kernel); RoPE on q and k
    assert body["RMSNorm"] == 3 * layers + 1 and body["RoPE"] == 2 * layers
    # per layer: fused q|k(|v), o, fused gate|up, down, the attention kernels (1-2), two residual norms
    assert 7 * layers <= body["CustomKernel"] <= 8 * layers
    assert "Rsqrt" not in body and "Cos" not in body  # no CPU composite of the fast ops is counted
    assert doc["per_layer"] == pytest.approx(doc["body_total"] / layers)
    assert sum(doc["with_head"].values()) > doc["body_total"]  # the head adds its matvec and softcap
    unfused = graph_count.step_counts(cfg, 40, fused=False)["body"]
    assert unfused["CustomKernel"] > body["CustomKernel"] and "Split" not in unfused


def test_command_line_writes_the_counts(graph_count, tmp_path, capsys):
    import json

    out = tmp_path / "counts.json"
    assert graph_count.main(["--model", "tiny-dense", "--layers", "6", "--context", "40", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["model"] == "tiny-dense" and doc["layers"] == 6 and doc["body_total"] > 0
    assert "per layer" in capsys.readouterr().out
