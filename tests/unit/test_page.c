/* test_page.c — FP8 append, retier FP8→TQ3, promote TQ3→FP8, block decode (cuda/page.c).
 *
 * Geometries: page_tokens 1, 7 (odd: TQ3 K blocks need code→metadata padding, TQ3 V blocks
 * carry the unowned high codes of the last token pair, which must be zero) and 16; every
 * head_dim; 2 layers × 3 KV heads so block offsets of every (layer, kind, head) are exercised.
 * The page functions are checked for EXACT agreement with the row codecs (which test_fp8 and
 * test_tq3 qualify), for zeroed padding, and for rejecting every invalid argument without
 * writing anything.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvkern.h"

static uint64_t rng_state;

static double rng_gauss(void)
{
    double a = ((double)(kv_splitmix64(rng_state++) >> 11) + 1.0) * 0x1p-53;
    double b = (double)(kv_splitmix64(rng_state++) >> 11) * 0x1p-53;
    return sqrt(-2.0 * log(a)) * cos(6.283185307179586 * b);
}

enum { NPHYS = 3, DIRLEN = 5 };

typedef struct fixture_s {
    kv_geom_t g;
    kv_pools_t pools;
    kv_dir_entry_t dir[DIRLEN];
    float *k, *v; /* [layers][NPHYS·T][heads][d] all tokens of all pages */
} fixture_t;

static const uint32_t test_tokens[] = {1, 7, 16};
static const uint32_t test_dims[] = {64, 128, 256};

/* Logical 0 → phys 2, 1 → phys 0, 2 → phys 1 (FP8); 3 unmapped; 4 mapped TQ3. */
static void fixture_init(fixture_t *f, uint32_t d, uint32_t T)
{
    memset(f, 0, sizeof *f);
    f->g = (kv_geom_t){.layers = 2, .kv_heads = 3, .head_dim = d, .page_tokens = T, .seed = 99};
    uint64_t pb = kv_page_bytes(&f->g, KV_FMT_FP8);
    f->pools.base[KV_FMT_FP8] = malloc(pb * NPHYS);
    f->pools.pages[KV_FMT_FP8] = NPHYS;
    f->pools.base[KV_FMT_TQ3] = malloc(kv_page_bytes(&f->g, KV_FMT_TQ3));
    f->pools.pages[KV_FMT_TQ3] = 1;
    assert_non_null(f->pools.base[KV_FMT_FP8]);
    memset(f->pools.base[KV_FMT_FP8], 0xCD, pb * NPHYS); /* garbage: padding must be zeroed */
    f->dir[0] = kv_dir_make(2, KV_FMT_FP8, KV_DIR_VALID, 1);
    f->dir[1] = kv_dir_make(0, KV_FMT_FP8, KV_DIR_VALID, 1);
    f->dir[2] = kv_dir_make(1, KV_FMT_FP8, KV_DIR_VALID, 1);
    f->dir[3] = 0;
    f->dir[4] = kv_dir_make(0, KV_FMT_TQ3, KV_DIR_VALID, 1);
    uint64_t n = (uint64_t)f->g.layers * NPHYS * T * f->g.kv_heads * d;
    f->k = malloc(n * sizeof(float));
    f->v = malloc(n * sizeof(float));
    for (uint64_t i = 0; i < n; i++) {
        f->k[i] = (float)rng_gauss();
        f->v[i] = (float)rng_gauss() * 0.5f;
    }
}

static void fixture_free(fixture_t *f)
{
    free(f->pools.base[KV_FMT_FP8]);
    free(f->pools.base[KV_FMT_TQ3]);
    free(f->k);
    free(f->v);
}

static uint8_t *phys_page(const fixture_t *f, uint32_t phys)
{
    return f->pools.base[KV_FMT_FP8] + (uint64_t)phys * kv_page_bytes(&f->g, KV_FMT_FP8);
}

