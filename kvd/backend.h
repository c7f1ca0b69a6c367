/* backend.h — kv_backend: where the page pools and the page directory live.
 *
 * DESIGN.md "Backends": one interface, two implementations.
 *   host  pools and directory in memfds mapped by the daemon and by every client (backend_host.c);
 *         conversions run the CPU twins of libkvkern (kv_page_retier / kv_page_promote).
 *   cuda  pools in device memory exported as CUDA VMM POSIX fds; conversions are kernels on a
 *         stream and sync waits for their event (backend_cuda.c; same ops).
 *
 * Memory the backend creates, per namespace:
 *
 *   pool[f]   pages[f] × page_bytes[f] bytes, f ∈ {FP8, TQ3}; clients map it READ-WRITE (the
 *             engine writes KV in place with the append kernel). Page p starts at p*page_bytes.
 *   directory dir_entries × 8 bytes of kv_dir_entry_t (kv_format.h); the daemon is the only
 *             writer (single 64-bit atomic stores); clients map it READ-ONLY. On the host
 *             backend the memfd is sealed with F_SEAL_FUTURE_WRITE after the daemon's own
 *             writable mapping exists, so that (Linux ≥ 5.1) the kernel refuses a writable
 *             mapping to anyone else; exp.dir_sealed says whether it did. Every host memfd ends
 *             with F_SEAL_SEAL, so that no client can add seals of its own.
 *
 * The backend knows nothing of refcounts, sessions or the prefix index: it stores bytes and
 * converts one physical page into another. The core (core.c) decides which pages.
 *
 * Thread rule: every op is called from the daemon's loop thread only. Fds in kvd_export_t are
 * owned by the backend; the server dup()s or sends them with SCM_RIGHTS, never closes them.
 */
#ifndef KVD_BACKEND_H
#define KVD_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "kv_format.h"

/* What a client needs to map the namespace (the hello reply carries it). All borrowed. */
typedef struct kvd_export_s {
    const char *backend;                /* "host" or "cuda"; static string */
    kv_geom_t geom;
    uint32_t pages[KV_FMT_COUNT];       /* physical pages per format (0 = format unused) */
    uint64_t page_bytes[KV_FMT_COUNT];  /* kv_page_bytes(geom, f) */
    uint64_t pool_bytes[KV_FMT_COUNT];  /* mapping size; ≥ pages × page_bytes (may be rounded) */
    int pool_fd[KV_FMT_COUNT];          /* -1 when pages[f] == 0; owned by the backend */
    uint32_t dir_entries;               /* logical page ids 0 .. dir_entries-1 */
    uint64_t dir_bytes;                 /* mapping size of the directory */
    int dir_fd;                         /* owned by the backend; map PROT_READ only */
    int dir_sealed; /* host: 1 when the kernel refuses clients a writable mapping of the
                     * directory (F_SEAL_FUTURE_WRITE took; the server warns when not); cuda: 0,
                     * the client asks the driver for a read-only mapping (kvc_cuda.c) */
} kvd_export_t;

typedef struct kvd_backend_s kvd_backend_t;

/* Pages per conversion kernel launch on cuda (the device index buffer holds this many pairs);
 * a longer batch is launched in pieces. */
#define KVD_CONVERT_BATCH_MAX 1024u
/* directory entries one device-side publish launch writes (backend_cuda.c dir_sync) */
#define KVD_DIR_BATCH_MAX 4096u

typedef struct kvd_backend_ops_s {
    const char *name;
    /* Convert n ≥ 1 physical pages of format src into pages of format dst (FP8 → TQ3 is
     * retier, TQ3 → FP8 promote): src_phys[i] → dst_phys[i], one batch (cuda: one kernel
     * launch per KVD_CONVERT_BATCH_MAX pages). May be asynchronous: completion is only
     * guaranteed after sync() returns 0. Every dst_phys must be a page nobody reads yet, all
     * distinct. Every index is checked before anything runs. Returns KV_ERR_OK, or
     * KV_ERR_INVALID_ARGUMENT / KV_ERR_DEVICE with a message in err[errlen]. */
    int (*convert)(kvd_backend_t *b, kv_fmt_t src, kv_fmt_t dst, uint32_t n,
                   const uint32_t *src_phys, const uint32_t *dst_phys, char *err, size_t errlen);
    /* Wait until every conversion issued so far has completed. KV_ERR_OK or KV_ERR_DEVICE. */
    int (*sync)(kvd_backend_t *b, char *err, size_t errlen);
    /* Release everything (unmap, close fds, free impl). Called once by kvd_backend_free. */
    void (*destroy)(kvd_backend_t *b);
    /* Optional (NULL on host, where `dir` IS the shared memory): make entries lids[0..n) of the
     * host array `dir` visible in the shared copy, each with one 64-bit write, before
     * returning (cuda: fewer than 6 entries as stream writes, more through one kernel,
     * kvk_cuda_dir_store; then one wait). The core calls it after its stores into
     * dir[] (pages.c; a conversion batch publishes all its flips with one call). Both copies
     * start all zero. KV_ERR_OK, KV_ERR_INVALID_ARGUMENT (an id beyond the directory: nothing
     * written) or KV_ERR_DEVICE. */
    int (*dir_sync)(kvd_backend_t *b, const uint32_t *lids, uint32_t n, char *err,
                    size_t errlen);
    /* Copy physical page `phys` of format f to host memory buf[page_bytes[f]] (page_read) or
     * from it (page_write). Synchronous: the copy is complete when it returns. The snapshot
     * writer reads sealed (immutable) pages; the loader writes pages no one can see yet (not
     * published in the directory). Host: memcpy on the daemon's mapping; cuda: a driver copy.
     * KV_ERR_OK, KV_ERR_INVALID_ARGUMENT (format, page) or KV_ERR_DEVICE. */
    int (*page_read)(kvd_backend_t *b, kv_fmt_t f, uint32_t phys, void *buf, char *err,
                     size_t errlen);
    int (*page_write)(kvd_backend_t *b, kv_fmt_t f, uint32_t phys, const void *buf, char *err,
                      size_t errlen);
} kvd_backend_ops_t;

