/* core_fixture.h — a small kvdcore on the host backend for the core's unit tests
 * (test_pages.c, test_prefix.c, test_core.c, test_lifecycle.c, …). Awkward sizes on purpose:
 * 3 tokens per page, 7 FP8 and 5 TQ3 pages, so off-by-one errors in page math or list lengths
 * show.
 */
#ifndef CORE_FIXTURE_H
#define CORE_FIXTURE_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core.h"
#include "core_int.h"
#include "kvkern.h"

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

/* Fill FP8 page lid with Gaussian-ish KV (sum of 12 uniforms: roughly normal, unit variance)
 * through the append twin, as an engine would; ref (optional, [T·H·d]) receives layer 0's K. */
static inline void fx_fill_page(kvd_core_t *c, uint32_t lid, unsigned seed, float *ref)
{
    kvd_backend_t *be = kvd_core_backend(c);
    kv_geom_t g = fx_geom();
    uint32_t T = g.page_tokens, H = g.kv_heads, d = g.head_dim;
    float *k = malloc(sizeof(float) * T * H * d), *v = malloc(sizeof(float) * T * H * d);
    assert_non_null(k);
    assert_non_null(v);
    uint32_t pages[FX_PT], slots[FX_PT];
    srand(seed);
    for (uint32_t layer = 0; layer < g.layers; layer++) {
        for (uint32_t i = 0; i < T * H * d; i++) {
            float s = 0;
            for (int r = 0; r < 12; r++)
                s += (float)rand() / (float)RAND_MAX;
            k[i] = s - 6.0f;
            v[i] = 0.5f * (s - 6.0f) + 0.1f;
        }
        for (uint32_t t = 0; t < T; t++)
            pages[t] = lid, slots[t] = t;
        assert_int_equal(kv_fp8_append(&g, &be->pools, be->dir, be->exp.dir_entries, layer, T,
                                       pages, slots, k, v),
                         KVK_OK);
        if (layer == 0 && ref)
            memcpy(ref, k, sizeof(float) * T * H * d);
    }
    free(k);
    free(v);
}

#endif /* CORE_FIXTURE_H */
