"""Where a decode step's host time goes, from py-spy's raw (folded) stacks.

On the GPU machine (py-spy from PyPI: `pip download --no-deps py-spy`, installed there with
`pip install --no-index --target DIR`):

    py-spy record --native --rate 250 --format raw -o stacks.txt -- \
        python3 bench/tools/inprocess_ab.py --model 26B-A4B --rounds 1 --steps 32 default= \
        --steady default --steady-seconds 10
    grep steady_decode stacks.txt | gzip > stacks-steady.txt.gz     # what comes back is small

then here:

    python bench/tools/host_profile.py stacks-steady.txt.gz [--frame steady_decode] [--top 40]
        [--children "mlx::core::fast::CustomKernel::eval_gpu"]

Prints each function's inclusive share of the samples whose stack holds --frame (only the frames
below it count: startup, tracing and kernel builds are left out), and with --children what the
named function's samples spend directly below it. py-spy pauses the process to sample it, so
rates under the profiler are lower; the shares are what this reports.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
import sys

_LIB = re.compile(r" \((?:[^()]*\.so[^()]*|[^()]*\.py:\d+)\)$")
_TEMPLATE = re.compile(r"<[^<>]*(?:<[^<>]*>[^<>]*)*>")


def frame_name(frame: str) -> str:
    """A py-spy frame without its library or file:line and with template arguments elided."""
    return _TEMPLATE.sub("<>", _LIB.sub("", frame.strip()))


def read_stacks(path: str, frame: str) -> list[tuple[list[str], int]]:
    """(frames below `frame`, samples) for every stack of the raw file that holds `frame`."""
    opener = gzip.open if path.endswith(".gz") else open
    out = []
    with opener(path, "rt") as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            names = [frame_name(f) for f in stack.split(";")]
            if frame in names:
                out.append((names[names.index(frame) + 1 :], int(count)))
    return out


def inclusive(stacks: list[tuple[list[str], int]]) -> collections.Counter:
    """Samples per function, each stack counted once per function in it."""
    c = collections.Counter()
    for names, n in stacks:
        for name in set(names):
            c[name] += n
    return c


def children(stacks: list[tuple[list[str], int]], parent: str) -> collections.Counter:
    """Samples of `parent` by the function right below it ("(self)" where it is the leaf)."""
    c = collections.Counter()
    for names, n in stacks:
        if parent in names:
            i = names.index(parent)
            c[names[i + 1] if i + 1 < len(names) else "(self)"] += n
    return c


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stacks", help="py-spy --format raw output (optionally .gz)")
    ap.add_argument("--frame", default="steady_decode", help="count only stacks holding this frame")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--children", action="append", default=[], metavar="FUNCTION")
    args = ap.parse_args(argv)
    stacks = read_stacks(args.stacks, args.frame)
    total = sum(n for _, n in stacks)
    if not total:
        print(f"no stack holds {args.frame!r}", file=sys.stderr)
        return 1
    print(f"{total} samples under {args.frame}")
    shown = 0
    for name, n in inclusive(stacks).most_common():
        if shown >= args.top:
            break
        if name.startswith("0x"):  # unsymbolised addresses
            continue
        print(f"{100 * n / total:6.1f}%  {name[:140]}")
        shown += 1
    for parent in args.children:
        below = children(stacks, parent)
        share = 100 * sum(below.values()) / total
        print(f"\n{parent}: {share:.1f}% of the samples; below it (shares of all samples):")
        for name, n in below.most_common(12):
            print(f"{100 * n / total:6.1f}%  {name[:140]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
