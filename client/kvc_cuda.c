/* kvc_cuda.c — libkvc's import of the cuda backend's memory. See kvc_cuda.h.
 *
 * VMM mode ("cuda"): each fd is a CUDA shareable handle of type POSIX_FILE_DESCRIPTOR exported
 * by the daemon (kvd/backend_cuda.c). Import = cuMemImportFromShareableHandle, then reserve a
 * VA range of the exported size (already a multiple of the granularity), cuMemMap, and
 * cuMemSetAccess for our device. The imported handle is released right after mapping: the
 * mapping keeps the physical memory alive, and the daemon's export keeps it alive past us.
 *
 * Legacy mode ("cuda-ipc", daemon opt-in): the fd is a memfd holding the 64 bytes of a
 * cuIpcGetMemHandle; cuIpcOpenMemHandle maps it. Weaker by construction (docs/backend-cuda.md).
 *
 * Read-only directory: we ask for CU_MEM_ACCESS_FLAGS_PROT_READ. Drivers that only support
 * PROT_NONE / PROT_READWRITE refuse it; then the directory is mapped read-write and
 * kvc__cuda_dir_readonly() reports 0 — the daemon still is the only one that SHOULD write it,
 * but unlike the host backend's sealed memfd nothing enforces that (a documented gap).
 *
 * Sizes: the descriptor's byte count comes from the daemon and is not trusted. VMM: cuMemMap
 * refuses a size past the exported allocation. Legacy: cuIpcOpenMemHandle maps the whole
 * allocation whatever we think its size is, so cuMemGetAddressRange must confirm that the
 * allocation holds the descriptor's bytes; otherwise kernels given kvc_pools() would read and
 * write past it.
 *
 * Contexts: everything lives in the PRIMARY context of the runtime's current device (the one
 * the runtime's kernels use). Each call makes it current only for its own duration and then
 * restores whatever context the calling thread had (cu_enter / cu_leave), so libkvc does not
 * switch an engine's context behind its back.
 *
 * Close: kvc__cuda_close waits for the whole primary context (cuCtxSynchronize) before it
 * unmaps. libkvc does not launch the engine's kernels and cannot know which streams read the
 * mappings, and a kernel that touches an unmapped range takes the context down with a sticky
 * error. The cost: a kvc_close waits for every kernel of the process on that device, other
 * threads' included. An engine that closes clients while others run kernels should close
 * them between steps.
 */
#include "kvc_cuda.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(KVC_HAVE_CUDA) && KVC_HAVE_CUDA

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "kv_cudrv.h"

#define KVC_CUDA_MAX_REGIONS 8

/* Driver functions through the runtime (kv_cudrv.h): libkvc must load where no driver is. */
#define KVC_CU_FNS(X)                                                                              \
    X(cuCtxGetCurrent)                                                                             \
    X(cuCtxSetCurrent)                                                                             \
    X(cuCtxSynchronize)                                                                            \
    X(cuDeviceGet)                                                                                 \
    X(cuDeviceGetCount)                                                                            \
    X(cuDevicePrimaryCtxRelease)                                                                   \
    X(cuDevicePrimaryCtxRetain)                                                                    \
    X(cuGetErrorString)                                                                            \
    X(cuInit)                                                                                      \
    X(cuIpcCloseMemHandle)                                                                         \
    X(cuIpcOpenMemHandle)                                                                          \
    X(cuMemAddressFree)                                                                            \
    X(cuMemAddressReserve)                                                                         \
    X(cuMemGetAddressRange)                                                                        \
    X(cuMemGetAllocationGranularity)                                                               \
    X(cuMemGetAllocationPropertiesFromHandle)                                                      \
    X(cuMemImportFromShareableHandle)                                                              \
    X(cuMemMap)                                                                                    \
    X(cuMemRelease)                                                                                \
    X(cuMemSetAccess)                                                                              \
    X(cuMemUnmap)                                                                                  \
    X(cuMemcpyDtoH)
typedef struct kvc_cu_drv_s {
    KVC_CU_FNS(KV_CUDRV_MEMBER)
} kvc_cu_drv_t;
/* Filled once per process (kvc_cu_load, through pthread_once): worker threads may open their
 * sessions at the same time, and none may see the table half written. */
