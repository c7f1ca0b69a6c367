#!/usr/bin/env python3
"""Dense BF16 decode attention through torch.nn.functional.scaled_dot_product_attention for the
shapes of tests/gpu/kvbench_attn.cu (one query token, GQA). Prints JSON on stdout.

bytes = K and V read once in BF16: 2 * B * kv_heads * L * d * 2. Each sample is a CUDA graph of
8 calls on 8 different K/V buffers where memory allows (so that small cases are not served from
L2); median of 9 samples, after SDPA_WARM_MS (default 20) of warm-up replays. Shapes and lengths
as kvbench_attn's: KVBENCH_SHAPES=B:q_heads:kv_heads:d,... and KVBENCH_LENS=N,... (unset: the
issue's two shapes at 8K, 32K, 128K)."""
import json
import os
import sys

import torch
import torch.nn.functional as F


def bench(B, H, KVH, D, L):
    dev = "cuda"
    kv_bytes = 2 * B * KVH * L * D * 2
    sets = max(1, min(8, (6 << 30) // kv_bytes))
    q = torch.randn(B, H, 1, D, device=dev, dtype=torch.bfloat16)
    ks = [torch.randn(B, KVH, L, D, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    vs = [torch.randn(B, KVH, L, D, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    outs = []  # each call's output stays where SDPA put it (the graph's pool): a copy into a
    # fixed buffer added a kernel per call that kvd's decode does not have (session 11 review)

    def step(i):
        return F.scaled_dot_product_attention(q, ks[i % sets], vs[i % sets], enable_gqa=True)

    reps = 8
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            step(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            outs.append(step(i))
    g.replay()
    torch.cuda.synchronize()
    warm_ms = float(os.environ.get("SDPA_WARM_MS", "20"))  # as kvbench_attn's KVBENCH_WARM_MS
    busy = 0.0
    while busy < warm_ms:  # warm-up: replays for warm_ms of GPU time before the samples
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        busy += e0.elapsed_time(e1)
    ts = []
    for _ in range(9):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / reps)
    ts.sort()
    ms = ts[len(ts) // 2]
    del ks, vs
    torch.cuda.empty_cache()
    return {"B": B, "q_heads": H, "kv_heads": KVH, "d": D, "tokens": L, "bytes": kv_bytes,
            "sets": sets, "ms": ms, "gbps": kv_bytes / (ms * 1e6)}


def env_list(name, default, parse):
    """KVBENCH_SHAPES / KVBENCH_LENS as kvbench_attn reads them; a bad value is a usage error"""
    v = os.environ.get(name, "")
    if not v:
        return default
    try:
        return [parse(x) for x in v.split(",")]
    except ValueError as e:
        sys.exit(f"torch_sdpa.py: {name}={v}: {e}")


def shape(x):
    f = [int(y) for y in x.split(":")]
    if len(f) != 4 or min(f) < 1 or f[1] % f[2] or f[3] not in (64, 128, 256):
        raise ValueError("want B:q_heads:kv_heads:head_dim,... (head_dim 64, 128 or 256)")
    return tuple(f)


def length(x):
    n = int(x)
    if n < 16 or n % 16:
        raise ValueError("want token counts, multiples of 16")
    return n


def main():
    rows = []
    for (B, H, KVH, D) in env_list("KVBENCH_SHAPES", [(8, 32, 8, 128), (2, 24, 4, 256)], shape):
        for L in env_list("KVBENCH_LENS", [8192, 32768, 131072], length):
            rows.append(bench(B, H, KVH, D, L))
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                      "sdpa_bf16": rows}, indent=1))


if __name__ == "__main__":
    main()
