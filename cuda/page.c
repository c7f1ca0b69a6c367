/* page.c — whole-page operations on the FP8 and TQ3 layouts (CPU twins of the append,
 * retier and promote kernels, and a block decoder for tests and the host backend).
 *
 * All addressing goes through kv_block_offset / kv_block_meta_offset of kv_format.h; nothing
 * here knows a layout the header does not state. Per block (layer, kind, head):
 *
 *   FP8      [ code[T][d] u8 ][ scale[T] f32 ][ pad → 16 ]
 *   TQ3 K    [ unit[T][d/32][3] u32 ][ pad → 16 ][ norm[T] f16 ][ pad → 16 ]
 *   TQ3 V    [ unit[⌈T/2⌉][d/16][3] u32 ][ pad → 16 ][ scale[T] f16 ][ zero[T] f16 ][ pad → 16 ]
 *   page     [ blocks of layer 0 … layer L-1 ][ pad → 256 ]
 *
 * TQ3 codes (layout 2): a token's codes are spread over a contiguous run of UNITS — K: d/32
 * units of its own at t·(d/32); V: d/16 units at (t/2)·(d/16) that it SHARES with its partner
 * token t^1 (it owns the low or the high half of every pair). A row is therefore read and
 * written as that run of units: copied into an aligned local, each code placed with kv_tq3_set
 * (kv_tq3_get on reads) at the token's index inside the run (K: 0, V: t%2), copied back. The
 * write is read-modify-write, so the partner's half is preserved; with page_tokens odd the
 * high half of the last V pair belongs to no token and stays zero (the target page is zeroed).
 *
 * Padding is always written as zero, so a page's bytes are a pure function of its contents
 * (snapshot CRCs and page-equality tests rely on it): retier and promote clear the whole target
 * page first; append clears the tail padding of every block it writes and the page's tail.
 * Metadata is written with memcpy: T·d code bytes keep the f32 scales 4-aligned, but a
 * caller's page pointer need not be, and memcpy costs nothing where it is.
 *
 * Append validates every argument and every token BEFORE writing anything, so a rejected call
 * leaves the pools untouched. A SEALED page is immutable (kv_format.h) and is rejected too.
 */
#include "kvkern.h"

#include <string.h>

static uint8_t *fp8_page_ptr(const kv_geom_t *g, const kv_pools_t *pools, uint32_t phys)
{
    return pools->base[KV_FMT_FP8] + (uint64_t)phys * kv_page_bytes(g, KV_FMT_FP8);
}

/* Zero the bytes between the end of a block's metadata and the end of the block. */
static void block_tail_zero(const kv_geom_t *g, kv_fmt_t f, int kind, uint8_t *blk)
{
    uint64_t end = kv_block_meta_offset(g, f, kind) + kv_block_meta_bytes(g, f, kind);
    memset(blk + end, 0, (size_t)(kv_block_bytes(g, f, kind) - end));
}

static void page_tail_zero(const kv_geom_t *g, kv_fmt_t f, uint8_t *page)
{
    uint64_t used = (uint64_t)g->layers * kv_layer_bytes(g, f);
    memset(page + used, 0, (size_t)(kv_page_bytes(g, f) - used));
}

/* FP8 row t of block blk: encode x and store codes and scale. */
static void fp8_block_put(const kv_geom_t *g, uint8_t *blk, uint32_t t, const float *x)
{
    uint64_t d = g->head_dim;
    float s;
    kv_fp8_encode_row(g->head_dim, x, blk + t * d, &s);
    uint64_t meta = kv_block_meta_offset(g, KV_FMT_FP8, KV_KIND_K); /* the same for K and V */
    memcpy(blk + meta + (uint64_t)t * sizeof(float), &s, sizeof s);
}

/* FP8 row t as its decoded codes (exact e4m3 values) in x; returns the row's scale. */
static float fp8_block_codes(const kv_geom_t *g, const uint8_t *blk, uint32_t t, float *x)
{
    uint64_t d = g->head_dim;
    float s;
    uint64_t meta = kv_block_meta_offset(g, KV_FMT_FP8, KV_KIND_K); /* the same for K and V */
    memcpy(&s, blk + meta + (uint64_t)t * sizeof(float), sizeof s);
    for (uint64_t i = 0; i < d; i++)
        x[i] = kv_fp8_to_float(blk[t * d + i]);
    return s;
}

/* FP8 row t decoded: codes × scale, kv_fp8_decode_row's product. */
static void fp8_block_get(const kv_geom_t *g, const uint8_t *blk, uint32_t t, float *x)
{
    float s = fp8_block_codes(g, blk, t, x);
    for (uint32_t i = 0; i < g->head_dim; i++)
        x[i] *= s;
}

/* The run of units holding token t's codes in a TQ3 block of kind: first unit, unit count and
 * the token's index inside the run (what kv_tq3_get/set see as t when given the run). */
