/* attn.c — paged decode attention over mixed FP8/TQ3 pages: CPU twin of the partial kernel,
 * the online-softmax merge, and the float64 dense reference.
 *
 * Partition scheme (the contract is in kvkern.h; docs/attention.md has the math):
 *
 *   sequence s:  pages  P0 P1 P2 P3 P4 P5 P6        (logical order, each FP8 or TQ3)
 *   num_splits 3: chunk = ceil(7/3) + 1 = 4 pages, 3·4 − 7 = 5 short: 2 off the first, 3 off
 *                 the last: split 0: P0 P1 | split 1: P2 P3 P4 P5 | split 2: P6
 *                 (kv_attn_split_range)
 *   inside a split the FP8 pages form one partition and the TQ3 pages another:
 *                 part (s, split, fmt) = (s * num_splits + split) * KV_FMT_COUNT + fmt
 *
 * Each partition of each query head gets m = max score, l = Σ exp(s − m) and the normalised
 * Ō = Σ exp(s − m) v / l. kv_attn_merge combines them (Minima-KV eqs. 11–13); the order of the
 * partitions does not matter, which is what lets the GPU run FP8 and TQ3 scans as separate,
 * branch-free launches.
 *
 * How this twin reads pages — the same way the GPU kernel will:
 *   - codes are read straight from the page, one token row of one KV head at a time; no page
 *     is decoded into a dense buffer (DESIGN.md: "no page is ever expanded");
 *   - one row of K and V codes is unpacked once per KV head and used by all q_heads/kv_heads
 *     query heads of its GQA group, so the cost is O(tokens · d · q_heads);
 *   - FP8: score = sm_scale · scale · Σ q_i · fp8(code_i)  (fp8 through a 256-entry table);
 *   - TQ3: the query is rotated once per (sequence, head), q' = R q, and
 *     score = sm_scale · γ · Σ q'_i · c[code_i] / sqrt(d); values are accumulated in the
 *     rotated basis, Σ p · (zero + code · scale), and Ō is un-rotated once per partition.
 *     Both are exact identities because R is orthonormal: q·(Rᵀĉ) = (Rq)·ĉ and
 *     Σ p Rᵀŷ = Rᵀ Σ p ŷ.
 *
 * Precision: page values are formed in float exactly as the decoders do (fp8 × float scale,
 * FP16 metadata widened), the rotations are float (kv_rot_*), and every reduction — dot
 * products, running max, exp sums, value sums, the merge — is carried in double. The twin is
 * the reference the GPU kernel is tested against, so its own rounding should be far below the
 * GPU's float accumulation error; the stored m, l, Ō are float as the contract says. m is
 * rounded to float first and l is expressed relative to that rounded m, so the (m, l) pair a
 * caller sees is self-consistent.
 *
 * Concurrency: the daemon republishes directory entries with single 64-bit atomic stores
 * (retier, promote). Each call reads every entry it needs exactly once, with an acquire load,
 * into a snapshot that both validation and compute use; a page that changes format during the
 * call is therefore seen wholly before or wholly after the flip, never half of each.
 */
#include "kvkern.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Everything a call needs that does not change across sequences. */
typedef struct attn_ctx_s {
    const kv_geom_t *g;
    const kv_pools_t *pools;
    uint32_t layer;
    uint32_t d;
    uint32_t group; /* query heads per KV head */
    uint64_t page_bytes[KV_FMT_COUNT];
    const kv_dir_entry_t *snap; /* [page_indptr[batch] - page_indptr[0]] resolved entries */
    float fp8_lut[256];
    double centroid[KV_TQ3_LEVELS]; /* KV_TQ3_CENTROIDS[i] / sqrt(d) */
} attn_ctx_t;

static kv_dir_entry_t attn_dir_load(const kv_dir_entry_t *e)
{
    /* acquire: the page contents written before the daemon published this entry are visible */
    return __atomic_load_n(e, __ATOMIC_ACQUIRE);
}

