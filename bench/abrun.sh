#!/usr/bin/env bash
# abrun.sh — bench/ab.sh repeated N times, then the median per case and binary, so that a 1-2%
# difference between kernel variants can be told from noise (session 7: 4 samples each).
# usage (device machine): bash bench/abrun.sh N NAME... ; raw lines go to ${OUT:-.}/ab.txt,
# one summary line per case: B d tokens(K) mode name, median ms, median ms_partial, samples.
# Env: LENS=32768,... (default 32768), GPU_DIR as ab.sh.
if [ $# -lt 2 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
  [ "$1" = -h ] || [ "$1" = --help ] && exit 0 || exit 2
fi
n=$1
shift
case $n in '' | *[!0-9]*) echo "abrun.sh: N must be a count, got '$n'" >&2; exit 2 ;; esac
raw=${OUT:-.}/ab.txt
for _ in $(seq "$n"); do
  KVBENCH_LENS=${LENS:-32768} KVBENCH_SWEEP=0 bash "$(dirname "$0")/ab.sh" "$@" || exit 1
done > "$raw"
python3 - "$raw" <<'PY'
import collections, statistics as st, sys
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    d[(f[1], f[2], f[3], f[4], f[0])].append((float(f[5]), float(f[6])))
for k in sorted(d):
    v = d[k]
    print(*k, 'ms med %.4f' % st.median(x[0] for x in v),
          'part med %.4f' % st.median(x[1] for x in v), ' '.join('%.4f' % x[0] for x in v))
PY