/* Row of token `tok` (0 … NPHYS·T−1) of layer l, head h. */
static const float *src_row(const fixture_t *f, const float *base, uint32_t l, uint32_t tok,
                            uint32_t h)
{
    uint64_t per_tok = (uint64_t)f->g.kv_heads * f->g.head_dim;
    return base + ((uint64_t)l * NPHYS * f->g.page_tokens + tok) * per_tok +
           (uint64_t)h * f->g.head_dim;
}

/* Append every token of logical pages 0..2, one layer per call, slots in a scrambled order
 * (token tok → logical page tok / T, slot (tok·5 + 3) mod T, which is a bijection when T ∤ 5,
 * and for T = 1 is the identity). */
static void fixture_fill(fixture_t *f)
{
    uint32_t T = f->g.page_tokens, n = NPHYS * T;
    uint32_t *sp = malloc(n * sizeof *sp), *si = malloc(n * sizeof *si);
    float *kk = malloc((size_t)n * f->g.kv_heads * f->g.head_dim * sizeof(float));
    float *vv = malloc((size_t)n * f->g.kv_heads * f->g.head_dim * sizeof(float));
    for (uint32_t l = 0; l < f->g.layers; l++) {
        for (uint32_t t = 0; t < n; t++) {
            sp[t] = t / T;
            si[t] = t % T;
        }
        /* hand tokens in a shuffled order: reverse */
        uint64_t row = (uint64_t)f->g.kv_heads * f->g.head_dim;
        uint32_t *sp2 = malloc(n * sizeof *sp2), *si2 = malloc(n * sizeof *si2);
        for (uint32_t t = 0; t < n; t++) {
            uint32_t src = n - 1 - t;
            sp2[t] = sp[src];
            si2[t] = (si[src] * 5 + 3) % T;
            memcpy(kk + t * row, src_row(f, f->k, l, src, 0), row * sizeof(float));
            memcpy(vv + t * row, src_row(f, f->v, l, src, 0), row * sizeof(float));
        }
        assert_int_equal(kv_fp8_append(&f->g, &f->pools, f->dir, DIRLEN, l, n, sp2, si2, kk, vv),
                         KVK_OK);
        free(sp2);
        free(si2);
    }
    free(sp);
    free(si);
    free(kk);
    free(vv);
}

/* Source token stored at (logical page p, slot s) by fixture_fill. */
static uint32_t token_at(uint32_t T, uint32_t p, uint32_t s)
{
    for (uint32_t tok = p * T; tok < (p + 1) * T; tok++) {
        if ((tok % T * 5 + 3) % T == s)
            return tok;
    }
    fail_msg("no token at page %u slot %u", p, s);
    return 0;
}

static void assert_padding_zero(const kv_geom_t *g, kv_fmt_t fmt, const uint8_t *page)
{
    for (uint32_t l = 0; l < g->layers; l++) {
        for (int kind = KV_KIND_K; kind <= KV_KIND_V; kind++) {
            for (uint32_t h = 0; h < g->kv_heads; h++) {
                const uint8_t *b = page + kv_block_offset(g, fmt, l, kind, h);
                uint64_t code_end = kv_block_code_bytes(g, fmt, kind);
                uint64_t meta = kv_block_meta_offset(g, fmt, kind);
                uint64_t meta_end = meta + kv_block_meta_bytes(g, fmt, kind);
                for (uint64_t i = code_end; i < meta; i++)
                    assert_int_equal(b[i], 0);
                for (uint64_t i = meta_end; i < kv_block_bytes(g, fmt, kind); i++)
                    assert_int_equal(b[i], 0);
                /* TQ3 V, T odd: the high codes of the last token pair belong to no token */
                if (fmt == KV_FMT_TQ3 && kind == KV_KIND_V && g->page_tokens % 2) {
                    const uint32_t *w = (const uint32_t *)(const void *)b; /* 16-aligned */
                    for (uint32_t i = 0; i < g->head_dim; i++)
                        assert_int_equal(kv_tq3_get(w, kind, g->head_dim, g->page_tokens, i), 0);
                }
            }
        }
    }
    for (uint64_t i = (uint64_t)g->layers * kv_layer_bytes(g, fmt); i < kv_page_bytes(g, fmt); i++)
        assert_int_equal(page[i], 0);
}