/* Validate everything kv_attn_partial and kv_attn_reference share, and snapshot the directory
 * entries of every page the batch touches. On success *snap_out is malloc'd (NULL when the
 * batch has no pages) and must be freed by the caller. */
static int attn_check(const kv_geom_t *g, const kv_pools_t *pools, const kv_dir_entry_t *dir,
                      uint32_t dir_len, const kv_attn_batch_t *b, const float *q,
                      kv_dir_entry_t **snap_out)
{
    *snap_out = NULL;
    if (!kv_geom_valid(g) || !pools || !b || !q || !b->page_indptr || !b->seq_len)
        return KVK_EINVAL;
    if (b->q_heads == 0 || b->q_heads % g->kv_heads != 0 || b->layer >= g->layers)
        return KVK_EINVAL;
    if (!isfinite(b->sm_scale))
        return KVK_EINVAL;

    const uint32_t *ip = b->page_indptr;
    for (uint32_t s = 0; s < b->batch; s++) {
        if (ip[s + 1] < ip[s])
            return KVK_EINVAL;
        if ((uint64_t)b->seq_len[s] > (uint64_t)(ip[s + 1] - ip[s]) * g->page_tokens)
            return KVK_EINVAL;
    }
    uint64_t first = ip[0], npages = (uint64_t)ip[b->batch] - first;
    if (npages == 0)
        return KVK_OK;
    if (!b->page_ids || !dir)
        return KVK_EINVAL;

    kv_dir_entry_t *snap = malloc(npages * sizeof(*snap));
    if (!snap)
        return KVK_ENOMEM;
    for (uint64_t i = 0; i < npages; i++) {
        uint32_t id = b->page_ids[first + i];
        if (id >= dir_len)
            goto bad;
        kv_dir_entry_t e = attn_dir_load(&dir[id]);
        uint32_t f = (uint32_t)kv_dir_fmt(e);
        if (!(kv_dir_flags(e) & KV_DIR_VALID) || f >= KV_FMT_COUNT)
            goto bad;
        if (kv_dir_phys(e) >= pools->pages[f] || !pools->base[f])
            goto bad;
        /* blocks are 16-byte aligned relative to the pool base; the base must be too */
        if ((uintptr_t)pools->base[f] % KV_BLOCK_ALIGN != 0)
            goto bad;
        snap[i] = e;
    }
    *snap_out = snap;
    return KVK_OK;
bad:
    free(snap);
    return KVK_EINVAL;
}

static void attn_ctx_init(attn_ctx_t *c, const kv_geom_t *g, const kv_pools_t *pools,
                          uint32_t layer, uint32_t q_heads, const kv_dir_entry_t *snap)
{
    static const float centroids[KV_TQ3_LEVELS] = KV_TQ3_CENTROIDS_INIT;
    c->g = g;
    c->pools = pools;
    c->layer = layer;
    c->d = g->head_dim;
    c->group = q_heads / g->kv_heads;
    c->snap = snap;
    for (int f = 0; f < KV_FMT_COUNT; f++)
        c->page_bytes[f] = kv_page_bytes(g, (kv_fmt_t)f);
    for (int i = 0; i < 256; i++)
        c->fp8_lut[i] = kv_fp8_to_float((uint8_t)i);
    for (int i = 0; i < KV_TQ3_LEVELS; i++)
        c->centroid[i] = (double)centroids[i] / sqrt((double)c->d);
}

static const uint8_t *attn_page(const attn_ctx_t *c, kv_dir_entry_t e)
{
    kv_fmt_t f = kv_dir_fmt(e);
    return c->pools->base[f] + (uint64_t)kv_dir_phys(e) * c->page_bytes[f];
}

/* One token row of a key block: row[i] such that k_i = factor · row[i] (FP8: fp8(code_i) and
 * the token scale; TQ3: c[code_i]/sqrt(d) in the rotated basis and γ). */
