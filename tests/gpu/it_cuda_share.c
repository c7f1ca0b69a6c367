/* it_cuda_share.c — two engine processes share KV pages in GPU memory through kvd (cuda
 * backend), end to end: real daemon, real protocol, CUDA VMM fds over SCM_RIGHTS.
 *
 *   parent   starts `kvd --backend cuda` on a temporary ipc endpoint (mkdtemp), waits for it
 *            with a no-map hello (the parent never initialises CUDA, so fork() stays legal)
 *   A        hello (imports pools + directory), allocates 3 FP8 pages, writes K/V of 48 tokens
 *            into every layer with the append kernel (resolving pages through the DEVICE
 *            directory), seals the 3 pages under token ids, runs decode attention (partial +
 *            merge via kvk_cuda_attn_decode) over them, saves the output and the raw page
 *            bytes, then waits until B is done and runs attention again
 *   B        another process: hello, lookup of the same tokens → must hit all 48 tokens on the
 *            SAME logical pages; reads the page bytes through its own mapping (must equal A's
 *            bytes), runs the same attention with the same query through its own mapping
 *   C        (session 3) hello and map, then the parent restarts the daemon on the same
 *            endpoint: C's next call fails with NO_SESSION and kvc_daemon_restarted(); after
 *            kvc_rehello() (unmap the old pools, import the new daemon's) C allocates, appends,
 *            seals and attends exactly as A did, through the NEW mapping
 *   D        libkvshim (engine-shim/kvshim.h) on the device path: begins a sequence with A's first
 *            SEQ tokens (the two full pages before the last token are a prefix hit), appends the
 *            rest with A's K/V (f16, device buffers, the append kernel through the shim),
 *            attends through kvs_attention
 *   E, F     (session 9) a client killed with a kernel in flight: E allocates one FP8 page
 *            and starts a kernel that keeps writing a pattern over it for 3 s; the parent
 *            kills E (SIGKILL) 100 ms later; F then allocates until the daemon hands out E's
 *            physical page again (after reclaiming E's session), zeroes it, waits past the
 *            3 s and reads it back: it must still be zero — no write of the dead process lands
 *            in a page the daemon gave to someone else
 *   G, H     (2026-12 review, no daemon) libkvc's import itself (client/kvc_cuda.c): H
 *            exports a legacy IPC handle of a 4 MiB cudaMalloc and a VMM fd of a 4 MiB
 *            cuMemCreate, both filled with a byte pattern, and hands both to G over a socket.
 *            G, with a context of its OWN current (cuCtxCreate), calls kvc__cuda_open / map /
 *            read / close directly: a descriptor 2 MiB larger than the allocation must be
 *            refused in both modes (legacy: MALFORMED, from cuMemGetAddressRange; VMM: cuMemMap
 *            refuses), the honest size must map and read back the pattern, and after every call
 *            G's own context must still be the current one (libkvc used to leave the primary
 *            context current)
 *   checks   A's and B's outputs are bit-identical (same kernel, same pages, same inputs), and
 *            A's second run equals its first (B's lookup did not disturb the pages); C's output
 *            after the restart equals A's; D's table starts with A's pages and its output equals
 *            A's within 1e-5 (kvs_attention picks its own split count, so only the partition
 *            merge order differs); outputs finite and not all zero; both daemons exit 0 on
 *            SIGTERM.
 *
 * Not registered with ctest (CI has no GPU). Run: it_cuda_share [--kvd PATH] (or KVD_BIN=PATH);
 * with KVD_CUDA_LEGACY_IPC=1 in the environment the daemon and clients use the legacy mode;
 * prints PASS/FAIL per check and "N passed, M failed"; exit 1 on any failure.
 * Geometry: layers 2, kv_heads 4, head_dim 128, page_tokens 16, q_heads 8 (GQA 2), seq_len 45
 * (the last page partly used: awkward on purpose).
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kv_cudrv.h"
#include "kvc.h"
#include "kvc_cuda.h"
#include "kvkern.h"
#include "kvkern_cuda.h"
#include "kvshim.h"

#ifndef KVD_BIN_DEFAULT
#define KVD_BIN_DEFAULT "kvd"
#endif

enum { LAYERS = 2, KVH = 4, HD = 128, PT = 16, NPAGES = 3, QH = 8, SEQ = 45, ATTN_LAYER = 1 };
#define NTOK (NPAGES * PT)

static int g_pass, g_fail;

/* a failed shim call in a child: its message, exit 5 */
#define KCK_S(s, call)                                                                             \
    do {                                                                                           \
        kv_err_t e_ = (call);                                                                      \
        if (e_ != KV_ERR_OK) {                                                                     \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, kvs_errmsg(s));           \
            _exit(5);                                                                              \
        }                                                                                          \
    } while (0)
static char g_dir[256], g_ep[320];

static void check(int ok, const char *name, const char *fmt, ...)
{
    char msg[256] = "";
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name, msg[0] ? ": " : "", msg);
    fflush(stdout);
    if (ok)
        g_pass++;
    else
        g_fail++;
}

/* In the children: any failure is fatal, with the call text; the parent sees the exit code. */
#define CK(call)                                                                                   \
    do {                                                                                           \
        long r_ = (long)(call);                                                                    \
        if (r_ != 0) {                                                                             \
            fprintf(stderr, "[%d] %s:%d: %s -> %ld\n", (int)getpid(), __FILE__, __LINE__, #call,   \
                    r_);                                                                           \
            _exit(3);                                                                              \
        }                                                                                          \
    } while (0)
