"""examples/*.py run as scripts on fixture models and print what they promise."""

import os
import re
import subprocess
import sys
from pathlib import Path

import gemma4_mlx  # noqa: F401  (first: MLX's CPU BLAS)
import pytest

from gemma4_mlx import demo

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    """A GEMMA4_MLX_CACHE directory holding the demo model (built once per session)."""
    directory = tmp_path_factory.getbasetemp() / "gemma4-demo-cache"
    demo.demo_path(directory, announce=False)
    return directory


def run_example(name, *args, env=None):
    r = subprocess.run([sys.executable, str(REPO / "examples" / name), *map(str, args)], cwd=REPO,
                       env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_basic_generation(fixture_gguf):
    out = run_example("basic_generation.py", "--model", fixture_gguf("dense", "q8_0"), "--max-tokens", "6")
    assert re.search(r"^model: 6 layers, hidden 256, vocab 1024$", out, re.M)
    assert re.search(r"\n==========\nPrompt: \d+ tokens, [\d.]+ tokens-per-sec\nGeneration: \d+ tokens", out)
    rows = re.findall(r"^ *(\d+) +(-?[\d.]+)  '", out, re.M)
    assert 1 <= len(rows) <= 8 and all(float(lp) <= 0 for _, lp in rows)
    assert "model(tokens) -> logits (1, " in out and ", 1024) mlx.core.float32" in out


def test_logit_lens_last_layer_is_the_output(fixture_gguf):
    out = run_example("logit_lens.py", "--model", fixture_gguf("dense", "f32"), "--top", "3")
    lines = {" ".join(line[:9].split()): line[9:].strip() for line in out.splitlines()[1:]}
    assert list(lines) == ["embed", *(f"layer {i}" for i in range(6)), "output"]
    assert lines["layer 5"] == lines["output"]  # the last layer through norm + head is the model's output
    assert lines["embed"] != lines["output"]
    assert all(len(re.findall(r" (\d\.\d{3})(?:  |$)", v)) == 3 for v in lines.values())


def test_compare_quantizations_on_a_float_fixture(fixture_gguf):
    out = run_example("compare_quantizations.py", "--model", fixture_gguf("dense", "f32"), "--tokens", "48")
    rows = {m[0]: (float(m[1]), float(m[2])) for m in
            re.findall(r"^(\w+) +[\d.]+ +([\d.e+-]+) +([\d.]+)%$", out, re.M)}
    assert set(rows) == {"bf16", "q8_0", "q4_0"}, out
    # the fixture's weights are bf16 values: BF16 is exact; Q8_0 is close; Q4_0 is far
    assert rows["bf16"] == (0.0, 100.0)
    assert 0 < rows["q8_0"][0] < 1e-2 and rows["q8_0"][1] >= 80.0
    assert rows["q8_0"][0] < rows["q4_0"][0]


def test_examples_default_to_the_demo_model(demo_cache):
    out = run_example("logit_lens.py", env={"GEMMA4_MLX_CACHE": str(demo_cache)})
    assert "layer  7" in out and "output" in out
