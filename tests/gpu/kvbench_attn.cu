/* kvbench_attn — decode attention, retier and append throughput on the GPU; JSON on stdout.
 *
 * Shapes (brief of issue 4): B=8, q_heads 32, kv_heads 8, d 128 and B=2, q_heads 24, kv_heads
 * 4, d 256; 8K, 32K, 128K tokens per sequence; page_tokens 16 (one page = one 16-token MMA
 * tile); layers = 1 so a page holds exactly the bytes one attention call reads. Modes: all
 * FP8, all TQ3, mix (first page and last two pages FP8, the rest TQ3).
 *
 * bytes = compressed bytes the call must read: kv_layer_bytes of each page's format (K and V
 * blocks of every KV head, codes + metadata + block padding). Effective bandwidth = bytes /
 * median time. Each timed sample (after KVBENCH_WARM_MS, default 20, of warm-up replays; the
 * same in bench/torch_sdpa.py) is a CUDA graph of `reps` decode calls, each call on a
 * different page set where the pool has room (so that 8K tokens, ~50 MB, is not served from
 * the 60 MB L2 on repeats). Ceiling: cudaMemcpy device-to-device of 2 GiB, read + write.
 * Per case: "ms" = kvk_cuda_attn_decode, "ms_two_pass" = kvk_cuda_attn_partial +
 * kvk_cuda_attn_merge called separately, "ms_partial" = the partial kernel alone, "ms_merge" =
 * the merge kernel alone (on the partitions the partial kernel left), "read_ms" = a plain read
 * of the case's byte count (read_stream, the same graph method): how long reading those bytes
 * and nothing else takes at this size, beside the 2 GiB copy ceiling. Rows with
 * "sweep": decode at other split counts at 32K. "empty_kernel_ms": an empty kernel per call
 * of a graph of 8, as the decode calls are timed (the least a second kernel adds).
 * Env: KVBENCH_SHAPES=B:q_heads:kv_heads:d,... other shapes (say serving batches;
 * bench/torch_sdpa.py reads the same variable and KVBENCH_LENS), KVBENCH_LENS=N,... other
 * lengths (multiples of 16), KVBENCH_SWEEP=0 no sweep, KVBENCH_MODES=tq3,mix only those modes.
 * Built with -DKVK_ATTN_TRACE (with attn.cu) it also prints a per-block timeline summary of
 * one decode call per case ("trace" rows), and with KVBENCH_TRACE_DUMP=dir writes every
 * block's raw records (start/end ns, SM id) to dir/<case>.bin for offline analysis
 * (docs/perf.md, "Where the ragged end comes from").
 * Pages hold valid random codes (no NaN codes): timings on zeros would flatter.
 * KVBENCH_COLD_MB=N adds "cold_mb" and "ms_cold" to each row: decode after a plain read of N
 * MB before every call (graph of reps × (read, decode) minus a graph of reps × read, per call),
 * so that nothing of the previous call is left in L2 — as in an engine, where each layer's
 * GEMMs stream their weights between two attention calls. Back-to-back calls (the "ms" figure)
 * find the page ids, directory entries and code the last call left (docs/perf.md, session 14).
 * ms_cold is a difference of two medians each dominated by the reads (N = 256: ~60 µs per
 * call at read_ms's rate), so expect more noise in it than in "ms" on the shortest calls.
 */
