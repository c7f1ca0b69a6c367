/* kv_cudrv.h — CUDA driver API calls without linking libcuda.
 *
 * Why: kvd and libkvc are built with CUDA wherever nvcc exists (CI has nvcc but no driver). A
 * binary linked against libcuda.so.1 cannot even start on such a machine, so every test that
 * links kvdcore or libkvc would die in the loader. The runtime (libcudart) loads the driver
 * lazily instead; cudaGetDriverEntryPointByVersion hands out driver functions once it has, and
 * fails with a cudaError_t (no driver, no device) that we turn into a clear message.
 *
 * Usage (one table per user, filled once):
 *     #define MY_FNS(X) X(cuInit) X(cuMemCreate) ...
 *     typedef struct { MY_FNS(KV_CUDRV_MEMBER) } my_drv_t;
 *     const char *bad = NULL;
 *     cudaError_t e = KV_CUDRV_LOAD_ALL(&drv, MY_FNS, &bad);   // cudaSuccess or why
 *     drv.cuInit(0);                                          // names as in cuda.h
 * Members are declared through cuda.h's own versioning macros (cuMemAlloc → cuMemAlloc_v2),
 * and the symbol asked for is the base name at ABI version KV_CUDRV_VERSION, which yields the
 * same versioned function. Header-only; host C or C++.
 */
#ifndef KV_CUDRV_H
#define KV_CUDRV_H

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <string.h>

#define KV_CUDRV_VERSION 12000 /* ABI of the entry points we call (CUDA 12.0 semantics) */

#define KV_CUDRV_MEMBER(n) __typeof__(&n) n;

#define KV_CUDRV_LOAD_ONE_(n)                                                                      \
    if (e_ == cudaSuccess) {                                                                       \
        enum cudaDriverEntryPointQueryResult q_ = cudaDriverEntryPointSymbolNotFound;              \
        e_ = cudaGetDriverEntryPointByVersion(#n, (void **)&tab_->n, KV_CUDRV_VERSION,             \
                                              cudaEnableDefault, &q_);                             \
        if (e_ == cudaSuccess && q_ != cudaDriverEntryPointSuccess)                                \
            e_ = cudaErrorSymbolNotFound;                                                          \
        if (e_ != cudaSuccess)                                                                     \
            *bad_ = #n;                                                                            \
    }

/* Fill every member of *tab listed by FNS; evaluates to cudaSuccess or the first failure, with
 * *bad naming the function that could not be resolved. */
#define KV_CUDRV_LOAD_ALL(tab, FNS, bad)                                                           \
    __extension__({                                                                                \
        __typeof__(tab) tab_ = (tab);                                                              \
        const char **bad_ = (bad);                                                                 \
        cudaError_t e_ = cudaSuccess;                                                              \
        FNS(KV_CUDRV_LOAD_ONE_)                                                                    \
        e_;                                                                                        \
    })

/* The allocation kvd's pools and directory are made of (backend_cuda.c), and that the GPU
 * tests mirror: pinned memory of device dev, exportable as a POSIX file descriptor (the
 * handle type of the SCM_RIGHTS handover). */
static inline CUmemAllocationProp kv_cudrv_fd_prop(int dev)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    return prop;
}

#endif /* KV_CUDRV_H */