static void test_page_append_decode(void **state)
{
    (void)state;
    rng_state = 1;
    for (size_t a = 0; a < 3; a++) {
        for (size_t b = 0; b < 3; b++) {
            fixture_t f;
            uint32_t d = test_dims[b], T = test_tokens[a];
            fixture_init(&f, d, T);
            fixture_fill(&f);
            float *out = malloc((size_t)T * d * sizeof(float)), want[256];
            uint8_t code[256];
            for (uint32_t p = 0; p < NPHYS; p++) {
                const uint8_t *page = phys_page(&f, kv_dir_phys(f.dir[p]));
                assert_padding_zero(&f.g, KV_FMT_FP8, page);
                for (uint32_t l = 0; l < f.g.layers; l++) {
                    for (int kind = 0; kind <= 1; kind++) {
                        for (uint32_t h = 0; h < f.g.kv_heads; h++) {
                            assert_int_equal(
                                kv_page_decode_block(&f.g, KV_FMT_FP8, page, l, kind, h, out),
                                KVK_OK);
                            const uint8_t *blk =
                                page + kv_block_offset(&f.g, KV_FMT_FP8, l, kind, h);
                            for (uint32_t s = 0; s < T; s++) {
                                const float *x =
                                    src_row(&f, kind ? f.v : f.k, l, token_at(T, p, s), h);
                                float sc, stored;
                                kv_fp8_encode_row(d, x, code, &sc);
                                kv_fp8_decode_row(d, code, sc, want);
                                assert_memory_equal(out + (uint64_t)s * d, want, d * sizeof(float));
                                /* raw layout: codes row s, then scale[s] at the meta offset */
                                assert_memory_equal(blk + (uint64_t)s * d, code, d);
                                uint64_t mo = kv_block_meta_offset(&f.g, KV_FMT_FP8, kind);
                                memcpy(&stored, blk + mo + 4 * s, 4);
                                assert_true(stored == sc);
                            }
                        }
                    }
                }
            }
            free(out);
            fixture_free(&f);
        }
    }
}

