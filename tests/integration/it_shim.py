#!/usr/bin/env python3
"""it_shim.py — the Python binding of libkvshim (engine-shim/python/kvshim.py) against the real
daemon on the host backend, the same flow as it_shim.c's first test:

  A (this process) starts kvd on a temporary ipc endpoint, begins a 2.5-page prompt (nothing
  cached), appends every layer (array('f') for K, bytes of float16 for V in layer 1: the
  binding's buffer paths), commits (2 pages sealed) and attends. B (a second process, a fresh
  interpreter running this file with --child) begins the same prompt while A still holds its
  sequence: 2 pages cached, its table starts with A's pages, it computes the last 8 tokens and
  its attention output equals A's bit for bit. Errors surface as KvsError with the shim's
  message. The daemon is stopped with SIGTERM and must exit 0; the directory is removed.

  Then the binding's own checks (review of the engine shim, /tmp/rev-shim-work e10): a layer,
  q_heads or token id that ctypes would truncate, an unknown dtype and an empty prompt raise
  ValueError before the call (a layer of 2**32 used to write layer 0); a daemon error names
  its code once; Seq.end() raises when the daemon does not confirm (it used to ignore it).

usage: it_shim.py --kvd PATH --lib LIBKVSHIM --pydir DIR   (ctest passes these)
"""

import argparse
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from array import array

PT, LAYERS, KVH, HD, QH, NTOK = 16, 2, 2, 64, 4, 40


def prompt():
    return [100000 + 5000 + i * 13 for i in range(NTOK)]


def kv_value(layer, pos, kind, h, i):
    """Multiples of 1/16 in [-1.875, 1.875]: exact in float16, as it_shim.c's values."""
    x = pos * 131 + layer * 31 + kind * 17 + h * 7 + i * 3
    return ((x % 61) - 30) / 16.0


def fill(seq, start, m):
    """K as array('f'); V of layer 1 as bytes of float16 (the same numbers)."""
    for layer in range(LAYERS):
        k = array("f", (kv_value(layer, start + t, 0, h, i)
                        for t in range(m) for h in range(KVH) for i in range(HD)))
        vals = [kv_value(layer, start + t, 1, h, i)
                for t in range(m) for h in range(KVH) for i in range(HD)]
        if layer == 1:
            v = struct.pack(f"<{len(vals)}e", *vals)
            # k as f16 too: one call has one dtype
            kh = struct.pack(f"<{len(k)}e", *k)
            seq.append(layer, kh, v, dtype="f16")
        else:
            seq.append(layer, k, array("f", vals))


def query():
    return array("f", [(((h * 37 + i * 11) % 23) - 11) / 8.0
                       for h in range(QH) for i in range(HD)])


def attend(shim, seq):
    out = array("f")
    for layer in range(LAYERS):
        out.extend(shim.attention([seq], layer, query(), q_heads=QH))
    return out


def child(endpoint):
    """Process B: report what it saw as JSON on stdout."""
    import kvshim
    with kvshim.Shim(endpoint, name="py-B", timeout_ms=30000) as s:
        tok = prompt()
        seq, cached = s.begin(tok)
        head = list(seq.pages())
        seq.extend(tok[cached:])
        fill(seq, cached, NTOK - cached)
        seq.commit()
        out = attend(s, seq)
        print(json.dumps({"cached": cached, "head": head, "pages": list(seq.pages()),
                          "out": out.tobytes().hex()}))
    return 0


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def raises(exc, words, fn, *args, **kw):
    """fn(*args, **kw) raises exc with `words` in its message; returns the exception."""
    try:
        fn(*args, **kw)
    except exc as e:
        check(words in str(e), f"{exc.__name__} without {words!r}: {e}")
        return e
    raise AssertionError(f"{fn.__name__}{args} did not raise {exc.__name__} ({words!r})")