typedef struct tq3_run_s {
    uint64_t first;
    uint32_t units;
    uint32_t t;
} tq3_run_t;

static tq3_run_t tq3_run(const kv_geom_t *g, int kind, uint32_t t)
{
    tq3_run_t r;
    if (kind == KV_KIND_K) {
        r.units = g->head_dim / 32;
        r.first = (uint64_t)t * r.units;
        r.t = 0;
    } else {
        r.units = g->head_dim / 16;
        r.first = (uint64_t)(t / 2) * r.units;
        r.t = t % 2;
    }
    return r;
}

#define TQ3_RUN_MAX_WORDS (KV_MAX_HEAD_DIM / 16 * KV_TQ3_UNIT_WORDS)

/* Units and FP16 metadata are copied through aligned locals (see the note above). */
/* TQ3 row t of block blk: encode the row s·x (retier passes an FP8 row's codes and scale). */
static void tq3_block_put(const kv_geom_t *g, int kind, uint8_t *blk, uint32_t t, const float *x,
                          float s)
{
    uint32_t words[TQ3_RUN_MAX_WORDS];
    uint8_t codes[KV_MAX_HEAD_DIM];
    uint64_t meta = kv_block_meta_offset(g, KV_FMT_TQ3, kind);
    tq3_run_t r = tq3_run(g, kind, t);
    uint64_t at = r.first * KV_TQ3_UNIT_WORDS * sizeof(uint32_t);
    size_t len = (size_t)r.units * KV_TQ3_UNIT_WORDS * sizeof(uint32_t);
    uint16_t a, b;
    if (kind == KV_KIND_K) {
        kv_tq3_encode_key_scaled(g->seed, g->head_dim, x, s, codes, &a);
        memcpy(blk + meta + (uint64_t)t * 2, &a, 2);
    } else {
        kv_tq3_encode_value_scaled(g->seed, g->head_dim, x, s, codes, &a, &b);
        memcpy(blk + meta + (uint64_t)t * 2, &a, 2);
        memcpy(blk + meta + (uint64_t)g->page_tokens * 2 + (uint64_t)t * 2, &b, 2);
    }
    memcpy(words, blk + at, len);
    for (uint32_t i = 0; i < g->head_dim; i++)
        kv_tq3_set(words, kind, g->head_dim, r.t, i, codes[i]);
    memcpy(blk + at, words, len);
}

/* TQ3 row t of block blk as one code byte per coordinate and its FP16 metadata (K: m[0] = γ;
 * V: m[0] = scale, m[1] = zero). */
static void tq3_block_row(const kv_geom_t *g, int kind, const uint8_t *blk, uint32_t t,
                          uint8_t *codes, uint16_t m[2])
{
    uint32_t words[TQ3_RUN_MAX_WORDS];
    uint64_t meta = kv_block_meta_offset(g, KV_FMT_TQ3, kind);
    tq3_run_t r = tq3_run(g, kind, t);
    memcpy(words, blk + r.first * KV_TQ3_UNIT_WORDS * sizeof(uint32_t),
           (size_t)r.units * KV_TQ3_UNIT_WORDS * sizeof(uint32_t));
    for (uint32_t i = 0; i < g->head_dim; i++)
        codes[i] = (uint8_t)kv_tq3_get(words, kind, g->head_dim, r.t, i);
    memcpy(&m[0], blk + meta + (uint64_t)t * 2, 2);
    m[1] = 0;
    if (kind == KV_KIND_V)
        memcpy(&m[1], blk + meta + (uint64_t)g->page_tokens * 2 + (uint64_t)t * 2, 2);
}

static void tq3_block_get(const kv_geom_t *g, int kind, const uint8_t *blk, uint32_t t, float *x)
{
    uint8_t codes[KV_MAX_HEAD_DIM];
    uint16_t m[2];
    tq3_block_row(g, kind, blk, t, codes, m);
    if (kind == KV_KIND_K)
        kv_tq3_decode_key(g->seed, g->head_dim, codes, m[0], x);
    else
        kv_tq3_decode_value(g->seed, g->head_dim, codes, m[0], m[1], x);
}

/* Promote row t of TQ3 block sb into FP8 block db (kv_tq3_*_to_fp8). */
static void tq3_block_to_fp8(const kv_geom_t *g, int kind, const uint8_t *sb, uint32_t t,
                             uint8_t *db)
{
    uint8_t codes[KV_MAX_HEAD_DIM];
    uint16_t m[2];
    uint64_t d = g->head_dim;
    float s;
    tq3_block_row(g, kind, sb, t, codes, m);
    if (kind == KV_KIND_K)
        kv_tq3_key_to_fp8(g->seed, g->head_dim, codes, m[0], db + t * d, &s);
    else
        kv_tq3_value_to_fp8(g->seed, g->head_dim, codes, m[0], m[1], db + t * d, &s);
    memcpy(db + kv_block_meta_offset(g, KV_FMT_FP8, KV_KIND_K) + (uint64_t)t * sizeof(float), &s,
           sizeof s);
}