/* Public part of every backend. The daemon-side mapping of the memory is in `pools` and `dir`:
 * pools.base[f] is a host pointer on the host backend and a device pointer on cuda; `dir` is
 * always a host pointer (the cuda backend mirrors it to the device on publish). */
struct kvd_backend_s {
    const kvd_backend_ops_t *ops;
    kvd_export_t exp;
    kv_pools_t pools;
    kv_dir_entry_t *dir; /* [exp.dir_entries], daemon's writable mapping */
    void *impl;
    /* Test hook: when > 0, the n-th convert() call from now fails with KV_ERR_DEVICE (a batch
     * is one call). */
    uint32_t test_fail_convert;
};

/* Create a backend by name: "host" (always built) or "cuda" (KV_ERR_DEVICE with a clear
 * message when not built or no GPU: never a silent fallback, DESIGN.md). pages[f] may be 0 for
 * an unused format. dir_entries ≥ 1. Errors: INVALID_ARGUMENT (geometry, sizes overflow),
 * NOMEM / IO (memfd_create, ftruncate, mmap failed: the message names the call and errno). */
int kvd_backend_create(kvd_backend_t **out, const char *name, const kv_geom_t *geom,
                       const uint32_t pages[KV_FMT_COUNT], uint32_t dir_entries, char *err,
                       size_t errlen);
int kvd_backend_host_create(kvd_backend_t **out, const kv_geom_t *geom,
                            const uint32_t pages[KV_FMT_COUNT], uint32_t dir_entries, char *err,
                            size_t errlen);
/* The cuda backend (backend_cuda.c, built with KVD_HAVE_CUDA): pools and directory in device
 * memory exported as CUDA VMM POSIX fds; `dir` is a host mirror pushed by ops->dir_sync.
 * KV_ERR_DEVICE "backend cuda: no CUDA device: <driver message>" without a usable GPU. */
int kvd_backend_cuda_create(kvd_backend_t **out, const kv_geom_t *geom,
                            const uint32_t pages[KV_FMT_COUNT], uint32_t dir_entries, char *err,
                            size_t errlen);
/* Device address of the directory in the daemon's context (cuda only; NULL otherwise). */
void *kvd_backend_cuda_dir_device(kvd_backend_t *b);
/* Destroy and set *b = NULL. NULL-safe. Clients that mapped the memfds keep their mappings. */
void kvd_backend_free(kvd_backend_t **b);

/* Host pointer to physical page `phys` of format f in the daemon's mapping (host backend only;
 * NULL on cuda or out of range). For tests and the snapshot writer. */
uint8_t *kvd_backend_host_page(kvd_backend_t *b, kv_fmt_t f, uint32_t phys);

/* Arguments every backend's convert checks first (formats, n ≥ 1, every index in its pool),
 * then the test hook (test_fail_convert). KV_ERR_OK, INVALID_ARGUMENT or DEVICE (injected). */
int kvd_backend_convert_check(kvd_backend_t *b, kv_fmt_t src, kv_fmt_t dst, uint32_t n,
                              const uint32_t *src_phys, const uint32_t *dst_phys, char *err,
                              size_t errlen);

/* Arguments every backend's create checks first: out non-NULL (set to NULL), a valid
 * geometry, pages non-NULL and at least one directory entry. KV_ERR_OK or INVALID_ARGUMENT. */
int kvd_backend_check_args(kvd_backend_t **out, const kv_geom_t *geom,
                           const uint32_t pages[KV_FMT_COUNT], uint32_t dir_entries, char *err,
                           size_t errlen);

#endif /* KVD_BACKEND_H */