#include "kvkern.h"
#include "kvkern_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)
#define KCK(call)                                                                                  \
    do {                                                                                           \
        kvk_status_t r_ = (call);                                                                  \
        if (r_ != KVK_OK) {                                                                        \
            fprintf(stderr, "%s:%d: %s -> %d\n", __FILE__, __LINE__, #call, (int)r_);              \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

/* Fill a pool with plausible page bytes: FP8 codes without NaN, positive scales; TQ3 random
 * code units with FP16 γ ≈ 10, scale ≈ 0.1, zero ≈ −0.35. */
__global__ void fill_pool(uint8_t *base, uint64_t bytes, kv_geom_t g, int fmt, uint64_t seed)
{
    const uint64_t page_bytes = kv_page_bytes(&g, (kv_fmt_t)fmt);
    for (uint64_t i = (blockIdx.x * (uint64_t)blockDim.x + threadIdx.x) * 4; i < bytes;
         i += (uint64_t)gridDim.x * blockDim.x * 4) {
        const uint64_t in_page = i % page_bytes;
        const uint64_t blk_k = kv_block_bytes(&g, (kv_fmt_t)fmt, KV_KIND_K);
        const int kind = in_page < g.kv_heads * blk_k ? KV_KIND_K : KV_KIND_V;
        const uint64_t in_blk = kind == KV_KIND_K
                                    ? in_page % blk_k
                                    : (in_page - g.kv_heads * blk_k) %
                                          kv_block_bytes(&g, (kv_fmt_t)fmt, KV_KIND_V);
        const uint64_t mo = kv_block_meta_offset(&g, (kv_fmt_t)fmt, kind);
        uint32_t v = (uint32_t)kv_splitmix64(seed ^ i);
        if (in_blk >= mo)
            v = fmt == KV_FMT_FP8 ? 0x3c000000u /* 2^-7 */ : 0x49004900u; /* 10.0 halves */
        else if (fmt == KV_FMT_FP8)
            v &= 0xf7f7f7f7u; /* never 0x7f/0xff */
        if (fmt == KV_FMT_TQ3 && in_blk >= mo && in_blk < mo + 2 * g.page_tokens &&
            in_page >= g.kv_heads * kv_block_bytes(&g, KV_FMT_TQ3, KV_KIND_K))
            v = 0x2e662e66u; /* V scale 0.1 */
        else if (fmt == KV_FMT_TQ3 && in_blk >= mo + 2 * g.page_tokens &&
                 in_page >= g.kv_heads * kv_block_bytes(&g, KV_FMT_TQ3, KV_KIND_K))
            v = 0xb59ab59au; /* V zero −0.35 */
        *reinterpret_cast<uint32_t *>(base + i) = v;
    }
}

/* A plain read of n 16-byte words (XOR-folded; the store never happens for these inputs but
 * keeps the loads): the size-matched ceiling of a decode call ("read_ms" of each case). Four
 * independent loads per thread per step, a grid of 8 blocks of 256 per SM: every SM full. */
/* LDCS: streaming loads (read_ms); else plain L2-allocating loads that leave L2 holding p's
 * bytes, as an engine's weight-streaming GEMM would (KVBENCH_COLD_MB) */
template <bool LDCS = true>
__global__ void read_stream(const uint4 *__restrict__ p, uint64_t n, uint32_t *sink)
{
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    uint32_t acc = 0;
    uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            v[k] = LDCS ? __ldcs(p + i + k * stride) : __ldcg(p + i + k * stride);
#pragma unroll
        for (int k = 0; k < 4; k++)
            acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    for (; i < n; i += stride) {
        const uint4 v = LDCS ? __ldcs(p + i) : __ldcg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u && n == 1)
        *sink = acc;
}

/* Does nothing: "empty_kernel_ms", the time per kernel of a graph of back-to-back launches,
 * the least a second kernel (decode's merge) adds to a call (bench/summary.py's floor). */
__global__ void empty_kernel() {}

/* Separator before the next element of the "attention" list: none before the first (with
 * KVBENCH_LENS filtering out every length the first element is an "op" row). */
static bool g_first = true;
static const char *sep()
{
    const char *s = g_first ? "" : ",\n";
    g_first = false;
    return s;
}

#ifdef KVK_ATTN_TRACE
/* timeline probe of attn.cu (trace builds only): one decode call, per-block phase averages */
extern "C" int kvk_cuda_attn_trace(unsigned long long *host, size_t blocks, int clear);
static void trace_row(uint32_t nblk, const char *what)
{
    std::vector<unsigned long long> t((size_t)nblk * 16);
    if (kvk_cuda_attn_trace(t.data(), nblk, 0) != 0)
        exit(3);
    /* KVBENCH_TRACE_DUMP=dir: every block's 16 records as raw little-endian u64 in
     * dir/<what>.bin (start/end global ns at 10/11, SM id at 12) for offline analysis */
    if (const char *dd = getenv("KVBENCH_TRACE_DUMP")) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s.bin", dd, what);
        for (char *c = path + strlen(dd) + 1; *c; c++)
            if (*c == ' ')
                *c = '_';
        if (FILE *f = fopen(path, "wb")) {
            fwrite(t.data(), sizeof(t[0]), t.size(), f);
            fclose(f);
        }
    }
    unsigned long long g0 = ~0ull, g0max = 0, g1min = ~0ull, g1 = 0;
    double sum[10] = {0}, cnt[10] = {0}, cyc = 0, ns = 0;
    for (uint32_t b = 0; b < nblk; b++) {
        const unsigned long long *r = &t[(size_t)b * 16];
        g0 = std::min(g0, r[10]), g0max = std::max(g0max, r[10]);
        g1 = std::max(g1, r[11]), g1min = std::min(g1min, r[11]);
        cyc += (double)(r[8] - r[0]), ns += (double)(r[11] - r[10]);
        /* kcycles: 0 prescan, 1 fp8 prologue, 2 fp8 loop (warp 0), 3 fp8 epilogue, 4 tq3
         * prologue, 5 tq3 loop, 6 tq3 epilogue, 7 end of the last phase → exit, 8/9 part of
         * the fp8/tq3 epilogue spent waiting for the block's other warps; -1: phase absent */
        const unsigned long long p8 = r[2] ? r[4] : r[1];
        const double d[10] = {(double)(r[1] - r[0]),
                              r[2] ? (double)(r[2] - r[1]) : -1,
                              r[2] ? (double)(r[3] - r[2]) : -1,
                              r[2] ? (double)(r[4] - r[3]) : -1,
                              r[5] ? (double)(r[5] - p8) : -1,
                              r[5] ? (double)(r[6] - r[5]) : -1,
                              r[5] ? (double)(r[7] - r[6]) : -1,
                              (double)(r[8] - (r[5] ? r[7] : p8)),
                              r[2] ? (double)(r[14] - r[3]) : -1,
                              r[5] ? (double)(r[15] - r[6]) : -1};
        for (int k = 0; k < 10; k++)
            if (d[k] >= 0)
                sum[k] += d[k], cnt[k] += 1;
    }
    printf("%s    {\"trace\": \"%s\", \"blocks\": %u, \"span_us\": %.2f, "
           "\"start_spread_us\": %.2f, \"first_end_us\": %.2f, \"ghz\": %.3f, "
           "\"avg_kcycles\": [",
           sep(), what, nblk, (g1 - g0) / 1e3, (g0max - g0) / 1e3, (g1min - g0) / 1e3, cyc / ns);
    for (int k = 0; k < 10; k++)
        printf("%s%.2f", k ? ", " : "", cnt[k] ? sum[k] / cnt[k] / 1e3 : -1.0);
    printf("]}");
}
#endif

static float median(std::vector<float> v)
{
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

struct Shape {
    uint32_t B, H, KVH, D;
};

[[noreturn]] static void usage_error(const char *var, const char *val, const char *want)
{
    fprintf(stderr, "kvbench_attn: %s=%s: %s\n", var, val, want);
    exit(1);
}

/* one whole number of `s` up to a separator in `seps` (or the end), at most max */
static uint32_t parse_u32(const char *&s, const char *seps, uint32_t max, bool &ok)
{
    char *end;
    const unsigned long v = strtoul(s, &end, 10);
    ok = ok && end != s && *s >= '0' && *s <= '9' && v <= max && (!*end || strchr(seps, *end));
    s = *end ? end + 1 : end;
    return (uint32_t)v;
}

/* KVBENCH_SHAPES=B:H:KVH:D,... (unset: the issue's two). Checked here, so that a typo is a
 * usage error, not a launcher's EINVAL halfway through a run. */
static std::vector<Shape> parse_shapes(const char *env)
{
    if (!env || !*env)
        return {{8, 32, 8, 128}, {2, 24, 4, 256}};
    std::vector<Shape> v;
    for (const char *s = env; *s;) {
        bool ok = true;
        Shape S;
        S.B = parse_u32(s, ":", 4096, ok);
        S.H = parse_u32(s, ":", 1024, ok);
        S.KVH = parse_u32(s, ":", 1024, ok);
        S.D = parse_u32(s, ",", 256, ok);
        if (!ok || !S.B || !S.H || !S.KVH || S.H % S.KVH || (S.D != 64 && S.D != 128 && S.D != 256))
            usage_error("KVBENCH_SHAPES", env,
                        "want B:q_heads:kv_heads:head_dim,... (q_heads a multiple of kv_heads, "
                        "head_dim 64, 128 or 256)");
        v.push_back(S);
    }
    return v;
}

/* KVBENCH_LENS=N,... tokens per sequence (unset: 8192, 32768, 131072), multiples of 16 */
static std::vector<uint32_t> parse_lens(const char *env)
{
    if (!env || !*env)
        return {8192, 32768, 131072};
    std::vector<uint32_t> v;
    for (const char *s = env; *s;) {
        bool ok = true;
        const uint32_t L = parse_u32(s, ",", 1u << 20, ok);
        if (!ok || L == 0 || L % 16)
            usage_error("KVBENCH_LENS", env, "want token counts, multiples of 16 up to 2^20");
        v.push_back(L);
    }
    return v;
}

int main(void)
{
    /* KVBENCH_COLD_MB: a whole number of MB, 0 or empty = off; anything else (a negative or
     * non-numeric value, which atoi read as 0 or as a huge size) is a usage error */
    const char *cold_env = getenv("KVBENCH_COLD_MB");
    size_t cold_bytes = 0;
    if (cold_env && *cold_env) {
        char *end;
        const unsigned long mb = strtoul(cold_env, &end, 10);
        if (*end || cold_env[0] < '0' || cold_env[0] > '9' || mb > (1ul << 20)) {
            fprintf(stderr, "kvbench_attn: KVBENCH_COLD_MB=%s: not a number of MB\n", cold_env);
            return 1;
        }
        cold_bytes = (size_t)mb << 20;
    }
    /* usage errors before the GPU is touched */
    const std::vector<Shape> shapes = parse_shapes(getenv("KVBENCH_SHAPES"));
    const std::vector<uint32_t> lens = parse_lens(getenv("KVBENCH_LENS"));
    const uint32_t max_len = *std::max_element(lens.begin(), lens.end());
    KCK(kvk_cuda_init());
    /* session 9: without it the first case measured (8K all-FP8) came out ~10% slow, at the
     * clocks of a GPU that had been idle (0.0490 vs 0.0443 ms with 50 ms; later cases equal) */
    const char *warm_env = getenv("KVBENCH_WARM_MS");
    const float warm_ms = warm_env ? (float)atof(warm_env) : 20.0f;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    /* median GPU time of one replay of a graph: 9 samples after warm_ms of warm-up replays */
    auto graph_ms = [&](cudaGraphExec_t exec) {
        auto replay_ms = [&]() {
            CK(cudaEventRecord(e0, st));
            CK(cudaGraphLaunch(exec, st));
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            return ms;
        };
        CK(cudaGraphLaunch(exec, st));
        for (float busy = 0.0f; busy < warm_ms;)
            busy += replay_ms();
        std::vector<float> ts;
        for (int i = 0; i < 9; i++)
            ts.push_back(replay_ms());
        return median(ts);
    };
    /* median GPU time per call of a graph that captures issue(r) for r = 0 … reps − 1 */
    auto graph_per_call_ms = [&](int reps, auto &&issue) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int r = 0; r < reps; r++)
            issue(r);
        CK(cudaStreamEndCapture(st, &graph));
        CK(cudaGraphInstantiate(&exec, graph, 0));
        const float t = graph_ms(exec) / reps;
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
        return t;
    };
    void *cold_buf = nullptr; /* read to empty L2 between calls (KVBENCH_COLD_MB) */
    if (cold_bytes) {
        CK(cudaMalloc(&cold_buf, cold_bytes));
        CK(cudaMemset(cold_buf, 1, cold_bytes));
    }
    printf("{\n  \"device\": \"%s\", \"sms\": %d, \"l2_bytes\": %d,\n", prop.name,
           prop.multiProcessorCount, prop.l2CacheSize);

    /* ---- copy ceiling ---- */
    {
        const size_t n = 2ull << 30;
        void *a, *b;
        CK(cudaMalloc(&a, n));
        CK(cudaMalloc(&b, n));
        CK(cudaMemset(a, 1, n));
        std::vector<float> ts;
        for (int i = 0; i < 12; i++) {
            CK(cudaEventRecord(e0, st));
            CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, st));
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (i >= 2)
                ts.push_back(ms);
        }
        printf("  \"copy_d2d\": {\"bytes_rw\": %zu, \"ms\": %.4f, \"gbps\": %.1f},\n", 2 * n,
               median(ts), 2.0 * n / (median(ts) * 1e6));
        CK(cudaFree(a));
        CK(cudaFree(b));
    }

    /* ---- the cost of one more kernel in a graph (one block per SM, as the merge's grids) ---- */
    printf("  \"empty_kernel_ms\": %.5f,\n", graph_per_call_ms(8, [&](int) {
               empty_kernel<<<prop.multiProcessorCount, 256, 0, st>>>();
               CK(cudaGetLastError());
           }));

    const char *modes[] = {"fp8", "tq3", "mix"};
    printf("  \"attention\": [\n");
    for (const Shape &S : shapes) {
        kv_geom_t g = {1, S.KVH, S.D, 16, 0x5eed};
        const uint64_t pb8 = kv_page_bytes(&g, KV_FMT_FP8), pbt = kv_page_bytes(&g, KV_FMT_TQ3);
        const uint32_t maxpages = S.B * (max_len / 16);
        uint8_t *p8, *pt;
        CK(cudaMalloc(&p8, maxpages * pb8));
        CK(cudaMalloc(&pt, maxpages * pbt));
        fill_pool<<<2048, 256, 0, st>>>(p8, maxpages * pb8, g, KV_FMT_FP8, 1);
        fill_pool<<<2048, 256, 0, st>>>(pt, maxpages * pbt, g, KV_FMT_TQ3, 2);
        CK(cudaGetLastError());
        kv_pools_t pools = {{p8, pt}, {maxpages, maxpages}};
        float *q, *out;
        std::vector<float> hq((size_t)S.B * S.H * S.D);
        for (size_t i = 0; i < hq.size(); i++)
            hq[i] = (float)((kv_splitmix64(i) >> 40) / 16777216.0 - 0.5) * 3.0f;
        CK(cudaMalloc(&q, hq.size() * 4));
        CK(cudaMalloc(&out, hq.size() * 4));
        CK(cudaMemcpy(q, hq.data(), hq.size() * 4, cudaMemcpyHostToDevice));
        /* directory: logical id i ↦ FP8 phys i (ids < maxpages) and TQ3 phys i (ids ≥) */
        std::vector<kv_dir_entry_t> dir(2 * (size_t)maxpages);
        for (uint32_t i = 0; i < maxpages; i++) {
            dir[i] = kv_dir_make(i, KV_FMT_FP8, KV_DIR_VALID, 1);
            dir[maxpages + i] = kv_dir_make(i, KV_FMT_TQ3, KV_DIR_VALID, 1);
        }
        kv_dir_entry_t *ddir;
        CK(cudaMalloc(&ddir, dir.size() * 8));
        CK(cudaMemcpy(ddir, dir.data(), dir.size() * 8, cudaMemcpyHostToDevice));

        for (uint32_t L : lens) {
            const uint32_t np = L / 16, need = S.B * np;
            const uint32_t sets = std::min<uint32_t>(8, maxpages / need);
            const uint32_t splits = kvk_cuda_attn_suggest_splits(S.B, S.KVH, S.H, S.D, np,
                                                                 prop.multiProcessorCount);
            const size_t wsb = kvk_cuda_attn_workspace_bytes(S.B, S.H, S.D, splits);
            void *ws;
            CK(cudaMalloc(&ws, wsb));
            for (int mode = 0; mode < 3; mode++) {
                /* KVBENCH_MODES=tq3,mix: only these modes (profiler runs) */
                const char *only_modes = getenv("KVBENCH_MODES");
                if (only_modes && !strstr(only_modes, modes[mode]))
                    continue;
                std::vector<uint32_t> ids((size_t)sets * need), ind(S.B + 1), sl(S.B, L);
                uint64_t bytes = 0;
                for (uint32_t set = 0; set < sets; set++)
                    for (uint32_t s = 0; s < S.B; s++)
                        for (uint32_t p = 0; p < np; p++) {
                            const uint32_t phys = set * need + s * np + p;
                            bool f8 = mode == 0 || (mode == 2 && (p == 0 || p + 2 >= np));
                            ids[(size_t)set * need + s * np + p] = f8 ? phys : maxpages + phys;
                            if (set == 0)
                                bytes += kv_layer_bytes(&g, f8 ? KV_FMT_FP8 : KV_FMT_TQ3);
                        }
                for (uint32_t s = 0; s <= S.B; s++)
                    ind[s] = s * np;
                uint32_t *dids, *dind, *dsl;
                CK(cudaMalloc(&dids, ids.size() * 4));
                CK(cudaMalloc(&dind, ind.size() * 4));
                CK(cudaMalloc(&dsl, sl.size() * 4));
                CK(cudaMemcpy(dids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
                CK(cudaMemcpy(dind, ind.data(), ind.size() * 4, cudaMemcpyHostToDevice));
                CK(cudaMemcpy(dsl, sl.data(), sl.size() * 4, cudaMemcpyHostToDevice));
                const int reps = 8;
                kv_attn_batch_t b = {S.B, S.H, 0, 1.0f / sqrtf((float)S.D), dind, dids, dsl};
                /* median per-call time of a graph of `reps` calls of variant v (call r reads
                 * page set r % sets) with num_splits ns; the output of the last call is checked
                 * to be finite */
                int finite = 1;
                auto batch_of = [&](int r) { /* call r of a graph reads page set r % sets */
                    kv_attn_batch_t br = b;
                    br.page_ids = dids + (size_t)(r % sets) * need;
                    return br;
                };
                auto timed = [&](int v, uint32_t ns, void *wsp, size_t wsn) -> float {
                    const uint64_t rows = (uint64_t)S.B * ns * KV_FMT_COUNT * S.H;
                    float *pm = (float *)wsp, *pl = pm + rows, *po = pl + rows;
                    auto call = [&](const kv_attn_batch_t &br) {
                        if (v == 3) { /* the merge alone, on the partitions v2 left */
                            KCK(kvk_cuda_attn_merge(S.B, ns * KV_FMT_COUNT, S.H, S.D, pm, pl, po,
                                                    out, st));
                            return;
                        }
                        if (v == 0)
                            KCK(kvk_cuda_attn_decode(&g, &pools, ddir, (uint32_t)dir.size(), &br,
                                                     q, ns, wsp, wsn, out, st));
                        else
                            KCK(kvk_cuda_attn_partial(&g, &pools, ddir, (uint32_t)dir.size(), &br,
                                                      q, ns, pm, pl, po, st));
                        if (v == 1)
                            KCK(kvk_cuda_attn_merge(S.B, ns * KV_FMT_COUNT, S.H, S.D, pm, pl, po,
                                                    out, st));
                    };
                    call(b); /* warm up outside the capture */
                    const float t = graph_per_call_ms(reps, [&](int r) { call(batch_of(r)); });
                    if (v != 2 && v != 3) {
                        std::vector<float> ho(hq.size());
                        CK(cudaMemcpy(ho.data(), out, ho.size() * 4, cudaMemcpyDeviceToHost));
                        for (float x : ho)
                            finite &= isfinite(x) ? 1 : 0;
                    }
                    return t;
                };
                /* v0 decode, v1 partial + merge called separately, v2 the partial kernel alone,
                 * v3 the merge alone (on v2's partitions) */
                float tv[4];
                for (int v = 0; v < 4; v++)
                    tv[v] = timed(v, splits, ws, wsb);
                const float ms = tv[0];
                /* decode after an L2-filling read (KVBENCH_COLD_MB), the reads' own time
                 * subtracted: a graph of each, timed as above */
                float ms_cold = 0.0f;
                for (int with = 1; cold_bytes && with >= 0; with--)
                    ms_cold += (with ? 1.0f : -1.0f) * graph_per_call_ms(reps, [&](int r) {
                        read_stream<false><<<8 * prop.multiProcessorCount, 256, 0, st>>>(
                            static_cast<const uint4 *>(cold_buf), cold_bytes / 16,
                            reinterpret_cast<uint32_t *>(ws));
                        CK(cudaGetLastError());
                        const kv_attn_batch_t br = batch_of(r);
                        if (with)
                            KCK(kvk_cuda_attn_decode(&g, &pools, ddir, (uint32_t)dir.size(),
                                                     &br, q, splits, ws, wsb, out, st));
                    });
                /* the same bytes read by read_stream, timed the same way (graph of `reps`
                 * reads, each of another region of the pool where it has room) */
                float read_ms;
                {
                    const uint8_t *pool = mode == 0 ? p8 : pt;
                    const uint64_t pool_bytes = (uint64_t)maxpages * (mode == 0 ? pb8 : pbt);
                    const uint64_t n16 = bytes / 16, span = n16 * 16;
                    const uint64_t regions = std::max<uint64_t>(1, pool_bytes / span);
                    /* the B=8 128K mix reads more bytes than the TQ3 pool holds (its FP8 pages
                     * are in the other pool): the rest comes from the FP8 pool, which is larger,
                     * instead of past the TQ3 pool's end (session 11 review) */
                    const uint64_t n16a = std::min<uint64_t>(n16, pool_bytes / 16);
                    const uint64_t n16b = n16 - n16a;
                    if (n16b && (uint64_t)maxpages * pb8 / 16 < n16b) {
                        fprintf(stderr, "kvbench_attn: the pools hold fewer than %llu bytes\n",
                                (unsigned long long)bytes);
                        exit(1);
                    }
                    read_ms = graph_per_call_ms(reps, [&](int r) {
                        read_stream<true><<<8 * prop.multiProcessorCount, 256, 0, st>>>(
                            reinterpret_cast<const uint4 *>(pool + (r % regions) * span), n16a,
                            reinterpret_cast<uint32_t *>(out));
                        if (n16b)
                            read_stream<true><<<8 * prop.multiProcessorCount, 256, 0, st>>>(
                                reinterpret_cast<const uint4 *>(p8), n16b,
                                reinterpret_cast<uint32_t *>(out));
                        CK(cudaGetLastError());
                    });
                }
                printf("%s    {\"B\": %u, \"q_heads\": %u, \"kv_heads\": %u, \"d\": %u, "
                       "\"tokens\": %u, \"mode\": \"%s\", \"splits\": %u, \"page_sets\": %u, "
                       "\"bytes\": %llu, \"ms\": %.5f, \"gbps\": %.1f, \"ms_two_pass\": %.5f, "
                       "\"ms_partial\": %.5f, \"ms_merge\": %.5f, \"read_ms\": %.5f, "
                       "\"out_finite\": %d",
                       sep(), S.B, S.H, S.KVH, S.D, L, modes[mode], splits, sets,
                       (unsigned long long)bytes, ms, bytes / (ms * 1e6), tv[1], tv[2], tv[3],
                       read_ms, finite);
                if (cold_bytes)
                    printf(", \"cold_mb\": %zu, \"ms_cold\": %.5f", cold_bytes >> 20, ms_cold);
                printf("}");
#ifdef KVK_ATTN_TRACE
                {
                    CK(cudaStreamSynchronize(st));
                    if (kvk_cuda_attn_trace(nullptr, 0, 1) != 0)
                        exit(3);
                    KCK(kvk_cuda_attn_decode(&g, &pools, ddir, (uint32_t)dir.size(), &b, q,
                                             splits, ws, wsb, out, st));
                    CK(cudaStreamSynchronize(st));
                    char what[64];
                    snprintf(what, sizeof what, "B%u d%u %uK %s", S.B, S.D, L / 1024,
                             modes[mode]);
                    trace_row(S.B * S.KVH * ((S.H / S.KVH + 7) / 8) * splits, what);
                }
#endif
                fflush(stdout);
                /* split-count sweep at 32K (fp8 and mix), decode */
                const char *sweep_env = getenv("KVBENCH_SWEEP");
                if (L == 32768 && mode != 1 && !(sweep_env && strcmp(sweep_env, "0") == 0)) {
                    const std::vector<uint32_t> sweep = S.D == 128
                                                            ? std::vector<uint32_t>{4, 6, 12, 16}
                                                            : std::vector<uint32_t>{16, 24, 48, 66};
                    for (uint32_t ns : sweep) {
                        const size_t wn = kvk_cuda_attn_workspace_bytes(S.B, S.H, S.D, ns);
                        void *w2;
                        CK(cudaMalloc(&w2, wn));
                        const float t1 = timed(0, ns, w2, wn);
                        printf("%s    {\"sweep\": 1, \"B\": %u, \"q_heads\": %u, "
                               "\"kv_heads\": %u, \"d\": %u, \"tokens\": %u, "
                               "\"mode\": \"%s\", \"splits\": %u, \"bytes\": %llu, "
                               "\"ms\": %.5f, \"gbps\": %.1f}",
                               sep(), S.B, S.H, S.KVH, S.D, L, modes[mode], ns,
                               (unsigned long long)bytes, t1, bytes / (t1 * 1e6));
                        CK(cudaFree(w2));
                    }
                }
                CK(cudaFree(dids));
                CK(cudaFree(dind));
                CK(cudaFree(dsl));
            }
            CK(cudaFree(ws));
        }
        if (S.D == 128) {
            /* ---- retier and promote throughput: 4096 pages of this shape ---- */
            const uint32_t n = 4096;
            std::vector<uint32_t> src(n), dst(n);
            for (uint32_t i = 0; i < n; i++)
                src[i] = i, dst[i] = n + i;
            uint32_t *ds, *dd;
            CK(cudaMalloc(&ds, n * 4));
            CK(cudaMalloc(&dd, n * 4));
            CK(cudaMemcpy(ds, src.data(), n * 4, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(dd, dst.data(), n * 4, cudaMemcpyHostToDevice));
            for (int pr = 0; pr < 2; pr++) {
                std::vector<float> ts;
                for (int i = 0; i < 7; i++) {
                    CK(cudaEventRecord(e0, st));
                    if (pr == 0)
                        KCK(kvk_cuda_page_retier(&g, &pools, n, ds, dd, st));
                    else
                        KCK(kvk_cuda_page_promote(&g, &pools, n, dd, ds, st));
                    CK(cudaEventRecord(e1, st));
                    CK(cudaEventSynchronize(e1));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    if (i > 0)
                        ts.push_back(ms);
                }
                const double ms = median(ts);
                printf("%s    {\"op\": \"%s\", \"pages\": %u, \"fp8_bytes\": %llu, \"tq3_bytes\": "
                       "%llu, \"ms\": %.4f, \"fp8_gbps\": %.1f}",
                       sep(), pr == 0 ? "retier" : "promote", n, (unsigned long long)(n * pb8),
                       (unsigned long long)(n * pbt), ms, n * pb8 / (ms * 1e6));
            }
            CK(cudaFree(ds));
            CK(cudaFree(dd));
            /* ---- append throughput: 8192 tokens × 8 heads × 128, fp16 ---- */
            const uint32_t ntok = 8192;
            std::vector<uint32_t> sp(ntok), si(ntok);
            for (uint32_t t = 0; t < ntok; t++)
                sp[t] = t / 16, si[t] = t % 16;
            uint32_t *dsp, *dsi;
            void *k, *v;
            const size_t el = (size_t)ntok * S.KVH * S.D;
            CK(cudaMalloc(&dsp, ntok * 4));
            CK(cudaMalloc(&dsi, ntok * 4));
            CK(cudaMalloc(&k, el * 2));
            CK(cudaMalloc(&v, el * 2));
            CK(cudaMemset(k, 0x3c, el * 2)); /* fp16 ≈ 1.06 */
            CK(cudaMemset(v, 0x35, el * 2));
            CK(cudaMemcpy(dsp, sp.data(), ntok * 4, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(dsi, si.data(), ntok * 4, cudaMemcpyHostToDevice));
            std::vector<float> ts;
            for (int i = 0; i < 7; i++) {
                CK(cudaEventRecord(e0, st));
                KCK(kvk_cuda_fp8_append(&g, &pools, ddir, (uint32_t)dir.size(), 0, ntok, dsp, dsi,
                                        k, v, KVK_DTYPE_F16, st));
                CK(cudaEventRecord(e1, st));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                if (i > 0)
                    ts.push_back(ms);
            }
            const double ms = median(ts);
            printf("%s    {\"op\": \"append_fp16\", \"tokens\": %u, \"input_bytes\": %zu, "
                   "\"ms\": %.4f, \"input_gbps\": %.1f}",
                   sep(), ntok, 2 * el * 2, ms, 2 * el * 2 / (ms * 1e6));
            CK(cudaFree(dsp));
            CK(cudaFree(dsi));
            CK(cudaFree(k));
            CK(cudaFree(v));
        }
        CK(cudaFree(p8));
        CK(cudaFree(pt));
        CK(cudaFree(q));
        CK(cudaFree(out));
        CK(cudaFree(ddir));
    }
    printf("\n  ]\n}\n");
    CK(cudaFree(cold_buf));
    return 0;
}
