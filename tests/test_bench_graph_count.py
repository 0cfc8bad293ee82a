"""bench/graph_count.py on the CPU: the model takes its CUDA kernel paths (stand-in kernels) and the
decode step's primitives are counted as a GPU build would run them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_counts_the_gpu_paths_primitives(graph_count):
    import decode

    # head dims 256 / 512: the decode attention kernel's sizes, so attention takes the kernel path too
    cfg = decode._tiny(head_dim=256, global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True)
    doc = graph_count.step_counts(cfg, 40)
    body, layers = doc["body"], cfg.num_hidden_layers
    # one MLX norm, the first layer's input norm: q/k/v norms and RoPE are one norm_rope kernel per
    # layer, and each residual add, with its post-norm and the next pre-norm or the final norm, is a
    # residual-norm kernel
    assert body["RMSNorm"] == 1 and "RoPE" not in body
    # per layer: fused q|k(|v), norm_rope, o, fused gate|up, down, the attention kernels (1-2), two
    # residual norms
    assert 8 * layers <= body["CustomKernel"] <= 9 * layers
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


def test_one_token_step_has_few_view_nodes(graph_count):
    """Every graph node costs host time in a decode step. At one token the heads are reshapes (no
    transposes), q/k/v come from one split along the head axis, the matvec outputs need no
    reshape, the gate/up kernel's one-expert view is kept (no expand node), and the per-layer
    inputs are one split for all layers (no slice + squeeze per layer): view nodes grow by at
    most 11 per layer (17 + 4 transposes + 3 before, session 9). The one slice per layer is
    kv_one_write's V view of the layer's K|V buffer (a CUDA default since session 31)."""
    import decode

    from gemma4_mlx.config import FULL, SLIDING

    def views(layers):
        cfg = decode._tiny(head_dim=256, global_head_dim=512, num_hidden_layers=layers, num_key_value_heads=1,
                           layer_types=([SLIDING] * 3 + [FULL]) * (layers // 4), hidden_size_per_layer_input=64,
                           vocab_size_per_layer_input=2048)  # fmt: skip
        body = graph_count.step_counts(cfg, 40)["body"]
        return {k: body.get(k, 0) for k in ("Reshape", "Transpose", "Slice", "Squeeze", "ExpandDims")}

    four, eight = views(4), views(8)
    assert four["Transpose"] == eight["Transpose"] == 0
    assert all(four[k] == eight[k] for k in ("Squeeze", "ExpandDims"))
    assert eight["Slice"] - four["Slice"] == 4
    assert 0 < eight["Reshape"] - four["Reshape"] <= 11 * 4


# a tiny model whose attention takes the kernel path (head dims 256 / 512), with or without experts
_KERNEL_SHAPES = {"head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
                  "intermediate_size": 128}  # fmt: skip
_EXPERTS = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 64}


def _moe_counts_with(graph_count, monkeypatch, family: str, off: str = ""):
    """Body primitives of the tiny MoE model's step without and with `family` (a CUDA default, so
    "without" is GEMMA4_MLX_KERNELS_OFF), both with the families `off` (comma-separated) off, and
    its layers."""
    import decode

    import custom_kernels

    cfg = decode._tiny(**_KERNEL_SHAPES, **_EXPERTS)
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, off)
    with_family = graph_count.step_counts(cfg, 40)["body"]
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, ",".join(filter(None, (family, off))))
    return graph_count.step_counts(cfg, 40)["body"], with_family, cfg.num_hidden_layers


def test_norm_moe_cuts_a_moe_layers_norms(graph_count, monkeypatch):
    """With family "norm_moe" a MoE layer's residual add after attention and its three norms of h
    (pre-FFN, pre-FFN 2, the router's weightless norm and scale) are one kernel: two MLX norms
    and the router's scale multiply fewer per layer, one kernel more."""
    base, fused, layers = _moe_counts_with(graph_count, monkeypatch, "norm_moe")
    assert base["RMSNorm"] - fused["RMSNorm"] == 2 * layers
    assert sum(base.values()) - sum(fused.values()) >= 3 * layers


def test_norm_moe_out_ends_a_moe_layer_in_one_kernel(graph_count, monkeypatch):
    """With family "norm_moe_out" a MoE layer's end (the dense MLP's post-norm, the add of the
    experts' normed output, the residual norm step) is one kernel instead of an MLX norm and two
    residual-norm kernels."""
    base, fused, layers = _moe_counts_with(graph_count, monkeypatch, "norm_moe_out")
    assert base["RMSNorm"] - fused.get("RMSNorm", 0) == layers
    assert base["CustomKernel"] - fused["CustomKernel"] == layers
    assert sum(base.values()) - sum(fused.values()) == 2 * layers


def test_router_fused_takes_one_kernel(graph_count, monkeypatch):
    """With family "router_fused" a MoE layer's router projection and route are one kernel."""
    base, fused, layers = _moe_counts_with(graph_count, monkeypatch, "router_fused")
    assert base["CustomKernel"] - fused["CustomKernel"] == layers
    assert sum(base.values()) - sum(fused.values()) == layers


def test_moe_experts_take_one_launch(graph_count, monkeypatch):
    """As on the H200 (sm_90): a MoE layer's Q4_0 experts are one kernel (moe_one_launch, a CUDA
    default), two with the family off (gate|up, then down with the weighted sum)."""
    import decode

    import custom_kernels

    cfg = decode._tiny(**_KERNEL_SHAPES, **_EXPERTS)
    one = graph_count.step_counts(cfg, 40)["body"]
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "moe_one_launch")
    two = graph_count.step_counts(cfg, 40)["body"]
    assert two["CustomKernel"] - one["CustomKernel"] == cfg.num_hidden_layers
    assert sum(two.values()) - sum(one.values()) == cfg.num_hidden_layers


