"""Peak memory while loading a checkpoint, against the final weight memory (issue: load <= 1.25x).

Each load runs in a fresh subprocess and reports MLX's peak and final memory and the process's
peak RSS (which also counts the pages of the memory-mapped GGUF that were read):

    python bench/load_memory.py --hf DIR [--gguf FILE ...] [--dtype bfloat16]

Writes bench/results/load_memory-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

CHILD = r"""
import json, resource, sys
import gemma4_mlx
import mlx.core as mx
from gemma4_mlx.checkpoint import load_gguf, load_hf
kind, path, dtype = sys.argv[1], sys.argv[2], getattr(mx, sys.argv[3])
mx.reset_peak_memory()
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = load_hf(path, dtype=dtype, progress=False) if kind == "hf" else load_gguf(path, dtype=dtype, progress=False)[0]
from mlx.utils import tree_flatten
weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
print(json.dumps(dict(kind=kind, path=path, dtype=sys.argv[3], weight_bytes=weights,
                      mlx_peak=mx.get_peak_memory(), mlx_active=mx.get_active_memory(),
                      rss_peak_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rss_before_kb=rss0)))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", action="append", default=[], help="HF safetensors directory")
    ap.add_argument("--gguf", action="append", default=[], help="GGUF file")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for kind, paths in (("hf", args.hf), ("gguf", args.gguf)):
        for path in paths:
            r = subprocess.run([sys.executable, "-c", CHILD, kind, path, args.dtype], capture_output=True, text=True)
            if r.returncode:
                print(r.stderr, file=sys.stderr)
                return 1
            row = json.loads(r.stdout.strip().splitlines()[-1])
            row["mlx_peak_over_weights"] = row["mlx_peak"] / row["weight_bytes"]
            row["rss_growth_over_weights"] = (row["rss_peak_kb"] - row["rss_before_kb"]) * 1024 / row["weight_bytes"]
            rows.append(row)
            print(f"{kind:5} {os.path.basename(path):28} weights {row['weight_bytes'] / 1e9:6.3f} GB  "
                  f"MLX peak {row['mlx_peak'] / 1e9:6.3f} GB ({row['mlx_peak_over_weights']:.3f}x)  "
                  f"RSS growth {row['rss_growth_over_weights']:.3f}x "
                  f"(+{((row['rss_peak_kb'] - row['rss_before_kb']) * 1024 - row['weight_bytes']) / 1e6:.0f} MB over the weights)")
    import mlx.core as mx

    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"load_memory-{datetime.date.today().isoformat()}.json")
    with open(out, "w") as f:
        json.dump(dict(hardware=dict(platform=platform.platform(), cpus=os.cpu_count(),
                                     device=str(mx.default_device())),
                       versions=dict(mlx=mx.__version__), dtype=args.dtype, rows=rows), f, indent=1)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
