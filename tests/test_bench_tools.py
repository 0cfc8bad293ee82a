"""bench/tools/ab_decode.sh on the CPU (decode.py --quick): every setting runs in its own process
with its environment, in turn, and leaves its JSON and a printed tokens/s row. bench/tools/memcheck.sh
with a stand-in compute-sanitizer: its arguments (a limit, then files or node ids) and its verdicts.
bench/tools/dynamic_smem_probe.py refuses a build without CUDA. bench/tools/kernel_sass.py: its loop
counter on a hand-written SASS listing, and the CUDA source it compiles. bench/tools/inprocess_ab.py:
settings alternated in one process, each traced under its own environment. bench/tools/host_profile.py:
shares of py-spy's folded stacks below one frame. bench/tools/generate_paths.py: its three
decode paths timed in turn. bench/tools/gpu_suite.sh: its two parts, its log
and verdict counts, and its usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ab_decode_alternates_settings(tmp_path):
    env = {**os.environ, "AB_ARGS": "--quick --steps 4 --warmup 1", "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "bench/tools/ab_decode.sh"), str(tmp_path), "1", "tiny-dense", "32",
                        "plain=", "ref=GEMMA4_MLX_KERNELS=reference", "bad=GEMMA4_MLX_KERNELS=bogus"],
                       env=env, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "plain round 1 (rc 0):" and "ref round 1 (rc 0):" in lines
    assert "bad round 1 (rc 1):" in lines  # its environment reached it: decode.py refused the value
    assert sum(line.startswith("| tiny-dense | 32 |") for line in lines) == 2
    for label in ("plain", "ref"):
        doc = json.loads((tmp_path / f"ab-{label}-1.json").read_text())
        assert doc["rows"][0]["model"] == "tiny-dense" and doc["rows"][0]["gemma4_mlx"]["tok_s"] > 0


def _inprocess_ab(tmp_path, *settings):
    cmd = [sys.executable, str(ROOT / "bench/tools/inprocess_ab.py"), "--model", "tiny-moe", "--context", "16",
           "--rounds", "3", "--steps", "3", "--warmup", "1", "--out", str(tmp_path / "ab.json"), *settings]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip


def test_inprocess_ab_alternates_settings_in_one_process(tmp_path):
    r = _inprocess_ab(tmp_path, "plain=", "ref=GEMMA4_MLX_KERNELS=reference", "--steady", "ref", "--steady-seconds", "0.2")
    assert r.returncode == 0, r.stderr
    rounds = [line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("round ")]
    assert rounds == ["round 1 plain", "round 1 ref", "round 2 ref", "round 2 plain", "round 3 plain", "round 3 ref"]
    doc = json.loads((tmp_path / "ab.json").read_text())
    assert doc["settings"] == {"plain": {}, "ref": {"GEMMA4_MLX_KERNELS": "reference"}}
    assert all(len(doc["rows"][k]) == 3 and doc["summary"][k]["median_tok_s"] > 0 for k in ("plain", "ref"))
    assert doc["steady"]["label"] == "ref" and doc["steady"]["tokens"] > 0


def test_inprocess_ab_traces_each_setting_under_its_environment(tmp_path):
    r = _inprocess_ab(tmp_path, "plain=", "bad=GEMMA4_MLX_KERNELS_OFF=bogus")
    assert r.returncode != 0 and "unknown kernel families" in r.stderr  # the setting reached the trace
    r = _inprocess_ab(tmp_path, "plain=", "plain=GEMMA4_MLX_KERNELS=reference")
    assert r.returncode != 0 and "labels must differ" in r.stderr


def test_generate_paths_times_its_three_paths_in_turn(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench/tools/generate_paths.py"), "--model", "tiny-dense", "--prompt", "8",
           "--tokens", "6", "--rounds", "2", "--out", str(tmp_path / "gp.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    rounds = [line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("round ")]
    assert rounds == ["round 1 compiled", "round 1 prompt_cache", "round 1 eager",
                      "round 2 prompt_cache", "round 2 eager", "round 2 compiled"]  # fmt: skip
    doc = json.loads((tmp_path / "gp.json").read_text())
    paths = ("compiled", "prompt_cache", "eager")
    assert all(len(doc["rows"][k]) == 2 and all(x["tokens"] == 6 for x in doc["rows"][k]) for k in paths)
    assert doc["summary"]["prompt_cache_over_eager"] > 0 and isinstance(doc["compiled_step_used"], bool)


def test_host_profile_counts_only_stacks_below_the_frame(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "bench" / "tools"))
    import host_profile

    raw = tmp_path / "stacks.txt"
    raw.write_text(
        "<module> (x.py:1);main (x.py:2);build (x.py:3);nvrtcCompileProgram (libnvrtc.so) 50\n"
        "<module> (x.py:1);steady_decode (x.py:9);mlx::core::eval_impl (libmlx.so);"
        "mlx::core::fast::CustomKernel::eval_gpu (libmlx.so);std::_Hash_bytes (libstdc++.so.6) 3\n"
        "<module> (x.py:1);steady_decode (x.py:9);mlx::core::eval_impl (libmlx.so);"
        "mlx::core::fast::CustomKernel::eval_gpu (libmlx.so) 1\n"
        "<module> (x.py:1);steady_decode (x.py:9);mlx::core::eval_impl (libmlx.so);"
        "std::vector<mlx::core::array, std::allocator<mlx::core::array> >::_M_realloc_insert<int> (libmlx.so) 4\n"
    )
    stacks = host_profile.read_stacks(str(raw), "steady_decode")
    assert sum(n for _, n in stacks) == 8  # the startup stack (nvrtc) is not counted
    inc = host_profile.inclusive(stacks)
    assert inc["mlx::core::eval_impl"] == 8 and inc["mlx::core::fast::CustomKernel::eval_gpu"] == 4
    assert inc["std::vector<>::_M_realloc_insert<>"] == 4
    below = host_profile.children(stacks, "mlx::core::fast::CustomKernel::eval_gpu")
    assert below == {"std::_Hash_bytes": 3, "(self)": 1}
    assert host_profile.main([str(raw), "--children", "mlx::core::fast::CustomKernel::eval_gpu"]) == 0
    out = capsys.readouterr().out
    assert "8 samples under steady_decode" in out and " 50.0%  mlx::core::fast::CustomKernel::eval_gpu" in out
    assert "mlx::core::fast::CustomKernel::eval_gpu: 50.0% of the samples" in out and " 37.5%  std::_Hash_bytes" in out
    assert host_profile.main([str(raw), "--frame", "nowhere"]) == 1


_FAKE_SANITIZER = """#!/usr/bin/env bash
# stand-in for compute-sanitizer: report the planted write, else say what pytest was asked to run
for a in "$@"; do case "$a" in *planted_oob.py) echo "========= Invalid __global__ write of size 4 bytes"; exit 0;; esac; done
echo "ran: ${@: -1}"
echo "asked: $*"
case "${@: -1}" in *bad*) echo "========= Invalid __global__ read of size 4 bytes"; echo "========= ERROR SUMMARY: 1 error"; exit 9;; esac
echo "========= ERROR SUMMARY: 0 errors"; echo "1 passed"
"""


def test_memcheck_takes_files_and_node_ids(tmp_path):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(_FAKE_SANITIZER)
    fake.chmod(0o755)
    env = {**os.environ, "COMPUTE_SANITIZER": str(fake)}
    node_log = Path("/tmp/memcheck-test_kernels_gpu-test_dense_kernels.txt")  # memcheck.sh's log of that node id
    node_log.unlink(missing_ok=True)
    args = ["bash", str(ROOT / "bench/tools/memcheck.sh"), "30", "tests/test_norm_gpu.py",
            "tests/test_kernels_gpu.py::test_dense_kernels", "tests/test_bad_gpu.py"]  # fmt: skip
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60, check=False)
    lines = r.stdout.splitlines()
    assert r.returncode == 1, r.stdout  # one file with an error fails the run
    assert "tests/test_norm_gpu.py: rc 0; ========= ERROR SUMMARY: 0 errors; 1 passed" in lines
    assert "tests/test_kernels_gpu.py::test_dense_kernels: rc 0; ========= ERROR SUMMARY: 0 errors; 1 passed" in lines
    assert any(line.startswith("tests/test_bad_gpu.py: rc 9;") for line in lines)
    assert any("Invalid __global__ read" in line for line in lines)
    assert "ran: tests/test_kernels_gpu.py::test_dense_kernels" in node_log.read_text()  # reached pytest whole
    # without a reported planted write nothing else counts
    fake.write_text("#!/usr/bin/env bash\necho '========= ERROR SUMMARY: 0 errors'\n")
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "did not report the planted write" in r.stdout


def test_memcheck_runs_other_tools_over_selected_tests(tmp_path):
    """TOOLS runs each compute-sanitizer tool in turn over every file, PYTEST_K selects tests."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(_FAKE_SANITIZER)
    fake.chmod(0o755)
    env = {**os.environ, "COMPUTE_SANITIZER": str(fake), "TOOLS": "memcheck racecheck", "PYTEST_K": "mma8 or wide"}
    args = ["bash", str(ROOT / "bench/tools/memcheck.sh"), "30", "tests/test_registry_cases_gpu.py"]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60, check=False)
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stdout
    assert "tests/test_registry_cases_gpu.py: rc 0; ========= ERROR SUMMARY: 0 errors; 1 passed" in lines
    assert "tests/test_registry_cases_gpu.py (racecheck): rc 0; ========= ERROR SUMMARY: 0 errors; 1 passed" in lines
    asked = Path("/tmp/racecheck-test_registry_cases_gpu.txt").read_text()
    assert "--tool racecheck" in asked and "-k mma8 or wide tests/test_registry_cases_gpu.py" in asked


