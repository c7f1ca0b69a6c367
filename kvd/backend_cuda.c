/* backend_cuda.c — the cuda backend: pools and directory in device memory, shared as CUDA VMM
 * POSIX file descriptors; conversions are kernels of libkvkern_cuda on a daemon stream.
 *
 *   region "pool-fp8"  pages[FP8] × page_bytes, rounded up to the allocation granularity
 *   region "pool-tq3"  pages[TQ3] × page_bytes, rounded up likewise
 *   region "dir"       dir_entries × 8 bytes (kv_dir_entry_t), rounded up likewise
 *
 * Each region is one cuMemCreate allocation (pinned to the device, requested shareable as
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), mapped into the daemon with cuMemAddressReserve /
 * cuMemMap / cuMemSetAccess(READWRITE), zeroed, and exported once with
 * cuMemExportToShareableHandle. The fd goes to admitted clients over the same SCM_RIGHTS socket
 * as the host backend's memfds (server.c); the client imports it with
 * cuMemImportFromShareableHandle (client/kvc_cuda.c). Why fds rather than cudaIpcMemHandle_t:
 * an fd can only be obtained from a process that already holds it (SCM_RIGHTS to a peer the
 * ZAP handler admitted, pid checked with SO_PEERCRED); a legacy IPC handle is 64 bytes that any
 * local process with the same GPU visible can open — a bearer secret (DESIGN.md).
 *
 * Granularity: cuMemGetAllocationGranularity(MINIMUM) — 2 MiB on the H200 — so a small test
 * pool still costs 2 MiB per region; pool_bytes in the export is the rounded size (backend.h
 * allows ≥ pages × page_bytes).
 *
 * The directory has two copies. backend.h's contract is that `b->dir` is a host array the core
 * writes with 64-bit atomic stores (its logic reads it back); kernels need it in device memory.
 * After its stores the core calls ops->dir_sync(lids, n), which writes each 8-byte entry to the
 * device with a single aligned 64-bit write (a kernel in another process sees the old entry or
 * the new one, never a mix) and waits once for all of them, so a reply that names a page is
 * only sent once the device entry is visible. Batches of kDirKernelMin entries or more (an
 * alloc, a collect) go through kvk_cuda_dir_store: the (id, entry) pairs copied to a device
 * buffer, one kernel of atomic 64-bit stores per KVD_DIR_BATCH_MAX entries. Fewer entries (a
 * seal, a restore) are written with cuStreamWriteValue64 on the daemon stream, one per entry
 * (~1.8 µs of host time each on the H200, which is why batches do not), or where 64-bit stream
 * memory operations are not supported, a synchronous 8-byte cuMemcpyHtoD per entry (aligned
 * 8-byte copies are not split by the copy engine in practice; documented as the weaker path in
 * docs/backend-cuda.md). Both copies start all zero, and kv_dir_make(0, FP8, 0, 0) == 0.
 *
 * Conversions: convert() copies a batch's physical indices into a device buffer and launches
 * kvk_cuda_page_retier / kvk_cuda_page_promote once per KVD_CONVERT_BATCH_MAX pages on the
 * stream; sync() waits for the stream. The core flips the directory only after sync() returned
 * 0 (Minima-KV Algorithm 1).
 *
 * Legacy mode (opt-in, KVD_CUDA_LEGACY_IPC=1 in the daemon's environment): pools and directory
 * are plain cuMemAlloc allocations exported with cuIpcGetMemHandle; each 64-byte handle is
 * written into a sealed memfd and that memfd is what travels over SCM_RIGHTS, so the handover
 * path is unchanged, but anyone who learns the 64 bytes (a core dump, /proc/<pid>/mem of any
 * client) can open the memory. The daemon logs this at startup. exp.backend is "cuda-ipc".
 *
 * Contexts: the daemon uses the device's primary context (the one the runtime API, hence the
 * kvkern_cuda launchers, also uses) and makes it current at every entry point, so the loop
 * thread may be any thread. Device selection: KVD_CUDA_DEVICE (ordinal, default 0).
 */