#define KCK(c, call)                                                                               \
    do {                                                                                           \
        kv_err_t e_ = (call);                                                                      \
        if (e_ != KV_ERR_OK) {                                                                     \
            fprintf(stderr, "[%d] %s:%d: %s -> %d (%s)\n", (int)getpid(), __FILE__, __LINE__,      \
                    #call, (int)e_, kvc_errmsg(c));                                                \
            _exit(3);                                                                              \
        }                                                                                          \
    } while (0)

static void path(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", g_dir, name);
}

static void save(const char *name, const void *p, size_t n)
{
    char f[400];
    path(f, sizeof f, name);
    FILE *fp = fopen(f, "wb");
    if (!fp || fwrite(p, 1, n, fp) != n || fclose(fp) != 0) {
        fprintf(stderr, "cannot write %s\n", f);
        _exit(3);
    }
}

static size_t load(const char *name, void *p, size_t cap)
{
    char f[400];
    path(f, sizeof f, name);
    FILE *fp = fopen(f, "rb");
    if (!fp)
        return 0;
    size_t n = fread(p, 1, cap, fp);
    fclose(fp);
    return n;
}

static void tokens(uint32_t *t)
{
    for (uint32_t i = 0; i < NTOK; i++)
        t[i] = 1000 + 7 * i;
}

/* Deterministic pseudo-random float in [-a, a) from an index (identical in every process). */
static float val(uint64_t i, float a)
{
    uint64_t x = kv_splitmix64(i);
    return ((float)(x >> 40) / (float)(1u << 24) * 2.0f - 1.0f) * a;
}

/* K/V (f16) of all NTOK tokens of layer l, [NTOK][KVH][HD]; a few large outliers so scales
 * differ across tokens. */
static void kv_data(uint32_t l, uint16_t *k, uint16_t *v)
{
    for (uint32_t i = 0; i < NTOK * KVH * HD; i++) {
        float o = (i % 97 == 0) ? 8.0f : 1.0f;
        k[i] = kv_half_from_float(val(((uint64_t)l << 32) | i, 2.0f * o));
        v[i] = kv_half_from_float(val(((uint64_t)(l + 16) << 32) | i, 3.0f));
    }
}

/* The query of attention(), [QH][HD] */
static void query(float *q)
{
    for (uint32_t i = 0; i < QH * HD; i++)
        q[i] = val(0xABCDull + i, 1.0f);
}

static kvc_t *client(const char *name)
{
    kvc_t *c = NULL;
    if (kvc_connect(&c, g_ep, 20000) != KV_ERR_OK)
        _exit(3);
    KCK(c, kvc_hello(c, NULL, name, 1));
    /* KVD_CUDA_LEGACY_IPC=1 is inherited by the daemon: then the legacy import is tested */
    const char *lg = getenv("KVD_CUDA_LEGACY_IPC");
    const char *want = lg && strcmp(lg, "1") == 0 ? "cuda-ipc" : "cuda";
    if (strcmp(kvc_backend(c), want) != 0 || !kvc_on_device(c)) {
        fprintf(stderr, "[%s] backend '%s', on device %d\n", name, kvc_backend(c),
                kvc_on_device(c));
        _exit(4);
    }
    return c;
}

/* Decode attention of one query over pages[NPAGES] (logical ids), SEQ tokens, on the device
 * through this process's mapping. out: host [QH][HD]. */
static void attention(kvc_t *c, const uint32_t *pages, float *out)
{
    kv_pools_t pools;
    kvc_pools(c, &pools);
    const kv_dir_entry_t *dir = (const kv_dir_entry_t *)kvc_directory(c);
    float q[QH * HD];
    query(q);
    uint32_t indptr[2] = {0, NPAGES}, len = SEQ;
    uint32_t *d_indptr, *d_ids, *d_len;
    float *d_q, *d_out;
    const uint32_t splits = 2;
    size_t ws = kvk_cuda_attn_workspace_bytes(1, QH, HD, splits);
    void *d_ws;
    CK(cudaMalloc((void **)&d_indptr, sizeof indptr));
    CK(cudaMalloc((void **)&d_ids, 4 * NPAGES));
    CK(cudaMalloc((void **)&d_len, 4));
    CK(cudaMalloc((void **)&d_q, sizeof q));
    CK(cudaMalloc((void **)&d_out, sizeof q));
    CK(cudaMalloc(&d_ws, ws));
    CK(cudaMemcpy(d_indptr, indptr, sizeof indptr, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_ids, pages, 4 * NPAGES, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_len, &len, 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_q, q, sizeof q, cudaMemcpyHostToDevice));
    kv_attn_batch_t b = {.batch = 1,
                         .q_heads = QH,
                         .layer = ATTN_LAYER,
                         .sm_scale = 1.0f / sqrtf((float)HD),
                         .page_indptr = d_indptr,
                         .page_ids = d_ids,
                         .seq_len = d_len};
    CK(kvk_cuda_attn_decode(kvc_geom(c), &pools, dir, kvc_dir_entries(c), &b, d_q, splits, d_ws, ws,
                            d_out, 0));
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(out, d_out, sizeof q, cudaMemcpyDeviceToHost));
    cudaFree(d_indptr);
    cudaFree(d_ids);
    cudaFree(d_len);
    cudaFree(d_q);
    cudaFree(d_out);
    cudaFree(d_ws);
}