static double attn_key_row(const attn_ctx_t *c, kv_fmt_t f, const uint8_t *blk, uint32_t t,
                           double *row)
{
    const uint32_t d = c->d;
    const uint8_t *meta = blk + kv_block_meta_offset(c->g, f, KV_KIND_K);
    if (f == KV_FMT_FP8) {
        const uint8_t *code = blk + (uint64_t)t * d;
        float scale;
        memcpy(&scale, meta + (uint64_t)t * sizeof(float), sizeof(scale));
        for (uint32_t i = 0; i < d; i++)
            row[i] = c->fp8_lut[code[i]];
        return scale;
    }
    /* blocks are 16-byte aligned (the pool base is checked), so the units can be read as words */
    const uint32_t *units = (const uint32_t *)(const void *)blk;
    uint16_t norm;
    memcpy(&norm, meta + (uint64_t)t * sizeof(uint16_t), sizeof(norm));
    for (uint32_t i = 0; i < d; i++)
        row[i] = c->centroid[kv_tq3_get(units, KV_KIND_K, d, t, i)];
    return kv_half_to_float(norm);
}

/* One token row of a value block, as the decoder forms it (FP8: fp8(code)·scale in float;
 * TQ3: zero + code·scale in float, rotated basis). */
static void attn_value_row(const attn_ctx_t *c, kv_fmt_t f, const uint8_t *blk, uint32_t t,
                           double *row)
{
    const uint32_t d = c->d;
    const uint8_t *meta = blk + kv_block_meta_offset(c->g, f, KV_KIND_V);
    if (f == KV_FMT_FP8) {
        const uint8_t *code = blk + (uint64_t)t * d;
        float scale;
        memcpy(&scale, meta + (uint64_t)t * sizeof(float), sizeof(scale));
        for (uint32_t i = 0; i < d; i++)
            row[i] = c->fp8_lut[code[i]] * scale;
        return;
    }
    const uint32_t *units = (const uint32_t *)(const void *)blk; /* V: token pairs share units */
    const uint64_t pt = c->g->page_tokens;
    uint16_t hs, hz;
    memcpy(&hs, meta + (uint64_t)t * sizeof(uint16_t), sizeof(hs));
    memcpy(&hz, meta + (pt + t) * sizeof(uint16_t), sizeof(hz));
    float scale = kv_half_to_float(hs), zero = kv_half_to_float(hz);
    for (uint32_t i = 0; i < d; i++)
        row[i] = zero + (float)kv_tq3_get(units, KV_KIND_V, d, t, i) * scale;
}

/* Running softmax state of the query heads of one GQA group over one partition. */
typedef struct attn_state_s {
    double *m;   /* [group] running max, -INFINITY while empty */
    double *l;   /* [group] Σ exp(s − m) */
    double *acc; /* [group][d] Σ exp(s − m) v (rotated basis for TQ3) */
} attn_state_t;

/* Scan pages [p0, p1) of one sequence that have format f, for KV head kh. qg: [group][d], the
 * group's queries (rotated for TQ3). */