#include "backend.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kv_err.h"
#include "kv_cudrv.h"
#include "kvkern_cuda.h"
#include "util.h"

#define KVD_CUDA_REGIONS (KV_FMT_COUNT + 1) /* pools, then the directory */
#define KVD_CUDA_DIR     KV_FMT_COUNT

/* Driver functions, resolved through the runtime (kv_cudrv.h: no link to libcuda, so a CUDA
 * build of kvd still starts, and says why, on a machine without a driver). Filled once. */
#define CUDA_FNS(X)                                                                                \
    X(cuCtxSetCurrent)                                                                             \
    X(cuDeviceGet)                                                                                 \
    X(cuDeviceGetAttribute)                                                                        \
    X(cuDeviceGetCount)                                                                            \
    X(cuDevicePrimaryCtxRelease)                                                                   \
    X(cuDevicePrimaryCtxRetain)                                                                    \
    X(cuGetErrorString)                                                                            \
    X(cuInit)                                                                                      \
    X(cuIpcGetMemHandle)                                                                           \
    X(cuMemAddressFree)                                                                            \
    X(cuMemAddressReserve)                                                                         \
    X(cuMemAlloc)                                                                                  \
    X(cuMemCreate)                                                                                 \
    X(cuMemExportToShareableHandle)                                                                \
    X(cuMemFree)                                                                                   \
    X(cuMemGetAllocationGranularity)                                                               \
    X(cuMemMap)                                                                                    \
    X(cuMemRelease)                                                                                \
    X(cuMemSetAccess)                                                                              \
    X(cuMemUnmap)                                                                                  \
    X(cuMemcpyDtoH)                                                                                \
    X(cuMemcpyHtoD)                                                                                \
    X(cuMemcpyHtoDAsync)                                                                           \
    X(cuMemsetD8)                                                                                  \
    X(cuStreamSynchronize)                                                                         \
    X(cuStreamWriteValue64)
typedef struct cuda_drv_s {
    CUDA_FNS(KV_CUDRV_MEMBER)
} cuda_drv_t;
static cuda_drv_t g_cu;
static int g_cu_loaded;

typedef struct cuda_region_s {
    CUdeviceptr ptr;
    size_t bytes;                     /* mapped (rounded) size */
    CUmemGenericAllocationHandle mem; /* VMM mode */
    int mapped, reserved, created;
} cuda_region_t;

typedef struct cuda_impl_s {
    CUdevice dev;
    CUcontext ctx;
    int ctx_retained;
    cudaStream_t stream;
    int legacy_ipc;
    int write_value64; /* cuStreamWriteValue64 usable */
    size_t gran;
    cuda_region_t reg[KVD_CUDA_REGIONS];
    CUdeviceptr idx; /* [2 · KVD_CONVERT_BATCH_MAX] uint32: src ids, then dst ids */
    CUdeviceptr dstage;      /* [KVD_DIR_BATCH_MAX] entries, then as many uint32 ids */
    kv_dir_entry_t *hentries; /* host staging of one dir_store batch: entries, then ids */
    kv_pools_t dpools;
} cuda_impl_t;

static const char *cu_str(CUresult r)
{
    const char *s = NULL;
    if (!g_cu_loaded || g_cu.cuGetErrorString(r, &s) != CUDA_SUCCESS || !s)
        return "unknown CUDA error";
    return s;
}

/* Log-where-it-failed helper: the call text and the driver's message. */
#define CU_TRY(call, err, errlen)                                                                  \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            kvd_fmt(err, errlen, "backend cuda: %s failed: %s", #call, cu_str(r_));                \
            return r_ == CUDA_ERROR_OUT_OF_MEMORY ? KV_ERR_NOMEM : KV_ERR_DEVICE;                  \
        }                                                                                          \
    } while (0)

static int cuda_enter(cuda_impl_t *im, char *err, size_t errlen)
{
    CU_TRY(g_cu.cuCtxSetCurrent(im->ctx), err, errlen);
    return KV_ERR_OK;
}

