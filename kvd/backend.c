/* backend.c — choosing a backend by name, and the generic destructor.
 *
 * "cuda" goes to backend_cuda.c when the build has CUDA (KVD_HAVE_CUDA=1); otherwise, and when
 * no GPU is usable, it is refused with a clear error: DESIGN.md forbids a silent fallback to
 * host when a GPU was asked for.
 */
#include "backend.h"

#include <string.h>

#include "kv_err.h"
#include "util.h"

int kvd_backend_create(kvd_backend_t **out, const char *name, const kv_geom_t *geom,
                       const uint32_t pages[KV_FMT_COUNT], uint32_t dir_entries, char *err,
                       size_t errlen)
{
    if (!out)
        return KV_ERR_INVALID_ARGUMENT;
    *out = NULL;
    if (!name || strcmp(name, "host") == 0)
        return kvd_backend_host_create(out, geom, pages, dir_entries, err, errlen);
    if (strcmp(name, "cuda") == 0) {
#if defined(KVD_HAVE_CUDA) && KVD_HAVE_CUDA
        return kvd_backend_cuda_create(out, geom, pages, dir_entries, err, errlen);
#else
        kvd_fmt(err, errlen, "backend \"cuda\" is not available in this build "
                             "(no CUDA backend compiled in); use backend host");
        return KV_ERR_DEVICE;
#endif
    }
    kvd_fmt(err, errlen, "unknown backend \"%s\" (expected host or cuda)", name);
    return KV_ERR_INVALID_ARGUMENT;
}

void kvd_backend_free(kvd_backend_t **b)
{
    if (!b || !*b)
        return;
    (*b)->ops->destroy(*b);
    *b = NULL;
}

int kvd_backend_check_args(kvd_backend_t **out, const kv_geom_t *geom,
                           const uint32_t pages[KV_FMT_COUNT], uint32_t dir_entries, char *err,
                           size_t errlen)
{
    if (!out)
        return KV_ERR_INVALID_ARGUMENT;
    *out = NULL;
    if (!kv_geom_valid(geom)) {
        kvd_fmt(err, errlen, "invalid geometry");
        return KV_ERR_INVALID_ARGUMENT;
    }
    if (dir_entries == 0 || !pages) {
        kvd_fmt(err, errlen, "the directory needs at least one entry");
        return KV_ERR_INVALID_ARGUMENT;
    }
    return KV_ERR_OK;
}

int kvd_backend_convert_check(kvd_backend_t *b, kv_fmt_t src, kv_fmt_t dst, uint32_t n,
                              const uint32_t *src_phys, const uint32_t *dst_phys, char *err,
                              size_t errlen)
{
    if (src >= KV_FMT_COUNT || dst >= KV_FMT_COUNT || src == dst || n == 0 || !src_phys ||
        !dst_phys) {
        kvd_fmt(err, errlen, "convert(%d -> %d, %u pages): bad formats or arguments", (int)src,
                (int)dst, n);
        return KV_ERR_INVALID_ARGUMENT;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (src_phys[i] >= b->exp.pages[src] || dst_phys[i] >= b->exp.pages[dst]) {
            kvd_fmt(err, errlen, "convert(%d:%u -> %d:%u): bad page (item %u of %u)", (int)src,
                    src_phys[i], (int)dst, dst_phys[i], i, n);
            return KV_ERR_INVALID_ARGUMENT;
        }
    }
    if (b->test_fail_convert > 0 && --b->test_fail_convert == 0) {
        kvd_fmt(err, errlen, "convert: injected failure (test hook)");
        return KV_ERR_DEVICE;
    }
    return KV_ERR_OK;
}
