/* kvc_cuda.h — libkvc internal: importing the cuda backend's device memory (kvc_cuda.c).
 *
 * kvc.c maps host-backend memfds with mmap; when the hello reply says backend "cuda" (VMM POSIX
 * fds) or "cuda-ipc" (memfds holding a legacy cudaIpcMemHandle_t), it calls these instead, and
 * the addresses it stores are DEVICE addresses in this process's CUDA context (the primary
 * context of the current runtime device, so the kvkern_cuda launchers can use them directly).
 *
 * Built in every libkvc: without CUDA (KVC_HAVE_CUDA unset) each call fails with KV_ERR_DEVICE
 * and a message saying so, never a silent host fallback.
 *
 * Thread rule: that of the owning kvc_t. Not part of the public API.
 */
#ifndef KVC_CUDA_H
#define KVC_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kv_err.h"
#include "kv_format.h"

typedef struct kvc_cuda_s kvc_cuda_t;

/* cuInit, pick the device (the runtime's current device, else 0), retain its primary context.
 * legacy: handles arrive as cudaIpcMemHandle_t bytes in memfds. */
kv_err_t kvc__cuda_open(kvc_cuda_t **out, int legacy, char *err, size_t errlen);
/* Import one region of `bytes` from fd (not closed here) and map it at *dptr (device address).
 * readonly: ask for read-only access (the directory); where the driver refuses read-only VMM
 * access the mapping is read-write (kvc__cuda_dir_readonly() returns 0; libkvc does not report
 * it further: the daemon is the only writer by contract, not by the driver there). */
kv_err_t kvc__cuda_map(kvc_cuda_t *cu, int fd, uint64_t bytes, int readonly, uint8_t **dptr,
                       char *err, size_t errlen);
/* Copy n bytes of device memory at src into host dst (the directory lookups of kvc_page_ptr). */
kv_err_t kvc__cuda_read(kvc_cuda_t *cu, const void *src, void *dst, size_t n);
/* 1 when the directory mapping really is read-only for this process. */
int kvc__cuda_dir_readonly(const kvc_cuda_t *cu);
/* Unmap every region, release the context; *cu = NULL. NULL-safe. */
void kvc__cuda_close(kvc_cuda_t **cu);

#endif /* KVC_CUDA_H */