static void attn_scan(const attn_ctx_t *c, const kv_dir_entry_t *pages, uint64_t p0, uint64_t p1,
                      uint32_t seq_len, kv_fmt_t f, uint32_t kh, float sm_scale, const float *qg,
                      attn_state_t *st)
{
    const uint32_t d = c->d, G = c->group, T = c->g->page_tokens;
    double krow[KV_MAX_HEAD_DIM], vrow[KV_MAX_HEAD_DIM];

    for (uint32_t h = 0; h < G; h++) {
        st->m[h] = -INFINITY;
        st->l[h] = 0.0;
    }
    memset(st->acc, 0, (size_t)G * d * sizeof(double));

    for (uint64_t p = p0; p < p1; p++) {
        uint64_t t0 = p * T;
        if (t0 >= seq_len)
            break; /* pages past the sequence end hold no live token */
        if (kv_dir_fmt(pages[p]) != f)
            continue;
        uint32_t ntok = (uint32_t)(seq_len - t0 < T ? seq_len - t0 : T);
        const uint8_t *page = attn_page(c, pages[p]);
        const uint8_t *kb = page + kv_block_offset(c->g, f, c->layer, KV_KIND_K, kh);
        const uint8_t *vb = page + kv_block_offset(c->g, f, c->layer, KV_KIND_V, kh);

        for (uint32_t t = 0; t < ntok; t++) {
            /* unpack once per KV head, use for every query head of the group */
            double kf = attn_key_row(c, f, kb, t, krow);
            attn_value_row(c, f, vb, t, vrow);
            for (uint32_t h = 0; h < G; h++) {
                const float *qh = qg + (uint64_t)h * d;
                double dot = 0.0;
                for (uint32_t i = 0; i < d; i++)
                    dot += (double)qh[i] * krow[i];
                double s = (double)sm_scale * kf * dot;
                if (s == -INFINITY)
                    continue; /* weight exactly 0; keeps exp(-inf - -inf) out */
                double *acc = st->acc + (uint64_t)h * d;
                if (s > st->m[h]) {
                    /* new max: rescale what was accumulated (exp(-inf) = 0 when empty) */
                    double r = exp(st->m[h] - s);
                    st->l[h] *= r;
                    for (uint32_t i = 0; i < d; i++)
                        acc[i] *= r;
                    st->m[h] = s;
                }
                double pw = exp(s - st->m[h]);
                st->l[h] += pw;
                for (uint32_t i = 0; i < d; i++)
                    acc[i] += pw * vrow[i];
            }
        }
    }
}

/* Store the state of one partition: m rounded to float, l relative to that rounded m, Ō = acc/l
 * (un-rotated for TQ3). m_out, l_out: [group]; o_out: [group][d]. */
static void attn_store(const attn_ctx_t *c, kv_fmt_t f, const attn_state_t *st, float *m_out,
                       float *l_out, float *o_out)
{
    const uint32_t d = c->d;
    float tmp[KV_MAX_HEAD_DIM];
    for (uint32_t h = 0; h < c->group; h++) {
        float *o = o_out + (uint64_t)h * d;
        if (!(st->l[h] > 0.0)) {
            m_out[h] = -INFINITY;
            l_out[h] = 0.0f;
            memset(o, 0, d * sizeof(float));
            continue;
        }
        float mf = (float)st->m[h];
        m_out[h] = mf;
        l_out[h] = (float)(st->l[h] * exp(st->m[h] - (double)mf));
        const double *acc = st->acc + (uint64_t)h * d;
        double inv = 1.0 / st->l[h];
        for (uint32_t i = 0; i < d; i++)
            tmp[i] = (float)(acc[i] * inv);
        if (f == KV_FMT_TQ3)
            kv_rot_inverse(c->g->seed, d, tmp, o); /* once per partition and head */
        else
            memcpy(o, tmp, d * sizeof(float));
    }
}