def test_dynamic_smem_probe_needs_cuda():
    r = subprocess.run([sys.executable, str(ROOT / "bench/tools/dynamic_smem_probe.py")], capture_output=True, text=True,
                       timeout=120, check=False)  # fmt: skip
    assert r.returncode == 2 and "needs MLX's CUDA backend" in r.stdout


def test_kernel_sass_attention_instances():
    """--family attention: g4_attn_decode_mma at the layer's default plan, and g4_attn_decode_mma8
    where the layer has at most 8 query rows per kv head."""
    sys.path.insert(0, str(ROOT / "bench" / "tools"))
    import kernel_sass

    units = kernel_sass.attention_instances(32, 4, 512)  # 31B full
    assert [(spec.name, list(inst)) for spec, inst in units] == [("g4_attn_decode_mma", ["k_mma"]),
                                                                 ("g4_attn_decode_mma8", ["k_mma8"])]  # fmt: skip
    assert dict(units[1][1]["k_mma8"])["G"] == 8
    assert [spec.name for spec, _ in kernel_sass.attention_instances(16, 1, 512)] == ["g4_attn_decode_mma"]  # 12B


def test_kernel_sass_counts_mma_loops():
    sys.path.insert(0, str(ROOT / "bench" / "tools"))
    import kernel_sass

    sass = """
\t\tFunction : _ZN3mlx4core2cu8k_s3_w16EPK
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS R2, [R3] ;
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, RZ ;
        /*0030*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0040*/              @!P0 BRA 0x10 ;
        /*0050*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0060*/               @P1 BRA 0x50 ;
        /*0070*/                   EXIT ;
"""
    loops = kernel_sass.mma_loops(sass, ["k_s3_w1", "k_s3_w16"])  # the longest name the header holds
    assert list(loops) == ["k_s3_w16"] and len(loops["k_s3_w16"]) == 1  # the mma-free loop is not one
    body = loops["k_s3_w16"][0]
    assert len(body) == 4 and kernel_sass.opcode_counts(body) == {"HMMA": 2, "LDS": 1, "BRA": 1}
    from custom_kernels import moe_experts as me

    spec, instances = kernel_sass.moe_instances(8, 704, 2816)
    src = kernel_sass.cuda_source(spec, {"k_s3_w16": instances["k_s3_w16"], "k_s2_w8": instances["k_s2_w8"]})
    assert src.count("__global__ void k_s") == 2
    assert "constexpr int SETS = 3;" in src and "constexpr int NW = 8;" in src
    spec, instances = kernel_sass.tiles_instances("gate_up", 21504, 5376)
    assert [dict(t)["BI"] for t in instances.values()] == [0, 2] and spec.name == "g4_q4_0_gate_up_tiles"