static void test_page_retier_promote(void **state)
{
    (void)state;
    rng_state = 2;
    for (size_t a = 0; a < 3; a++) {
        for (size_t b = 0; b < 3; b++) {
            fixture_t f;
            uint32_t d = test_dims[b], T = test_tokens[a];
            fixture_init(&f, d, T);
            fixture_fill(&f);
            const kv_geom_t *g = &f.g;
            const uint8_t *fp8 = phys_page(&f, kv_dir_phys(f.dir[1]));
            uint64_t tb = kv_page_bytes(g, KV_FMT_TQ3), fb = kv_page_bytes(g, KV_FMT_FP8);
            uint8_t *tq3 = malloc(tb), *tq3b = malloc(tb), *back = malloc(fb);
            memset(tq3, 0xEE, tb);
            assert_int_equal(kv_page_retier(g, fp8, tq3), KVK_OK);
            assert_padding_zero(g, KV_FMT_TQ3, tq3);
            assert_int_equal(kv_page_retier(g, fp8, tq3b), KVK_OK);
            assert_memory_equal(tq3, tq3b, tb); /* deterministic bytes */
            memset(back, 0x77, fb);
            assert_int_equal(kv_page_promote(g, tq3, back), KVK_OK);
            assert_padding_zero(g, KV_FMT_FP8, back);

            float *x8 = malloc((size_t)T * d * 4), *x3 = malloc((size_t)T * d * 4);
            float *xb = malloc((size_t)T * d * 4), want[256];
            uint8_t codes[256];
            uint16_t m0, m1;
            double pe = 0, pt = 0;
            for (uint32_t l = 0; l < g->layers; l++) {
                for (int kind = 0; kind <= 1; kind++) {
                    for (uint32_t h = 0; h < g->kv_heads; h++) {
                        kv_page_decode_block(g, KV_FMT_FP8, fp8, l, kind, h, x8);
                        kv_page_decode_block(g, KV_FMT_TQ3, tq3, l, kind, h, x3);
                        kv_page_decode_block(g, KV_FMT_FP8, back, l, kind, h, xb);
                        for (uint32_t s = 0; s < T; s++) {
                            /* retier = TQ3 row codec applied to the FP8 row as its codes
                             * (exact e4m3 values) and its scale */
                            const uint8_t *fb8 = fp8 + kv_block_offset(g, KV_FMT_FP8, l, kind, h);
                            float r8[256], s8;
                            for (uint32_t i = 0; i < d; i++)
                                r8[i] = kv_fp8_to_float(fb8[(uint64_t)s * d + i]);
                            memcpy(&s8,
                                   fb8 + kv_block_meta_offset(g, KV_FMT_FP8, KV_KIND_K) + 4 * s,
                                   4);
                            if (kind == KV_KIND_K) {
                                kv_tq3_encode_key_scaled(g->seed, d, r8, s8, codes, &m0);
                                kv_tq3_decode_key(g->seed, d, codes, m0, want);
                            } else {
                                kv_tq3_encode_value_scaled(g->seed, d, r8, s8, codes, &m0, &m1);
                                kv_tq3_decode_value(g->seed, d, codes, m0, m1, want);
                            }
                            assert_memory_equal(x3 + (uint64_t)s * d, want, d * sizeof(float));
                            /* raw layout: the row's codes where kv_tq3_get says, metadata at
                             * the kind's meta offset (V: scale[T] then zero[T]) */
                            const uint8_t *blk =
                                tq3 + kv_block_offset(g, KV_FMT_TQ3, l, kind, h);
                            const uint32_t *w = (const uint32_t *)(const void *)blk;
                            for (uint32_t i = 0; i < d; i++)
                                assert_int_equal(kv_tq3_get(w, kind, d, s, i), codes[i]);
                            uint64_t mo = kv_block_meta_offset(g, KV_FMT_TQ3, kind);
                            uint16_t st;
                            memcpy(&st, blk + mo + 2 * s, 2);
                            assert_int_equal(st, m0);
                            if (kind == KV_KIND_V) {
                                memcpy(&st, blk + mo + 2 * ((uint64_t)T + s), 2);
                                assert_int_equal(st, m1);
                            }
                            /* promote: FP8 of the TQ3-decoded row; per element the e4m3 error
                             * is ≤ 2^-4 relative (half of the 2^-3 step) plus the subnormal
                             * floor 2^-10·scale, scale = amax/448. */
                            const float *r3 = x3 + (uint64_t)s * d, *rb = xb + (uint64_t)s * d;
                            float amax = 0;
                            for (uint32_t i = 0; i < d; i++)
                                amax = fmaxf(amax, fabsf(r3[i]));
                            for (uint32_t i = 0; i < d; i++) {
                                float tol = fabsf(r3[i]) * 0.0625f + amax / 448.0f * 0x1p-10f;
                                assert_true(fabsf(rb[i] - r3[i]) <= tol * 1.0001f + 1e-30f);
                                pe += ((double)rb[i] - r3[i]) * ((double)rb[i] - r3[i]);
                                pt += (double)r3[i] * r3[i];
                            }
                        }
                    }
                }
            }
            assert_true(pe / pt < 1e-3); /* the FP8 row bound of test_fp8 */
            free(x8);
            free(x3);
            free(xb);
            free(tq3);
            free(tq3b);
            free(back);
            fixture_free(&f);
        }
    }
}

/* Retier quality on a whole page against the original FP8 values: 16 tokens × 4 heads × 4
 * layers = 256 rows per kind. Bounds are the row bounds of test_tq3 (K 0.038, V 0.05 / 0.06 at
 * d = 256) plus 10% for the sampling spread of 256 rows (the per-row NMSE has a relative sd of
 * ~0.15, so the mean over 256 rows has ~1%). */