def check_binding(kvshim, s, endpoint, kvd):
    """Arguments refused by the binding, a daemon error's message, Seq.end() failing."""
    raises(ValueError, "empty prompt", s.begin, [])
    seq, _ = s.begin([7, 8, 9])
    seq.extend([7, 8, 9])
    kv = array("f", bytes(4 * 3 * KVH * HD))
    raises(ValueError, "layer = 4294967296", seq.append, 2**32, kv, kv)
    raises(ValueError, "layer = -1", seq.append, -1, kv, kv)
    raises(ValueError, "dtype 'fp16': one of 'f32'", seq.append, 0, kv, kv, dtype="fp16")
    q = array("f", bytes(4 * QH * HD))
    raises(ValueError, "q_heads = -4", s.attention, [seq], 0, q, q_heads=-4)
    raises(ValueError, "q_heads = 4294967300", s.attention, [seq], 0, q, q_heads=2**32 + 4)
    raises(ValueError, "layer = 4294967296", s.attention, [seq], 2**32, q, q_heads=QH)
    raises(ValueError, "token id -1 at index 1", seq.extend, [5, -1])
    raises(ValueError, "token id 4294967296", seq.extend, [2**32])
    # the 3 tokens must have K/V in every layer before the sequence grows again
    e = raises(kvshim.KvsError, "layer 0 has K/V for 0 of the sequence's 3", seq.extend, [1])
    check(e.name == "FAILED_PRECONDITION", str(e))
    for layer in range(LAYERS):
        seq.append(layer, kv, kv)
    # 255 more pages of a 256-page pool: the daemon's RESOURCE_EXHAUSTED, its name said once
    e = raises(kvshim.KvsError, "kvs_seq_extend: kvc_alloc", seq.extend, list(range(255 * PT)))
    check(e.name == "RESOURCE_EXHAUSTED" and str(e).count("RESOURCE_EXHAUSTED") == 1, str(e))
    check(len(seq) == 3, f"a failed extend changed the length to {len(seq)}")
    seq.end()
    # Seq.end() against a stopped daemon: TIMEOUT raised, the handle freed anyway
    t = kvshim.Shim(endpoint, name="py-stalled", timeout_ms=300)
    q3, _ = t.begin([5])
    os.kill(kvd.pid, signal.SIGSTOP)
    try:
        e = raises(kvshim.KvsError, "kvs_seq_end: kvc_seq_close", q3.end)
    finally:
        os.kill(kvd.pid, signal.SIGCONT)
    check(e.name == "TIMEOUT", str(e))
    q3.end()  # ended: a no-op
    t.close()


def check_append_batch(kvshim, s):
    """Shim.append_batch (kvs_append_batch): the tokens of two sequences in one call per layer
    give the same attention output as appending them one sequence at a time; a duplicate
    sequence and a wrong-sized k are refused."""
    prompts = [[900 + i for i in range(3)], [950 + i for i in range(3)]]

    def rows(layer, kind, seqs_idx):
        return array("f", (kv_value(layer, 40 * j + t, kind, h, i)
                           for j in seqs_idx for t in range(3)
                           for h in range(KVH) for i in range(HD)))

    def begin_two():
        pair = []
        for p in prompts:
            sq, cached = s.begin(p)
            check(cached == 0, f"append_batch: cached {cached}")
            sq.extend(p)
            pair.append(sq)
        return pair

    def attend_two(pair):
        q = array("f", list(query()) * 2)
        return array("f", b"".join(s.attention(pair, layer, q, q_heads=QH).tobytes()
                                   for layer in range(LAYERS)))

    one = begin_two()
    for layer in range(LAYERS):
        for j, sq in enumerate(one):
            sq.append(layer, rows(layer, 0, [j]), rows(layer, 1, [j]))
    two = begin_two()
    raises(kvshim.KvsError, "is seqs[0] again", s.append_batch, [two[0], two[0]], 0,
           rows(0, 0, [0, 0]), rows(0, 1, [0, 0]), m=3)
    raises(ValueError, "k and v must be [2][3]", s.append_batch, two, 0, rows(0, 0, [0]),
           rows(0, 1, [0]), m=3)
    for layer in range(LAYERS):
        s.append_batch(two, layer, rows(layer, 0, [0, 1]), rows(layer, 1, [0, 1]), m=3)
    check(attend_two(two).tobytes() == attend_two(one).tobytes(),
          "append_batch: attention differs from one-by-one appends")
    for sq in one + two:
        sq.end()


