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