static void test_page_retier_quality(void **state)
{
    (void)state;
    rng_state = 3;
    for (size_t b = 0; b < 3; b++) {
        uint32_t d = test_dims[b];
        kv_geom_t g = {.layers = 4, .kv_heads = 4, .head_dim = d, .page_tokens = 16, .seed = 5};
        uint8_t *fp8 = calloc(1, kv_page_bytes(&g, KV_FMT_FP8));
        uint8_t *tq3 = calloc(1, kv_page_bytes(&g, KV_FMT_TQ3));
        kv_pools_t pools = {.base = {fp8, NULL}, .pages = {1, 0}};
        kv_dir_entry_t dir[1] = {kv_dir_make(0, KV_FMT_FP8, KV_DIR_VALID, 0)};
        uint32_t n = g.page_tokens, sp[16], si[16];
        float *k = malloc((size_t)n * g.kv_heads * d * 4),
              *v = malloc((size_t)n * g.kv_heads * d * 4);
        for (uint32_t l = 0; l < g.layers; l++) {
            for (uint32_t t = 0; t < n; t++) {
                sp[t] = 0;
                si[t] = t;
            }
            for (uint64_t i = 0; i < (uint64_t)n * g.kv_heads * d; i++) {
                k[i] = (float)rng_gauss();
                v[i] = (float)rng_gauss();
            }
            assert_int_equal(kv_fp8_append(&g, &pools, dir, 1, l, n, sp, si, k, v), KVK_OK);
        }
        assert_int_equal(kv_page_retier(&g, fp8, tq3), KVK_OK);
        float *a = malloc((size_t)n * d * 4), *c = malloc((size_t)n * d * 4);
        double e[2] = {0, 0}, t[2] = {0, 0};
        for (uint32_t l = 0; l < g.layers; l++)
            for (int kind = 0; kind <= 1; kind++)
                for (uint32_t h = 0; h < g.kv_heads; h++) {
                    kv_page_decode_block(&g, KV_FMT_FP8, fp8, l, kind, h, a);
                    kv_page_decode_block(&g, KV_FMT_TQ3, tq3, l, kind, h, c);
                    for (uint64_t i = 0; i < (uint64_t)n * d; i++) {
                        e[kind] += ((double)a[i] - c[i]) * ((double)a[i] - c[i]);
                        t[kind] += (double)a[i] * a[i];
                    }
                }
        print_message("d=%u retier NMSE vs FP8: K %.4f V %.4f\n", d, e[0] / t[0], e[1] / t[1]);
        assert_true(e[0] / t[0] <= 0.038 * 1.1);
        assert_true(e[1] / t[1] <= (d <= 128 ? 0.05 : 0.06) * 1.1);
        free(a);
        free(c);
        free(k);
        free(v);
        free(fp8);
        free(tq3);
    }
}

/* Block sizes of layout 2, worked by hand from kv_format.h (a unit = 12 bytes; K: T·d/32 units,
 * V: ⌈T/2⌉·d/16 units; metadata 16-aligned after the codes, block 16-aligned):
 *   d  T   K codes  K meta@  K block   V codes  V meta@  V block
 *   64 1      24       32      48        48       48       64    (V pays for a missing partner)
 *   64 7     168      176     192       192      192      224
 *  128 16    768      768     800       768      768      832    (page ×4 layers ×8 heads: 52224)
 *  256 1      96       96     112       192      192      208                                   */
