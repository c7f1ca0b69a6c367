#!/usr/bin/env python3
"""Print the decode-attention table of a kvbench_attn + torch_sdpa run against the goals."""
import json
import sys


def main(bench_path, sdpa_path):
    b = json.load(open(bench_path))
    try:
        s = json.load(open(sdpa_path))
        dense = {(r["B"], r["d"], r["tokens"]): r["ms"] for r in s["sdpa_bf16"]}
    except (OSError, ValueError, KeyError):
        dense = {}
    copy = b["copy_d2d"]["gbps"]
    print(f"copy ceiling {copy:.0f} GB/s (read+write)")
    print(f"{'B':>2} {'d':>4} {'tokens':>7} {'mode':>4} {'ms':>8} {'GB/s':>7} {'%copy':>6} "
          f"{'dense ms':>8} {'x dense':>7}")
    for r in b["attention"]:
        if "mode" not in r:
            print("  ", json.dumps(r))
            continue
        dm = dense.get((r["B"], r["d"], r["tokens"]))
        sp = f"{dm / r['ms']:7.2f}" if dm else "      -"
        dms = f"{dm:8.4f}" if dm else "       -"
        print(f"{r['B']:>2} {r['d']:>4} {r['tokens']:>7} {r['mode']:>4} {r['ms']:8.4f} "
              f"{r['gbps']:7.0f} {100 * r['gbps'] / copy:5.0f}% {dms} {sp}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