def test_matvec_gelu_mul_folds_the_per_layer_input_product(graph_count, monkeypatch):
    """With family "matvec_gelu_mul" (a CUDA default) an E-series layer's per-layer-input gate and its
    gelu * input product are one kernel: the same kernels per layer, and the product's MLX nodes gone."""
    import decode

    import custom_kernels

    cfg = decode._tiny(**_KERNEL_SHAPES, hidden_size_per_layer_input=64, vocab_size_per_layer_input=2048)
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "matvec_gelu_mul")
    base = graph_count.step_counts(cfg, 40)["body"]
    monkeypatch.delenv(custom_kernels.KERNELS_OFF_ENV)
    fused = graph_count.step_counts(cfg, 40)["body"]
    assert fused["CustomKernel"] == base["CustomKernel"]
    assert sum(base.values()) - sum(fused.values()) >= 2 * cfg.num_hidden_layers  # multiplies, tanh, adds


def test_compiled_step_counts_and_replays(graph_count):
    """--compiled: the step CompiledDecoder replays, after mx.compile's fusion: fewer primitives
    than the uncompiled graph of the same step, no transposes, and a replay time."""
    import decode

    cfg = decode._tiny(head_dim=256, global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True)
    doc = graph_count.compiled_counts(cfg, 40, replays=3)
    plain = graph_count.step_counts(cfg, 40)
    assert 0 < doc["compiled_total"] < sum(plain["with_head"].values())
    assert doc["compiled"]["CustomKernel"] >= 7 * cfg.num_hidden_layers and "Transpose" not in doc["compiled"]
    assert "Arange" not in doc["compiled"]  # slot indices are constants (cache.iota), q_pos the caches' slots
    assert doc["replay_us"] > 0
    # the kernels in launch order: one per CustomKernel node, each layer's norm + RoPE before its attention
    names = doc["kernels"]
    assert len(names) == doc["compiled"]["CustomKernel"]
    rope = [i for i, n in enumerate(names) if n.startswith("g4_norm_rope")]
    assert len(rope) == cfg.num_hidden_layers and all(names[i + 1].startswith("g4_attn_decode") for i in rope)


