/* core_fixture.h — a small kvdcore on the host backend for the core's unit tests
 * (test_pages.c, test_prefix.c, test_core.c). Awkward sizes on purpose: 3 tokens per page,
 * 7 FP8 and 5 TQ3 pages, so off-by-one errors in page math or list lengths show.
 */
#ifndef CORE_FIXTURE_H
#define CORE_FIXTURE_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "core.h"
#include "core_int.h"

#define FX_PT 3u
#define FX_FP8 7u
#define FX_TQ3 5u

static uint64_t fx_clock;
static uint64_t fx_now(void *ud)
{
    (void)ud;
    return fx_clock += 1000;
}

static inline kv_geom_t fx_geom(void)
{
    kv_geom_t g = {.layers = 2, .kv_heads = 2, .head_dim = 64, .page_tokens = FX_PT, .seed = 7};
    return g;
}

static inline kvd_core_t *fx_core_opts(kvd_core_opts_t *o)
{
    char err[256] = "";
    kvd_core_t *c = NULL;
    int rc = kvd_core_init(&c, o, err, sizeof(err));
    if (rc != KV_ERR_OK)
        fail_msg("kvd_core_init: %s (%s)", kv_err_name(rc), err);
    return c;
}

static inline void fx_opts(kvd_core_opts_t *o)
{
    kv_geom_t g = fx_geom();
    kvd_core_opts_default(o, &g, FX_FP8, FX_TQ3);
    for (int i = 0; i < KVD_HASH_KEY_BYTES; i++)
        o->hash_key[i] = (uint8_t)(i * 7 + 1);
    o->now_ns = fx_now;
}

static inline kvd_core_t *fx_core(void)
{
    kvd_core_opts_t o;
    fx_opts(&o);
    return fx_core_opts(&o);
}

/* Assert the invariant checker is happy, printing its report otherwise. */
#define FX_CHECK(c)                                                                                \
    do {                                                                                           \
        char rep_[2048];                                                                           \
        int n_ = kvd_core_check((c), rep_, sizeof(rep_));                                          \
        if (n_ != 0)                                                                               \
            fail_msg("kvd_core_check found %d problems:\n%s", n_, rep_);                           \
    } while (0)

#define FX_OK(expr)                                                                                \
    do {                                                                                           \
        int rc_ = (expr);                                                                          \
        if (rc_ != KV_ERR_OK)                                                                      \
            fail_msg("%s -> %s: %s", #expr, kv_err_name(rc_), kvd_core_errmsg(c));                 \
    } while (0)

/* Tokens of page i of a "prompt" named by seed: deterministic, distinct per seed and page. */
static inline void fx_tokens(uint32_t seed, uint32_t npages, uint32_t *out)
{
    for (uint32_t i = 0; i < npages * FX_PT; i++)
        out[i] = seed * 100000u + i * 13u + 5u;
}

static inline kvd_stats_t fx_stats(const kvd_core_t *c)
{
    kvd_stats_t s;
    kvd_core_stats(c, &s);
    return s;
}

/* Report a safe epoch equal to the current epoch for session sid (no kernels in flight). */
static inline void fx_quiesce(kvd_core_t *c, uint64_t sid)
{
    FX_OK(kvd_core_session_report_epoch(c, sid, kvd_core_epoch(c)));
}

#endif /* CORE_FIXTURE_H */