int kv_fp8_append(const kv_geom_t *g, const kv_pools_t *pools, const kv_dir_entry_t *dir,
                  uint32_t dir_len, uint32_t layer, uint32_t ntok, const uint32_t *slot_page,
                  const uint32_t *slot_idx, const float *k, const float *v)
{
    if (!kv_geom_valid(g) || !pools || !dir || layer >= g->layers)
        return KVK_EINVAL;
    if (ntok == 0)
        return KVK_OK;
    if (!slot_page || !slot_idx || !k || !v || !pools->base[KV_FMT_FP8])
        return KVK_EINVAL;
    for (uint32_t t = 0; t < ntok; t++) {
        if (slot_idx[t] >= g->page_tokens || slot_page[t] >= dir_len)
            return KVK_EINVAL;
        kv_dir_entry_t e = dir[slot_page[t]];
        if (!(kv_dir_flags(e) & KV_DIR_VALID) || (kv_dir_flags(e) & KV_DIR_SEALED) ||
            kv_dir_fmt(e) != KV_FMT_FP8 || kv_dir_phys(e) >= pools->pages[KV_FMT_FP8])
            return KVK_EINVAL;
    }

    uint64_t row = (uint64_t)g->kv_heads * g->head_dim; /* floats per token in k and v */
    for (uint32_t t = 0; t < ntok; t++) {
        uint8_t *page = fp8_page_ptr(g, pools, kv_dir_phys(dir[slot_page[t]]));
        for (int kind = KV_KIND_K; kind <= KV_KIND_V; kind++) {
            const float *src = (kind == KV_KIND_K ? k : v) + (uint64_t)t * row;
            for (uint32_t h = 0; h < g->kv_heads; h++) {
                uint8_t *blk = page + kv_block_offset(g, KV_FMT_FP8, layer, kind, h);
                fp8_block_put(g, blk, slot_idx[t], src + (uint64_t)h * g->head_dim);
                block_tail_zero(g, KV_FMT_FP8, kind, blk);
            }
        }
        page_tail_zero(g, KV_FMT_FP8, page);
    }
    return KVK_OK;
}

/* Convert every (layer, kind, head, token) row of src (format sf) into dst (format df). */
static int page_convert(const kv_geom_t *g, kv_fmt_t sf, const uint8_t *src, kv_fmt_t df,
                        uint8_t *dst)
{
    float x[KV_MAX_HEAD_DIM];
    if (!kv_geom_valid(g) || !src || !dst || src == dst)
        return KVK_EINVAL;
    memset(dst, 0, (size_t)kv_page_bytes(g, df));
    for (uint32_t l = 0; l < g->layers; l++) {
        for (int kind = KV_KIND_K; kind <= KV_KIND_V; kind++) {
            for (uint32_t h = 0; h < g->kv_heads; h++) {
                const uint8_t *sb = src + kv_block_offset(g, sf, l, kind, h);
                uint8_t *db = dst + kv_block_offset(g, df, l, kind, h);
                for (uint32_t t = 0; t < g->page_tokens; t++) {
                    if (sf == KV_FMT_FP8) { /* retier: the TQ3 encoder sees codes and scale */
                        float s = fp8_block_codes(g, sb, t, x);
                        tq3_block_put(g, kind, db, t, x, s);
                    } else { /* promote: codes and metadata straight to the FP8 row */
                        tq3_block_to_fp8(g, kind, sb, t, db);
                    }
                }
            }
        }
    }
    return KVK_OK;
}

int kv_page_retier(const kv_geom_t *g, const uint8_t *fp8_page, uint8_t *tq3_page)
{
    return page_convert(g, KV_FMT_FP8, fp8_page, KV_FMT_TQ3, tq3_page);
}

int kv_page_promote(const kv_geom_t *g, const uint8_t *tq3_page, uint8_t *fp8_page)
{
    return page_convert(g, KV_FMT_TQ3, tq3_page, KV_FMT_FP8, fp8_page);
}

int kv_page_decode_block(const kv_geom_t *g, kv_fmt_t f, const uint8_t *page, uint32_t layer,
                         int kind, uint32_t head, float *out)
{
    if (!kv_geom_valid(g) || (f != KV_FMT_FP8 && f != KV_FMT_TQ3) || !page || !out ||
        layer >= g->layers || (kind != KV_KIND_K && kind != KV_KIND_V) || head >= g->kv_heads)
        return KVK_EINVAL;
    const uint8_t *blk = page + kv_block_offset(g, f, layer, kind, head);
    for (uint32_t t = 0; t < g->page_tokens; t++) {
        float *x = out + (uint64_t)t * g->head_dim;
        if (f == KV_FMT_FP8)
            fp8_block_get(g, blk, t, x);
        else
            tq3_block_get(g, kind, blk, t, x);
    }
    return KVK_OK;
}