def test_moe_layer_view_nodes(graph_count):
    """A MoE layer's routing and expert ops take the caller's lead dims (the kernels read the slot
    count from ids' last dimension): no reshape node more than the same layer without experts
    (seven before session 10)."""
    import decode

    moe = decode._tiny(**_KERNEL_SHAPES, **_EXPERTS)
    with_experts = graph_count.step_counts(moe, 40)["body"]
    without = graph_count.step_counts(decode._tiny(**_KERNEL_SHAPES), 40)["body"]
    assert with_experts["Reshape"] == without["Reshape"]


def test_router_proj_replaces_the_matmul_nodes(graph_count, monkeypatch):
    """With family "router_proj" a MoE layer's router projection is one kernel instead of MLX's
    flatten / transpose / matmul / unflatten (router_fused off: it takes the projection too)."""
    base, fused, layers = _moe_counts_with(graph_count, monkeypatch, "router_proj", off="router_fused")
    assert base["Matmul"] == layers and "Matmul" not in fused and "Transpose" not in fused
    assert fused["CustomKernel"] - base["CustomKernel"] == layers
    assert sum(base.values()) - sum(fused.values()) == 3 * layers


def test_kernels_off_moves_a_default_family_off(graph_count, monkeypatch):
    """GEMMA4_MLX_KERNELS_OFF reaches the ops of models built from raw blocks too: with
    quant_matvec off, a layer's matvecs (q|k|v, o, gate|up, down) run MLX's reference instead of
    kernels; with norm_rope off, the q/k/v norms and RoPE are MLX ops again."""
    import decode

    import custom_kernels

    cfg = decode._tiny(**_KERNEL_SHAPES)
    layers = cfg.num_hidden_layers
    base = graph_count.step_counts(cfg, 40)["body"]
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "quant_matvec")
    off = graph_count.step_counts(cfg, 40)["body"]
    assert base["CustomKernel"] - off["CustomKernel"] >= 4 * layers
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "norm_rope")
    no_nr = graph_count.step_counts(cfg, 40)["body"]
    assert base["CustomKernel"] - no_nr["CustomKernel"] == layers and no_nr["RoPE"] == 2 * layers


def test_attention_fused_takes_one_kernel(graph_count, monkeypatch):
    """With family "attention_fused" a layer's decode attention is one kernel where its merge is
    small: at this short context every layer's (5 sliding, 1 full)."""
    import decode

    import custom_kernels

    cfg = decode._tiny(**_KERNEL_SHAPES)
    fused = graph_count.step_counts(cfg, 40)["body"]
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "attention_fused")
    base = graph_count.step_counts(cfg, 40)["body"]
    layers = cfg.num_hidden_layers
    assert base["CustomKernel"] - fused["CustomKernel"] == layers
    assert sum(base.values()) - sum(fused.values()) == layers


def test_matvec_norm_takes_the_norms_into_the_projections(graph_count, monkeypatch):
    """With opt-in family "matvec_norm" a dense layer's o_proj and FFN down each take the residual
    norm after them into their launch: two kernels fewer per layer."""
    import decode

    import custom_kernels

    cfg = decode._tiny(**_KERNEL_SHAPES)
    base = graph_count.step_counts(cfg, 40)["body"]
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "matvec_norm")
    fused = graph_count.step_counts(cfg, 40)["body"]
    layers = cfg.num_hidden_layers
    assert base["CustomKernel"] - fused["CustomKernel"] == 2 * layers
    assert sum(base.values()) - sum(fused.values()) == 2 * layers