int kv_attn_partial(const kv_geom_t *g, const kv_pools_t *pools, const kv_dir_entry_t *dir,
                    uint32_t dir_len, const kv_attn_batch_t *b, const float *q, uint32_t num_splits,
                    float *part_m, float *part_l, float *part_o)
{
    if (num_splits == 0 || !part_m || !part_l || !part_o)
        return KVK_EINVAL;
    if (!b || (uint64_t)b->batch * num_splits * KV_FMT_COUNT > UINT32_MAX)
        return KVK_EINVAL; /* kv_attn_num_parts must not wrap */
    kv_dir_entry_t *snap;
    int rc = attn_check(g, pools, dir, dir_len, b, q, &snap);
    if (rc != KVK_OK)
        return rc;

    attn_ctx_t *c = malloc(sizeof(*c));
    const uint32_t d = g->head_dim, H = b->q_heads;
    const uint64_t G = H / g->kv_heads;
    float *qrot = malloc((uint64_t)H * d * sizeof(float));
    attn_state_t st = {
        .m = malloc(G * sizeof(double)),
        .l = malloc(G * sizeof(double)),
        .acc = malloc(G * d * sizeof(double)),
    };
    if (!c || !qrot || !st.m || !st.l || !st.acc) {
        rc = KVK_ENOMEM;
        goto out;
    }
    attn_ctx_init(c, g, pools, b->layer, H, snap);

    for (uint32_t s = 0; s < b->batch; s++) {
        const uint64_t np = (uint64_t)b->page_indptr[s + 1] - b->page_indptr[s];
        const kv_dir_entry_t *pages = snap ? snap + (b->page_indptr[s] - b->page_indptr[0]) : NULL;
        const float *qs = q + (uint64_t)s * H * d;

        /* rotate the query once per (sequence, head), only if a TQ3 page is live */
        int any_tq3 = 0;
        for (uint64_t p = 0; p < np && p * g->page_tokens < b->seq_len[s]; p++)
            any_tq3 |= kv_dir_fmt(pages[p]) == KV_FMT_TQ3;
        if (any_tq3)
            for (uint32_t h = 0; h < H; h++)
                kv_rot_forward(g->seed, d, qs + (uint64_t)h * d, qrot + (uint64_t)h * d);

        for (uint32_t sp = 0; sp < num_splits; sp++) {
            uint64_t p0, p1;
            kv_attn_split_range(np, num_splits, sp, &p0, &p1);
            for (int f = 0; f < KV_FMT_COUNT; f++) {
                uint64_t part = ((uint64_t)s * num_splits + sp) * KV_FMT_COUNT + (uint64_t)f;
                const float *qf = f == KV_FMT_TQ3 ? qrot : qs;
                for (uint32_t kh = 0; kh < g->kv_heads; kh++) {
                    uint64_t h0 = (uint64_t)kh * G;
                    attn_scan(c, pages, p0, p1, b->seq_len[s], (kv_fmt_t)f, kh, b->sm_scale,
                              qf + h0 * d, &st);
                    attn_store(c, (kv_fmt_t)f, &st, part_m + part * H + h0, part_l + part * H + h0,
                               part_o + (part * H + h0) * d);
                }
            }
        }
    }
out:
    free(st.acc);
    free(st.l);
    free(st.m);
    free(qrot);
    free(c);
    free(snap);
    return rc;
}

int kv_attn_merge(uint32_t batch, uint32_t parts_per_seq, uint32_t q_heads, uint32_t d,
                  const float *part_m, const float *part_l, const float *part_o, float *out)
{
    if (parts_per_seq == 0 || q_heads == 0 || d == 0 || d > KV_MAX_HEAD_DIM)
        return KVK_EINVAL;
    if (batch == 0)
        return KVK_OK;
    if (!part_m || !part_l || !part_o || !out)
        return KVK_EINVAL;
    const uint64_t n = (uint64_t)batch * parts_per_seq * q_heads;
    /* A partition is (m = -inf, l = 0) when empty, or finite m with finite l > 0. Anything else
     * (NaN, +inf, negative l) is a broken producer: refuse rather than emit NaN. */
    for (uint64_t i = 0; i < n; i++) {
        float m = part_m[i], l = part_l[i];
        int empty = l == 0.0f;
        if (isnan(m) || m == INFINITY || !(l >= 0.0f) || isinf(l) || (!empty && isinf(m)))
            return KVK_EINVAL;
    }

    double acc[KV_MAX_HEAD_DIM];
    for (uint32_t s = 0; s < batch; s++) {
        for (uint32_t h = 0; h < q_heads; h++) {
            /* eq. 11: m = max over non-empty partitions */
            double m = -INFINITY;
            for (uint32_t j = 0; j < parts_per_seq; j++) {
                uint64_t i = ((uint64_t)s * parts_per_seq + j) * q_heads + h;
                if (part_l[i] > 0.0f && part_m[i] > m)
                    m = part_m[i];
            }
            float *o = out + ((uint64_t)s * q_heads + h) * d;
            if (m == -INFINITY) {
                memset(o, 0, d * sizeof(float)); /* all partitions empty */
                continue;
            }
            /* eqs. 12–13: l = Σ e^{m_j − m} l_j, O = Σ e^{m_j − m} l_j Ō_j / l */
            double l = 0.0;
            memset(acc, 0, d * sizeof(double));
            for (uint32_t j = 0; j < parts_per_seq; j++) {
                uint64_t i = ((uint64_t)s * parts_per_seq + j) * q_heads + h;
                if (!(part_l[i] > 0.0f))
                    continue;
                double w = exp((double)part_m[i] - m) * part_l[i];
                const float *oj = part_o + i * d;
                l += w;
                for (uint32_t k = 0; k < d; k++)
                    acc[k] += w * oj[k];
            }
            /* l ≥ l_j of the max partition > 0 */
            for (uint32_t k = 0; k < d; k++)
                o[k] = (float)(acc[k] / l);
        }
    }
    return KVK_OK;
}

