/* test_attn.c — mixed FP8/TQ3 paged decode attention (cuda/attn.c): partials + merge against
 * the float64 dense reference, split and order invariance, empty partitions, bad input.
 *
 * Fixtures build real pools in host memory the way the daemon does: every logical page is
 * first written as FP8 by kv_fp8_append (two layers, random K/V, all page_tokens slots), then
 * the pages meant to be Stale are retiered with kv_page_retier into the TQ3 pool and their
 * directory entries flipped. Logical ids are a random permutation of a directory that also has
 * unmapped holes, so id → phys resolution is really exercised. Attention runs on layer 1 so
 * the layer offset inside a page is exercised too.
 *
 * Tolerances (why):
 *  - partial+merge vs reference: ‖out − ref‖/‖ref‖ ≤ 1e-5 per sequence. Both see the same
 *    decoded numbers; they differ only by rounding: the twin stores m, l, Ō in float (2^-24)
 *    and rotates q and Ō in float (log2 d ≤ 8 butterfly stages), the reference rotates each
 *    decoded token in float. That is ~1e-6 at most. 1e-5 is also the bound a float32
 *    accumulating kernel meets over the N ≤ ~300 tokens used here (typical error √N·2^-24 ≈
 *    1e-6, with margin), so the same bound serves the GPU tests. Dropping one token of ~100 moves
 *    the output by ~2e-2 under near-uniform attention (checked by mutating the twin).
 *  - different num_splits / partition order: ≤ 1e-6 — only the float rounding of the stored
 *    partials and the order of a double sum differ.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvkern.h"

/* ---- deterministic randomness ------------------------------------------------------------- */
typedef struct rng_s {
    uint64_t s;
} rng_t;

static uint64_t rng_u64(rng_t *r)
{
    r->s += 0x9E3779B97F4A7C15ull;
    return kv_splitmix64(r->s);
}

static double rng_unif(rng_t *r) /* (0, 1) */
{
    return ((double)(rng_u64(r) >> 11) + 0.5) / 9007199254740992.0;
}

static float rng_gauss(rng_t *r)
{
    return (float)(sqrt(-2.0 * log(rng_unif(r))) * cos(6.283185307179586 * rng_unif(r)));
}

static uint32_t rng_below(rng_t *r, uint32_t n)
{
    return (uint32_t)(rng_u64(r) % n);
}

/* ---- fixture ------------------------------------------------------------------------------ */
/* A sequence: len tokens over ceil(len/T) + extra pages; page p has format pattern[p % strlen]
 * ('F' = FP8, 'T' = TQ3). */
typedef struct seq_spec_s {
    uint32_t len;
    uint32_t extra_pages;
    const char *pattern;
} seq_spec_t;

enum { FX_LAYERS = 2, FX_LAYER = 1 };

typedef struct fx_s {
    kv_geom_t g;
    kv_pools_t pools;
    kv_dir_entry_t *dir;
    uint32_t dir_len;
    uint32_t *indptr, *ids, *len;
    uint32_t *fp8_phys; /* [total pages] the FP8 page each logical page was written into */
    char *fmt;          /* [total pages] 'F' or 'T' */
    uint32_t total;
    float *q;
    kv_attn_batch_t b;
    rng_t rng;
} fx_t;

static uint8_t *pool_alloc(const kv_geom_t *g, kv_fmt_t f, uint32_t pages)
{
    uint64_t bytes = kv_page_bytes(g, f) * (pages ? pages : 1);
    uint8_t *p = aligned_alloc(KV_PAGE_ALIGN, bytes);
    assert_non_null(p);
    memset(p, 0, bytes);
    return p;
}

static uint8_t *fx_fp8_page(const fx_t *fx, uint32_t phys)
{
    return fx->pools.base[KV_FMT_FP8] + (uint64_t)phys * kv_page_bytes(&fx->g, KV_FMT_FP8);
}

/* Write all T slots of one FP8 page for one layer: keys N(0,1) + a per-channel bias (real keys
 * have outlier channels), values N(0,1) + 0.5 so the attention output is not ~0. */
static void fx_fill_page(fx_t *fx, uint32_t id, uint32_t layer, float gain)
{
    const kv_geom_t *g = &fx->g;
    const uint32_t T = g->page_tokens, n = T * g->kv_heads * g->head_dim;
    float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
    uint32_t *sp = malloc(T * sizeof(uint32_t)), *si = malloc(T * sizeof(uint32_t));
    assert_true(k && v && sp && si);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t c = i % g->head_dim;
        k[i] = gain * (rng_gauss(&fx->rng) + (c % 17 == 0 ? 3.0f : 0.0f));
        v[i] = gain * (rng_gauss(&fx->rng) + 0.5f);
    }
    for (uint32_t t = 0; t < T; t++) {
        sp[t] = id;
        si[t] = t;
    }
    assert_int_equal(kv_fp8_append(g, &fx->pools, fx->dir, fx->dir_len, layer, T, sp, si, k, v),
                     KVK_OK);
    free(si);
    free(sp);
    free(v);
    free(k);
}

