"""bench/ncu_targets.py on the CPU: each target builds its launch (the kernels are graph_count's
stand-ins, so nothing runs) with the output shape of its layer."""

from __future__ import annotations


def test_matvec_targets_build_their_launches(graph_count, capsys):
    import ncu_targets

    graph_count.pretend_cuda()
    assert ncu_targets.main(["--targets", "gate_up_split,gate_up_split_e4b,down_e4b,fma,gate_up_runs,gate_up_runs_e4b"]) == 0
    out = capsys.readouterr().out
    assert "gate_up_runs: (1, 21504)" in out and "gate_up_runs_e4b: (1, 10240)" in out
    assert "gate_up_split: (1, 21504)" in out and "gate_up_split_e4b: (1, 10240)" in out
    assert "down_e4b: (1, 2560)" in out and "fma: (1, 21504)" in out