def test_mlp_one_launch_makes_a_dense_mlp_one_kernel(graph_count, monkeypatch):
    """With family "mlp_one_launch" a dense Q4_0 MLP's token (gate|up, GeGLU, down) is one launch of
    the expert kernel: one kernel fewer per layer, dense and MoE layers alike (the MoE layer's dense
    MLP), and the step's other nodes unchanged or fewer."""
    import decode

    import custom_kernels

    for cfg in (decode._tiny(**_KERNEL_SHAPES), decode._tiny(**_KERNEL_SHAPES, **_EXPERTS)):
        graph_count.LAUNCHES.clear()
        base = graph_count.step_counts(cfg, 40)["body"]
        experts = graph_count.LAUNCHES.count("g4_q4_0_moe_experts")
        monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "mlp_one_launch")
        graph_count.LAUNCHES.clear()
        one = graph_count.step_counts(cfg, 40)["body"]
        monkeypatch.delenv(custom_kernels.UNPROVEN_ENV)
        assert graph_count.LAUNCHES.count("g4_q4_0_moe_experts") == experts + cfg.num_hidden_layers
        assert base["CustomKernel"] - one["CustomKernel"] == cfg.num_hidden_layers
        assert sum(base.values()) - sum(one.values()) >= cfg.num_hidden_layers


def _one_launch_for_two(graph_count, monkeypatch, settings: tuple[str, ...], kernel: str, replaced: tuple[str, str]):
    """The tiny MoE model's step with each UNPROVEN_ENV setting (settings[1]: the family under test):
    `kernel` launches once per MoE layer in place of the two `replaced`, one node fewer per MoE layer
    and nothing added. -> {setting: the launches' names}."""
    import decode

    import custom_kernels

    cfg = decode._tiny(**_KERNEL_SHAPES, **_EXPERTS)
    moe_layers = sum(spec.moe for spec in cfg.layers)
    runs = {}
    for setting in ("", *settings):
        monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, setting)
        graph_count.LAUNCHES.clear()
        runs[setting] = graph_count.step_counts(cfg, 40)["body"], list(graph_count.LAUNCHES)
    (base, base_launches), (fused, fused_launches) = runs[""], runs[settings[0]]
    assert moe_layers > 0 and base_launches.count(kernel) == 0
    assert fused_launches.count(kernel) == moe_layers
    for name in replaced:
        assert base_launches.count(name) - fused_launches.count(name) == moe_layers, name
    assert base["CustomKernel"] - fused["CustomKernel"] == moe_layers
    assert sum(base.values()) - sum(fused.values()) == moe_layers
    return {setting: launches for setting, (_, launches) in runs.items()}, moe_layers


def test_moe_route_fold_makes_the_route_part_of_the_expert_launch(graph_count, monkeypatch):
    """With family "moe_route_fold" a MoE layer's route (g4_route_logits) and experts
    (g4_q4_0_moe_experts) are one launch of g4_q4_0_moe_routed: one kernel fewer per MoE layer and
    no other node added."""
    _one_launch_for_two(graph_count, monkeypatch, ("moe_route_fold",), "g4_q4_0_moe_routed",
                        ("g4_route_logits", "g4_q4_0_moe_experts"))  # fmt: skip


def test_norm_route_makes_the_route_part_of_the_norm_launch(graph_count, monkeypatch):
    """With family "norm_route" a MoE layer's post-attention norms (g4_residual_norm_moe) and route
    (g4_route_logits) are one launch of g4_residual_norm_route: one kernel fewer per MoE layer and
    no other node added; with "moe_route_fold" on too, the fold keeps the layer (it takes the
    router's input)."""
    runs, moe_layers = _one_launch_for_two(graph_count, monkeypatch, ("norm_route", "norm_route,moe_route_fold"),
                                           "g4_residual_norm_route", ("g4_residual_norm_moe", "g4_route_logits"))  # fmt: skip
    both = runs["norm_route,moe_route_fold"]
    assert both.count("g4_residual_norm_route") == 0 and both.count("g4_q4_0_moe_routed") == moe_layers