static void cuda_region_free(cuda_region_t *r, int legacy)
{
    if (legacy) {
        if (r->ptr)
            g_cu.cuMemFree(r->ptr);
    } else {
        if (r->mapped)
            g_cu.cuMemUnmap(r->ptr, r->bytes);
        if (r->reserved)
            g_cu.cuMemAddressFree(r->ptr, r->bytes);
        if (r->created)
            g_cu.cuMemRelease(r->mem);
    }
    memset(r, 0, sizeof(*r));
}

static void cuda_destroy(kvd_backend_t *b)
{
    cuda_impl_t *im = b->impl;
    if (im && g_cu_loaded) {
        if (im->ctx)
            g_cu.cuCtxSetCurrent(im->ctx);
        if (im->stream)
            cudaStreamSynchronize(im->stream);
        for (int i = 0; i < KVD_CUDA_REGIONS; i++)
            cuda_region_free(&im->reg[i], im->legacy_ipc);
        if (im->idx)
            g_cu.cuMemFree(im->idx);
        if (im->dstage)
            g_cu.cuMemFree(im->dstage);
        if (im->stream)
            cudaStreamDestroy(im->stream);
        if (im->ctx_retained)
            g_cu.cuDevicePrimaryCtxRelease(im->dev);
    }
    if (im)
        kvd_free(im->hentries);
    for (int f = 0; f < KV_FMT_COUNT; f++)
        if (b->exp.pool_fd[f] >= 0)
            close(b->exp.pool_fd[f]);
    if (b->exp.dir_fd >= 0)
        close(b->exp.dir_fd);
    kvd_free(b->dir);
    kvd_free(im);
    kvd_free(b);
}

static int cuda_convert(kvd_backend_t *b, kv_fmt_t src, kv_fmt_t dst, uint32_t n,
                        const uint32_t *src_phys, const uint32_t *dst_phys, char *err,
                        size_t errlen)
{
    cuda_impl_t *im = b->impl;
    int rc = kvd_backend_convert_check(b, src, dst, n, src_phys, dst_phys, err, errlen);
    if (rc != KV_ERR_OK)
        return rc;
    rc = cuda_enter(im, err, errlen);
    if (rc != KV_ERR_OK)
        return rc;
    /* idx holds [src ids | dst ids] of one launch; stream order keeps a piece's ids until its
     * kernel ran. Pageable sources: the driver stages them before returning. */
    const uint32_t *d_src = (const uint32_t *)(uintptr_t)im->idx;
    const uint32_t *d_dst = d_src + KVD_CONVERT_BATCH_MAX;
    for (uint32_t at = 0; at < n; at += KVD_CONVERT_BATCH_MAX) {
        const uint32_t k = n - at < KVD_CONVERT_BATCH_MAX ? n - at : KVD_CONVERT_BATCH_MAX;
        CU_TRY(g_cu.cuMemcpyHtoDAsync(im->idx, src_phys + at, k * sizeof(uint32_t),
                                      (CUstream)im->stream),
               err, errlen);
        CU_TRY(g_cu.cuMemcpyHtoDAsync(im->idx + KVD_CONVERT_BATCH_MAX * sizeof(uint32_t),
                                      dst_phys + at, k * sizeof(uint32_t), (CUstream)im->stream),
               err, errlen);
        kvk_status_t st =
            src == KV_FMT_FP8
                ? kvk_cuda_page_retier(&b->exp.geom, &im->dpools, k, d_src, d_dst, im->stream)
                : kvk_cuda_page_promote(&b->exp.geom, &im->dpools, k, d_src, d_dst, im->stream);
        if (st != KVK_OK) {
            kvd_fmt(err, errlen, "backend cuda: %s(%u pages, first %u -> %u) failed: kvk status "
                    "%d (%s)",
                    src == KV_FMT_FP8 ? "kvk_cuda_page_retier" : "kvk_cuda_page_promote", k,
                    src_phys[at], dst_phys[at], (int)st, cudaGetErrorString(cudaGetLastError()));
            return KV_ERR_DEVICE;
        }
    }
    return KV_ERR_OK;
}

