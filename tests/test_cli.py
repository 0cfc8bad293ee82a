"""The CLI `python -m gemma4_mlx.generate`: output format, flags, defaults, and one-line errors."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import gemma4_mlx  # noqa: F401  (first: MLX's CPU BLAS)
import pytest

from gemma4_mlx import demo
from gemma4_mlx.generate import main
from gemma4_mlx.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
STATS = re.compile(r"\n==========\nPrompt: (\d+) tokens, [\d.]+ tokens-per-sec\n"
                   r"Generation: (\d+) tokens, [\d.]+ tokens-per-sec\nPeak memory: [\d.]+ GB\n$")


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    """A GEMMA4_MLX_CACHE directory holding the demo model (built once per session)."""
    directory = tmp_path_factory.getbasetemp() / "gemma4-demo-cache"
    demo.demo_path(directory, announce=False)
    return directory


def run_cli(*args, env=None, stdin=None, timeout=120):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "gemma4_mlx.generate", *map(str, args)], cwd=REPO, env=full_env,
                          input=stdin, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(stderr: str, *fragments: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_end_to_end_on_a_fixture_gguf(fixture_gguf):
    r = run_cli("--model", fixture_gguf("dense", "q8_0"), "--prompt", "Hello there", "-m", "12", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("==========\n")
    m = STATS.search(r.stdout)
    assert m, r.stdout
    assert 1 <= int(m.group(2)) <= 12
    text = r.stdout[len("==========\n"):m.start()]
    assert text.strip(), r.stdout
    # the same greedy run, text only
    quiet = run_cli("--model", fixture_gguf("dense", "q8_0"), "--prompt", "Hello there", "-m", "12", "--temp", "0",
                    "--verbose", "False")
    assert quiet.returncode == 0 and "==========" not in quiet.stdout
    assert quiet.stdout == text + "\n"


def test_demo_model_and_stdin_prompt(demo_cache):
    r = run_cli("--model", "demo", "-p", "-", "-m", "8", "--seed", "1", env={"GEMMA4_MLX_CACHE": str(demo_cache)},
                stdin="Hello from stdin")
    assert r.returncode == 0, r.stderr
    m = STATS.search(r.stdout)
    assert m, r.stdout
    assert int(m.group(1)) > len("Hello from stdin".split())  # chat template + the stdin text


def test_errors_are_one_line_and_exit_1_in_a_real_process(tmp_path):
    r = run_cli("--model", tmp_path / "missing.gguf")
    assert r.returncode == 1
    assert_one_line_error(r.stderr, str(tmp_path / "missing.gguf"), "no such file")
    assert r.stdout == ""


def test_error_cases(tmp_path, capsys, fixture_gguf, dense_fixture):
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(dense_fixture.hf_dir / "config.json", no_weights)
    corrupt = tmp_path / "corrupt.gguf"
    good = fixture_gguf("dense", "q8_0").read_bytes()
    corrupt.write_bytes(good[:4096])
    model = fixture_gguf("dense", "q8_0")
    cases = [
        (["--model", str(tmp_path / "nothing-here")], [str(tmp_path / "nothing-here"), "no such file"]),
        (["--model", str(no_weights)], [str(no_weights), "no weights"]),
        (["--model", str(corrupt)], [str(corrupt), "GGUF"]),
        (["--model", str(model), "--chat-template-args", "{not json"], ["--chat-template-args", "JSON"]),
        (["--model", str(model), "--chat-template-args", "[1, 2]"], ["JSON object"]),
        (["--model", str(model), "--temp", "-1"], ["temperature"]),
        (["--model", str(model), "--prompt", "x " * 40, "--max-kv-size", "8"], ["does not fit", "--max-kv-size"]),
    ]
    for argv, fragments in cases:
        assert main(argv) == 1, argv
        captured = capsys.readouterr()
        assert_one_line_error(captured.err, *fragments)
        assert "==========" not in captured.out


def test_flags_reach_generation(fixture_gguf, dense_fixture, capsys):
    model = str(fixture_gguf("dense", "q8_0"))
    base = ["--model", model, "--prompt", "Hello", "--verbose", "False"]
    # the file's general.sampling.* (temp 1.0, top-p 0.95, top-k 64) are the defaults: seeded runs repeat
    assert main([*base, "-m", "16", "--seed", "3"]) == 0
    a = capsys.readouterr().out
    assert main([*base, "-m", "16", "--seed", "3"]) == 0
    assert capsys.readouterr().out == a
    assert main([*base, "-m", "16", "--seed", "4"]) == 0
    assert capsys.readouterr().out != a
    # --max-kv-size bounds the generation (prompt + new tokens - 1 <= size) and finishes cleanly
    assert main(["--model", model, "--prompt", "Hello", "-m", "50", "--max-kv-size", "30", "--temp", "0",
                 "--ignore-chat-template"]) == 0
    m = STATS.search(capsys.readouterr().out)
    assert m and int(m.group(1)) + int(m.group(2)) - 1 <= 30
    # chat template switches and JSON args are accepted; --ignore-chat-template feeds <bos> + text only
    assert main([*base, "-m", "4", "--system-prompt", "Be brief.", "--enable-thinking",
                 "--chat-template-args", '{"enable_thinking": false}', "--repetition-penalty", "1.2",
                 "--top-k", "5", "--min-p", "0.1", "--dtype", "float32"]) == 0
    capsys.readouterr()
    assert main(["--model", model, "--prompt", "Hello", "-m", "1", "--ignore-chat-template"]) == 0
    m = STATS.search(capsys.readouterr().out)
    tokenizer = Tokenizer.from_hf_dir(dense_fixture.hf_dir)
    assert m and int(m.group(1)) == 1 + len(tokenizer.encode("Hello"))  # <bos> "Hello"


def test_repo_id_from_the_local_hf_cache(tmp_path, fixture_gguf):
    """A repo id resolves through the HF cache layout (refs/main -> snapshots/<commit>), never the network."""
    snapshot = tmp_path / "hub" / "models--someorg--tiny-gemma4-GGUF" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    shutil.copy(fixture_gguf("dense", "q8_0"), snapshot / "tiny-Q8_0.gguf")
    shutil.copy(fixture_gguf("dense", "q4_0"), snapshot / "tiny-Q4_0.gguf")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    r = run_cli("--model", "someorg/tiny-gemma4-GGUF:Q4_0", "-m", "3", "--temp", "0", env=env)
    assert r.returncode == 0, r.stderr
    assert STATS.search(r.stdout)
    r = run_cli("--model", "someorg/tiny-gemma4-GGUF", "-m", "3", env=env)
    assert r.returncode == 1
    assert_one_line_error(r.stderr, "several GGUF files", "REPO:QUANT")
    r = run_cli("--model", "someorg/absent", "-m", "3", env=env)
    assert r.returncode == 1
    assert_one_line_error(r.stderr, "someorg/absent", "not in the local Hugging Face cache")