/* Raw bytes of the pages, copied through this process's mapping. */
static void page_bytes(kvc_t *c, const uint32_t *pages, uint8_t *out)
{
    uint64_t pb = kvc_page_bytes(c, KV_FMT_FP8);
    for (int i = 0; i < NPAGES; i++) {
        uint8_t *p = kvc_page_ptr(c, pages[i]);
        if (!p)
            _exit(5);
        CK(cudaMemcpy(out + i * pb, p, pb, cudaMemcpyDeviceToHost));
    }
}

/* Allocate NPAGES FP8 pages, write K/V of NTOK tokens into every layer with the append kernel
 * (pages resolved through the DEVICE directory), seal them under tokens(), run attention. */
static void build(kvc_t *c, uint32_t *pages, float *out)
{
    /* the engine's kernels are synchronous here, so the default safe-epoch mode is right */
    KCK(c, kvc_alloc(c, KV_FMT_FP8, NPAGES, pages));
    kv_pools_t pools;
    kvc_pools(c, &pools);
    const kv_dir_entry_t *dir = (const kv_dir_entry_t *)kvc_directory(c);
    static uint16_t k[NTOK * KVH * HD], v[NTOK * KVH * HD];
    uint32_t sp[NTOK], si[NTOK];
    for (uint32_t t = 0; t < NTOK; t++) {
        sp[t] = pages[t / PT];
        si[t] = t % PT;
    }
    void *dk, *dv, *dsp, *dsi;
    CK(cudaMalloc(&dk, sizeof k));
    CK(cudaMalloc(&dv, sizeof v));
    CK(cudaMalloc(&dsp, sizeof sp));
    CK(cudaMalloc(&dsi, sizeof si));
    CK(cudaMemcpy(dsp, sp, sizeof sp, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsi, si, sizeof si, cudaMemcpyHostToDevice));
    for (uint32_t l = 0; l < LAYERS; l++) {
        kv_data(l, k, v);
        CK(cudaMemcpy(dk, k, sizeof k, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dv, v, sizeof v, cudaMemcpyHostToDevice));
        CK(kvk_cuda_fp8_append(kvc_geom(c), &pools, dir, kvc_dir_entries(c), l, NTOK, dsp, dsi, dk,
                               dv, KVK_DTYPE_F16, 0));
    }
    CK(cudaDeviceSynchronize());
    uint32_t tok[NTOK];
    tokens(tok);
    uint32_t prev = KVP_NO_PAGE;
    for (int i = 0; i < NPAGES; i++) {
        uint32_t out_page;
        KCK(c, kvc_seal(c, pages[i], prev, tok + i * PT, PT, NULL, 0, &out_page));
        if (out_page != pages[i])
            _exit(6); /* a fresh daemon holds no duplicate */
        prev = pages[i];
    }
    attention(c, pages, out);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dsp);
    cudaFree(dsi);
}

static int child_a(int ready_fd, int go_fd)
{
    CK(cudaSetDevice(0));
    kvc_t *c = client("it-cuda-A");
    uint32_t pages[NPAGES];
    float out[QH * HD];
    build(c, pages, out);
    save("outA.bin", out, sizeof out);
    save("pagesA.ids", pages, sizeof pages);
    uint64_t pb = kvc_page_bytes(c, KV_FMT_FP8);
    uint8_t *raw = malloc(NPAGES * pb);
    page_bytes(c, pages, raw);
    save("pagesA.bin", raw, NPAGES * pb);
    free(raw);
    char x = 'r';
    if (write(ready_fd, &x, 1) != 1)
        _exit(3);
    if (read(go_fd, &x, 1) != 1) /* B is done */
        _exit(3);
    attention(c, pages, out);
    save("outA2.bin", out, sizeof out);
    kvc_close(&c);
    return 0;
}

/* C: mapped, waits while the parent restarts the daemon, then must see the restart, rehello
 * and work through the new daemon's pools. Result codes in restart.bin:
 * [first call's error, kvc_daemon_restarted, rehello error, instance changed, on device] */
static int child_c(int ready_fd, int go_fd)
{
    CK(cudaSetDevice(0));
    kvc_t *c = client("it-cuda-C");
    const uint64_t inst0 = kvc_instance(c);
    char x = 'r';
    if (write(ready_fd, &x, 1) != 1 || read(go_fd, &x, 1) != 1)
        _exit(3);
    uint32_t pages[NPAGES];
    int32_t r[5];
    r[0] = (int32_t)kvc_alloc(c, KV_FMT_FP8, NPAGES, pages);
    r[1] = kvc_daemon_restarted(c);
    r[2] = (int32_t)kvc_rehello(c);
    r[3] = kvc_instance(c) != inst0;
    r[4] = kvc_on_device(c);
    save("restart.bin", r, sizeof r);
    if (r[2] != KV_ERR_OK)
        return 0; /* the parent reports it */
    float out[QH * HD];
    build(c, pages, out);
    save("outC.bin", out, sizeof out);
    kvc_close(&c);
    return 0;
}

static int child_b(void)
{
    CK(cudaSetDevice(0));
    kvc_t *c = client("it-cuda-B");
    uint32_t tok[NTOK], pages[NPAGES] = {0}, matched = 0;
    size_t n = 0;
    tokens(tok);
    KCK(c, kvc_lookup(c, tok, NTOK, NULL, 0, 0, pages, NPAGES, &n, &matched));
    save("pagesB.ids", pages, sizeof pages);
    uint32_t nm[2] = {(uint32_t)n, matched};
    save("matchB.bin", nm, sizeof nm);
    if (n != NPAGES)
        return 0; /* the parent reports it */
    uint64_t pb = kvc_page_bytes(c, KV_FMT_FP8);
    uint8_t *raw = malloc(NPAGES * pb);
    page_bytes(c, pages, raw);
    save("pagesB.bin", raw, NPAGES * pb);
    free(raw);
    float out[QH * HD];
    attention(c, pages, out);
    save("outB.bin", out, sizeof out);
    KCK(c, kvc_release(c, pages, NPAGES));
    kvc_close(&c);
    return 0;
}