static int cuda_sync(kvd_backend_t *b, char *err, size_t errlen)
{
    cuda_impl_t *im = b->impl;
    int rc = cuda_enter(im, err, errlen);
    if (rc != KV_ERR_OK)
        return rc;
    cudaError_t e = cudaStreamSynchronize(im->stream);
    if (e != cudaSuccess) {
        kvd_fmt(err, errlen, "backend cuda: cudaStreamSynchronize failed: %s",
                cudaGetErrorString(e));
        return KV_ERR_DEVICE;
    }
    return KV_ERR_OK;
}

/* dir_sync batches from this many entries on go through kvk_cuda_dir_store (two copies, a
 * kernel and a wait) instead of one stream write each. On the H200 (test_backend_cuda, mean
 * of 20): stream writes 6.1-6.6 µs for 1 entry, 11-12 for 4, 17-18 for 7; the kernel 12-16 µs
 * for 8 to 512 entries. They cross at 5 or 6. */
enum { kDirKernelMin = 6 };

static int cuda_dir_sync(kvd_backend_t *b, const uint32_t *lids, uint32_t n, char *err,
                         size_t errlen)
{
    cuda_impl_t *im = b->impl;
    for (uint32_t i = 0; i < n; i++) {
        if (lids[i] >= b->exp.dir_entries) {
            kvd_fmt(err, errlen, "dir_sync(%u): beyond %u entries", lids[i], b->exp.dir_entries);
            return KV_ERR_INVALID_ARGUMENT;
        }
    }
    int rc = cuda_enter(im, err, errlen);
    if (rc != KV_ERR_OK)
        return rc;
    if (n >= kDirKernelMin) {
        /* one copy and one kernel per KVD_DIR_BATCH_MAX entries, one wait. The host staging is
         * pageable: cuMemcpyHtoDAsync has copied it out before it returns, so the next piece
         * may refill it; stream order keeps the device staging until the kernel ran. */
        kv_dir_entry_t *d_dir = (kv_dir_entry_t *)(uintptr_t)im->reg[KVD_CUDA_DIR].ptr;
        const kv_dir_entry_t *d_ent = (const kv_dir_entry_t *)(uintptr_t)im->dstage;
        const uint32_t *d_ids = (const uint32_t *)(d_ent + KVD_DIR_BATCH_MAX);
        uint32_t *h_ids = (uint32_t *)(im->hentries + KVD_DIR_BATCH_MAX);
        for (uint32_t at = 0; at < n; at += KVD_DIR_BATCH_MAX) {
            const uint32_t k = n - at < KVD_DIR_BATCH_MAX ? n - at : KVD_DIR_BATCH_MAX;
            for (uint32_t i = 0; i < k; i++) {
                h_ids[i] = lids[at + i];
                im->hentries[i] = __atomic_load_n(&b->dir[lids[at + i]], __ATOMIC_ACQUIRE);
            }
            CU_TRY(g_cu.cuMemcpyHtoDAsync(im->dstage, im->hentries, k * sizeof(kv_dir_entry_t),
                                          (CUstream)im->stream),
                   err, errlen);
            CU_TRY(g_cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)d_ids, h_ids,
                                          k * sizeof(uint32_t), (CUstream)im->stream),
                   err, errlen);
            if (kvk_cuda_dir_store(d_dir, b->exp.dir_entries, k, d_ids, d_ent, im->stream) !=
                KVK_OK) {
                kvd_fmt(err, errlen, "backend cuda: kvk_cuda_dir_store(%u entries) failed: %s",
                        k, cudaGetErrorString(cudaGetLastError()));
                return KV_ERR_DEVICE;
            }
        }
        return cuda_sync(b, err, errlen); /* the one wait */
    }
    for (uint32_t i = 0; i < n; i++) {
        kv_dir_entry_t e = __atomic_load_n(&b->dir[lids[i]], __ATOMIC_ACQUIRE);
        CUdeviceptr at =
            im->reg[KVD_CUDA_DIR].ptr + (CUdeviceptr)lids[i] * sizeof(kv_dir_entry_t);
        if (im->write_value64)
            CU_TRY(g_cu.cuStreamWriteValue64((CUstream)im->stream, at, (cuuint64_t)e,
                                             CU_STREAM_WRITE_VALUE_DEFAULT),
                   err, errlen);
        else
            CU_TRY(g_cu.cuMemcpyHtoD(at, &e, sizeof(e)), err, errlen);
    }
    if (im->write_value64)
        CU_TRY(g_cu.cuStreamSynchronize((CUstream)im->stream), err, errlen);
    return KV_ERR_OK;
}