static kvc_cu_drv_t g_cu;
static int g_cu_loaded;               /* the table is complete; written once, inside the once */
static cudaError_t g_cu_load_err;     /* why it is not */
static const char *g_cu_load_bad = "";
static pthread_once_t g_cu_once = PTHREAD_ONCE_INIT;
static void kvc_cu_load(void)
{
    g_cu_load_err = KV_CUDRV_LOAD_ALL(&g_cu, KVC_CU_FNS, &g_cu_load_bad);
    g_cu_loaded = g_cu_load_err == cudaSuccess;
}

typedef struct kvc_cuda_region_s {
    CUdeviceptr ptr;
    size_t bytes;
} kvc_cuda_region_t;

struct kvc_cuda_s {
    CUdevice dev;
    CUcontext ctx;
    int legacy;
    int dir_ro; /* last readonly request was honoured */
    int nreg;
    kvc_cuda_region_t reg[KVC_CUDA_MAX_REGIONS];
};

static const char *cu_str(CUresult r)
{
    const char *s = NULL;
    if (!g_cu_loaded || g_cu.cuGetErrorString(r, &s) != CUDA_SUCCESS || !s)
        return "unknown CUDA error";
    return s;
}

#define CU_TRY(call)                                                                               \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            snprintf(err, errlen, "kvc cuda: %s failed: %s", #call, cu_str(r_));                   \
            return r_ == CUDA_ERROR_OUT_OF_MEMORY ? KV_ERR_NOMEM : KV_ERR_DEVICE;                  \
        }                                                                                          \
    } while (0)

/* Make cu's context current for one call; *prev receives the thread's context (maybe NULL),
 * which cu_leave puts back. */
static CUresult cu_enter(const kvc_cuda_t *cu, CUcontext *prev)
{
    *prev = NULL;
    CUresult r = g_cu.cuCtxGetCurrent(prev);
    if (r == CUDA_SUCCESS && *prev != cu->ctx)
        r = g_cu.cuCtxSetCurrent(cu->ctx);
    return r;
}

static void cu_leave(const kvc_cuda_t *cu, CUcontext prev)
{
    if (prev != cu->ctx)
        (void)g_cu.cuCtxSetCurrent(prev);
}

kv_err_t kvc__cuda_open(kvc_cuda_t **out, int legacy, char *err, size_t errlen)
{
    *out = NULL;
    pthread_once(&g_cu_once, kvc_cu_load);
    if (!g_cu_loaded) {
        snprintf(err, errlen,
                 "kvc cuda: the daemon serves backend cuda but this process has "
                 "no CUDA device: %s (resolving %s)",
                 cudaGetErrorString(g_cu_load_err), g_cu_load_bad);
        return KV_ERR_DEVICE;
    }
    CUresult r = g_cu.cuInit(0);
    int n = 0;
    if (r == CUDA_SUCCESS)
        r = g_cu.cuDeviceGetCount(&n);
    if (r != CUDA_SUCCESS || n == 0) {
        snprintf(err, errlen,
                 "kvc cuda: the daemon serves backend cuda but this process has no "
                 "CUDA device: %s",
                 r != CUDA_SUCCESS ? cu_str(r) : "0 devices");
        return KV_ERR_DEVICE;
    }
    kvc_cuda_t *cu = calloc(1, sizeof(*cu));
    if (!cu) {
        snprintf(err, errlen, "kvc cuda: out of memory (%zu bytes)", sizeof(*cu));
        return KV_ERR_NOMEM;
    }
    int ord = 0;
    if (cudaGetDevice(&ord) != cudaSuccess) {
        ord = 0;
        (void)cudaGetLastError(); /* ours, handled: not for the engine's next check */
    }
    cu->legacy = legacy;
    const char *call = "cuDeviceGet";
    r = g_cu.cuDeviceGet(&cu->dev, ord);
    if (r == CUDA_SUCCESS) {
        call = "cuDevicePrimaryCtxRetain";
        r = g_cu.cuDevicePrimaryCtxRetain(&cu->ctx, cu->dev);
    }
    if (r != CUDA_SUCCESS) {
        snprintf(err, errlen, "kvc cuda: %s(device %d) failed: %s", call, ord, cu_str(r));
        free(cu);
        return r == CUDA_ERROR_OUT_OF_MEMORY ? KV_ERR_NOMEM : KV_ERR_DEVICE;
    }
    /* no cuCtxSetCurrent: the calls that need the context make it current (cu_enter) */
    *out = cu;
    return KV_ERR_OK;
}

