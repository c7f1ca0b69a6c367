/* backend_host.c — the host backend: pools and directory in memfds, conversions on the CPU.
 *
 *   memfd "kvd-pool-fp8"  pages[FP8] × page_bytes, sealed against grow/shrink
 *   memfd "kvd-pool-tq3"  pages[TQ3] × page_bytes, sealed against grow/shrink
 *   memfd "kvd-dir"       dir_entries × 8 bytes, sealed against grow/shrink and FUTURE_WRITE
 *
 * Why seals: a client that could ftruncate() a pool would make the daemon SIGBUS on its next
 * access; a client that could map the directory writable could redirect other tenants' logical
 * ids. F_SEAL_FUTURE_WRITE (Linux ≥ 5.1) forbids new writable mappings while keeping the
 * daemon's own, which is exactly "the daemon is the only writer". On an older kernel that seal
 * fails and the directory stays unsealed (exp.dir_sealed = 0, and the server warns; clients
 * are still told to map it PROT_READ); the grow/shrink seals are required. Last, F_SEAL_SEAL
 * on every memfd: without it any client could add seals of its own to the fd it received —
 * F_SEAL_FUTURE_WRITE on a pool would make every later client's read-write mapping fail until
 * the daemon restarts.
 *
 * Conversions run synchronously with the CPU twins (kv_page_retier / kv_page_promote), so
 * sync() has nothing to wait for.
 */
#include "backend.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kv_err.h"
#include "kvkern.h"
#include "util.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

static void host_destroy(kvd_backend_t *b)
{
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        if (b->pools.base[f])
            munmap(b->pools.base[f], b->exp.pool_bytes[f]);
        if (b->exp.pool_fd[f] >= 0)
            close(b->exp.pool_fd[f]);
    }
    if (b->dir)
        munmap(b->dir, b->exp.dir_bytes);
    if (b->exp.dir_fd >= 0)
        close(b->exp.dir_fd);
    kvd_free(b);
}

static int host_convert(kvd_backend_t *b, kv_fmt_t src, kv_fmt_t dst, uint32_t n,
                        const uint32_t *src_phys, const uint32_t *dst_phys, char *err,
                        size_t errlen)
{
    int rc = kvd_backend_convert_check(b, src, dst, n, src_phys, dst_phys, err, errlen);
    if (rc != KV_ERR_OK)
        return rc;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *s = kvd_backend_host_page(b, src, src_phys[i]);
        uint8_t *d = kvd_backend_host_page(b, dst, dst_phys[i]);
        int k = src == KV_FMT_FP8 ? kv_page_retier(&b->exp.geom, s, d)
                                  : kv_page_promote(&b->exp.geom, s, d);
        if (k != KVK_OK) {
            kvd_fmt(err, errlen, "%s(%u -> %u) failed: kvk status %d",
                    src == KV_FMT_FP8 ? "kv_page_retier" : "kv_page_promote", src_phys[i],
                    dst_phys[i], k);
            return k == KVK_ENOMEM ? KV_ERR_NOMEM : KV_ERR_DEVICE;
        }
    }
    return KV_ERR_OK;
}

static int host_sync(kvd_backend_t *b, char *err, size_t errlen)
{
    return KV_ERR_OK; /* conversions above are synchronous */
}

static int host_page_check(kvd_backend_t *b, kv_fmt_t f, uint32_t phys, const void *buf,
                           char *err, size_t errlen)
{
    if (f >= KV_FMT_COUNT || phys >= b->exp.pages[f] || !buf) {
        kvd_fmt(err, errlen, "page copy %d:%u: bad format or page", (int)f, phys);
        return KV_ERR_INVALID_ARGUMENT;
    }
    return KV_ERR_OK;
}

static int host_page_read(kvd_backend_t *b, kv_fmt_t f, uint32_t phys, void *buf, char *err,
                          size_t errlen)
{
    int rc = host_page_check(b, f, phys, buf, err, errlen);
    if (rc == KV_ERR_OK)
        memcpy(buf, kvd_backend_host_page(b, f, phys), b->exp.page_bytes[f]);
    return rc;
}

static int host_page_write(kvd_backend_t *b, kv_fmt_t f, uint32_t phys, const void *buf,
                           char *err, size_t errlen)
{
    int rc = host_page_check(b, f, phys, buf, err, errlen);
    if (rc == KV_ERR_OK)
        memcpy(kvd_backend_host_page(b, f, phys), buf, b->exp.page_bytes[f]);
    return rc;
}