static void test_page_block_sizes(void **state)
{
    (void)state;
    static const uint32_t want[][8] = {
        {64, 1, 24, 32, 48, 48, 48, 64},
        {64, 7, 168, 176, 192, 192, 192, 224},
        {128, 16, 768, 768, 800, 768, 768, 832},
        {256, 1, 96, 96, 112, 192, 192, 208},
    };
    for (size_t r = 0; r < sizeof want / sizeof want[0]; r++) {
        kv_geom_t g = {.layers = 4, .kv_heads = 8, .head_dim = want[r][0],
                       .page_tokens = want[r][1], .seed = 1};
        for (int kind = KV_KIND_K; kind <= KV_KIND_V; kind++) {
            const uint32_t *w = want[r] + 2 + 3 * kind;
            assert_int_equal(kv_block_code_bytes(&g, KV_FMT_TQ3, kind), w[0]);
            assert_int_equal(kv_block_meta_offset(&g, KV_FMT_TQ3, kind), w[1]);
            assert_int_equal(kv_block_bytes(&g, KV_FMT_TQ3, kind), w[2]);
            /* FP8 does not depend on the kind */
            assert_int_equal(kv_block_code_bytes(&g, KV_FMT_FP8, kind),
                             (uint64_t)want[r][0] * want[r][1]);
        }
    }
    kv_geom_t g = {.layers = 4, .kv_heads = 8, .head_dim = 128, .page_tokens = 16, .seed = 1};
    assert_int_equal(kv_page_bytes(&g, KV_FMT_TQ3), 52224);
    assert_int_equal(kv_page_bytes(&g, KV_FMT_FP8), 135168);
}

