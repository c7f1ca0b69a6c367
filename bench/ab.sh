#!/usr/bin/env bash
# ab.sh — A/B figures of kvbench_attn binaries in one device call, alternating (A B A B ...).
# usage (device machine, packed programs in $GPU_DIR/bin): bash bench/ab.sh NAME... ; one line
# per case and binary: name B d tokens(K) mode ms ms_partial ms_merge. Env as kvbench_attn.
if [ $# -eq 0 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'
  [ $# -eq 0 ] && exit 2 || exit 0
fi
GPU_DIR=${GPU_DIR:-.gpu}
export LD_LIBRARY_PATH=$PWD/$GPU_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for name in "$@"; do
  [ -x "$GPU_DIR/bin/$name" ] || { echo "ab.sh: no program $GPU_DIR/bin/$name" >&2; exit 1; }
done
for rep in 1 2; do
  for name in "$@"; do
    "$GPU_DIR/bin/$name" 2>/dev/null | grep '"mode"' | python3 -c "
import sys, json
for l in sys.stdin:
    d = json.loads(l.strip().rstrip(','))
    if 'sweep' in d: continue
    print('$name', d['B'], d['d'], d['tokens'] // 1024, d['mode'], d['ms'], d['ms_partial'],
          d.get('ms_merge'))"
  done
done