/* D: libkvshim on device pools. Results in shimD.bin: [open error, on device, cached tokens,
 * table starts with A's pages, append errors, attention error, attention on a q 4 bytes off
 * 16-byte alignment (error; 1 more when the message says why)]; output in outD.bin. */
int it_spin_fill(void *p, size_t bytes, uint32_t v, uint32_t ms); /* spin.cu */

enum { SPIN_MS = 3000 };
#define SPIN_WORD 0xE5E5E5E5u

/* physical FP8 page behind a logical one, from this process's mapping */
static uint32_t phys_of(kvc_t *c, uint32_t page)
{
    kv_pools_t pools;
    kvc_pools(c, &pools);
    uint8_t *p = kvc_page_ptr(c, page);
    if (!p)
        _exit(5);
    return (uint32_t)((uint64_t)(p - pools.base[KV_FMT_FP8]) / kvc_page_bytes(c, KV_FMT_FP8));
}

/* E: one page, a kernel writing SPIN_WORD over it for SPIN_MS, then wait to be killed */
static int child_e(int ready_fd)
{
    CK(cudaSetDevice(0));
    kvc_t *c = client("it-cuda-E");
    uint32_t page;
    KCK(c, kvc_alloc(c, KV_FMT_FP8, 1, &page));
    uint32_t phys = phys_of(c, page);
    save("physE.bin", &phys, sizeof phys);
    const uint64_t pb = kvc_page_bytes(c, KV_FMT_FP8);
    if (it_spin_fill(kvc_page_ptr(c, page), pb, SPIN_WORD, SPIN_MS))
        _exit(7);
    /* the control: read the page on another stream while the kernel runs, so that the check
     * after the kill is known to look at a page that was being written */
    struct timespec ts = {0, 50 * 1000000L};
    nanosleep(&ts, NULL);
    cudaStream_t s2;
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    uint32_t *seen = malloc(pb);
    CK(cudaMemcpyAsync(seen, kvc_page_ptr(c, page), pb, cudaMemcpyDeviceToHost, s2));
    CK(cudaStreamSynchronize(s2));
    int32_t spinning = 0;
    for (uint64_t i = 0; i < pb / 4; i++)
        spinning += seen[i] == SPIN_WORD;
    save("spinE.bin", &spinning, sizeof spinning);
    if (write(ready_fd, "r", 1) != 1)
        _exit(8);
    for (;;)
        pause();
}

/* F: allocate until E's physical page comes back (the daemon reclaims E's session when its
 * pidfd fires), zero it, wait past E's kernel's end, read it back. Results in reuseF.bin:
 * [found, ms until found, nonzero words afterwards]. */
static int child_f(void)
{
    CK(cudaSetDevice(0));
    kvc_t *c = client("it-cuda-F");
    uint32_t want = ~0u;
    load("physE.bin", &want, sizeof want);
    const uint64_t pb = kvc_page_bytes(c, KV_FMT_FP8);
    int32_t res[3] = {0, -1, -1};
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    uint32_t page = KVP_NO_PAGE;
    for (int tries = 0; tries < 500 && !res[0]; tries++) {
        kv_err_t e = kvc_alloc(c, KV_FMT_FP8, 1, &page);
        if (e == KV_ERR_OK && phys_of(c, page) == want) {
            res[0] = 1;
        } else if (e != KV_ERR_OK) { /* pool exhausted until the reclaim: wait a little */
            struct timespec ts = {0, 10 * 1000000L};
            nanosleep(&ts, NULL);
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t);
    res[1] = (int32_t)((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000);
    if (res[0]) {
        uint8_t *p = kvc_page_ptr(c, page);
        CK(cudaMemset(p, 0, pb));
        CK(cudaDeviceSynchronize());
        struct timespec ts = {SPIN_MS / 1000 + 1, 0}; /* past the dead kernel's 3 s */
        nanosleep(&ts, NULL);
        uint32_t *back = malloc(pb);
        CK(cudaMemcpy(back, p, pb, cudaMemcpyDeviceToHost));
        res[2] = 0;
        for (uint64_t i = 0; i < pb / 4; i++)
            res[2] += back[i] != 0;
        free(back);
    }
    save("reuseF.bin", res, sizeof res);
    return 0;
}

static int wait_child(pid_t p);

/* G and H: two fds and two sizes over a unix socket (SCM_RIGHTS). */
static int send_two(int sock, const int fds[2], const uint64_t sizes[2])
{
    char ctl[CMSG_SPACE(2 * sizeof(int))];
    memset(ctl, 0, sizeof ctl);
    struct iovec io = {(void *)sizes, 2 * sizeof(uint64_t)};
    struct msghdr m = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = ctl,
                       .msg_controllen = sizeof ctl};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(2 * sizeof(int));
    memcpy(CMSG_DATA(c), fds, 2 * sizeof(int));
    return sendmsg(sock, &m, 0) == (ssize_t)(2 * sizeof(uint64_t)) ? 0 : -1;
}

static int recv_two(int sock, int fds[2], uint64_t sizes[2])
{
    char ctl[CMSG_SPACE(2 * sizeof(int))];
    struct iovec io = {sizes, 2 * sizeof(uint64_t)};
    struct msghdr m = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = ctl,
                       .msg_controllen = sizeof ctl};
    if (recvmsg(sock, &m, 0) != (ssize_t)(2 * sizeof(uint64_t)))
        return -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    if (!c || c->cmsg_type != SCM_RIGHTS || c->cmsg_len != CMSG_LEN(2 * sizeof(int)))
        return -1;
    memcpy(fds, CMSG_DATA(c), 2 * sizeof(int));
    return 0;
}

