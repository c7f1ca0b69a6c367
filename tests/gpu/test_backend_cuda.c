/* test_backend_cuda.c — the cuda backend of kvd (kvd/backend_cuda.c) on a real GPU, in one
 * process, through the core's API (no daemon, no sockets: it_cuda_share covers those).
 *
 * Checks, each printed PASS/FAIL, then "N passed, M failed" (exit 1 if any failed):
 *   export     backend "cuda", fds ≥ 0, pool_bytes a multiple of the VMM granularity and
 *              ≥ pages × page_bytes, directory size likewise
 *   import     the exported directory fd imported again (cuMemImportFromShareableHandle) and
 *              mapped at a second address shows the same bytes as the daemon's device copy
 *   publish    after alloc, every allocated entry on the device equals the host mirror (VALID,
 *              FP8, phys) — the device copy is what kernels read
 *   append     the FP8 append kernel, resolving pages through the device directory, wrote the
 *              pages (nonzero scales where the input is nonzero)
 *   retier     kvd_core_convert(→ TQ3): device entry flipped to (TQ3, new phys, gen+1) and the
 *              TQ3 page is bit-identical to kvk_cuda_page_retier of the same source run
 *              directly (same kernel; the kernel-vs-CPU tolerance is test_kernels' business)
 *   promote    back to FP8 the same way, compared with kvk_cuda_page_promote
 *   failure    with the test hook a failed conversion leaves the device entry untouched
 *   device     KVD_CUDA_DEVICE=999 is refused with a message naming the variable
 *   snapshot   a restored cache page (ops->page_write) is on the device byte for byte and
 *              reads back through ops->page_read, per format (the snapshot's copies)
 *   collect    a second core of 5000 small pages (more than one KVD_DIR_BATCH_MAX launch of
 *              kvk_cuda_dir_store): all allocated (every device entry VALID and equal to the
 *              mirror), released and collected (every device entry invalid). Prints (INFO) the
 *              alloc's and the collect's times beside the same 5000 entries pushed one by one
 *
 * Geometry: layers 3, kv_heads 2, head_dim 128, page_tokens 13 (awkward: not a power of two,
 * so block tails have padding), 7 FP8 + 5 TQ3 pages.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "core.h"
#include "kv_cudrv.h"
#include "kv_err.h"
#include "kvkern.h"
#include "kvkern_cuda.h"

static int g_pass, g_fail;

static void check(int ok, const char *name, const char *fmt, ...)
{
    char msg[256] = "";
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name, msg[0] ? ": " : "", msg);
    if (ok)
        g_pass++;
    else
        g_fail++;
}

#define CK(call)                                                                                   \
    do {                                                                                           \
        int r_ = (int)(call);                                                                      \
        if (r_ != 0) {                                                                             \
            printf("FATAL %s:%d: %s -> %d\n", __FILE__, __LINE__, #call, r_);                      \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

static kv_dir_entry_t dev_entry(kvd_backend_t *b, uint32_t lid)
{
    kv_dir_entry_t e = 0;
    CK(cuMemcpyDtoH(&e, (CUdeviceptr)(uintptr_t)kvd_backend_cuda_dir_device(b) + 8ull * lid, 8));
    return e;
}

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* collect: a release of many pages is published to the device with one dir_sync */
static void test_collect_many(void)
{
    enum { N = 5000 };
    kv_geom_t g = {.layers = 1, .kv_heads = 1, .head_dim = 64, .page_tokens = 16, .seed = 3};
    kvd_core_opts_t o;
    kvd_core_opts_default(&o, &g, N, 16);
    o.backend = "cuda";
    char err[256] = "";
    kvd_core_t *c = NULL;
    int rc = kvd_core_init(&c, &o, err, sizeof err);
    if (rc != KV_ERR_OK) {
        check(0, "collect", "kvd_core_init(cuda, %d pages): %d %s", N, rc, err);
        return;
    }
    kvd_backend_t *b = kvd_core_backend(c);
    uint64_t sid = 0;
    static uint32_t ids[N];
    CK(kvd_core_session_open(c, (int32_t)getpid(), (uint32_t)getuid(), &sid));
    const double ta = now_us();
    CK(kvd_core_alloc(c, sid, N, ids));
    const double t_alloc = now_us() - ta;
    int ok = 1;
    for (int i = 0; i < N; i++)
        ok = ok && dev_entry(b, ids[i]) == b->dir[ids[i]] &&
             (kv_dir_flags(b->dir[ids[i]]) & KV_DIR_VALID);
    check(ok, "alloc many", "%d entries VALID on the device, equal to the mirror", N);
    CK(kvd_core_release(c, sid, ids, N));
    const double t0 = now_us();
    CK(kvd_core_session_close(c, sid)); /* the last session: collects all N */
    const double t_collect = now_us() - t0;
    for (int i = 0; i < N; i++)
        ok = ok && dev_entry(b, ids[i]) == b->dir[ids[i]] &&
             !(kv_dir_flags(b->dir[ids[i]]) & KV_DIR_VALID);
    check(ok, "collect", "%d freed entries invalid on the device and in the mirror", N);
    kvd_stats_t st;
    kvd_core_stats(c, &st);
    check(st.dir_syncs == 2 && st.dir_sync_entries == 2ull * N, "collect counters",
          "dir_syncs %llu (want 2: the alloc, the collect), entries %llu, %.0f us in them",
          (unsigned long long)st.dir_syncs, (unsigned long long)st.dir_sync_entries,
          st.dir_sync_ns / 1e3);
    /* the same N entries pushed one call each (what a collect did before) */
    const double t1 = now_us();
    for (int i = 0; i < N && ok; i++)
        ok = b->ops->dir_sync(b, &ids[i], 1, err, sizeof err) == KV_ERR_OK;
    const double t_each = now_us() - t1;
    const double t2 = now_us();
    ok = ok && b->ops->dir_sync(b, ids, N, err, sizeof err) == KV_ERR_OK;
    const double t_one = now_us() - t2;
    check(ok, "collect pushes", "%s", err);
    printf("INFO %d pages: alloc %.0f us, collect (session close) %.0f us; the same entries "
           "pushed one dir_sync each: %.0f us, in one dir_sync: %.0f us\n",
           N, t_alloc, t_collect, t_each, t_one);
    /* one dir_sync of n entries, mean of 20: below kDirKernelMin (6) stream writes, from it on
     * the kvk_cuda_dir_store kernel (backend_cuda.c) — where the two paths cross */
    static const uint32_t sizes[] = {1, 4, 7, 8, 16, 32, 64, 512};
    printf("INFO one dir_sync of n entries, mean of 20 (us):");
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        const double t = now_us();
        for (int r = 0; r < 20 && ok; r++)
            ok = b->ops->dir_sync(b, ids, sizes[k], err, sizeof err) == KV_ERR_OK;
        printf(" n=%u %.1f", sizes[k], (now_us() - t) / 20);
    }
    printf("\n");
    check(ok, "dir_sync sizes", "%s", err);
    kvd_core_free(&c);
}

