#!/usr/bin/env python3
"""sass_loops.py — the hot loops of the fast attention kernel, from an object file's SASS.

ptxas re-draws the fast kernel's loops on almost any edit of cuda/attn.cu (docs/perf.md,
sessions 7 and 8): the same loop can come out with IMAD or MOV/IADD3 forms and run 1-2%
faster or slower. This prints, per loop of attn_fast_kernel<D> of at least MIN instructions,
its size and a few counts, and with --dump PREFIX writes each loop's instructions (addresses
and immediates removed) to PREFIX.N, so that two builds can be compared before any device
time is spent: `cmp` of the dumps says whether a change left a loop's code alone, and
`--regs` ignores register numbering.

usage: sass_loops.py OBJ [--d 128] [--min 300] [--dump PREFIX] [--regs]
  OBJ   an object file with sm_90 SASS, e.g. the build's attn.cu.o, or one compiled like it:
        nvcc -O2 -g -DNDEBUG -arch=sm_90 --expt-relaxed-constexpr -lineinfo -Icuda -c
        cuda/attn.cu -o attn.o
Needs cuobjdump (CUDA toolkit; or `pip download nvidia-cuda-cuobjdump-cu13` and unpack):
CUOBJDUMP=path overrides. The first two loops of the d = 128 kernel are the FP8 loop and the
TQ3 loop; the longer "loops" after them are back-edges of out-of-line branch handlers.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` is fine
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("obj")
    ap.add_argument("--d", default="128", help="head_dim of the kernel (64, 128, 256)")
    ap.add_argument("--min", type=int, default=300, help="smallest loop to report")
    ap.add_argument("--dump", help="write loop N's instructions to DUMP.N")
    ap.add_argument("--regs", action="store_true", help="dumps without register numbers")
    args = ap.parse_args()
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not tool:
        sys.exit("sass_loops.py: cuobjdump not found (set CUOBJDUMP)")
    run = subprocess.run([tool, "-sass", args.obj], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit("sass_loops.py: cuobjdump failed: " + run.stderr.strip())
    key = "attn_fast_kernelILi%sEE" % args.d
    ins, on = [], False
    for line in run.stdout.split("\n"):
        if "Function :" in line:
            on = key in line
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) if on else None
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    if not ins:
        sys.exit("sass_loops.py: no %s in %s" % (key, args.obj))
    at = {pc: i for i, (pc, _) in enumerate(ins)}
    print("attn_fast_kernel<%s>: %d instructions" % (args.d, len(ins)))
    n = 0
    for i, (pc, text) in enumerate(ins):
        m = re.search(r"BRA\s+.*?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= pc or int(m.group(1), 16) not in at:
            continue
        body = [t for _, t in ins[at[int(m.group(1), 16)]: i + 1]]
        if len(body) < args.min:
            continue

        def count(pat):
            return sum(1 for t in body if re.match(r"(@!?U?P\w+\s+)?" + pat, t))

        print("loop %d  %05x-%05x  n=%d  HMMA=%d  IMAD=%d  MOV=%d  S2R=%d  LDL/STL=%d"
              % (n, int(m.group(1), 16), pc, len(body), count("HMMA"), count("IMAD"),
                 count("MOV"), count("S2R"), count("LDL") + count("STL")))
        if args.dump:
            norm = [re.sub(r"0x[0-9a-f]+", "X", t) for t in body]
            if args.regs:
                norm = [re.sub(r"\bU?R\d+|\bU?P\d", "R", t) for t in norm]
            with open("%s.%d" % (args.dump, n), "w") as f:
                f.write("\n".join(norm) + "\n")
        n += 1


if __name__ == "__main__":
    main()