/* Legacy IPC import of the handle in fd, checked against the descriptor's bytes. */
static kv_err_t cu_map_legacy(kvc_cuda_t *cu, int fd, uint64_t bytes, uint8_t **dptr, char *err,
                              size_t errlen)
{
    kvc_cuda_region_t *rg = &cu->reg[cu->nreg];
    CUipcMemHandle h;
    if (pread(fd, &h, sizeof(h), 0) != (ssize_t)sizeof(h)) {
        snprintf(err, errlen, "kvc cuda: reading the legacy IPC handle failed");
        return KV_ERR_MALFORMED;
    }
    CUdeviceptr p = 0;
    CU_TRY(g_cu.cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    /* the handle opens the whole allocation, of whatever size; the descriptor only claims one */
    CUdeviceptr base = 0;
    size_t size = 0;
    CUresult r = g_cu.cuMemGetAddressRange(&base, &size, p);
    if (r != CUDA_SUCCESS || base != p || size < bytes) {
        g_cu.cuIpcCloseMemHandle(p);
        if (r != CUDA_SUCCESS) {
            snprintf(err, errlen, "kvc cuda: cuMemGetAddressRange of a legacy IPC region: %s",
                     cu_str(r));
            return KV_ERR_DEVICE;
        }
        snprintf(err, errlen,
                 "kvc cuda: pool descriptor of %llu bytes, but its legacy IPC allocation holds "
                 "%zu bytes from offset %llu",
                 (unsigned long long)bytes, size, (unsigned long long)(p - base));
        return KV_ERR_MALFORMED;
    }
    rg->ptr = p;
    rg->bytes = bytes;
    cu->nreg++;
    cu->dir_ro = 0;
    *dptr = (uint8_t *)(uintptr_t)p;
    return KV_ERR_OK;
}

/* VMM import of the POSIX fd: import, reserve, map, release the handle, set access. */
static kv_err_t cu_map_vmm(kvc_cuda_t *cu, int fd, uint64_t bytes, int readonly, uint8_t **dptr,
                           char *err, size_t errlen)
{
    kvc_cuda_region_t *rg = &cu->reg[cu->nreg];
    CUmemGenericAllocationHandle h;
    CU_TRY(g_cu.cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
                                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    size_t gran = 0;
    const char *call = "cuMemGetAllocationPropertiesFromHandle";
    CUresult r = g_cu.cuMemGetAllocationPropertiesFromHandle(&prop, h);
    if (r == CUDA_SUCCESS) {
        call = "cuMemGetAllocationGranularity";
        r = g_cu.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    }
    if (r == CUDA_SUCCESS && (gran == 0 || bytes % gran != 0)) {
        call = "the size check (not a multiple of the granularity)";
        r = CUDA_ERROR_INVALID_VALUE;
    }
    CUdeviceptr p = 0;
    if (r == CUDA_SUCCESS) {
        call = "cuMemAddressReserve";
        r = g_cu.cuMemAddressReserve(&p, bytes, gran, 0, 0);
    }
    /* cuMemMap refuses a size past the allocation: that is the check of a descriptor that
     * claims more bytes than the daemon exported */
    if (r == CUDA_SUCCESS && (r = g_cu.cuMemMap(p, bytes, 0, h, 0)) != CUDA_SUCCESS) {
        call = "cuMemMap (a descriptor larger than the exported allocation fails here)";
        g_cu.cuMemAddressFree(p, bytes);
    }
    g_cu.cuMemRelease(h); /* the mapping (or nothing, on failure) holds the memory now */
    if (r != CUDA_SUCCESS) {
        snprintf(err, errlen,
                 "kvc cuda: importing a %llu-byte region (granularity %zu) failed in %s: %s",
                 (unsigned long long)bytes, gran, call, cu_str(r));
        return r == CUDA_ERROR_OUT_OF_MEMORY ? KV_ERR_NOMEM : KV_ERR_DEVICE;
    }
    rg->ptr = p;
    rg->bytes = bytes;
    cu->nreg++;
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof(acc));
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = (int)cu->dev;
    acc.flags = readonly ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = g_cu.cuMemSetAccess(p, bytes, &acc, 1);
    if (r != CUDA_SUCCESS && readonly) {
        acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE; /* see the file comment */
        r = g_cu.cuMemSetAccess(p, bytes, &acc, 1);
        cu->dir_ro = 0;
    } else if (readonly) {
        cu->dir_ro = 1;
    }
    if (r != CUDA_SUCCESS) {
        snprintf(err, errlen, "kvc cuda: cuMemSetAccess failed: %s", cu_str(r));
        return KV_ERR_DEVICE;
    }
    *dptr = (uint8_t *)(uintptr_t)p;
    return KV_ERR_OK;
}

kv_err_t kvc__cuda_map(kvc_cuda_t *cu, int fd, uint64_t bytes, int readonly, uint8_t **dptr,
                       char *err, size_t errlen)
{
    *dptr = NULL;
    if (cu->nreg >= KVC_CUDA_MAX_REGIONS) {
        snprintf(err, errlen, "kvc cuda: too many regions");
        return KV_ERR_MALFORMED;
    }
    if (bytes == 0 || bytes > SIZE_MAX) {
        snprintf(err, errlen, "kvc cuda: a region of %llu bytes", (unsigned long long)bytes);
        return KV_ERR_MALFORMED;
    }
    CUcontext prev;
    const CUresult r = cu_enter(cu, &prev);
    if (r != CUDA_SUCCESS) {
        snprintf(err, errlen, "kvc cuda: making the primary context current failed: %s",
                 cu_str(r));
        return KV_ERR_DEVICE;
    }
    const kv_err_t e = cu->legacy ? cu_map_legacy(cu, fd, bytes, dptr, err, errlen)
                                  : cu_map_vmm(cu, fd, bytes, readonly, dptr, err, errlen);
    cu_leave(cu, prev);
    return e;
}

kv_err_t kvc__cuda_read(kvc_cuda_t *cu, const void *src, void *dst, size_t n)
{
    CUcontext prev;
    if (cu_enter(cu, &prev) != CUDA_SUCCESS)
        return KV_ERR_DEVICE;
    const CUresult r = g_cu.cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, n);
    cu_leave(cu, prev);
    return r == CUDA_SUCCESS ? KV_ERR_OK : KV_ERR_DEVICE;
}