int main(void)
{
    const kv_geom_t g = {
        .layers = 3, .kv_heads = 2, .head_dim = 128, .page_tokens = 13, .seed = 0x5eed};
    kvd_core_opts_t o;
    kvd_core_opts_default(&o, &g, 7, 5);
    o.backend = "cuda";
    char err[512] = "";

    /* device: a bad ordinal is a clear error, never a fallback */
    setenv("KVD_CUDA_DEVICE", "999", 1);
    kvd_core_t *bad = NULL;
    int rc = kvd_core_init(&bad, &o, err, sizeof err);
    check(rc != KV_ERR_OK && bad == NULL && strstr(err, "KVD_CUDA_DEVICE"), "device", "rc %d, '%s'",
          rc, err);
    unsetenv("KVD_CUDA_DEVICE");

    kvd_core_t *c = NULL;
    rc = kvd_core_init(&c, &o, err, sizeof err);
    if (rc != KV_ERR_OK) {
        printf("FATAL kvd_core_init(cuda): %d %s\n", rc, err);
        return 2;
    }
    kvd_backend_t *b = kvd_core_backend(c);
    const kvd_export_t *ex = kvd_core_export(c);

    /* export */
    const CUmemAllocationProp prop = kv_cudrv_fd_prop(0); /* kvd's allocations' */
    size_t gran = 0;
    CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    int ok = strcmp(ex->backend, "cuda") == 0 && ex->dir_fd >= 0 && gran > 0 &&
             ex->dir_bytes % gran == 0 && ex->dir_bytes >= 8ull * ex->dir_entries;
    for (int f = 0; f < KV_FMT_COUNT; f++)
        ok = ok && ex->pool_fd[f] >= 0 && ex->pool_bytes[f] % gran == 0 &&
             ex->pool_bytes[f] >= (uint64_t)ex->pages[f] * ex->page_bytes[f];
    check(ok, "export", "backend %s, granularity %zu, pools %llu/%llu bytes, dir %llu bytes",
          ex->backend, gran, (unsigned long long)ex->pool_bytes[0],
          (unsigned long long)ex->pool_bytes[1], (unsigned long long)ex->dir_bytes);

    /* publish */
    uint64_t sid;
    CK(kvd_core_session_open(c, (int32_t)getpid(), (uint32_t)getuid(), &sid));
    uint32_t ids[3];
    CK(kvd_core_alloc(c, sid, 3, ids));
    ok = 1;
    for (int i = 0; i < 3; i++) {
        kv_dir_entry_t d = dev_entry(b, ids[i]), h = b->dir[ids[i]];
        ok = ok && d == h && (kv_dir_flags(d) & KV_DIR_VALID) && kv_dir_fmt(d) == KV_FMT_FP8;
    }
    check(ok, "publish", "3 allocated entries equal on device and host");

    /* import: a second mapping of the exported directory sees the same bytes */
    {
        CUmemGenericAllocationHandle h;
        CUdeviceptr p = 0;
        CK(cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)ex->dir_fd,
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        CK(cuMemAddressReserve(&p, ex->dir_bytes, gran, 0, 0));
        CK(cuMemMap(p, ex->dir_bytes, 0, h, 0));
        CUmemAccessDesc acc = {.location = prop.location,
                               .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        CK(cuMemSetAccess(p, ex->dir_bytes, &acc, 1));
        kv_dir_entry_t e[3];
        ok = 1;
        for (int i = 0; i < 3; i++) {
            CK(cuMemcpyDtoH(&e[i], p + 8ull * ids[i], 8));
            ok = ok && e[i] == b->dir[ids[i]];
        }
        check(ok, "import", "entries read through a second mapping of the exported fd");
        /* Can a client map the directory read-only? If the driver accepts PROT_READ, a write
         * through that mapping must fail; if it refuses, that is reported (docs: a known gap). */
        CUmemAccessDesc ro = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READ};
        CUresult rr = cuMemSetAccess(p, ex->dir_bytes, &ro, 1);
        if (rr == CUDA_SUCCESS) {
            kv_dir_entry_t junk = ~0ull;
            CUresult wr = cuMemcpyHtoD(p + 8ull * ids[0], &junk, 8);
            kv_dir_entry_t now = dev_entry(b, ids[0]);
            check(wr != CUDA_SUCCESS && now == b->dir[ids[0]], "import read-only",
                  "write through a PROT_READ mapping: %d, entry intact %d", (int)wr,
                  now == b->dir[ids[0]]);
        } else {
            const char *m = "";
            cuGetErrorString(rr, &m);
            printf("INFO import read-only: cuMemSetAccess(PROT_READ) refused: %s\n", m);
        }
        cuMemUnmap(p, ex->dir_bytes);
        cuMemAddressFree(p, ex->dir_bytes);
        cuMemRelease(h);
    }

    /* append: KV for all 13 slots of each page, every layer, through the device directory */
    const uint32_t ntok = 3 * g.page_tokens, row = g.kv_heads * g.head_dim;
    uint16_t *hk = malloc(sizeof(uint16_t) * ntok * row),
             *hv = malloc(sizeof(uint16_t) * ntok * row);
    uint32_t *sp = malloc(4 * ntok), *si = malloc(4 * ntok);
    for (uint32_t i = 0; i < ntok * row; i++) { /* uniform in [-2, 2) and [-3, 3) */
        hk[i] = kv_half_from_float((float)(kv_splitmix64(i) >> 40) / (1u << 24) * 4.0f - 2.0f);
        hv[i] = kv_half_from_float((float)(kv_splitmix64(~(uint64_t)i) >> 40) / (1u << 24) * 6.0f -
                                   3.0f);
    }
    for (uint32_t t = 0; t < ntok; t++) {
        sp[t] = ids[t / g.page_tokens];
        si[t] = t % g.page_tokens;
    }
    void *dk, *dv, *dsp, *dsi;
    CK(cudaMalloc(&dk, 2ull * ntok * row));
    CK(cudaMalloc(&dv, 2ull * ntok * row));
    CK(cudaMalloc(&dsp, 4ull * ntok));
    CK(cudaMalloc(&dsi, 4ull * ntok));
    CK(cudaMemcpy(dsp, sp, 4ull * ntok, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsi, si, 4ull * ntok, cudaMemcpyHostToDevice));
    const kv_dir_entry_t *ddir = kvd_backend_cuda_dir_device(b);
    for (uint32_t l = 0; l < g.layers; l++) {
        /* a different input per layer: shift the values */
        for (uint32_t i = 0; i < ntok * row; i++)
            hk[i] ^= (uint16_t)(l << 3);
        CK(cudaMemcpy(dk, hk, 2ull * ntok * row, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dv, hv, 2ull * ntok * row, cudaMemcpyHostToDevice));
        CK(kvk_cuda_fp8_append(&g, &b->pools, ddir, ex->dir_entries, l, ntok, dsp, dsi, dk, dv,
                               KVK_DTYPE_F16, 0));
    }
    CK(cudaDeviceSynchronize());
    uint64_t pb8 = ex->page_bytes[KV_FMT_FP8], pbt = ex->page_bytes[KV_FMT_TQ3];
    uint8_t *page = malloc(pb8), *t1 = malloc(pb8 > pbt ? pb8 : pbt), *t2 = malloc(pb8);
    uint32_t p0 = kv_dir_phys(b->dir[ids[0]]);
    CK(cudaMemcpy(page, b->pools.base[KV_FMT_FP8] + p0 * pb8, pb8, cudaMemcpyDeviceToHost));
    float sc;
    memcpy(&sc,
           page + kv_block_offset(&g, KV_FMT_FP8, 2, KV_KIND_V, 1) +
               kv_block_meta_offset(&g, KV_FMT_FP8, KV_KIND_V) + 4 * 12,
           4);
    check(sc > 0.0f && sc != 1.0f && isfinite(sc), "append",
          "scale of layer 2 V head 1 slot 12 "
          "= %g",
          sc);

    /* retier: through the core, then the same kernel directly into a scratch TQ3 page */
    kv_dir_entry_t before = dev_entry(b, ids[0]);
    rc = kvd_core_convert(c, ids[0], KV_FMT_TQ3);
    kv_dir_entry_t after = dev_entry(b, ids[0]);
    check(rc == KV_ERR_OK && after == b->dir[ids[0]] && kv_dir_fmt(after) == KV_FMT_TQ3 &&
              kv_dir_gen(after) == kv_dir_gen(before) + 1 &&
              kv_dir_phys(after) < ex->pages[KV_FMT_TQ3],
          "retier flip", "rc %d, entry %016llx -> %016llx", rc, (unsigned long long)before,
          (unsigned long long)after);
    uint32_t *dix;
    CK(cudaMalloc((void **)&dix, 8));
    uint8_t *scratch;
    CK(cudaMalloc((void **)&scratch, pb8 + pbt));
    {
        /* pools whose TQ3 "pool" is the scratch page: direct retier of FP8 p0 into it */
        kv_pools_t sp8 = b->pools;
        sp8.base[KV_FMT_TQ3] = scratch;
        sp8.pages[KV_FMT_TQ3] = 1;
        uint32_t ix[2] = {p0, 0};
        CK(cudaMemcpy(dix, ix, 8, cudaMemcpyHostToDevice));
        CK(kvk_cuda_page_retier(&g, &sp8, 1, dix, dix + 1, 0));
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(t1, scratch, pbt, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(t2, b->pools.base[KV_FMT_TQ3] + kv_dir_phys(after) * pbt, pbt,
                      cudaMemcpyDeviceToHost));
        size_t diff = 0;
        for (uint64_t i = 0; i < pbt; i++)
            diff += t1[i] != t2[i];
        check(diff == 0, "retier bytes", "%zu of %llu bytes differ from a direct retier", diff,
              (unsigned long long)pbt);
    }

    /* promote back */
    before = after;
    rc = kvd_core_convert(c, ids[0], KV_FMT_FP8);
    after = dev_entry(b, ids[0]);
    check(rc == KV_ERR_OK && after == b->dir[ids[0]] && kv_dir_fmt(after) == KV_FMT_FP8 &&
              kv_dir_gen(after) == kv_dir_gen(before) + 1,
          "promote flip", "rc %d, entry %016llx -> %016llx", rc, (unsigned long long)before,
          (unsigned long long)after);
    {
        kv_pools_t s8 = b->pools;
        s8.base[KV_FMT_FP8] = scratch + pbt; /* 256-aligned: pbt is a multiple of 256 */
        s8.pages[KV_FMT_FP8] = 1;
        uint32_t ix[2] = {kv_dir_phys(before), 0};
        CK(cudaMemcpy(dix, ix, 8, cudaMemcpyHostToDevice));
        CK(kvk_cuda_page_promote(&g, &s8, 1, dix, dix + 1, 0));
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(t1, scratch + pbt, pb8, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(t2, b->pools.base[KV_FMT_FP8] + kv_dir_phys(after) * pb8, pb8,
                      cudaMemcpyDeviceToHost));
        size_t diff = 0;
        for (uint64_t i = 0; i < pb8; i++)
            diff += t1[i] != t2[i];
        check(diff == 0, "promote bytes", "%zu of %llu bytes differ from a direct promote", diff,
              (unsigned long long)pb8);
    }

    /* failure: the hook fails the conversion; the device entry must not move */
    before = dev_entry(b, ids[1]);
    b->test_fail_convert = 1;
    rc = kvd_core_convert(c, ids[1], KV_FMT_TQ3);
    after = dev_entry(b, ids[1]);
    check(rc == KV_ERR_DEVICE && after == before && after == b->dir[ids[1]], "failure",
          "rc %d, entry %016llx -> %016llx", rc, (unsigned long long)before,
          (unsigned long long)after);

    /* release: the freed entries are cleared on the device too */
    CK(kvd_core_release(c, sid, ids, 3));
    CK(kvd_core_session_close(c, sid));
    kvd_core_collect(c);
    ok = 1;
    for (int i = 0; i < 3; i++)
        ok = ok && dev_entry(b, ids[i]) == b->dir[ids[i]] &&
             !(kv_dir_flags(b->dir[ids[i]]) & KV_DIR_VALID);
    check(ok, "release", "freed entries invalid on the device and in the mirror");

    /* snapshot copies: kvd_core_cache_restore writes a page through ops->page_write, the bytes
     * are on the device at its phys, and kvd_core_page_read (ops->page_read) returns them */
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        uint64_t pbf = kvd_core_export(c)->page_bytes[f];
        uint8_t *src = malloc(pbf), *dev = malloc(pbf), *back = malloc(pbf);
        for (uint64_t i = 0; i < pbf; i++)
            src[i] = (uint8_t)(i * 37u + 11u + (uint64_t)f);
        uint8_t h[32];
        memset(h, 0xC0 + f, sizeof h);
        uint32_t lid = KVD_NONE;
        rc = kvd_core_cache_restore(c, h, (kv_fmt_t)f, src, pbf, &lid);
        ok = rc == KV_ERR_OK && lid != KVD_NONE;
        if (ok) {
            kv_dir_entry_t e = dev_entry(b, lid);
            CK(cudaMemcpy(dev, b->pools.base[f] + kv_dir_phys(e) * pbf, pbf,
                          cudaMemcpyDeviceToHost));
            ok = kv_dir_fmt(e) == (kv_fmt_t)f && memcmp(dev, src, pbf) == 0 &&
                 kvd_core_page_read(c, lid, back, pbf) == KV_ERR_OK &&
                 memcmp(back, src, pbf) == 0;
        }
        check(ok, f == KV_FMT_FP8 ? "snapshot copy fp8" : "snapshot copy tq3",
              "restore rc %d, %llu bytes through page_write / page_read", rc,
              (unsigned long long)pbf);
        free(src);
        free(dev);
        free(back);
    }

    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dsp);
    cudaFree(dsi);
    cudaFree(dix);
    cudaFree(scratch);
    free(hk);
    free(hv);
    free(sp);
    free(si);
    free(page);
    free(t1);
    free(t2);
    kvd_core_free(&c);
    test_collect_many();
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
