#!/usr/bin/env python3
"""trace_dump.py — per-block phase times from the raw timeline dumps of kvbench_attn.

kvbench_attn built with -DKVK_ATTN_TRACE (and attn.cu with it) and run with
KVBENCH_TRACE_DUMP=dir writes dir/<case>.bin: per block 16 little-endian u64 records (clock64 at
the TRACE points of cuda/attn.cu, %globaltimer ns at 10 / 11, SM id at 12). This prints, per
all-TQ3 case of a -DKVK_ATTN_TRACE_FINE build, the mean cycles between consecutive points of
the TQ3 phase, and the kernel span, as one JSON line each. Slot 14 means "query arrival"
(prologue) in a KVK_ATTN_TRACE_FINE=2 build, "first head combined" (epilogue) in a =1 build and
"first tile requested" (prologue, after the first directory refill) in a =3 build;
only the segment that fits its build's order is meaningful.

usage: trace_dump.py DIR [DIR...]
"""
import glob
import json
import os
import struct
import sys

# (name, from slot, to slot) in execution order of a block that runs only the TQ3 phase
SEGMENTS = [
    ("prescan", 0, 1),
    ("issue_first_tiles", 1, 2),
    ("first_tile_issued", 1, 14),  # KVK_ATTN_TRACE_FINE=3 builds
    ("other_first_tiles", 14, 2),  # KVK_ATTN_TRACE_FINE=3 builds
    ("query_arrival", 2, 14),  # KVK_ATTN_TRACE_FINE=2 builds
    ("query_rotate", 2, 3),
    ("query_barrier", 3, 4),
    ("query_operands", 4, 5),
    ("loop", 5, 6),
    ("warp_reduce_barrier", 6, 15),
    ("partials_to_smem", 15, 9),
    ("weights", 9, 13),
    ("combine_first_head", 13, 14),  # KVK_ATTN_TRACE_FINE=1 builds
    ("combine_unrotate_store", 13, 7),
    ("exit", 7, 8),
]


def summarize(path):
    raw = open(path, "rb").read()
    n = len(raw) // (16 * 8)
    recs = [struct.unpack_from("<16Q", raw, 128 * b) for b in range(n)]
    recs = [r for r in recs if r[10] and r[11]]
    out = {"case": os.path.basename(path)[:-4], "blocks": len(recs)}
    if not recs:
        return out
    g0 = min(r[10] for r in recs)
    out["span_us"] = round((max(r[11] for r in recs) - g0) / 1e3, 2)
    out["first_end_us"] = round((min(r[11] for r in recs) - g0) / 1e3, 2)
    ends = sorted((r[11] - g0) / 1e3 for r in recs)
    out["end_p50_us"] = round(ends[len(ends) // 2], 2)
    seg = {}
    for name, a, b in SEGMENTS:
        vals = [r[b] - r[a] for r in recs if r[a] and r[b] and r[b] >= r[a]]
        if vals:
            seg[name] = round(sum(vals) / len(vals) / 1e3, 2)
    out["kcycles"] = seg
    return out


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(sys.argv) > 1 else 2
    for d in sys.argv[1:]:
        for p in sorted(glob.glob(os.path.join(d, "*.bin"))):
            print(json.dumps(summarize(p)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