/* Page copies for the snapshot (backend.h). Synchronous driver copies: cuMemcpyDtoH/HtoD
 * return once the copy is done. Ordering with the daemon stream: a page read is sealed, and
 * any conversion that filled it was waited for (sync) before it was published; a page written
 * is a fresh free page no kernel targets. Checked on the H200: test_backend_cuda's "snapshot
 * copy" round trip per format, and a daemon's save and restore (docs/backend-cuda.md). */
static int cuda_page_copy(kvd_backend_t *b, kv_fmt_t f, uint32_t phys, void *hbuf, int to_host,
                          char *err, size_t errlen)
{
    cuda_impl_t *im = b->impl;
    if (f >= KV_FMT_COUNT || phys >= b->exp.pages[f] || !hbuf) {
        kvd_fmt(err, errlen, "page copy %d:%u: bad format or page", (int)f, phys);
        return KV_ERR_INVALID_ARGUMENT;
    }
    int rc = cuda_enter(im, err, errlen);
    if (rc != KV_ERR_OK)
        return rc;
    uint64_t pb = b->exp.page_bytes[f];
    CUdeviceptr at = im->reg[f].ptr + (CUdeviceptr)((uint64_t)phys * pb);
    if (to_host)
        CU_TRY(g_cu.cuMemcpyDtoH(hbuf, at, (size_t)pb), err, errlen);
    else
        CU_TRY(g_cu.cuMemcpyHtoD(at, hbuf, (size_t)pb), err, errlen);
    return KV_ERR_OK;
}

static int cuda_page_read(kvd_backend_t *b, kv_fmt_t f, uint32_t phys, void *buf, char *err,
                          size_t errlen)
{
    return cuda_page_copy(b, f, phys, buf, 1, err, errlen);
}

static int cuda_page_write(kvd_backend_t *b, kv_fmt_t f, uint32_t phys, const void *buf,
                           char *err, size_t errlen)
{
    return cuda_page_copy(b, f, phys, (void *)(uintptr_t)buf, 0, err, errlen);
}

static const kvd_backend_ops_t cuda_ops = {
    .page_read = cuda_page_read,
    .page_write = cuda_page_write,
    .name = "cuda",
    .convert = cuda_convert,
    .sync = cuda_sync,
    .destroy = cuda_destroy,
    .dir_sync = cuda_dir_sync,
};

/* One VMM region: create, reserve, map, grant read-write, zero, export as a POSIX fd. */
static int cuda_region_vmm(cuda_impl_t *im, cuda_region_t *r, uint64_t bytes, int *fd, char *err,
                           size_t errlen)
{
    const CUmemAllocationProp prop = kv_cudrv_fd_prop((int)im->dev);
    r->bytes = (size_t)kv_align_up(bytes, im->gran);
    CU_TRY(g_cu.cuMemCreate(&r->mem, r->bytes, &prop, 0), err, errlen);
    r->created = 1;
    CU_TRY(g_cu.cuMemAddressReserve(&r->ptr, r->bytes, im->gran, 0, 0), err, errlen);
    r->reserved = 1;
    CU_TRY(g_cu.cuMemMap(r->ptr, r->bytes, 0, r->mem, 0), err, errlen);
    r->mapped = 1;
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof(acc));
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_TRY(g_cu.cuMemSetAccess(r->ptr, r->bytes, &acc, 1), err, errlen);
    CU_TRY(g_cu.cuMemsetD8(r->ptr, 0, r->bytes), err, errlen);
    int h = -1;
    CU_TRY(
        g_cu.cuMemExportToShareableHandle(&h, r->mem, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        err, errlen);
    /* The server forks nothing, but a CLOEXEC fd cannot leak into a helper it might exec. */
    fcntl(h, F_SETFD, FD_CLOEXEC);
    *fd = h;
    return KV_ERR_OK;
}