static const kvd_backend_ops_t host_ops = {
    .name = "host",
    .convert = host_convert,
    .sync = host_sync,
    .destroy = host_destroy,
    .page_read = host_page_read,
    .page_write = host_page_write,
};

/* memfd of `bytes`, sealed against size changes, mapped read-write into *map. */
static int host_region(const char *name, uint64_t bytes, int *fd_out, void **map, char *err,
                       size_t errlen)
{
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        kvd_fmt(err, errlen, "memfd_create(%s) failed: %s", name, strerror(errno));
        return KV_ERR_IO;
    }
    if (ftruncate(fd, (off_t)bytes) != 0) {
        const int en = errno;
        kvd_fmt(err, errlen, "ftruncate(%s, %llu) failed: %s%s", name, (unsigned long long)bytes,
                strerror(en),
                en == EFBIG ? " (the file size limit, ulimit -f or systemd LimitFSIZE=, is below "
                              "the pool)"
                            : "");
        close(fd);
        return KV_ERR_NOMEM;
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        kvd_fmt(err, errlen, "mmap(%s, %llu) failed: %s", name, (unsigned long long)bytes,
                strerror(errno));
        close(fd);
        return KV_ERR_NOMEM;
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
        kvd_fmt(err, errlen, "fcntl(%s, F_ADD_SEALS) failed: %s", name, strerror(errno));
        munmap(p, bytes);
        close(fd);
        return KV_ERR_IO;
    }
    *fd_out = fd;
    *map = p;
    return KV_ERR_OK;
}

int kvd_backend_host_create(kvd_backend_t **out, const kv_geom_t *geom,
                            const uint32_t pages[KV_FMT_COUNT], uint32_t dir_entries, char *err,
                            size_t errlen)
{
    int e = kvd_backend_check_args(out, geom, pages, dir_entries, err, errlen);
    if (e != KV_ERR_OK)
        return e;
    kvd_backend_t *b = kvd_calloc(1, sizeof(*b)); /* no impl: the host keeps no more state */
    if (!b) {
        kvd_fmt(err, errlen, "out of memory creating the host backend");
        return KV_ERR_NOMEM;
    }
    b->ops = &host_ops;
    b->exp.backend = "host";
    b->exp.geom = *geom;
    b->exp.dir_fd = -1;
    for (int f = 0; f < KV_FMT_COUNT; f++)
        b->exp.pool_fd[f] = -1;
    int rc = KV_ERR_OK;
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
        b->exp.pool_bytes[f] = (uint64_t)pages[f] * pb;
        void *map = NULL;
        rc = host_region(f == KV_FMT_FP8 ? "kvd-pool-fp8" : "kvd-pool-tq3", b->exp.pool_bytes[f],
                         &b->exp.pool_fd[f], &map, err, errlen);
        b->pools.base[f] = map;
    }
    if (rc == KV_ERR_OK) {
        void *map = NULL;
        b->exp.dir_entries = dir_entries;
        b->exp.dir_bytes = (uint64_t)dir_entries * sizeof(kv_dir_entry_t);
        rc = host_region("kvd-dir", b->exp.dir_bytes, &b->exp.dir_fd, &map, err, errlen);
        b->dir = map;
    }
    if (rc != KV_ERR_OK) {
        host_destroy(b);
        return rc;
    }
    /* The daemon's writable mapping exists; from now on nobody else may get one. */
    b->exp.dir_sealed = fcntl(b->exp.dir_fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE) == 0;
    /* and nobody may add seals of their own (F_SEAL_SEAL, last) */
    for (int f = 0; f <= KV_FMT_COUNT; f++) {
        const int fd = f < KV_FMT_COUNT ? b->exp.pool_fd[f] : b->exp.dir_fd;
        if (fd >= 0 && fcntl(fd, F_ADD_SEALS, F_SEAL_SEAL) != 0) {
            kvd_fmt(err, errlen, "fcntl(F_ADD_SEALS, F_SEAL_SEAL) failed: %s", strerror(errno));
            host_destroy(b);
            return KV_ERR_IO;
        }
    }
    *out = b;
    return KV_ERR_OK;
}

uint8_t *kvd_backend_host_page(kvd_backend_t *b, kv_fmt_t f, uint32_t phys)
{
    if (!b || b->ops != &host_ops || f >= KV_FMT_COUNT || phys >= b->exp.pages[f])
        return NULL;
    return b->pools.base[f] + (uint64_t)phys * b->exp.page_bytes[f];
}