static void fx_build(fx_t *fx, uint32_t T, uint32_t kv_heads, uint32_t d, uint32_t group,
                     const seq_spec_t *spec, uint32_t batch, uint64_t seed, float qscale)
{
    memset(fx, 0, sizeof(*fx));
    fx->rng.s = seed;
    fx->g = (kv_geom_t){.layers = FX_LAYERS,
                        .kv_heads = kv_heads,
                        .head_dim = d,
                        .page_tokens = T,
                        .seed = seed * 7 + 1};
    assert_true(kv_geom_valid(&fx->g));

    fx->indptr = calloc(batch + 1, sizeof(uint32_t));
    fx->len = calloc(batch ? batch : 1, sizeof(uint32_t));
    assert_true(fx->indptr && fx->len);
    for (uint32_t s = 0; s < batch; s++) {
        fx->len[s] = spec[s].len;
        fx->indptr[s + 1] = fx->indptr[s] + (spec[s].len + T - 1) / T + spec[s].extra_pages;
    }
    fx->total = fx->indptr[batch];
    fx->dir_len = 2 * fx->total + 3; /* holes: unmapped entries between the live ones */
    fx->dir = calloc(fx->dir_len, sizeof(kv_dir_entry_t));
    fx->ids = calloc(fx->total + 1, sizeof(uint32_t));
    fx->fp8_phys = calloc(fx->total + 1, sizeof(uint32_t));
    fx->fmt = calloc(fx->total + 1, 1);
    uint32_t *perm = calloc(fx->dir_len, sizeof(uint32_t));
    assert_true(fx->dir && fx->ids && fx->fp8_phys && fx->fmt && perm);

    /* logical ids: a random subset of the directory in random order */
    for (uint32_t i = 0; i < fx->dir_len; i++)
        perm[i] = i;
    for (uint32_t i = fx->dir_len - 1; i > 0; i--) {
        uint32_t j = rng_below(&fx->rng, i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    uint32_t ntq3 = 0;
    for (uint32_t s = 0; s < batch; s++) {
        size_t plen = strlen(spec[s].pattern);
        for (uint32_t p = fx->indptr[s]; p < fx->indptr[s + 1]; p++) {
            fx->ids[p] = perm[p];
            fx->fmt[p] = spec[s].pattern[(p - fx->indptr[s]) % plen];
            ntq3 += fx->fmt[p] == 'T';
        }
    }
    free(perm);

    fx->pools.base[KV_FMT_FP8] = pool_alloc(&fx->g, KV_FMT_FP8, fx->total);
    fx->pools.pages[KV_FMT_FP8] = fx->total;
    fx->pools.base[KV_FMT_TQ3] = pool_alloc(&fx->g, KV_FMT_TQ3, ntq3);
    fx->pools.pages[KV_FMT_TQ3] = ntq3;

    /* append as FP8 (phys = creation order, reversed so phys ≠ position) ... */
    for (uint32_t p = 0; p < fx->total; p++) {
        fx->fp8_phys[p] = fx->total - 1 - p;
        fx->dir[fx->ids[p]] = kv_dir_make(fx->fp8_phys[p], KV_FMT_FP8, KV_DIR_VALID, 1);
        for (uint32_t l = 0; l < FX_LAYERS; l++)
            fx_fill_page(fx, fx->ids[p], l, l == FX_LAYER ? 1.0f : 5.0f);
    }
    /* ... then retier the Stale ones and publish the flip */
    uint32_t j = 0;
    for (uint32_t p = 0; p < fx->total; p++) {
        if (fx->fmt[p] != 'T')
            continue;
        uint8_t *dst = fx->pools.base[KV_FMT_TQ3] + (uint64_t)j * kv_page_bytes(&fx->g, KV_FMT_TQ3);
        assert_int_equal(kv_page_retier(&fx->g, fx_fp8_page(fx, fx->fp8_phys[p]), dst), KVK_OK);
        fx->dir[fx->ids[p]] = kv_dir_make(j, KV_FMT_TQ3, KV_DIR_VALID | KV_DIR_SEALED, 2);
        j++;
    }

    const uint32_t H = kv_heads * group;
    uint64_t nq = (uint64_t)(batch ? batch : 1) * H * d;
    fx->q = malloc(nq * sizeof(float));
    assert_non_null(fx->q);
    for (uint64_t i = 0; i < nq; i++)
        fx->q[i] = qscale * rng_gauss(&fx->rng);

    fx->b = (kv_attn_batch_t){.batch = batch,
                              .q_heads = H,
                              .layer = FX_LAYER,
                              .sm_scale = 1.0f / sqrtf((float)d),
                              .page_indptr = fx->indptr,
                              .page_ids = fx->ids,
                              .seq_len = fx->len};
}

static void fx_free(fx_t *fx)
{
    free(fx->q);
    free(fx->pools.base[KV_FMT_TQ3]);
    free(fx->pools.base[KV_FMT_FP8]);
    free(fx->fmt);
    free(fx->fp8_phys);
    free(fx->ids);
    free(fx->dir);
    free(fx->len);
    free(fx->indptr);
    memset(fx, 0, sizeof(*fx));
}

/* Partials of the fixture's batch. Returns malloc'd m, l, o (caller frees). */
typedef struct parts_s {
    uint32_t splits, n; /* n = batch * splits * KV_FMT_COUNT */
    float *m, *l, *o;
} parts_t;

static void parts_run(const fx_t *fx, uint32_t splits, parts_t *pt)
{
    const uint32_t H = fx->b.q_heads, d = fx->g.head_dim;
    pt->splits = splits;
    pt->n = kv_attn_num_parts(fx->b.batch, splits);
    uint64_t nn = pt->n ? pt->n : 1;
    pt->m = malloc(nn * H * sizeof(float));
    pt->l = malloc(nn * H * sizeof(float));
    pt->o = malloc(nn * H * d * sizeof(float));
    assert_true(pt->m && pt->l && pt->o);
    assert_int_equal(kv_attn_partial(&fx->g, &fx->pools, fx->dir, fx->dir_len, &fx->b, fx->q,
                                     splits, pt->m, pt->l, pt->o),
                     KVK_OK);
}

static void parts_free(parts_t *pt)
{
    free(pt->m);
    free(pt->l);
    free(pt->o);
    memset(pt, 0, sizeof(*pt));
}

static float *merge_out(const fx_t *fx, const parts_t *pt)
{
    const uint32_t H = fx->b.q_heads, d = fx->g.head_dim;
    float *out = malloc((uint64_t)(fx->b.batch ? fx->b.batch : 1) * H * d * sizeof(float));
    assert_non_null(out);
    assert_int_equal(
        kv_attn_merge(fx->b.batch, pt->splits * KV_FMT_COUNT, H, d, pt->m, pt->l, pt->o, out),
        KVK_OK);
    return out;
}

static double *reference_out(const fx_t *fx)
{
    const uint32_t H = fx->b.q_heads, d = fx->g.head_dim;
    double *ref = malloc((uint64_t)(fx->b.batch ? fx->b.batch : 1) * H * d * sizeof(double));
    assert_non_null(ref);
    assert_int_equal(
        kv_attn_reference(&fx->g, &fx->pools, fx->dir, fx->dir_len, &fx->b, fx->q, ref), KVK_OK);
    return ref;
}

/* ‖a − b‖ / ‖b‖ over sequence s (all heads); 0 when both are zero, +inf when only b is. */
static double seq_rel_err_ref(const fx_t *fx, uint32_t s, const float *a, const double *b)
{
    const uint64_t n = (uint64_t)fx->b.q_heads * fx->g.head_dim, o = s * n;
    double num = 0, den = 0;
    for (uint64_t i = 0; i < n; i++) {
        double e = (double)a[o + i] - b[o + i];
        num += e * e;
        den += b[o + i] * b[o + i];
    }
    if (den == 0)
        return num == 0 ? 0 : INFINITY;
    return sqrt(num / den);
}

static double seq_rel_err(const fx_t *fx, uint32_t s, const float *a, const float *b)
{
    const uint64_t n = (uint64_t)fx->b.q_heads * fx->g.head_dim, o = s * n;
    double num = 0, den = 0;
    for (uint64_t i = 0; i < n; i++) {
        double e = (double)a[o + i] - b[o + i];
        num += e * e;
        den += (double)b[o + i] * b[o + i];
    }
    if (den == 0)
        return num == 0 ? 0 : INFINITY;
    return sqrt(num / den);
}

#define TOL_REF   1e-5
#define TOL_SPLIT 1e-6

/* The standard batch: mixed interleaved, all FP8, all TQ3, one partial page, empty, and one
 * with a trailing page past seq_len. Lengths are not multiples of page_tokens (except where
 * page_tokens is 1) and differ across the batch. */
static uint32_t std_batch(uint32_t T, seq_spec_t *spec)
{
    uint32_t n = 0;
    spec[n++] = (seq_spec_t){97, 0, "FTTFTFFT"};
    spec[n++] = (seq_spec_t){54, 0, "F"};
    spec[n++] = (seq_spec_t){61, 0, "T"};
    spec[n++] = (seq_spec_t){T > 2 ? T - 1 - T / 3 : 1, 0, "T"};
    spec[n++] = (seq_spec_t){0, 0, "F"};
    spec[n++] = (seq_spec_t){2 * T + 1, 1, "TF"};
    return n;
}

/* ---- partial + merge against the dense reference -------------------------------------------- */
static void check_against_reference(uint32_t T, uint32_t kvh, uint32_t d, uint32_t group,
                                    float qscale, uint32_t splits, uint64_t seed, double *worst)
{
    seq_spec_t spec[8];
    uint32_t batch = std_batch(T, spec);
    fx_t fx;
    fx_build(&fx, T, kvh, d, group, spec, batch, seed, qscale);
    parts_t pt;
    parts_run(&fx, splits, &pt);
    float *out = merge_out(&fx, &pt);
    double *ref = reference_out(&fx);
    for (uint32_t s = 0; s < batch; s++) {
        double e = seq_rel_err_ref(&fx, s, out, ref);
        if (!(e <= TOL_REF))
            fail_msg("T=%u d=%u group=%u seq %u: rel err %.3g > %.0e", T, d, group, s, e, TOL_REF);
        if (spec[s].len == 0) /* nothing to attend: exactly zero, and ref agrees */
            for (uint64_t i = 0; i < (uint64_t)fx.b.q_heads * d; i++)
                assert_true(out[s * fx.b.q_heads * d + i] == 0.0f);
        else
            assert_true(e < INFINITY);
        *worst = e > *worst ? e : *worst;
    }
    free(ref);
    free(out);
    parts_free(&pt);
    fx_free(&fx);
}

static void test_matches_reference_grid(void **state)
{
    (void)state;
    static const uint32_t Ts[] = {1, 16, 13}, groups[] = {1, 4, 6}, ds[] = {64, 128, 256};
    double worst = 0;
    uint64_t seed = 11;
    for (size_t a = 0; a < 3; a++)
        for (size_t b = 0; b < 3; b++)
            for (size_t c = 0; c < 3; c++)
                check_against_reference(Ts[a], 2, ds[c], groups[b], 1.0f, 3, seed++, &worst);
    printf("[ attn ] partial+merge vs reference, 27 geometries: worst rel err %.3g (tol %.0e)\n",
           worst, TOL_REF);
}

/* Peaked softmax (scores spread ~8×wider) and a single KV head: the max-tracking and rescaling
 * paths are exercised, not just near-uniform attention. */
static void test_matches_reference_peaky(void **state)
{
    (void)state;
    double worst = 0;
    check_against_reference(13, 1, 128, 6, 8.0f, 2, 101, &worst);
    check_against_reference(16, 3, 64, 4, 8.0f, 5, 102, &worst);
    printf("[ attn ] peaked scores: worst rel err %.3g (tol %.0e)\n", worst, TOL_REF);
}

/* ---- split count and partition order do not matter ---------------------------------------- */
static void test_split_and_order_invariance(void **state)
{
    (void)state;
    static const uint32_t Ts[] = {13, 1};
    for (size_t c = 0; c < 2; c++) {
        seq_spec_t spec[8];
        uint32_t batch = std_batch(Ts[c], spec);
        fx_t fx;
        fx_build(&fx, Ts[c], 2, 128, 6, spec, batch, 200 + c, 2.0f);
        const uint32_t H = fx.b.q_heads, d = fx.g.head_dim;
        parts_t base;
        parts_run(&fx, 1, &base);
        float *want = merge_out(&fx, &base);

        /* 1000 > pages of any sequence: most partitions are empty */
        static const uint32_t splits[] = {1, 2, 3, 7, 1000};
        for (size_t k = 0; k < sizeof(splits) / sizeof(splits[0]); k++) {
            parts_t pt;
            parts_run(&fx, splits[k], &pt);
            float *out = merge_out(&fx, &pt);
            for (uint32_t s = 0; s < batch; s++)
                assert_true(seq_rel_err(&fx, s, out, want) <= TOL_SPLIT);

            /* permute the partitions of each sequence, merge again */
            const uint32_t pps = splits[k] * KV_FMT_COUNT;
            float *m2 = malloc((uint64_t)pt.n * H * sizeof(float));
            float *l2 = malloc((uint64_t)pt.n * H * sizeof(float));
            float *o2 = malloc((uint64_t)pt.n * H * d * sizeof(float));
            uint32_t *perm = malloc(pps * sizeof(uint32_t));
            assert_true(m2 && l2 && o2 && perm);
            for (uint32_t s = 0; s < batch; s++) {
                for (uint32_t j = 0; j < pps; j++)
                    perm[j] = j;
                for (uint32_t j = pps - 1; j > 0; j--) {
                    uint32_t r = rng_below(&fx.rng, j + 1), t = perm[j];
                    perm[j] = perm[r];
                    perm[r] = t;
                }
                for (uint32_t j = 0; j < pps; j++) {
                    uint64_t dst = (uint64_t)s * pps + j, src = (uint64_t)s * pps + perm[j];
                    memcpy(m2 + dst * H, pt.m + src * H, H * sizeof(float));
                    memcpy(l2 + dst * H, pt.l + src * H, H * sizeof(float));
                    memcpy(o2 + dst * H * d, pt.o + src * H * d, (uint64_t)H * d * sizeof(float));
                }
            }
            float *out2 = malloc((uint64_t)batch * H * d * sizeof(float));
            assert_non_null(out2);
            assert_int_equal(kv_attn_merge(batch, pps, H, d, m2, l2, o2, out2), KVK_OK);
            for (uint32_t s = 0; s < batch; s++)
                assert_true(seq_rel_err(&fx, s, out2, want) <= TOL_SPLIT);
            free(out2);
            free(perm);
            free(o2);
            free(l2);
            free(m2);
            free(out);
            parts_free(&pt);
        }
        free(want);
        parts_free(&base);
        fx_free(&fx);
    }
}

/* ---- which partitions are empty ------------------------------------------------------------- */
static int part_is_empty(const fx_t *fx, const parts_t *pt, uint64_t part)
{
    const uint32_t H = fx->b.q_heads, d = fx->g.head_dim;
    int empty = 1;
    for (uint32_t h = 0; h < H; h++) {
        float m = pt->m[part * H + h], l = pt->l[part * H + h];
        int e = m == -INFINITY && l == 0.0f;
        if (e)
            for (uint32_t i = 0; i < d; i++)
                assert_true(pt->o[(part * H + h) * d + i] == 0.0f);
        else
            /* the max token contributes exp(m − float(m)) ≈ 1 */
            assert_true(isfinite(m) && l >= 0.999f);
        empty &= e;
    }
    return empty;
}

/* ---- the split rule: contiguous, covering, at most ceil(np / splits) + 1 pages each, the
 * shortfall off both ends (kvkern.h) ---------------------------------------------------------- */
static void test_split_ranges(void **state)
{
    (void)state;
    static const struct {
        uint64_t np;
        uint32_t splits, first, last; /* expected lengths of the first and the last split */
    } cases[] = {
        {7, 3, 2, 1},       /* chunk 4, 5 short: [0,2) [2,6) [6,7) */
        {2048, 2, 1024, 1024}, /* B=8's two splits: chunk 1025, one page off each end */
        {2048, 33, 32, 32}, /* the bench's B=2 d=256 32K: chunk 64, 64 short */
        {8192, 33, 221, 221},
        {1, 33, 0, 0},      /* fewer pages than splits: the page sits in a middle split */
        {0, 4, 0, 0},
        {5, 1, 5, 5},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const uint64_t np = cases[i].np;
        const uint32_t S = cases[i].splits;
        const uint64_t chunk = (np + S - 1) / S + 1;
        uint64_t next = 0, first = 0, last = 0;
        for (uint32_t sp = 0; sp < S; sp++) {
            uint64_t p0, p1;
            kv_attn_split_range(np, S, sp, &p0, &p1);
            if (p0 != next || p1 < p0 || p1 - p0 > chunk || p1 > np)
                fail_msg("np %llu splits %u: split %u = [%llu, %llu) after %llu (chunk %llu)",
                         (unsigned long long)np, S, sp, (unsigned long long)p0,
                         (unsigned long long)p1, (unsigned long long)next,
                         (unsigned long long)chunk);
            if (sp == 0)
                first = p1 - p0;
            if (sp == S - 1)
                last = p1 - p0;
            next = p1;
        }
        assert_int_equal(next, np); /* every page in exactly one split */
        if (first != cases[i].first || last != cases[i].last)
            fail_msg("np %llu splits %u: first %llu last %llu, expected %u %u",
                     (unsigned long long)np, S, (unsigned long long)first,
                     (unsigned long long)last, cases[i].first, cases[i].last);
    }
}

static void test_empty_partitions(void **state)
{
    (void)state;
    const uint32_t T = 13;
    seq_spec_t spec[8];
    uint32_t batch = std_batch(T, spec);
    fx_t fx;
    fx_build(&fx, T, 2, 64, 4, spec, batch, 300, 1.0f);
    const uint32_t splits = 9; /* > pages of every sequence but the first (8 pages) */
    parts_t pt;
    parts_run(&fx, splits, &pt);
    for (uint32_t s = 0; s < batch; s++) {
        const uint32_t np = fx.indptr[s + 1] - fx.indptr[s];
        for (uint32_t sp = 0; sp < splits; sp++) {
            uint64_t c0, c1;
            kv_attn_split_range(np, splits, sp, &c0, &c1);
            for (uint32_t f = 0; f < KV_FMT_COUNT; f++) {
                /* expected: non-empty iff a page of format f in this chunk has a live token */
                int live = 0;
                for (uint64_t p = c0; p < c1; p++)
                    live |= fx.fmt[fx.indptr[s] + p] == (f == KV_FMT_FP8 ? 'F' : 'T') &&
                            (uint64_t)p * T < fx.len[s];
                uint64_t part = ((uint64_t)s * splits + sp) * KV_FMT_COUNT + f;
                if (part_is_empty(&fx, &pt, part) != !live)
                    fail_msg("seq %u split %u fmt %u: empty=%d, expected live=%d", s, sp, f,
                             part_is_empty(&fx, &pt, part), live);
            }
        }
    }
    /* the zero-length sequence merges to exactly zero */
    float *out = merge_out(&fx, &pt);
    const uint64_t n = (uint64_t)fx.b.q_heads * fx.g.head_dim;
    for (uint64_t i = 0; i < n; i++)
        assert_true(out[4 * n + i] == 0.0f);
    free(out);
    parts_free(&pt);
    fx_free(&fx);

    /* a batch made only of empty sequences, one with no pages at all */
    seq_spec_t empty[2] = {{0, 0, "F"}, {0, 2, "FT"}};
    fx_build(&fx, 16, 1, 64, 1, empty, 2, 301, 1.0f);
    parts_run(&fx, 3, &pt);
    for (uint64_t part = 0; part < pt.n; part++)
        assert_true(part_is_empty(&fx, &pt, part));
    out = merge_out(&fx, &pt);
    double *ref = reference_out(&fx);
    for (uint64_t i = 0; i < 2 * (uint64_t)fx.b.q_heads * 64; i++)
        assert_true(out[i] == 0.0f && ref[i] == 0.0);
    free(ref);
    free(out);
    parts_free(&pt);
    fx_free(&fx);
}

/* ---- token slots past seq_len are never read ----------------------------------------------- */
static void test_tail_slots_ignored(void **state)
{
    (void)state;
    const uint32_t T = 16;
    seq_spec_t spec[3] = {{T + 5, 0, "TF"}, {2 * T + 3, 0, "FT"}, {T + 1, 1, "FT"}};
    fx_t fx;
    fx_build(&fx, T, 2, 128, 4, spec, 3, 400, 1.0f);
    const uint32_t H = fx.b.q_heads, d = fx.g.head_dim;
    parts_t a, b;
    parts_run(&fx, 2, &a);
    double *ref_a = reference_out(&fx);

    /* overwrite every dead slot (and the whole trailing page) with huge keys and values: for
     * FP8 pages in place, for TQ3 pages in the FP8 source and then retier again */
    const uint32_t n = T * fx.g.kv_heads * d;
    float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
    uint32_t *sp = malloc(T * sizeof(uint32_t)), *si = malloc(T * sizeof(uint32_t));
    assert_true(k && v && sp && si);
    for (uint32_t i = 0; i < n; i++) {
        k[i] = 400.0f * rng_gauss(&fx.rng);
        v[i] = 1000.0f;
    }
    uint32_t j = 0; /* TQ3 phys counter, same order as fx_build */
    for (uint32_t s = 0; s < 3; s++) {
        for (uint32_t p = fx.indptr[s]; p < fx.indptr[s + 1]; p++) {
            uint64_t t0 = (uint64_t)(p - fx.indptr[s]) * T;
            uint32_t first = fx.len[s] > t0 ? (uint32_t)(fx.len[s] - t0) : 0, cnt = 0;
            for (uint32_t t = first; t < T; t++, cnt++) {
                sp[cnt] = fx.ids[p];
                si[cnt] = t;
            }
            kv_dir_entry_t e = fx.dir[fx.ids[p]];
            if (cnt) {
                /* kv_fp8_append wants the page mapped FP8: map its source page temporarily */
                fx.dir[fx.ids[p]] = kv_dir_make(fx.fp8_phys[p], KV_FMT_FP8, KV_DIR_VALID, 3);
                assert_int_equal(kv_fp8_append(&fx.g, &fx.pools, fx.dir, fx.dir_len, FX_LAYER, cnt,
                                               sp, si, k, v),
                                 KVK_OK);
                fx.dir[fx.ids[p]] = e;
            }
            if (fx.fmt[p] == 'T') {
                uint8_t *dst =
                    fx.pools.base[KV_FMT_TQ3] + (uint64_t)j * kv_page_bytes(&fx.g, KV_FMT_TQ3);
                assert_int_equal(kv_page_retier(&fx.g, fx_fp8_page(&fx, fx.fp8_phys[p]), dst),
                                 KVK_OK);
                j++;
            }
        }
    }
    parts_run(&fx, 2, &b);
    double *ref_b = reference_out(&fx);
    assert_memory_equal(a.m, b.m, (uint64_t)a.n * H * sizeof(float));
    assert_memory_equal(a.l, b.l, (uint64_t)a.n * H * sizeof(float));
    assert_memory_equal(a.o, b.o, (uint64_t)a.n * H * d * sizeof(float));
    assert_memory_equal(ref_a, ref_b, 3 * (uint64_t)H * d * sizeof(double));
    free(ref_b);
    free(ref_a);
    free(si);
    free(sp);
    free(v);
    free(k);
    parts_free(&b);
    parts_free(&a);
    fx_free(&fx);
}

/* ---- one token: softmax weight 1, output = that token's decoded value ----------------------- */
static void test_single_token_is_its_value(void **state)
{
    (void)state;
    const uint32_t T = 13, d = 256;
    seq_spec_t spec[2] = {{1, 0, "F"}, {1, 0, "T"}};
    fx_t fx;
    fx_build(&fx, T, 2, d, 6, spec, 2, 500, 1.0f);
    const uint32_t H = fx.b.q_heads, G = 6;
    parts_t pt;
    parts_run(&fx, 1, &pt);
    float *out = merge_out(&fx, &pt);
    float *blk = malloc((uint64_t)T * d * sizeof(float));
    assert_non_null(blk);
    for (uint32_t s = 0; s < 2; s++) {
        kv_dir_entry_t e = fx.dir[fx.ids[fx.indptr[s]]];
        kv_fmt_t f = kv_dir_fmt(e);
        assert_int_equal(f, s == 0 ? KV_FMT_FP8 : KV_FMT_TQ3);
        const uint8_t *page = fx.pools.base[f] + (uint64_t)kv_dir_phys(e) * kv_page_bytes(&fx.g, f);
        for (uint32_t kh = 0; kh < 2; kh++) {
            assert_int_equal(kv_page_decode_block(&fx.g, f, page, FX_LAYER, KV_KIND_V, kh, blk),
                             KVK_OK);
            for (uint32_t h = kh * G; h < (kh + 1) * G; h++) {
                double num = 0, den = 0;
                for (uint32_t i = 0; i < d; i++) {
                    double x = out[((uint64_t)s * H + h) * d + i], y = blk[i];
                    num += (x - y) * (x - y);
                    den += y * y;
                }
                /* FP8: identical floats; TQ3: Ō un-rotated once vs the decoder's own inverse
                 * rotation — same operation, float rounding only */
                assert_true(den > 0 && sqrt(num / den) <= 1e-6);
            }
        }
    }
    free(blk);
    free(out);
    parts_free(&pt);
    fx_free(&fx);
}

/* ---- merge on hand-made partitions ----------------------------------------------------------- */
/* Exact softmax over N scores cut into parts of random sizes (some empty): merge must give the
 * full softmax. Scores span ±600 so exp() of an unshifted score would overflow in double. */
static void test_merge_math(void **state)
{
    (void)state;
    enum { N = 40, D = 5, P = 7 };
    rng_t r = {.s = 600};
    for (int round = 0; round < 20; round++) {
        double sc[N], v[N][D], want[D] = {0}, l = 0, m = -INFINITY;
        double spread = round % 2 ? 600.0 : 3.0;
        for (int i = 0; i < N; i++) {
            sc[i] = spread * (2 * rng_unif(&r) - 1);
            m = sc[i] > m ? sc[i] : m;
            for (int k = 0; k < D; k++)
                v[i][k] = rng_gauss(&r);
        }
        for (int i = 0; i < N; i++) {
            l += exp(sc[i] - m);
            for (int k = 0; k < D; k++)
                want[k] += exp(sc[i] - m) * v[i][k];
        }
        /* random cut points; part j gets tokens [cut[j], cut[j+1]) */
        int cut[P + 1];
        cut[0] = 0;
        cut[P] = N;
        for (int j = 1; j < P; j++)
            cut[j] = (int)rng_below(&r, N + 1);
        for (int j = 1; j < P; j++) /* insertion sort */
            for (int i = j; i > 1 && cut[i - 1] > cut[i]; i--) {
                int t = cut[i];
                cut[i] = cut[i - 1];
                cut[i - 1] = t;
            }
        float pm[P], pl[P], po[P][D];
        for (int j = 0; j < P; j++) {
            double mj = -INFINITY, lj = 0, oj[D] = {0};
            for (int i = cut[j]; i < cut[j + 1]; i++)
                mj = sc[i] > mj ? sc[i] : mj;
            float mf = (float)mj;
            for (int i = cut[j]; i < cut[j + 1]; i++) {
                double w = exp(sc[i] - (double)mf);
                lj += w;
                for (int k = 0; k < D; k++)
                    oj[k] += w * v[i][k];
            }
            pm[j] = lj > 0 ? mf : -INFINITY;
            pl[j] = (float)lj;
            for (int k = 0; k < D; k++)
                po[j][k] = lj > 0 ? (float)(oj[k] / lj) : 0.0f;
        }
        float out[D];
        assert_int_equal(kv_attn_merge(1, P, 1, D, pm, pl, &po[0][0], out), KVK_OK);
        double num = 0, den = 0;
        for (int k = 0; k < D; k++) {
            assert_true(isfinite(out[k]));
            num += (out[k] - want[k] / l) * (out[k] - want[k] / l);
            den += (want[k] / l) * (want[k] / l);
        }
        /* float storage of Ō_j and l_j only: a few 2^-24 */
        assert_true(sqrt(num / den) <= 1e-6);
    }
}

static void test_merge_empty_and_extremes(void **state)
{
    (void)state;
    enum { D = 3 };
    /* batch 2, 3 parts, 2 heads: seq 0 all empty, seq 1 head 0 one live part, head 1 two live
     * parts far apart (e^{-1000} underflows to 0: weight exactly 0, no NaN) */
    float m[2 * 3 * 2], l[2 * 3 * 2], o[2 * 3 * 2 * D], out[2 * 2 * D];
    for (int i = 0; i < 12; i++) {
        m[i] = -INFINITY;
        l[i] = 0;
    }
    for (int i = 0; i < 12 * D; i++)
        o[i] = 0;
    /* seq 1, part 1, head 0 */
    m[(3 + 1) * 2 + 0] = 5;
    l[(3 + 1) * 2 + 0] = 2;
    for (int k = 0; k < D; k++)
        o[((3 + 1) * 2 + 0) * D + k] = (float)(k + 1);
    /* seq 1, part 0 and 2, head 1 */
    m[(3 + 0) * 2 + 1] = 1000;
    l[(3 + 0) * 2 + 1] = 1;
    m[(3 + 2) * 2 + 1] = -1000;
    l[(3 + 2) * 2 + 1] = 3;
    for (int k = 0; k < D; k++) {
        o[((3 + 0) * 2 + 1) * D + k] = -7.0f;
        o[((3 + 2) * 2 + 1) * D + k] = 1e30f;
    }
    for (int i = 0; i < 4 * D; i++)
        out[i] = NAN;
    assert_int_equal(kv_attn_merge(2, 3, 2, D, m, l, o, out), KVK_OK);
    for (int i = 0; i < 2 * D; i++)
        assert_true(out[i] == 0.0f); /* seq 0: all empty → zero */
    for (int k = 0; k < D; k++) {
        assert_true(out[(2 + 0) * D + k] == (float)(k + 1));
        assert_true(out[(2 + 1) * D + k] == -7.0f);
    }
}

static void test_merge_rejects_bad_args(void **state)
{
    (void)state;
    float m[2] = {0, 1}, l[2] = {1, 1}, o[2 * 4] = {0}, out[4];
    assert_int_equal(kv_attn_merge(1, 2, 1, 4, m, l, o, out), KVK_OK);
    assert_int_equal(kv_attn_merge(1, 0, 1, 4, m, l, o, out), KVK_EINVAL);
    assert_int_equal(kv_attn_merge(1, 2, 0, 4, m, l, o, out), KVK_EINVAL);
    assert_int_equal(kv_attn_merge(1, 2, 1, 0, m, l, o, out), KVK_EINVAL);
    assert_int_equal(kv_attn_merge(1, 2, 1, KV_MAX_HEAD_DIM + 1, m, l, o, out), KVK_EINVAL);
    assert_int_equal(kv_attn_merge(1, 2, 1, 4, NULL, l, o, out), KVK_EINVAL);
    assert_int_equal(kv_attn_merge(1, 2, 1, 4, m, NULL, o, out), KVK_EINVAL);
    assert_int_equal(kv_attn_merge(1, 2, 1, 4, m, l, NULL, out), KVK_EINVAL);
    assert_int_equal(kv_attn_merge(1, 2, 1, 4, m, l, o, NULL), KVK_EINVAL);
    /* broken partitions: NaN/+inf m, negative/NaN/inf l, live l with m = -inf */
    const float bad_m[] = {NAN, INFINITY, 0, 0, 0, -INFINITY};
    const float bad_l[] = {1, 1, -1, NAN, INFINITY, 1};
    for (size_t i = 0; i < sizeof(bad_m) / sizeof(bad_m[0]); i++) {
        float mm[2] = {0, bad_m[i]}, ll[2] = {1, bad_l[i]};
        assert_int_equal(kv_attn_merge(1, 2, 1, 4, mm, ll, o, out), KVK_EINVAL);
    }
}

/* ---- bad input to partial and reference ----------------------------------------------------- */
static void expect_einval(const fx_t *fx, const kv_geom_t *g, const kv_pools_t *pools,
                          const kv_dir_entry_t *dir, uint32_t dir_len, const kv_attn_batch_t *b,
                          const float *q, uint32_t splits, const char *what)
{
    const uint64_t n = (uint64_t)kv_attn_num_parts(fx->b.batch, 4) * 64 * fx->g.head_dim;
    float *buf = malloc(3 * n * sizeof(float));
    double *ref = malloc(n * sizeof(double));
    assert_true(buf && ref);
    for (uint64_t i = 0; i < 3 * n; i++)
        buf[i] = 12345.0f;
    int rc = kv_attn_partial(g, pools, dir, dir_len, b, q, splits, buf, buf + n, buf + 2 * n);
    if (rc != KVK_EINVAL)
        fail_msg("partial accepted bad input: %s (rc %d)", what, rc);
    for (uint64_t i = 0; i < 3 * n; i++) /* nothing written before the error */
        assert_true(buf[i] == 12345.0f);
    if (splits != 0) {
        rc = kv_attn_reference(g, pools, dir, dir_len, b, q, ref);
        if (rc != KVK_EINVAL)
            fail_msg("reference accepted bad input: %s (rc %d)", what, rc);
    }
    free(ref);
    free(buf);
}

static void test_partial_rejects_bad_input(void **state)
{
    (void)state;
    const uint32_t T = 13;
    seq_spec_t spec[3] = {{30, 0, "FT"}, {14, 0, "T"}, {5, 0, "F"}};
    fx_t fx;
    fx_build(&fx, T, 2, 64, 4, spec, 3, 700, 1.0f);
    const kv_geom_t *g = &fx.g;
    const kv_pools_t *P = &fx.pools;

    /* the fixture itself is valid */
    parts_t ok;
    parts_run(&fx, 4, &ok);
    parts_free(&ok);

    kv_geom_t gg = *g;
    gg.head_dim = 96;
    expect_einval(&fx, &gg, P, fx.dir, fx.dir_len, &fx.b, fx.q, 4, "head_dim 96");
    gg = *g;
    gg.page_tokens = 0;
    expect_einval(&fx, &gg, P, fx.dir, fx.dir_len, &fx.b, fx.q, 4, "page_tokens 0");
    expect_einval(&fx, NULL, P, fx.dir, fx.dir_len, &fx.b, fx.q, 4, "NULL geometry");
    expect_einval(&fx, g, NULL, fx.dir, fx.dir_len, &fx.b, fx.q, 4, "NULL pools");
    expect_einval(&fx, g, P, NULL, fx.dir_len, &fx.b, fx.q, 4, "NULL dir");
    expect_einval(&fx, g, P, fx.dir, fx.dir_len, NULL, fx.q, 4, "NULL batch");
    expect_einval(&fx, g, P, fx.dir, fx.dir_len, &fx.b, NULL, 4, "NULL q");
    expect_einval(&fx, g, P, fx.dir, fx.dir_len, &fx.b, fx.q, 0, "num_splits 0");

    kv_attn_batch_t b = fx.b;
    b.q_heads = 0;
    expect_einval(&fx, g, P, fx.dir, fx.dir_len, &b, fx.q, 4, "q_heads 0");
    b = fx.b;
    b.q_heads = 7; /* not a multiple of kv_heads = 2 */
    expect_einval(&fx, g, P, fx.dir, fx.dir_len, &b, fx.q, 4, "q_heads not multiple");
    b = fx.b;
    b.layer = FX_LAYERS;
    expect_einval(&fx, g, P, fx.dir, fx.dir_len, &b, fx.q, 4, "layer out of range");
    b = fx.b;
    b.sm_scale = NAN;
    expect_einval(&fx, g, P, fx.dir, fx.dir_len, &b, fx.q, 4, "NaN sm_scale");

    uint32_t len2[3] = {30, 14, T + 1}; /* seq 2 has one page of 13 tokens */
    b = fx.b;
    b.seq_len = len2;
    expect_einval(&fx, g, P, fx.dir, fx.dir_len, &b, fx.q, 4, "seq_len > pages*page_tokens");
    uint32_t ip2[4] = {0, 3, 2, 5}; /* not monotone */
    b = fx.b;
    b.page_indptr = ip2;
    expect_einval(&fx, g, P, fx.dir, fx.dir_len, &b, fx.q, 4, "page_indptr not monotone");
    b = fx.b;
    b.page_ids = NULL;
    expect_einval(&fx, g, P, fx.dir, fx.dir_len, &b, fx.q, 4, "NULL page_ids");
    b = fx.b;
    b.page_indptr = NULL;
    expect_einval(&fx, g, P, fx.dir, fx.dir_len, &b, fx.q, 4, "NULL page_indptr");

    /* page id ≥ dir_len */
    uint32_t *ids = malloc(fx.total * sizeof(uint32_t));
    assert_non_null(ids);
    memcpy(ids, fx.ids, fx.total * sizeof(uint32_t));
    ids[fx.total - 1] = fx.dir_len;
    b = fx.b;
    b.page_ids = ids;
    expect_einval(&fx, g, P, fx.dir, fx.dir_len, &b, fx.q, 4, "page id >= dir_len");
    /* an id that is a hole of the directory (never mapped) */
    uint32_t hole = 0;
    while (fx.dir[hole] != 0)
        hole++;
    ids[fx.total - 1] = hole;
    expect_einval(&fx, g, P, fx.dir, fx.dir_len, &b, fx.q, 4, "unmapped dir entry");
    free(ids);

    /* directory entries: not VALID, unknown format, phys out of its pool */
    const uint32_t victim = fx.ids[1];
    const kv_dir_entry_t saved = fx.dir[victim];
    const kv_dir_entry_t bad[] = {
        saved & ~((uint64_t)KV_DIR_VALID << 40),
        kv_dir_make(0, (kv_fmt_t)KV_FMT_COUNT, KV_DIR_VALID, 1),
        kv_dir_make(0, (kv_fmt_t)0x7f, KV_DIR_VALID, 1),
        kv_dir_make(P->pages[KV_FMT_TQ3], KV_FMT_TQ3, KV_DIR_VALID, 1),
        kv_dir_make(P->pages[KV_FMT_FP8], KV_FMT_FP8, KV_DIR_VALID, 1),
        kv_dir_make(UINT32_MAX, KV_FMT_FP8, KV_DIR_VALID, 1),
    };
    static const char *what[] = {"entry not VALID",      "format KV_FMT_COUNT",  "format 0x7f",
                                 "TQ3 phys out of pool", "FP8 phys out of pool", "phys ~0"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        fx.dir[victim] = bad[i];
        expect_einval(&fx, g, P, fx.dir, fx.dir_len, &fx.b, fx.q, 4, what[i]);
    }
    fx.dir[victim] = saved;

    /* a pool with no base, or a misaligned base */
    kv_pools_t pp = *P;
    pp.base[KV_FMT_TQ3] = NULL;
    expect_einval(&fx, g, &pp, fx.dir, fx.dir_len, &fx.b, fx.q, 4, "NULL pool base");
    pp = *P;
    pp.base[KV_FMT_FP8] += 4;
    expect_einval(&fx, g, &pp, fx.dir, fx.dir_len, &fx.b, fx.q, 4, "misaligned pool base");

    /* and, after all that, the fixture still works (nothing was left modified) */
    double worst = 0;
    parts_t pt;
    parts_run(&fx, 2, &pt);
    float *out = merge_out(&fx, &pt);
    double *ref = reference_out(&fx);
    for (uint32_t s = 0; s < 3; s++) {
        double e = seq_rel_err_ref(&fx, s, out, ref);
        worst = e > worst ? e : worst;
    }
    assert_true(worst <= TOL_REF);
    free(ref);
    free(out);
    parts_free(&pt);
    fx_free(&fx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_reference_grid),
        cmocka_unit_test(test_matches_reference_peaky),
        cmocka_unit_test(test_split_and_order_invariance),
        cmocka_unit_test(test_split_ranges),
        cmocka_unit_test(test_empty_partitions),
        cmocka_unit_test(test_tail_slots_ignored),
        cmocka_unit_test(test_single_token_is_its_value),
        cmocka_unit_test(test_merge_math),
        cmocka_unit_test(test_merge_empty_and_extremes),
        cmocka_unit_test(test_merge_rejects_bad_args),
        cmocka_unit_test(test_partial_rejects_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