def start_kvd(kvd, d):
    endpoint = f"ipc://{d}/run/kvd.sock"
    log = open(os.path.join(d, "kvd.log"), "wb")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # see CMakeLists.txt
    p = subprocess.Popen([kvd, "--endpoint", endpoint, "--layers", str(LAYERS), "--kv_heads",
                          str(KVH), "--head_dim", str(HD), "--page_tokens", str(PT),
                          "--pages_fp8", "256", "--pages_tq3", "64", "--epoch_ms", "5"],
                         stdout=log, stderr=log, env=env)
    fds = os.path.join(d, "run", "kvd.sock.fds")  # created last: the daemon is ready
    t0 = time.monotonic()
    while not os.path.exists(fds):
        if p.poll() is not None:
            raise RuntimeError(f"kvd exited during startup ({p.returncode}): "
                               + open(os.path.join(d, "kvd.log")).read())
        if time.monotonic() - t0 > 30:
            raise RuntimeError("kvd did not become ready within 30 s")
        time.sleep(0.005)
    return p, endpoint


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvd")
    ap.add_argument("--lib", required=True)
    ap.add_argument("--pydir", required=True)
    ap.add_argument("--child", metavar="ENDPOINT")
    a = ap.parse_args()
    sys.path.insert(0, a.pydir)
    os.environ["KVSHIM_LIB"] = a.lib
    if a.child:
        return child(a.child)
    import kvshim

    d = tempfile.mkdtemp(prefix="kvd-it-py-")
    p = None
    try:
        p, endpoint = start_kvd(a.kvd, d)
        try:
            kvshim.Shim(endpoint + ".missing", timeout_ms=300)
            check(False, "a Shim on a missing endpoint opened")
        except kvshim.KvsError as e:
            check(e.name in ("TIMEOUT", "UNAVAILABLE") and "kvs_open" in e.message, str(e))
        s = kvshim.Shim(endpoint, name="py-A", timeout_ms=30000)
        check(not s.on_device and s.geom.page_tokens == PT and s.geom.layers == LAYERS,
              repr(s.geom))
        tok = prompt()
        seq, cached = s.begin(array("I", tok))
        check(cached == 0, f"A: cached {cached}, want 0")
        seq.extend(tok)
        check(len(seq) == NTOK, f"len {len(seq)}")
        raises(ValueError, "layer = 2 is outside 0..1", seq.append, LAYERS,
               array("f", bytes(4 * NTOK * KVH * HD)), array("f", bytes(4 * NTOK * KVH * HD)))
        try:
            s.attention([seq], 0, query(), q_heads=QH)
            check(False, "attention before append went through")
        except kvshim.KvsError as e:
            check(e.name == "FAILED_PRECONDITION" and "kvs_append first" in e.message, str(e))
        fill(seq, 0, NTOK)
        seq.commit()
        pages = list(seq.pages())
        check(len(pages) == 3, f"pages {pages}")
        out_a = attend(s, seq)
        check(len(out_a) == LAYERS * QH * HD and any(x != 0 for x in out_a), "A's output")
        # B in another process, while A holds its sequence
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", endpoint,
                            "--lib", a.lib, "--pydir", a.pydir], capture_output=True, text=True,
                           timeout=300)
        sys.stderr.write(r.stderr)
        check(r.returncode == 0, f"child exited {r.returncode}")
        b = json.loads(r.stdout.strip().splitlines()[-1])
        check(b["cached"] == 2 * PT, f"B: cached {b['cached']}, want {2 * PT}")
        check(b["head"] == pages[:2], f"B's table {b['head']} does not start with A's {pages}")
        check(b["pages"][:2] == pages[:2] and b["pages"][2] != pages[2], f"B {b['pages']}")
        check(bytes.fromhex(b["out"]) == out_a.tobytes(), "B's attention differs from A's")
        check_append_batch(kvshim, s)
        check_binding(kvshim, s, endpoint, p)
        seq.end()
        seq.end()  # idempotent
        s.close()
        print(f"[ shim.py ] A and B (two processes): prefix of {b['cached']} tokens shared, "
              f"attention equal bit for bit")
    finally:
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                rc = p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
            if rc != 0:
                sys.stderr.write(open(os.path.join(d, "kvd.log")).read())
                raise AssertionError(f"kvd exited {rc}")
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