def test_gpu_suite_parts_and_their_log(tmp_path):
    """bench/tools/gpu_suite.sh: the kernels part runs the GPU tests but tests/test_model_gpu.py (on
    this CPU machine they skip), writes the verbose log to $OUT and counts its verdicts; the model
    part needs the fixture GGUFs' directory, and an unknown part is a usage error."""
    script = str(ROOT / "bench/tools/gpu_suite.sh")
    env = {**os.environ, "OUT": str(tmp_path), "WORKERS": "0", "PYTHON": sys.executable}
    env.pop("GEMMA4_FIXTURE_GGUFS", None)
    r = subprocess.run(["bash", script, "kernels", "-k", "registry_case or test_model_gpu"], env=env,
                       capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[:3] == ["PASSED 0", "FAILED 0", "ERROR 0"] and lines[3].startswith("SKIPPED ")
    assert int(lines[3].split()[1]) > 0 and "skipped" in lines[-1]
    log = (tmp_path / "gpu-suite-kernels.txt").read_text()
    assert "test_registry_cases_gpu.py::" in log and "test_model_gpu.py::" not in log
    for part in ("model", "bogus"):
        r = subprocess.run(["bash", script, part], env=env, capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 2 and ("GEMMA4_FIXTURE_GGUFS" in r.stdout if part == "model" else "usage" in r.stdout)