static void test_page_invalid_args(void **state)
{
    (void)state;
    rng_state = 4;
    fixture_t f;
    fixture_init(&f, 64, 7);
    const kv_geom_t *g = &f.g;
    uint64_t pool_bytes = kv_page_bytes(g, KV_FMT_FP8) * NPHYS;
    uint8_t *snap = malloc(pool_bytes);
    memcpy(snap, f.pools.base[KV_FMT_FP8], pool_bytes);
    /* two tokens: the first valid, the second varied; nothing may be written on rejection */
    uint32_t sp[2] = {0, 1}, si[2] = {0, 6};
    const float *k = f.k, *v = f.v;
#define APPEND(G, P, D, DL, L) kv_fp8_append(G, P, D, DL, L, 2, sp, si, k, v)
    kv_geom_t bad = *g;
    bad.head_dim = 96;
    assert_int_equal(APPEND(&bad, &f.pools, f.dir, DIRLEN, 0), KVK_EINVAL);
    bad = *g;
    bad.page_tokens = 0;
    assert_int_equal(APPEND(&bad, &f.pools, f.dir, DIRLEN, 0), KVK_EINVAL);
    assert_int_equal(APPEND(NULL, &f.pools, f.dir, DIRLEN, 0), KVK_EINVAL);
    assert_int_equal(APPEND(g, NULL, f.dir, DIRLEN, 0), KVK_EINVAL);
    assert_int_equal(APPEND(g, &f.pools, NULL, DIRLEN, 0), KVK_EINVAL);
    assert_int_equal(APPEND(g, &f.pools, f.dir, DIRLEN, 2), KVK_EINVAL); /* layer */
    si[1] = 7;                                                           /* slot ≥ page_tokens */
    assert_int_equal(APPEND(g, &f.pools, f.dir, DIRLEN, 0), KVK_EINVAL);
    si[1] = 6;
    sp[1] = DIRLEN; /* logical id ≥ dir_len */
    assert_int_equal(APPEND(g, &f.pools, f.dir, DIRLEN, 0), KVK_EINVAL);
    sp[1] = 1;
    assert_int_equal(APPEND(g, &f.pools, f.dir, 1, 0), KVK_EINVAL); /* dir_len cuts id 1 */
    sp[1] = 3;                                                      /* unmapped entry */
    assert_int_equal(APPEND(g, &f.pools, f.dir, DIRLEN, 0), KVK_EINVAL);
    sp[1] = 4; /* mapped TQ3 */
    assert_int_equal(APPEND(g, &f.pools, f.dir, DIRLEN, 0), KVK_EINVAL);
    sp[1] = 1;
    f.dir[1] = kv_dir_make(0, KV_FMT_FP8, KV_DIR_VALID | KV_DIR_SEALED, 2); /* immutable */
    assert_int_equal(APPEND(g, &f.pools, f.dir, DIRLEN, 0), KVK_EINVAL);
    f.dir[1] = kv_dir_make(NPHYS, KV_FMT_FP8, KV_DIR_VALID, 2); /* phys out of the pool */
    assert_int_equal(APPEND(g, &f.pools, f.dir, DIRLEN, 0), KVK_EINVAL);
    f.dir[1] = kv_dir_make(0, KV_FMT_FP8, KV_DIR_VALID, 2);
    assert_int_equal(kv_fp8_append(g, &f.pools, f.dir, DIRLEN, 0, 2, NULL, si, k, v), KVK_EINVAL);
    assert_int_equal(kv_fp8_append(g, &f.pools, f.dir, DIRLEN, 0, 2, sp, NULL, k, v), KVK_EINVAL);
    assert_int_equal(kv_fp8_append(g, &f.pools, f.dir, DIRLEN, 0, 2, sp, si, NULL, v), KVK_EINVAL);
    assert_int_equal(kv_fp8_append(g, &f.pools, f.dir, DIRLEN, 0, 2, sp, si, k, NULL), KVK_EINVAL);
    assert_memory_equal(f.pools.base[KV_FMT_FP8], snap, pool_bytes);
    /* zero tokens is a valid no-op; then the good call succeeds */
    assert_int_equal(kv_fp8_append(g, &f.pools, f.dir, DIRLEN, 0, 0, NULL, NULL, NULL, NULL),
                     KVK_OK);
    assert_int_equal(APPEND(g, &f.pools, f.dir, DIRLEN, 1), KVK_OK);
#undef APPEND

    uint8_t *p8 = phys_page(&f, 0), *p3 = f.pools.base[KV_FMT_TQ3];
    float out[7 * 64];
    kv_geom_t bg = *g;
    bg.layers = 0;
    assert_int_equal(kv_page_retier(&bg, p8, p3), KVK_EINVAL);
    assert_int_equal(kv_page_retier(g, NULL, p3), KVK_EINVAL);
    assert_int_equal(kv_page_retier(g, p8, NULL), KVK_EINVAL);
    assert_int_equal(kv_page_retier(g, p8, p8), KVK_EINVAL);
    assert_int_equal(kv_page_promote(&bg, p3, p8), KVK_EINVAL);
    assert_int_equal(kv_page_promote(g, NULL, p8), KVK_EINVAL);
    assert_int_equal(kv_page_promote(g, p3, NULL), KVK_EINVAL);
    assert_int_equal(kv_page_decode_block(&bg, KV_FMT_FP8, p8, 0, 0, 0, out), KVK_EINVAL);
    assert_int_equal(kv_page_decode_block(g, KV_FMT_COUNT, p8, 0, 0, 0, out), KVK_EINVAL);
    assert_int_equal(kv_page_decode_block(g, KV_FMT_FP8, NULL, 0, 0, 0, out), KVK_EINVAL);
    assert_int_equal(kv_page_decode_block(g, KV_FMT_FP8, p8, 2, 0, 0, out), KVK_EINVAL);
    assert_int_equal(kv_page_decode_block(g, KV_FMT_FP8, p8, 0, 2, 0, out), KVK_EINVAL);
    assert_int_equal(kv_page_decode_block(g, KV_FMT_FP8, p8, 0, -1, 0, out), KVK_EINVAL);
    assert_int_equal(kv_page_decode_block(g, KV_FMT_FP8, p8, 0, 0, 3, out), KVK_EINVAL);
    assert_int_equal(kv_page_decode_block(g, KV_FMT_FP8, p8, 0, 0, 0, NULL), KVK_EINVAL);
    assert_int_equal(kv_page_decode_block(g, KV_FMT_FP8, p8, 1, 1, 2, out), KVK_OK);
    free(snap);
    fixture_free(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_page_append_decode),
        cmocka_unit_test(test_page_retier_promote),
        cmocka_unit_test(test_page_retier_quality),
        cmocka_unit_test(test_page_block_sizes),
        cmocka_unit_test(test_page_invalid_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
