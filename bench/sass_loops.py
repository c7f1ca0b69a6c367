#!/usr/bin/env python3
"""sass_loops.py — the hot loops of the fast attention kernel, from an object file's SASS.

ptxas re-draws the fast kernel's loops on almost any edit of cuda/attn.cu (docs/perf.md,
sessions 7 and 8): the same loop can come out with IMAD or MOV/IADD3 forms and run 1-2%
faster or slower. This prints, per loop of attn_fast_kernel<D> of at least MIN instructions,
its size and a few counts. Two builds can be compared before any device time is spent:
--against OTHER says, per loop, whether it is identical, identical up to register numbers, or
how many lines differ; --dump PREFIX writes each loop's instructions (addresses and immediates
removed; register numbers too with --regs) to PREFIX.N.

usage: sass_loops.py OBJ [--d 128] [--p16 0|1] [--min 300] [--against OTHER [--against-p16 0|1]]
                      [--dump PREFIX] [--regs]
  OBJ   an object file with sm_90 SASS, e.g. the build's attn.cu.o, or one compiled like it:
        nvcc -O2 -g -DNDEBUG -arch=sm_90 --expt-relaxed-constexpr -lineinfo -Icuda -c
        cuda/attn.cu -o attn.o
Needs cuobjdump (CUDA toolkit; or `pip download nvidia-cuda-cuobjdump-cu13` and unpack):
CUOBJDUMP=path overrides. The first two loops of the d = 128 kernel are the FP8 loop and the
TQ3 loop; the longer "loops" after them are back-edges of out-of-line branch handlers.
"""
import argparse
import difflib
import os
import re
import shutil
import signal
import subprocess
import sys


def kernel(tool, obj, d, p16, warps=None):
    """(address, instruction) of attn_fast_kernel<d, p16, warps> in obj (an object from before
    v36, whose kernel has no warps parameter, matches any warps; one from before v32, whose
    kernel has no p16 parameter, matches with p16 = 0)"""
    run = subprocess.run([tool, "-sass", obj], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit("sass_loops.py: cuobjdump failed on %s: %s" % (obj, run.stderr.strip()))
    if warps is None:
        warps = 4 if int(d) == 256 else 16
    keys = ["attn_fast_kernelILi%sELb%dELi%dEE" % (d, p16, warps),
            "attn_fast_kernelILi%sELb%dEE" % (d, p16)] + (["attn_fast_kernelILi%sEE" % d]
                                                          if not p16 else [])
    ins, on = [], False
    for line in run.stdout.split("\n"):
        if "Function :" in line:
            on = any(k in line for k in keys)
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) if on else None
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    if not ins:
        sys.exit("sass_loops.py: no %s in %s" % (keys[0], obj))
    return ins


def loops(ins, least):
    """the bodies of the backward branches of at least `least` instructions, in order"""
    at = {pc: i for i, (pc, _) in enumerate(ins)}
    out = []
    for i, (pc, text) in enumerate(ins):
        m = re.search(r"BRA\s+.*?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= pc or int(m.group(1), 16) not in at:
            continue
        body = [t for _, t in ins[at[int(m.group(1), 16)]: i + 1]]
        if len(body) >= least:
            out.append((int(m.group(1), 16), pc, [re.sub(r"0x[0-9a-f]+", "X", t) for t in body]))
    return out


def no_regs(body):
    return [re.sub(r"\bU?R\d+|\bU?P\d", "R", t) for t in body]


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` is fine
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("obj")
    ap.add_argument("--d", default="128", help="head_dim of the kernel (64, 128, 256)")
    ap.add_argument("--p16", type=int, default=0, choices=(0, 1),
                    help="the kernel's page-tokens-16 variant (v32: 1 is what kvd's pages run)")
    ap.add_argument("--warps", type=int, help="the kernel's warps per block (v36: 16 or 8 at "
                    "d <= 128, 4 at 256; default 16 / 4); an object from before v36 has one")
    ap.add_argument("--min", type=int, default=300, help="smallest loop to report")
    ap.add_argument("--against", help="another object file: compare its loops with OBJ's")
    ap.add_argument("--against-p16", type=int, choices=(0, 1),
                    help="the variant of OTHER's kernel (default: --p16; an object from before v32"
                    " has only 0)")
    ap.add_argument("--dump", help="write loop N's instructions to DUMP.N")
    ap.add_argument("--regs", action="store_true", help="dumps without register numbers")
    args = ap.parse_args()
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not tool:
        sys.exit("sass_loops.py: cuobjdump not found (set CUOBJDUMP)")
    ins = kernel(tool, args.obj, args.d, args.p16, args.warps)
    mine = loops(ins, args.min)
    other = (loops(kernel(tool, args.against, args.d, args.p16 if args.against_p16 is None
                          else args.against_p16, args.warps), args.min)
             if args.against else [])
    print("attn_fast_kernel<%s, %d%s>: %d instructions"
          % (args.d, args.p16, ", %d" % args.warps if args.warps else "", len(ins)))
    for n, (lo, hi, body) in enumerate(mine):
        def count(pat):
            return sum(1 for t in body if re.match(r"(@!?U?P\w+\s+)?" + pat, t))

        line = "loop %d  %05x-%05x  n=%d  HMMA=%d  IMAD=%d  MOV=%d  LDL/STL=%d" % (
            n, lo, hi, len(body), count("HMMA"), count("IMAD"), count("MOV"),
            count("LDL") + count("STL"))
        if args.against:
            if n >= len(other):
                line += "  | no such loop in the other build"
            elif other[n][2] == body:
                line += "  | identical"
            elif no_regs(other[n][2]) == no_regs(body):
                line += "  | identical up to register numbers"
            else:
                diff = difflib.unified_diff(no_regs(other[n][2]), no_regs(body), n=0)
                lines = sum(1 for t in diff if t[:1] in "+-" and t[:3] not in ("+++", "---"))
                line += "  | differs: %d lines (registers ignored)" % lines
        print(line)
        if args.dump:
            with open("%s.%d" % (args.dump, n), "w") as f:
                f.write("\n".join(no_regs(body) if args.regs else body) + "\n")


if __name__ == "__main__":
    main()
