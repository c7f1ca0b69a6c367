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
    if (!cu)
        return KV_ERR_NOMEM;
    int ord = 0;
    if (cudaGetDevice(&ord) != cudaSuccess)
        ord = 0;
    cu->legacy = legacy;
    if (g_cu.cuDeviceGet(&cu->dev, ord) != CUDA_SUCCESS ||
        (r = g_cu.cuDevicePrimaryCtxRetain(&cu->ctx, cu->dev)) != CUDA_SUCCESS) {
        snprintf(err, errlen, "kvc cuda: g_cu.cuDevicePrimaryCtxRetain(device %d) failed", ord);
        free(cu);
        return KV_ERR_DEVICE;
    }
    *out = cu;
    CU_TRY(g_cu.cuCtxSetCurrent(cu->ctx));
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
    CU_TRY(g_cu.cuCtxSetCurrent(cu->ctx));
    kvc_cuda_region_t *rg = &cu->reg[cu->nreg];
    if (cu->legacy) {
        CUipcMemHandle h;
        if (pread(fd, &h, sizeof(h), 0) != (ssize_t)sizeof(h)) {
            snprintf(err, errlen, "kvc cuda: reading the legacy IPC handle failed");
            return KV_ERR_MALFORMED;
        }
        CU_TRY(g_cu.cuIpcOpenMemHandle(&rg->ptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
        rg->bytes = bytes;
        cu->nreg++;
        cu->dir_ro = 0;
        *dptr = (uint8_t *)(uintptr_t)rg->ptr;
        return KV_ERR_OK;
    }
    CUmemGenericAllocationHandle h;
    CU_TRY(g_cu.cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
                                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    size_t gran = 0;
    CUresult r = g_cu.cuMemGetAllocationPropertiesFromHandle(&prop, h);
    if (r == CUDA_SUCCESS)
        r = g_cu.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r == CUDA_SUCCESS && (gran == 0 || bytes % gran != 0))
        r = CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr p = 0;
    if (r == CUDA_SUCCESS)
        r = g_cu.cuMemAddressReserve(&p, bytes, gran, 0, 0);
    if (r == CUDA_SUCCESS && (r = g_cu.cuMemMap(p, bytes, 0, h, 0)) != CUDA_SUCCESS)
        g_cu.cuMemAddressFree(p, bytes);
    g_cu.cuMemRelease(h); /* the mapping (or nothing, on failure) holds the memory now */
    if (r != CUDA_SUCCESS) {
        snprintf(err, errlen,
                 "kvc cuda: importing a %llu-byte region (granularity %zu) failed: "
                 "%s",
                 (unsigned long long)bytes, gran, cu_str(r));
        return KV_ERR_DEVICE;
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

kv_err_t kvc__cuda_read(kvc_cuda_t *cu, const void *src, void *dst, size_t n)
{
    if (g_cu.cuCtxSetCurrent(cu->ctx) != CUDA_SUCCESS ||
        g_cu.cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, n) != CUDA_SUCCESS)
        return KV_ERR_DEVICE;
    return KV_ERR_OK;
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
    g_cu.cuCtxSetCurrent(cu->ctx);
    /* Kernels of ours that still read these mappings must be done before they vanish. */
    g_cu.cuCtxSynchronize();
    for (int i = 0; i < cu->nreg; i++) {
        if (cu->legacy) {
            g_cu.cuIpcCloseMemHandle(cu->reg[i].ptr);
        } else {
            g_cu.cuMemUnmap(cu->reg[i].ptr, cu->reg[i].bytes);
            g_cu.cuMemAddressFree(cu->reg[i].ptr, cu->reg[i].bytes);
        }
    }
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