enum { IMPORT_BYTES = 4 << 20, LEGACY_FILL = 0x5A, VMM_FILL = 0x6B };

/* H: the exporter, in its own process (a legacy IPC handle cannot be opened by the process
 * that made it). Lives until G writes a byte back. */
static int child_h(int sock)
{
    CK(cudaSetDevice(0));
    CK(cudaFree(0));
    void *lp = NULL;
    CK(cudaMalloc(&lp, IMPORT_BYTES));
    CK(cudaMemset(lp, LEGACY_FILL, IMPORT_BYTES));
    cudaIpcMemHandle_t ih;
    CK(cudaIpcGetMemHandle(&ih, lp));
    int fds[2];
    fds[0] = memfd_create("it-cuda-ipc", 0);
    if (fds[0] < 0 || write(fds[0], &ih, sizeof ih) != (ssize_t)sizeof ih)
        _exit(3);
    const CUmemAllocationProp prop = kv_cudrv_fd_prop(0); /* kvd's allocations' */
    size_t gran = 0;
    CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    const size_t vbytes = (IMPORT_BYTES + gran - 1) / gran * gran;
    CUmemGenericAllocationHandle vh;
    CK(cuMemCreate(&vh, vbytes, &prop, 0));
    CUdeviceptr vp = 0;
    CK(cuMemAddressReserve(&vp, vbytes, gran, 0, 0));
    CK(cuMemMap(vp, vbytes, 0, vh, 0));
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CK(cuMemSetAccess(vp, vbytes, &acc, 1));
    CK(cuMemsetD8(vp, VMM_FILL, vbytes));
    CK(cudaDeviceSynchronize());
    CK(cuMemExportToShareableHandle(&fds[1], vh, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    const uint64_t sizes[2] = {IMPORT_BYTES, vbytes};
    if (send_two(sock, fds, sizes))
        _exit(3);
    char x;
    if (read(sock, &x, 1) != 1) /* G is done */
        _exit(3);
    return 0;
}

/* G: the importer. Results in importG.bin: [legacy lie rc, legacy honest rc, legacy pattern
 * seen, VMM lie rc, VMM honest rc, VMM pattern seen, G's context current after every call]. */
static int child_g(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        _exit(3);
    pid_t h = fork(); /* before this process touches CUDA */
    if (h == 0) {
        close(sv[0]);
        _exit(child_h(sv[1]));
    }
    close(sv[1]);
    int fds[2];
    uint64_t sizes[2];
    if (recv_two(sv[0], fds, sizes))
        _exit(3);
    int32_t r[7] = {-1, -1, 0, -1, -1, 0, 1};
    CK(cuInit(0));
    CUdevice dev;
    CK(cuDeviceGet(&dev, 0));
    CUcontext mine = NULL, cur = NULL;
    CUctxCreateParams cp;
    memset(&cp, 0, sizeof cp); /* no affinity, no CIG: a plain context */
    const CUresult cr = cuCtxCreate(&mine, &cp, 0, dev); /* current now: libkvc must leave it */
    if (cr != CUDA_SUCCESS) { /* then at least: no context current stays none */
        printf("INFO G: cuCtxCreate failed (%d); checking that NO context stays current\n",
               (int)cr);
        mine = NULL;
        CK(cuCtxSetCurrent(NULL));
    }
#define MINE_CURRENT() (cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == mine)
    char err[512] = "";
    for (int legacy = 1; legacy >= 0; legacy--) {
        const int fd = fds[legacy ? 0 : 1];
        const uint64_t bytes = sizes[legacy ? 0 : 1];
        int32_t *o = r + (legacy ? 0 : 3);
        kvc_cuda_t *cu = NULL;
        kv_err_t e = kvc__cuda_open(&cu, legacy, err, sizeof err);
        r[6] &= MINE_CURRENT();
        if (e != KV_ERR_OK) {
            printf("INFO G: kvc__cuda_open(legacy %d): %s\n", legacy, err);
            continue;
        }
        uint8_t *d = NULL;
        err[0] = 0;
        o[0] = kvc__cuda_map(cu, fd, bytes + (2u << 20), 0, &d, err, sizeof err);
        r[6] &= MINE_CURRENT();
        printf("INFO G: %s descriptor of %llu bytes over %llu: %s\n",
               legacy ? "legacy" : "VMM", (unsigned long long)bytes + (2u << 20),
               (unsigned long long)bytes, err[0] ? err : "accepted");
        err[0] = 0;
        o[1] = kvc__cuda_map(cu, fd, bytes, 0, &d, err, sizeof err);
        r[6] &= MINE_CURRENT();
        if (o[1] == KV_ERR_OK) {
            uint8_t tail[8] = {0};
            o[2] = kvc__cuda_read(cu, d + bytes - sizeof tail, tail, sizeof tail) == KV_ERR_OK;
            r[6] &= MINE_CURRENT();
            for (size_t i = 0; i < sizeof tail; i++)
                o[2] &= tail[i] == (legacy ? LEGACY_FILL : VMM_FILL);
        } else {
            printf("INFO G: honest %s map: %s\n", legacy ? "legacy" : "VMM", err);
        }
        kvc__cuda_close(&cu);
        r[6] &= MINE_CURRENT() && cu == NULL;
    }
#undef MINE_CURRENT
    save("importG.bin", r, sizeof r);
    if (write(sv[0], "d", 1) != 1)
        _exit(3);
    return wait_child(h) == 0 ? 0 : 6;
}

static int child_d(void)
{
    CK(cudaSetDevice(0));
    int32_t r[7] = {-1, 0, 0, 0, 0, -1, -1};
    kvs_t *s = NULL;
    const kvs_opts_t o = {.endpoint = g_ep, .name = "it-cuda-D"};
    r[0] = (int32_t)kvs_open(&s, &o);
    if (r[0] != KV_ERR_OK) {
        fprintf(stderr, "[D] kvs_open: %s\n", kvs_errmsg(NULL));
        save("shimD.bin", r, sizeof r);
        return 0;
    }
    r[1] = kvs_on_device(s);
    uint32_t tok[NTOK], ia[NPAGES] = {0}, tab[NPAGES] = {0};
    tokens(tok);
    load("pagesA.ids", ia, sizeof ia);
    kvs_seq_t *q = NULL;
    size_t cached = 0;
    KCK_S(s, kvs_seq_begin(s, tok, SEQ, &q, &cached));
    r[2] = (int32_t)cached;
    KCK_S(s, kvs_seq_extend(q, tok + cached, SEQ - cached));
    const size_t m = SEQ - cached, off = cached * KVH * HD;
    r[3] = kvs_seq_pages(q, tab, NPAGES) == NPAGES && tab[0] == ia[0] && tab[1] == ia[1];
    static uint16_t k[NTOK * KVH * HD], v[NTOK * KVH * HD];
    void *dk, *dv, *dq, *dout;
    CK(cudaMalloc(&dk, sizeof k));
    CK(cudaMalloc(&dv, sizeof v));
    for (uint32_t l = 0; l < LAYERS; l++) {
        kv_data(l, k, v);
        CK(cudaMemcpy(dk, k + off, m * KVH * HD * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dv, v + off, m * KVH * HD * 2, cudaMemcpyHostToDevice));
        r[4] |= kvs_append(q, l, dk, dv, KVS_F16, m) != KV_ERR_OK;
    }
    float qh[QH * HD], out[QH * HD];
    query(qh);
    CK(cudaMalloc(&dq, sizeof qh));
    CK(cudaMalloc(&dout, sizeof out));
    CK(cudaMemcpy(dq, qh, sizeof qh, cudaMemcpyHostToDevice));
    r[5] = (int32_t)kvs_attention(s, &q, 1, ATTN_LAYER, QH, (const float *)dq, 0.0f, (float *)dout);
    if (r[5] != KV_ERR_OK)
        fprintf(stderr, "[D] kvs_attention: %s\n", kvs_errmsg(s));
    CK(cudaMemcpy(out, dout, sizeof out, cudaMemcpyDeviceToHost));
    save("outD.bin", out, sizeof out);
    /* the fast kernel stages q with cp.async: a misaligned q is refused with a reason */
    r[6] = (int32_t)kvs_attention(s, &q, 1, ATTN_LAYER, QH, (const float *)dq + 1, 0.0f,
                                  (float *)dout);
    if (r[6] == KV_ERR_INVALID_ARGUMENT && strstr(kvs_errmsg(s), "16-byte aligned"))
        r[6] = -2; /* the right error with its reason */
    save("shimD.bin", r, sizeof r);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dq);
    cudaFree(dout);
    kvs_seq_end(&q);
    kvs_close(&s);
    return 0;
}

/* `kvd --backend cuda` on g_ep, its stderr appended to logp */
static pid_t start_kvd(const char *kvd, const char *logp)
{
    pid_t dpid = fork();
    if (dpid == 0) {
        int fd = open(logp, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) {
            dup2(fd, 2);
            close(fd);
        }
        execl(kvd, kvd, "--endpoint", g_ep, "--backend", "cuda", "--layers", "2", "--kv_heads", "4",
              "--head_dim", "128", "--page_tokens", "16", "--pages_fp8", "64", "--pages_tq3", "32",
              "--epoch_ms", "5", (char *)NULL);
        fprintf(stderr, "exec %s: %s\n", kvd, strerror(errno));
        _exit(127);
    }
    return dpid;
}

/* ready when a no-map hello succeeds (no CUDA in the parent); 0 when the daemon died or 20 s
 * passed */
static int wait_up(pid_t dpid)
{
    for (int i = 0; i < 400; i++) {
        kvc_t *c = NULL;
        int up =
            kvc_connect(&c, g_ep, 200) == KV_ERR_OK && kvc_hello(c, NULL, "probe", 0) == KV_ERR_OK;
        kvc_close(&c);
        int st;
        if (up)
            return 1;
        if (waitpid(dpid, &st, WNOHANG) == dpid)
            return 0;
        struct timespec ts = {0, 50 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return 0;
}

static int wait_child(pid_t p)
{
    int st = 0;
    while (waitpid(p, &st, 0) < 0 && errno == EINTR)
        ;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

int main(int argc, char **argv)
{
    const char *kvd = getenv("KVD_BIN") ? getenv("KVD_BIN") : KVD_BIN_DEFAULT;
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--kvd") == 0)
            kvd = argv[++i];
    snprintf(g_dir, sizeof g_dir, "/tmp/kvd-gpu-XXXXXX");
    if (!mkdtemp(g_dir))
        return 2;
    snprintf(g_ep, sizeof g_ep, "ipc://%s/kvd.sock", g_dir);
    char logp[400];
    path(logp, sizeof logp, "kvd.log");
    pid_t dpid = start_kvd(kvd, logp);
    int up = wait_up(dpid);
    check(up, "daemon up", "kvd %s --backend cuda on %s (log %s)", kvd, g_ep, logp);
    if (!up) {
        char buf[2048] = "";
        size_t n = load("kvd.log", buf, sizeof buf - 1);
        buf[n] = 0;
        printf("kvd log:\n%s\n", buf);
        kill(dpid, SIGKILL);
        wait_child(dpid);
        printf("%d passed, %d failed\n", g_pass, g_fail);
        return 1;
    }
    int ready[2], go[2];
    if (pipe(ready) || pipe(go))
        return 2;
    pid_t a = fork();
    if (a == 0) {
        close(ready[0]);
        close(go[1]);
        _exit(child_a(ready[1], go[0]));
    }
    close(ready[1]);
    close(go[0]);
    char x;
    int a_ready = read(ready[0], &x, 1) == 1;
    check(a_ready, "A appended, sealed, attended", "");
    int rb = -1;
    if (a_ready) {
        pid_t b = fork();
        if (b == 0)
            _exit(child_b());
        rb = wait_child(b);
    }
    check(rb == 0, "B ran", "exit %d", rb);
    if (write(go[1], "g", 1) != 1)
        return 2;
    int ra = wait_child(a);
    check(ra == 0, "A ran", "exit %d", ra);

    uint32_t ia[NPAGES] = {0}, ib[NPAGES] = {1}, nm[2] = {0, 0};
    load("pagesA.ids", ia, sizeof ia);
    load("pagesB.ids", ib, sizeof ib);
    load("matchB.bin", nm, sizeof nm);
    check(nm[0] == NPAGES && nm[1] == NTOK && memcmp(ia, ib, sizeof ia) == 0, "B hits A's pages",
          "%u pages, %u tokens matched; A %u,%u,%u B %u,%u,%u", nm[0], nm[1], ia[0], ia[1], ia[2],
          ib[0], ib[1], ib[2]);
    static uint8_t pa[NPAGES << 20], pbuf[NPAGES << 20];
    size_t na = load("pagesA.bin", pa, sizeof pa), nb = load("pagesB.bin", pbuf, sizeof pbuf);
    check(na > 0 && na == nb && memcmp(pa, pbuf, na) == 0, "B sees A's bytes",
          "%zu bytes through A's mapping, %zu through B's", na, nb);
    float oa[QH * HD], ob[QH * HD], oa2[QH * HD];
    size_t s1 = load("outA.bin", oa, sizeof oa), s2 = load("outB.bin", ob, sizeof ob),
           s3 = load("outA2.bin", oa2, sizeof oa2);
    int finite = s1 == sizeof oa, nonzero = 0;
    for (int i = 0; finite && i < QH * HD; i++) {
        finite = isfinite(oa[i]);
        nonzero |= oa[i] != 0.0f;
    }
    check(finite && nonzero, "output sane", "finite and not all zero; out[0] = %g", oa[0]);
    int ndiff = 0;
    for (int i = 0; i < QH * HD; i++)
        ndiff += memcmp(&oa[i], &ob[i], sizeof(float)) != 0;
    check(s1 == s2 && s1 == sizeof oa && ndiff == 0, "A == B bit-exact", "%d of %d floats differ",
          ndiff, QH * HD);
    check(s3 == sizeof oa && memcmp(oa, oa2, sizeof oa) == 0, "A stable after B", "");

    /* D: the engine shim on the device path, prefix from A's sealed pages */
    pid_t dp = fork();
    if (dp == 0)
        _exit(child_d());
    int rdd = wait_child(dp);
    int32_t rs[7] = {-1, 0, 0, 0, 0, -1, -1};
    load("shimD.bin", rs, sizeof rs);
    check(rdd == 0 && rs[0] == KV_ERR_OK && rs[1] == 1, "D opens the shim on device pools",
          "exit %d, open %s, on device %d", rdd, kv_err_name(rs[0]), rs[1]);
    check(rs[2] == 2 * PT && rs[3] == 1, "D hits A's prefix through the shim",
          "cached %d tokens (want %d), table starts with A's pages: %d", rs[2], 2 * PT, rs[3]);
    float od[QH * HD];
    size_t s5 = load("outD.bin", od, sizeof od);
    double num = 0.0, den = 0.0;
    for (int i = 0; s5 == sizeof od && i < QH * HD; i++) {
        num += ((double)od[i] - oa[i]) * ((double)od[i] - oa[i]);
        den += (double)oa[i] * oa[i];
    }
    const double rel = den > 0.0 ? sqrt(num / den) : 1.0;
    check(rs[4] == 0 && rs[5] == KV_ERR_OK && s5 == sizeof od && rel <= 1e-5,
          "D's shim attention equals A's", "append errors %d, attention %s, rel %.2e (≤ 1e-5)",
          rs[4], kv_err_name(rs[5]), rel);
    check(rs[6] == -2, "D's shim refuses a misaligned q with its reason",
          "got %s (want INVALID_ARGUMENT saying \"16-byte aligned\")",
          rs[6] == -2 ? "it" : kv_err_name(rs[6]));

    /* C: a mapped client across a daemon restart (kvc_rehello on the cuda backend) */
    int cr[2], cg[2];
    if (pipe(cr) || pipe(cg))
        return 2;
    pid_t cp = fork();
    if (cp == 0) {
        close(cr[0]);
        close(cg[1]);
        _exit(child_c(cr[1], cg[0]));
    }
    close(cr[1]);
    close(cg[0]);
    int c_ready = read(cr[0], &x, 1) == 1;
    kill(dpid, SIGTERM);
    int rd = wait_child(dpid);
    check(rd == 0, "daemon clean exit", "status %d", rd);
    dpid = start_kvd(kvd, logp);
    int up2 = wait_up(dpid);
    check(c_ready && up2, "daemon restarted under a mapped client", "");
    if (write(cg[1], "g", 1) != 1)
        return 2;
    int rc_ = wait_child(cp);
    int32_t rr[5] = {0, 0, -1, 0, 0};
    load("restart.bin", rr, sizeof rr);
    check(rc_ == 0 && rr[0] == KV_ERR_NO_SESSION && rr[1] == 1, "C sees the restart",
          "exit %d, first call %s, restarted %d", rc_, kv_err_name((kv_err_t)rr[0]), rr[1]);
    check(rr[2] == KV_ERR_OK && rr[3] == 1 && rr[4] == 1, "C rehello remaps the device pools",
          "rehello %s, new instance %d, on device %d", kv_err_name((kv_err_t)rr[2]), rr[3], rr[4]);
    float oc[QH * HD];
    size_t s4 = load("outC.bin", oc, sizeof oc);
    check(s4 == sizeof oc && memcmp(oa, oc, sizeof oa) == 0, "C == A after the restart",
          "same inputs through the new daemon's pools");

    /* E, F: a client killed with a kernel writing its page; the page handed out again */
    int er[2];
    if (pipe(er))
        return 2;
    pid_t ep = fork();
    if (ep == 0) {
        close(er[0]);
        _exit(child_e(er[1]));
    }
    close(er[1]);
    int e_ready = read(er[0], &x, 1) == 1;
    struct timespec ts100 = {0, 100 * 1000000L};
    nanosleep(&ts100, NULL); /* the kernel is running */
    kill(ep, SIGKILL);
    int re = wait_child(ep);
    int32_t spinning = 0;
    load("spinE.bin", &spinning, sizeof spinning);
    check(e_ready && re == 128 + SIGKILL && spinning > 0, "E killed with its kernel running",
          "status %d; %d words of its page held the pattern 50 ms into the kernel", re, spinning);
    pid_t fp = fork();
    if (fp == 0)
        _exit(child_f());
    int rf = wait_child(fp);
    int32_t fr[3] = {0, -1, -1};
    load("reuseF.bin", fr, sizeof fr);
    check(rf == 0 && fr[0] == 1, "F gets E's physical page back", "exit %d, after %d ms", rf,
          fr[1]);
    check(fr[0] == 1 && fr[2] == 0, "no write of the dead E lands in F's page",
          "%d nonzero words %d s after the kill", fr[2], SPIN_MS / 1000 + 1);

    /* G, H: libkvc's import of lying descriptors, and the caller's context (no daemon) */
    pid_t gp = fork();
    if (gp == 0)
        _exit(child_g());
    int rg = wait_child(gp);
    int32_t gr[7] = {-1, -1, 0, -1, -1, 0, 0};
    load("importG.bin", gr, sizeof gr);
    check(rg == 0 && gr[0] == KV_ERR_MALFORMED, "G: legacy descriptor past its allocation refused",
          "exit %d, map %s (want MALFORMED)", rg, kv_err_name((kv_err_t)gr[0]));
    check(gr[1] == KV_ERR_OK && gr[2] == 1, "G: legacy honest descriptor maps",
          "map %s, pattern read back %d", kv_err_name((kv_err_t)gr[1]), gr[2]);
    check(gr[3] != KV_ERR_OK && gr[3] != -1, "G: VMM descriptor past its allocation refused",
          "map %s", gr[3] == -1 ? "not run" : kv_err_name((kv_err_t)gr[3]));
    check(gr[4] == KV_ERR_OK && gr[5] == 1, "G: VMM honest descriptor maps",
          "map %s, pattern read back %d", kv_err_name((kv_err_t)gr[4]), gr[5]);
    check(gr[6] == 1, "G: libkvc leaves the caller's context current",
          "after open, map, read and close");

    kill(dpid, SIGTERM);
    rd = wait_child(dpid);
    check(rd == 0, "restarted daemon clean exit", "status %d", rd);
    {
        /* the daemon's own account of the backend (device, granularity, publish path, legacy) */
        char buf[8192] = "";
        size_t n = load("kvd.log", buf, sizeof buf - 1);
        buf[n] = 0;
        for (char *l = strtok(buf, "\n"); l; l = strtok(NULL, "\n"))
            if (strstr(l, "backend cuda") || strstr(l, "WARNING"))
                printf("INFO %s\n", l);
    }
    if (g_fail) {
        char buf[4096] = "";
        size_t n = load("kvd.log", buf, sizeof buf - 1);
        buf[n] = 0;
        printf("kvd log:\n%s\n", buf);
    }
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
