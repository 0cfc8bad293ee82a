"""Every custom kernel text is either the one that passed `pytest -m gpu` (pinned in
custom_kernels/gpu_tested.json) or listed there as pending (opt-in, not yet run on a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import custom_kernels
from custom_kernels.registry import all_kernel_specs, text_digest

RECORD = json.loads((Path(custom_kernels.__file__).parent / "gpu_tested.json").read_text())


def test_gpu_tested_texts_unchanged():
    current = {s.name: text_digest(s) for s in all_kernel_specs()}
    changed = {name: (entry["digest"], current.get(name)) for name, entry in RECORD["kernels"].items()
               if current.get(name) != entry["digest"]}  # fmt: skip
    assert not changed, (
        f"kernel texts changed since their GPU run (pinned, now): {changed}. Run `pytest -m gpu` on a GPU, "
        "then record the new digests in custom_kernels/gpu_tested.json under a new run."
    )
    assert all(entry["run"] in RECORD["runs"] for entry in RECORD["kernels"].values())


def test_every_kernel_is_tested_or_pending():
    names = {s.name for s in all_kernel_specs()}
    pending = set(RECORD["pending"])
    assert not pending & set(RECORD["kernels"]), "a kernel cannot be both GPU-tested and pending"
    assert names == set(RECORD["kernels"]) | pending, (
        f"not recorded: {sorted(names - set(RECORD['kernels']) - pending)}; "
        f"recorded but gone: {sorted((set(RECORD['kernels']) | pending) - names)}"
    )


def test_families_known_and_checked(monkeypatch):
    """use_kernel knows every family the code asks for and rejects a misspelt one (a typo would
    otherwise silently keep a kernel off); opt-in families need UNPROVEN_ENV, on a GPU build."""
    import pytest

    assert custom_kernels.PROVEN <= custom_kernels.FAMILIES
    with pytest.raises(ValueError, match="unknown kernel family"):
        custom_kernels.use_kernel("norm-rope")
    monkeypatch.setattr(custom_kernels, "backend", lambda: "cuda")
    monkeypatch.delenv(custom_kernels.KERNELS_ENV, raising=False)
    monkeypatch.delenv(custom_kernels.UNPROVEN_ENV, raising=False)
    assert custom_kernels.use_kernel("router") and custom_kernels.use_kernel("norm_moe")
    assert custom_kernels.use_kernel("norm") and custom_kernels.use_kernel("gate_up_split")
    assert custom_kernels.use_kernel("norm_rope")
    monkeypatch.setattr(custom_kernels, "backend", lambda: "metal")  # CUDA_ONLY families: opt-in there
    assert custom_kernels.use_kernel("router") and not custom_kernels.use_kernel("norm")
    assert not custom_kernels.use_kernel("gate_up_split") and not custom_kernels.use_kernel("norm_rope")
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "norm, norm_rope")
    assert custom_kernels.use_kernel("norm") and custom_kernels.use_kernel("norm_rope")


def test_families_turned_off_and_misspelt(monkeypatch):
    """GEMMA4_MLX_KERNELS_OFF keeps the families it names off, default or opted in, and leaves the
    others alone; a misspelt family in either variable is an error, not a silent no-op."""
    import pytest

    monkeypatch.setattr(custom_kernels, "backend", lambda: "cuda")
    monkeypatch.delenv(custom_kernels.KERNELS_ENV, raising=False)
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "norm_rope, router_proj")
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "router_proj,norm_moe")
    assert not custom_kernels.use_kernel("norm_rope") and not custom_kernels.use_kernel("router_proj")
    assert custom_kernels.use_kernel("norm") and custom_kernels.use_kernel("norm_moe")
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "norm-rope")
    with pytest.raises(ValueError, match="GEMMA4_MLX_KERNELS_OFF: unknown kernel families"):
        custom_kernels.use_kernel("norm")
    monkeypatch.delenv(custom_kernels.KERNELS_OFF_ENV)
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "router-proj")
    with pytest.raises(ValueError, match="GEMMA4_MLX_UNPROVEN_KERNELS: unknown kernel families"):
        custom_kernels.use_kernel("norm")


def test_readme_lists_every_family():
    """README's kernel-families table has a row per family, with its default as the code has it."""
    import re

    readme = (Path(custom_kernels.__file__).parent.parent / "README.md").read_text()
    section = readme.split("### Kernel families", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| (`[a-z0-9_]+`(?: \+ `[a-z0-9_]+`)*) \| (yes|CUDA|no) \|", line)
        if m:
            for name in re.findall(r"`([a-z0-9_]+)`", m.group(1)):
                rows[name] = m.group(2)
    want = {f: "no" if f in custom_kernels.OPT_IN else "CUDA" if f in custom_kernels.CUDA_ONLY else "yes"
            for f in custom_kernels.FAMILIES}  # fmt: skip
    assert rows == want
