#!/usr/bin/env python3
"""Print the decode-attention table of a kvbench_attn + torch_sdpa run against the goals.

Columns: ms / GB/s / %copy of kvk_cuda_attn_decode (partial + merge); "2pass ms" = the same two
kernels launched through kvk_cuda_attn_partial + kvk_cuda_attn_merge (a repeat measurement of
the same work), "part ms" = the partial kernel alone (so ms − part ≈ the merge and its launch);
x dense = dense ms / ms; "read ms" = a plain read of the same byte count timed the same way,
"%read" = read ms / ms (how close the call comes to reading its bytes and nothing else);
"cold ms" = the call after a read of cold_mb MB (256 in run_gpu.sh) has filled L2 with other
data, as between two layers of an engine (kvbench_attn KVBENCH_COLD_MB; "ms" is back to back),
and the x dense after it = dense ms / cold ms. JSON of older versions without those fields
prints "-"; so does the cold x dense of a cold ms that is not positive (it is a difference of
two timings: a sign the measurement failed). Rows with
"sweep" (decode at other split counts, 32K) and "trace" (timeline probe) follow.

A second table puts issue 4's bandwidth goal (TQ3 and mix at >= 80% of the copy ceiling on
compressed bytes) beside what a call of the required structure (a partial kernel that reads
every byte, then a merge kernel) can reach: "80% ms" = bytes / (0.8 x copy), the time the goal
allows; "floor ms" = read ms + merge ms, a plain read of the same bytes followed by the merge
kernel alone, each timed as a graph of back-to-back calls. When the floor is above the budget,
no partial kernel, however fast its loop, meets the goal at that shape beside this merge
kernel: only a shorter merge (or none) could. "empty" (from empty_kernel_ms, newer runs) = what
is left of the budget after the read and an empty second kernel: the most a partial kernel's
own work beyond reading and the merge's own work could take together, by any design of the
required structure.
"""
import json
import sys


def fmt(v, w=8, p=4):
    return f"{v:{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"


def keys(r):
    """a row's shape, fully and as (B, d, tokens): sweep rows of older runs carry no heads"""
    return [(r["B"], r.get("q_heads"), r.get("kv_heads"), r["d"], r["tokens"]),
            (r["B"], r["d"], r["tokens"])]


def main(bench_path, sdpa_path):
    b = json.load(open(bench_path))
    try:
        s = json.load(open(sdpa_path))
        dense = {k: r["ms"] for r in s["sdpa_bf16"] for k in keys(r)}
    except (OSError, ValueError, KeyError):
        dense = {}
    copy = b["copy_d2d"]["gbps"]
    print(f"copy ceiling {copy:.0f} GB/s (read+write)")
    print(f"{'B':>2} {'d':>4} {'tokens':>7} {'mode':>4} {'sp':>3} {'ms':>8} {'GB/s':>7} "
          f"{'%copy':>6} {'2pass ms':>8} {'part ms':>8} {'read ms':>8} {'%read':>5} "
          f"{'dense ms':>8} {'x dense':>7} {'cold ms':>8} {'x dense':>7}")
    extra = []
    for r in b["attention"]:
        if "mode" not in r or r.get("sweep"):
            extra.append(r)
            continue
        dm = next((dense[k] for k in keys(r) if k in dense), None)
        sp = f"{dm / r['ms']:7.2f}" if dm else "      -"
        rd = r.get("read_ms")
        pr = f"{100 * rd / r['ms']:4.0f}%" if rd else "    -"
        cold = r.get("ms_cold")
        ok = isinstance(cold, (int, float)) and cold > 0
        cp = f"{dm / cold:7.2f}" if dm and ok else "      -"
        print(f"{r['B']:>2} {r['d']:>4} {r['tokens']:>7} {r['mode']:>4} {r['splits']:>3} "
              f"{r['ms']:8.4f} {r['gbps']:7.0f} {100 * r['gbps'] / copy:5.0f}% "
              f"{fmt(r.get('ms_two_pass'))} {fmt(r.get('ms_partial'))} {fmt(rd)} {pr} "
              f"{fmt(dm)} {sp} {fmt(cold)} {cp}")
    goal_table(b["attention"], copy, b.get("empty_kernel_ms"))
    for r in extra:
        if r.get("sweep") and "ms" in r:
            dm = next((dense[k] for k in keys(r) if k in dense), None)
            sp = f"{dm / r['ms']:6.2f}" if dm else "     -"
            print(f"sweep {r['B']:>2} {r['d']:>4} {r['tokens']:>7} {r['mode']:>4} "
                  f"splits {r['splits']:>3} {r['ms']:8.4f} ms {100 * r['gbps'] / copy:5.0f}% "
                  f"x dense {sp}")
        else:
            print("  ", json.dumps(r))


def goal_table(rows, copy, empty):
    rows = [r for r in rows if r.get("mode") in ("tq3", "mix") and not r.get("sweep")
            and r.get("tokens", 0) >= 32768 and isinstance(r.get("bytes"), int)]
    if not rows:
        return
    print("80% of copy (TQ3, mix, >= 32K): budget, and the floor of partial + merge")
    print(f"{'B':>2} {'d':>4} {'tokens':>7} {'mode':>4} {'ms':>8} {'80% ms':>8} {'read ms':>8} "
          f"{'merge ms':>8} {'floor ms':>8} {'empty':>6}  verdict")
    for r in rows:
        budget = r["bytes"] / (0.8 * copy * 1e9) * 1e3
        rd, mg = r.get("read_ms"), r.get("ms_merge")
        num = (int, float)
        floor = rd + mg if isinstance(rd, num) and isinstance(mg, num) else None
        left = budget - rd - empty if isinstance(rd, num) and isinstance(empty, num) else None
        lf = f"{1e3 * left:5.1f}u" if left is not None else f"{'-':>6}"
        if r["ms"] <= budget:
            verdict = "met"
        elif floor is None:
            verdict = "missed"
        elif floor > budget:
            verdict = "missed; read + this merge exceed the budget"
        else:
            verdict = f"missed by {1e3 * (r['ms'] - budget):.1f} us; floor leaves " \
                      f"{1e3 * (budget - floor):.1f} us for the rest"
        print(f"{r['B']:>2} {r['d']:>4} {r['tokens']:>7} {r['mode']:>4} {r['ms']:8.4f} "
              f"{budget:8.4f} {fmt(rd)} {fmt(mg)} {fmt(floor)} {lf}  {verdict}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