int kv_attn_reference(const kv_geom_t *g, const kv_pools_t *pools, const kv_dir_entry_t *dir,
                      uint32_t dir_len, const kv_attn_batch_t *b, const float *q, double *out)
{
    if (!out)
        return KVK_EINVAL;
    kv_dir_entry_t *snap;
    int rc = attn_check(g, pools, dir, dir_len, b, q, &snap);
    if (rc != KVK_OK)
        return rc;

    const uint32_t d = g->head_dim, H = b->q_heads, T = g->page_tokens;
    const uint32_t G = H / g->kv_heads;
    uint64_t max_tok = 0;
    for (uint32_t s = 0; s < b->batch; s++)
        max_tok = b->seq_len[s] > max_tok ? b->seq_len[s] : max_tok;

    /* dense K and V of one (sequence, KV head), decoded block by block */
    float *kd = malloc((max_tok + T) * d * sizeof(float));
    float *vd = malloc((max_tok + T) * d * sizeof(float));
    double *sc = malloc((max_tok + 1) * sizeof(double));
    if (!kd || !vd || !sc) {
        rc = KVK_ENOMEM;
        goto out;
    }

    for (uint32_t s = 0; s < b->batch; s++) {
        const uint32_t len = b->seq_len[s];
        const kv_dir_entry_t *pages = snap ? snap + (b->page_indptr[s] - b->page_indptr[0]) : NULL;
        const uint64_t np = ((uint64_t)len + T - 1) / T; /* pages holding live tokens */
        for (uint32_t kh = 0; kh < g->kv_heads; kh++) {
            for (uint64_t p = 0; p < np; p++) {
                kv_fmt_t f = kv_dir_fmt(pages[p]);
                const uint8_t *page =
                    pools->base[f] + (uint64_t)kv_dir_phys(pages[p]) * kv_page_bytes(g, f);
                /* the buffers have T spare rows, so the last block may land whole */
                rc = kv_page_decode_block(g, f, page, b->layer, KV_KIND_K, kh, kd + p * T * d);
                if (rc == KVK_OK)
                    rc = kv_page_decode_block(g, f, page, b->layer, KV_KIND_V, kh, vd + p * T * d);
                if (rc != KVK_OK)
                    goto out;
            }
            for (uint32_t gh = 0; gh < G; gh++) {
                const uint64_t h = (uint64_t)kh * G + gh;
                const float *qh = q + ((uint64_t)s * H + h) * d;
                double *o = out + ((uint64_t)s * H + h) * d;
                double m = -INFINITY, l = 0.0;
                for (uint32_t t = 0; t < len; t++) {
                    double dot = 0.0;
                    for (uint32_t i = 0; i < d; i++)
                        dot += (double)qh[i] * kd[(uint64_t)t * d + i];
                    sc[t] = (double)b->sm_scale * dot;
                    m = sc[t] > m ? sc[t] : m;
                }
                for (uint32_t i = 0; i < d; i++)
                    o[i] = 0.0;
                for (uint32_t t = 0; t < len; t++) {
                    double pw = exp(sc[t] - m);
                    l += pw;
                    for (uint32_t i = 0; i < d; i++)
                        o[i] += pw * vd[(uint64_t)t * d + i];
                }
                if (len > 0)
                    for (uint32_t i = 0; i < d; i++)
                        o[i] /= l;
            }
        }
    }
out:
    free(sc);
    free(vd);
    free(kd);
    free(snap);
    return rc;
}
