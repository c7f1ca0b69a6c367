#!/usr/bin/env python3
"""Dense BF16 decode attention through torch.nn.functional.scaled_dot_product_attention for the
shapes of tests/gpu/kvbench_attn.cu (one query token, GQA). Prints JSON on stdout.

bytes = K and V read once in BF16: 2 * B * kv_heads * L * d * 2. Each sample is a CUDA graph of
8 calls on 8 different K/V buffers where memory allows (so that small cases are not served from
L2); median of 9 samples, after SDPA_WARM_MS (default 20) of warm-up replays."""
import json
import os

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


def main():
    rows = []
    for (B, H, KVH, D) in [(8, 32, 8, 128), (2, 24, 4, 256)]:
        for L in [8192, 32768, 131072]:
            rows.append(bench(B, H, KVH, D, L))
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                      "sdpa_bf16": rows}, indent=1))


if __name__ == "__main__":
    main()