/* Legacy: cuMemAlloc + cuIpcGetMemHandle; the handle's bytes travel in a sealed memfd. */
static int cuda_region_legacy(cuda_impl_t *im, cuda_region_t *r, uint64_t bytes, int *fd, char *err,
                              size_t errlen)
{
    r->bytes = (size_t)kv_align_up(bytes, im->gran);
    CU_TRY(g_cu.cuMemAlloc(&r->ptr, r->bytes), err, errlen);
    CU_TRY(g_cu.cuMemsetD8(r->ptr, 0, r->bytes), err, errlen);
    CUipcMemHandle h;
    CU_TRY(g_cu.cuIpcGetMemHandle(&h, r->ptr), err, errlen);
    int m = memfd_create("kvd-cuda-ipc-handle", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (m < 0) {
        kvd_fmt(err, errlen, "memfd_create(kvd-cuda-ipc-handle) failed: %s", strerror(errno));
        return KV_ERR_IO;
    }
    if (pwrite(m, &h, sizeof(h), 0) != (ssize_t)sizeof(h) ||
        fcntl(m, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
        kvd_fmt(err, errlen, "writing the IPC handle memfd failed: %s", strerror(errno));
        close(m);
        return KV_ERR_IO;
    }
    *fd = m;
    return KV_ERR_OK;
}

/* cuInit, device, primary context, capability checks, stream. */
static int cuda_open_device(cuda_impl_t *im, char *err, size_t errlen)
{
    if (!g_cu_loaded) {
        const char *bad = "";
        cudaError_t le = KV_CUDRV_LOAD_ALL(&g_cu, CUDA_FNS, &bad);
        if (le != cudaSuccess) {
            kvd_fmt(err, errlen, "backend cuda: no CUDA device: %s (resolving %s)",
                    cudaGetErrorString(le), bad);
            return KV_ERR_DEVICE;
        }
        g_cu_loaded = 1;
    }
    CUresult r = g_cu.cuInit(0);
    int n = 0;
    if (r == CUDA_SUCCESS)
        r = g_cu.cuDeviceGetCount(&n);
    if (r != CUDA_SUCCESS || n == 0) {
        kvd_fmt(err, errlen, "backend cuda: no CUDA device: %s",
                r != CUDA_SUCCESS ? cu_str(r) : "cuDeviceGetCount() found 0 devices");
        return KV_ERR_DEVICE;
    }
    int ord = 0;
    const char *e = getenv("KVD_CUDA_DEVICE");
    if (e && *e) {
        char *end = NULL;
        long v = strtol(e, &end, 10);
        if (*end || v < 0 || v >= n) {
            kvd_fmt(err, errlen,
                    "backend cuda: KVD_CUDA_DEVICE=%s is not a device ordinal "
                    "below %d",
                    e, n);
            return KV_ERR_INVALID_ARGUMENT;
        }
        ord = (int)v;
    }
    CU_TRY(g_cu.cuDeviceGet(&im->dev, ord), err, errlen);
    CU_TRY(g_cu.cuDevicePrimaryCtxRetain(&im->ctx, im->dev), err, errlen);
    im->ctx_retained = 1;
    CU_TRY(g_cu.cuCtxSetCurrent(im->ctx), err, errlen);
    if (cudaSetDevice(ord) != cudaSuccess) {
        kvd_fmt(err, errlen, "backend cuda: cudaSetDevice(%d) failed", ord);
        return KV_ERR_DEVICE;
    }
    const char *legacy = getenv("KVD_CUDA_LEGACY_IPC");
    im->legacy_ipc = legacy && strcmp(legacy, "1") == 0;
    int vmm = 0, fdok = 0, wv = 0;
    CU_TRY(g_cu.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                     im->dev),
           err, errlen);
    CU_TRY(g_cu.cuDeviceGetAttribute(
               &fdok, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, im->dev),
           err, errlen);
    if (g_cu.cuDeviceGetAttribute(&wv, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                                  im->dev) != CUDA_SUCCESS)
        wv = 0;
    im->write_value64 = wv;
    if (!im->legacy_ipc && (!vmm || !fdok)) {
        kvd_fmt(err, errlen,
                "backend cuda: device %d lacks %s; legacy cudaIpc export is "
                "available as an explicit opt-in (KVD_CUDA_LEGACY_IPC=1)",
                ord, !vmm ? "virtual memory management" : "POSIX fd shareable handles");
        return KV_ERR_DEVICE;
    }
    if (!im->legacy_ipc) {
        const CUmemAllocationProp prop = kv_cudrv_fd_prop((int)im->dev);
        CU_TRY(
            g_cu.cuMemGetAllocationGranularity(&im->gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            err, errlen);
    } else {
        im->gran = 2u << 20; /* same rounding as VMM on Hopper; legacy has no granularity */
    }
    if (im->gran == 0)
        im->gran = 2u << 20;
    cudaError_t ce = cudaStreamCreateWithFlags(&im->stream, cudaStreamNonBlocking);
    if (ce != cudaSuccess) {
        kvd_fmt(err, errlen, "backend cuda: cudaStreamCreateWithFlags failed: %s",
                cudaGetErrorString(ce));
        return KV_ERR_DEVICE;
    }
    CU_TRY(g_cu.cuMemAlloc(&im->idx, 2 * KVD_CONVERT_BATCH_MAX * sizeof(uint32_t)), err, errlen);
    CU_TRY(g_cu.cuMemAlloc(&im->dstage,
                           KVD_DIR_BATCH_MAX * (sizeof(kv_dir_entry_t) + sizeof(uint32_t))),
           err, errlen);
    im->hentries = kvd_malloc(KVD_DIR_BATCH_MAX * (sizeof(kv_dir_entry_t) + sizeof(uint32_t)));
    if (!im->hentries) {
        kvd_fmt(err, errlen, "backend cuda: out of memory for the directory staging");
        return KV_ERR_NOMEM;
    }
    if (kvk_cuda_init() != KVK_OK) {
        kvd_fmt(err, errlen, "backend cuda: kvk_cuda_init failed: %s",
                cudaGetErrorString(cudaGetLastError()));
        return KV_ERR_DEVICE;
    }
    return KV_ERR_OK;
}

int kvd_backend_cuda_create(kvd_backend_t **out, const kv_geom_t *geom,
                            const uint32_t pages[KV_FMT_COUNT], uint32_t dir_entries, char *err,
                            size_t errlen)
{
    int e = kvd_backend_check_args(out, geom, pages, dir_entries, err, errlen);
    if (e != KV_ERR_OK)
        return e;
    kvd_backend_t *b = kvd_calloc(1, sizeof(*b));
    cuda_impl_t *im = kvd_calloc(1, sizeof(*im));
    kv_dir_entry_t *mirror = kvd_calloc(dir_entries, sizeof(kv_dir_entry_t));
    if (!b || !im || !mirror) {
        kvd_free(b);
        kvd_free(im);
        kvd_free(mirror);
        kvd_fmt(err, errlen, "out of memory creating the cuda backend");
        return KV_ERR_NOMEM;
    }
    b->ops = &cuda_ops;
    b->impl = im;
    b->dir = mirror;
    b->exp.geom = *geom;
    b->exp.dir_fd = -1;
    for (int f = 0; f < KV_FMT_COUNT; f++)
        b->exp.pool_fd[f] = -1;
    int rc = cuda_open_device(im, err, errlen);
    b->exp.backend = im->legacy_ipc ? "cuda-ipc" : "cuda";
    for (int f = 0; f < KV_FMT_COUNT && rc == KV_ERR_OK; f++) {
        uint64_t pb = kv_page_bytes(geom, (kv_fmt_t)f);
        b->exp.pages[f] = pages[f];
        b->exp.page_bytes[f] = pb;
        b->pools.pages[f] = pages[f];
        if (pages[f] == 0)
            continue;
        if (pb > (UINT64_MAX >> 2) / pages[f] || (uint64_t)pages[f] * pb > (uint64_t)SIZE_MAX) {
            kvd_fmt(err, errlen, "pool of %u pages of %llu bytes overflows", pages[f],
                    (unsigned long long)pb);
            rc = KV_ERR_INVALID_ARGUMENT;
            break;
        }
        uint64_t want = (uint64_t)pages[f] * pb;
        rc = im->legacy_ipc
                 ? cuda_region_legacy(im, &im->reg[f], want, &b->exp.pool_fd[f], err, errlen)
                 : cuda_region_vmm(im, &im->reg[f], want, &b->exp.pool_fd[f], err, errlen);
        b->exp.pool_bytes[f] = im->reg[f].bytes;
        b->pools.base[f] = (uint8_t *)(uintptr_t)im->reg[f].ptr;
    }
    if (rc == KV_ERR_OK) {
        b->exp.dir_entries = dir_entries;
        uint64_t want = (uint64_t)dir_entries * sizeof(kv_dir_entry_t);
        cuda_region_t *r = &im->reg[KVD_CUDA_DIR];
        rc = im->legacy_ipc ? cuda_region_legacy(im, r, want, &b->exp.dir_fd, err, errlen)
                            : cuda_region_vmm(im, r, want, &b->exp.dir_fd, err, errlen);
        b->exp.dir_bytes = r->bytes;
    }
    if (rc == KV_ERR_OK) {
        /* The regions' zero fills (cuMemsetD8) run on the legacy stream, which the daemon's
         * non-blocking stream does not wait for: finish them before any directory publish or
         * conversion can be queued behind them. */
        const CUresult cr = g_cu.cuStreamSynchronize(NULL);
        if (cr != CUDA_SUCCESS) {
            kvd_fmt(err, errlen, "backend cuda: zeroing the pools failed: %s", cu_str(cr));
            rc = KV_ERR_DEVICE;
        }
    }
    if (rc != KV_ERR_OK) {
        cuda_destroy(b);
        return rc;
    }
    im->dpools = b->pools;
    fprintf(stderr,
            "kvd: backend cuda: device %d, granularity %zu bytes, directory entries "
            "published with %s (batches of %d or more: kvk_cuda_dir_store)\n",
            (int)im->dev, im->gran,
            im->write_value64 ? "cuStreamWriteValue64" : "cuMemcpyHtoD (no 64-bit stream ops)",
            (int)kDirKernelMin);
    if (im->legacy_ipc)
        fprintf(stderr, "kvd: WARNING: backend cuda in legacy cudaIpcMemHandle mode "
                        "(KVD_CUDA_LEGACY_IPC=1): a memory handle is a 64-byte bearer secret "
                        "that ANY local process can open once it learns the bytes; the default "
                        "VMM fd export reaches admitted peers only. Use it only for clients "
                        "that cannot import VMM fds.\n");
    *out = b;
    return KV_ERR_OK;
}

void *kvd_backend_cuda_dir_device(kvd_backend_t *b)
{
    if (!b || b->ops != &cuda_ops)
        return NULL;
    cuda_impl_t *im = b->impl;
    return (void *)(uintptr_t)im->reg[KVD_CUDA_DIR].ptr;
}