int kvc__cuda_dir_readonly(const kvc_cuda_t *cu)
{
    return cu ? cu->dir_ro : 0;
}

void kvc__cuda_close(kvc_cuda_t **pcu)
{
    if (!pcu || !*pcu)
        return;
    kvc_cuda_t *cu = *pcu;
    CUcontext prev;
    const int entered = cu_enter(cu, &prev) == CUDA_SUCCESS;
    /* Kernels that still read these mappings must be done before they vanish; which ones do
     * is the engine's knowledge, so wait for the whole context (file comment: the cost). */
    if (entered)
        g_cu.cuCtxSynchronize();
    for (int i = 0; i < cu->nreg; i++) {
        if (cu->legacy) {
            g_cu.cuIpcCloseMemHandle(cu->reg[i].ptr);
        } else {
            g_cu.cuMemUnmap(cu->reg[i].ptr, cu->reg[i].bytes);
            g_cu.cuMemAddressFree(cu->reg[i].ptr, cu->reg[i].bytes);
        }
    }
    /* Restore before the release: if our reference was the last one, the primary context
     * is destroyed and must not stay current here. A thread that had it current before us
     * got it from the runtime (or another client), which holds its own reference. */
    if (entered)
        cu_leave(cu, prev);
    g_cu.cuDevicePrimaryCtxRelease(cu->dev);
    free(cu);
    *pcu = NULL;
}

#else /* no CUDA in this build */

static kv_err_t kvc_cuda_absent(char *err, size_t errlen)
{
    snprintf(err, errlen,
             "kvc: the daemon serves backend cuda but this libkvc was built "
             "without CUDA; rebuild with KVD_CUDA=ON");
    return KV_ERR_DEVICE;
}

kv_err_t kvc__cuda_open(kvc_cuda_t **out, int legacy, char *err, size_t errlen)
{
    *out = NULL;
    return kvc_cuda_absent(err, errlen);
}

kv_err_t kvc__cuda_map(kvc_cuda_t *cu, int fd, uint64_t bytes, int readonly, uint8_t **dptr,
                       char *err, size_t errlen)
{
    *dptr = NULL;
    return kvc_cuda_absent(err, errlen);
}

kv_err_t kvc__cuda_read(kvc_cuda_t *cu, const void *src, void *dst, size_t n)
{
    return KV_ERR_DEVICE;
}

int kvc__cuda_dir_readonly(const kvc_cuda_t *cu)
{
    return 0;
}

void kvc__cuda_close(kvc_cuda_t **cu)
{
    if (cu)
        *cu = NULL;
}

#endif
