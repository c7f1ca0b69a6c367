/* kvcodec.c — one JSON report on the page formats of a geometry: bits per value, codec error,
 * attention error and CPU throughput. `./dev.sh run` runs it; docs/formats.md quotes it.
 *
 * Sections of the report (all figures measured on this run, seeded, reproducible):
 *   geometry        the flags
 *   bits_per_value  kv_page_bits_per_value (metadata and padding included) and K / V blocks
 *   nmse            Σ‖x − x̂‖²/Σ‖x‖² per format and kind, on N(0,1) data and on data with 4
 *                   outlier channels ×20; TQ3 is measured end to end (append FP8, retier), i.e.
 *                   against the ORIGINAL floats, as a stale page really is
 *   attention       ‖o − ô‖/‖o‖ (Frobenius over query heads) of one decode step over --tokens
 *                   tokens of layer 0, ô from kv_attn_partial + kv_attn_merge on all-FP8, all-TQ3
 *                   and mixed pages (first page and last two FP8, the rest TQ3); o is float64
 *                   dense attention on the ORIGINAL unquantized K/V
 *   gamma_study     the three TQ3 norm corrections (see tq3.c) on the same codes: key NMSE and
 *                   attention error, at two softmax temperatures; "shipped" names tq3.c's choice
 *   throughput      append tokens/s (all layers), retier and promote MB/s of FP8 page bytes
 *
 * Exit status: 0 on success, 2 on a bad flag (with a message on stderr), 1 on failure.
 */
#include "kvkern.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct opts_s {
    kv_geom_t g;
    uint32_t tokens;
    uint32_t q_heads;
} opts_t;

static const char usage[] =
    "usage: kvcodec [options]\n"
    "  Prints one JSON object: bits per value, NMSE, attention error and throughput of the\n"
    "  FP8 and TQ3 page formats of one geometry.\n"
    "  --layers N       layers (1..1024, default 4)\n"
    "  --kv-heads N     KV heads (1..256, default 8)\n"
    "  --head-dim N     64, 128 or 256 (default 128)\n"
    "  --page-tokens N  tokens per page (1..4096, default 16)\n"
    "  --seed N         rotation and data seed (default 1)\n"
    "  --tokens N       context length of the attention measurement (1..1048576, default 4096)\n"
    "  --q-heads N      query heads, a multiple of --kv-heads (default 4 x kv-heads)\n"
    "  --help           this text\n";

/* ---- data ------------------------------------------------------------------------------- */
typedef struct rng_s {
    uint64_t s;
} rng_t;

static double rng_gauss(rng_t *r)
{
    double a = ((double)(kv_splitmix64(r->s++) >> 11) + 1.0) * 0x1p-53;
    double b = (double)(kv_splitmix64(r->s++) >> 11) * 0x1p-53;
    return sqrt(-2.0 * log(a)) * cos(6.283185307179586 * b);
}

/* n rows of d: N(0,1), times 20 on 4 fixed channels when outliers is set (per-channel outliers
 * are what real K caches show; the channel set is the same for every row). */
static void fill_rows(rng_t *r, float *x, uint64_t rows, uint32_t d, int outliers)
{
    for (uint64_t i = 0; i < rows; i++)
        for (uint32_t j = 0; j < d; j++)
            x[i * d + j] = (float)rng_gauss(r) * (outliers && (j * 37u) % d < 4 ? 20.0f : 1.0f);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *xcalloc(uint64_t n, uint64_t size)
{
    void *p = calloc((size_t)n, (size_t)size);
    if (!p) {
        fprintf(stderr, "kvcodec: calloc(%" PRIu64 ", %" PRIu64 ") failed\n", n, size);
        exit(1);
    }
    return p;
}

/* ---- a small page store: npages FP8 pages filled by append, and their TQ3 retiers ------- */
typedef struct store_s {
    const kv_geom_t *g;
    uint32_t npages;
    uint8_t *fp8, *tq3;
    kv_pools_t pools;
    kv_dir_entry_t *dir_fp8; /* logical p → FP8 phys p */
} store_t;

static void store_init(store_t *s, const kv_geom_t *g, uint32_t npages)
{
    memset(s, 0, sizeof *s);
    s->g = g;
    s->npages = npages;
    s->fp8 = xcalloc(npages, kv_page_bytes(g, KV_FMT_FP8));
    s->tq3 = xcalloc(npages, kv_page_bytes(g, KV_FMT_TQ3));
    s->pools.base[KV_FMT_FP8] = s->fp8;
    s->pools.base[KV_FMT_TQ3] = s->tq3;
    s->pools.pages[KV_FMT_FP8] = npages;
    s->pools.pages[KV_FMT_TQ3] = npages;
    s->dir_fp8 = xcalloc(npages, sizeof *s->dir_fp8);
    for (uint32_t p = 0; p < npages; p++)
        s->dir_fp8[p] = kv_dir_make(p, KV_FMT_FP8, KV_DIR_VALID, 1);
}

static void store_free(store_t *s)
{
    free(s->fp8);
    free(s->tq3);
    free(s->dir_fp8);
    memset(s, 0, sizeof *s);
}

/* Append ntok tokens of one layer (k, v: [ntok][kv_heads][d]) into logical pages in order. */
static int store_append(store_t *s, uint32_t layer, uint32_t ntok, const float *k, const float *v)
{
    uint32_t *sp = xcalloc(ntok, sizeof *sp), *si = xcalloc(ntok, sizeof *si);
    for (uint32_t t = 0; t < ntok; t++) {
        sp[t] = t / s->g->page_tokens;
        si[t] = t % s->g->page_tokens;
    }
    int rc = kv_fp8_append(s->g, &s->pools, s->dir_fp8, s->npages, layer, ntok, sp, si, k, v);
    free(sp);
    free(si);
    return rc;
}

static int store_retier_all(store_t *s)
{
    uint64_t fb = kv_page_bytes(s->g, KV_FMT_FP8), tb = kv_page_bytes(s->g, KV_FMT_TQ3);
    for (uint32_t p = 0; p < s->npages; p++) {
        int rc = kv_page_retier(s->g, s->fp8 + p * fb, s->tq3 + p * tb);
        if (rc != KVK_OK)
            return rc;
    }
    return KVK_OK;
}

/* ---- NMSE ------------------------------------------------------------------------------- */
typedef struct nmse_s {
    double fp8[2], tq3[2]; /* [kind] */
} nmse_t;

static int measure_nmse(const kv_geom_t *g, uint64_t seed, int outliers, nmse_t *out)
{
    /* enough pages for ≥ 1024 rows per kind, at least one page */
    uint64_t rows_page = (uint64_t)g->layers * g->kv_heads * g->page_tokens;
    uint32_t npages = (uint32_t)((1024 + rows_page - 1) / rows_page);
    uint32_t d = g->head_dim, ntok = npages * g->page_tokens;
    uint64_t per_layer = (uint64_t)ntok * g->kv_heads * d;
    store_t s;
    store_init(&s, g, npages);
    float *k = xcalloc(per_layer * g->layers, sizeof(float));
    float *v = xcalloc(per_layer * g->layers, sizeof(float));
    rng_t r = {seed};
    fill_rows(&r, k, per_layer * g->layers / d, d, outliers);
    fill_rows(&r, v, per_layer * g->layers / d, d, outliers);
    int rc = KVK_OK;
    for (uint32_t l = 0; l < g->layers && rc == KVK_OK; l++)
        rc = store_append(&s, l, ntok, k + l * per_layer, v + l * per_layer);
    if (rc == KVK_OK)
        rc = store_retier_all(&s);
    float *blk = xcalloc((uint64_t)g->page_tokens * d, sizeof(float));
    double e[2][2] = {{0}}, tot[2] = {0};
    for (uint32_t p = 0; p < npages && rc == KVK_OK; p++) {
        for (int f = 0; f < 2; f++) {
            const uint8_t *page = (f == 0 ? s.fp8 : s.tq3) + p * kv_page_bytes(g, (kv_fmt_t)f);
            for (uint32_t l = 0; l < g->layers; l++)
                for (int kind = 0; kind < 2; kind++)
                    for (uint32_t h = 0; h < g->kv_heads; h++) {
                        rc |= kv_page_decode_block(g, (kv_fmt_t)f, page, l, kind, h, blk);
                        for (uint32_t t = 0; t < g->page_tokens; t++) {
                            uint64_t tok = (uint64_t)p * g->page_tokens + t;
                            const float *x =
                                (kind ? v : k) + l * per_layer + (tok * g->kv_heads + h) * d;
                            for (uint32_t i = 0; i < d; i++) {
                                double diff = (double)x[i] - blk[(uint64_t)t * d + i];
                                e[f][kind] += diff * diff;
                                if (f == 0)
                                    tot[kind] += (double)x[i] * x[i];
                            }
                        }
                    }
        }
    }
    for (int kind = 0; kind < 2; kind++) {
        out->fp8[kind] = e[0][kind] / tot[kind];
        out->tq3[kind] = e[1][kind] / tot[kind];
    }
    free(blk);
    free(k);
    free(v);
    store_free(&s);
    return rc;
}

/* ---- attention error -------------------------------------------------------------------- */
/* Float64 dense attention of one query token over n tokens. q [H][d], k, v [n][kv_heads][d]. */
static void dense_attention(uint32_t H, uint32_t KH, uint32_t d, uint64_t n, const float *q,
                            const float *k, const float *v, double *out)
{
    double *sc = xcalloc(n, sizeof(double));
    double smul = 1.0 / sqrt((double)d);
    for (uint32_t h = 0; h < H; h++) {
        uint32_t kh = h / (H / KH);
        double m = -INFINITY, l = 0;
        for (uint64_t t = 0; t < n; t++) {
            const float *kr = k + (t * KH + kh) * d;
            double a = 0;
            for (uint32_t i = 0; i < d; i++)
                a += (double)q[(uint64_t)h * d + i] * kr[i];
            sc[t] = a * smul;
            m = fmax(m, sc[t]);
        }
        double *o = out + (uint64_t)h * d;
        memset(o, 0, d * sizeof(double));
        for (uint64_t t = 0; t < n; t++) {
            double p = exp(sc[t] - m);
            l += p;
            const float *vr = v + (t * KH + kh) * d;
            for (uint32_t i = 0; i < d; i++)
                o[i] += p * vr[i];
        }
        for (uint32_t i = 0; i < d; i++)
            o[i] /= l;
    }
    free(sc);
}

typedef struct attn_res_s {
    double rel[3];             /* fp8, tq3, mix */
    double merge_vs_reference; /* max |merged − kv_attn_reference| on the mix, relative */
} attn_res_t;

static int measure_attention(const opts_t *o, attn_res_t *res)
{
    const kv_geom_t *g = &o->g;
    uint32_t d = g->head_dim, T = g->page_tokens, H = o->q_heads, KH = g->kv_heads;
    uint32_t n = o->tokens, npages = (n + T - 1) / T;
    uint64_t row = (uint64_t)KH * d;
    store_t s;
    store_init(&s, g, npages);
    float *k = xcalloc((uint64_t)npages * T * row, sizeof(float));
    float *v = xcalloc((uint64_t)npages * T * row, sizeof(float));
    float *q = xcalloc((uint64_t)H * d, sizeof(float));
    rng_t r = {g->seed ^ 0xA77Eu};
    fill_rows(&r, k, (uint64_t)n * KH, d, 0);
    fill_rows(&r, v, (uint64_t)n * KH, d, 0);
    fill_rows(&r, q, H, d, 0);
    int rc = store_append(&s, 0, n, k, v); /* layer 0 only; other layers stay zero */
    if (rc == KVK_OK)
        rc = store_retier_all(&s);

    double *ref = xcalloc((uint64_t)H * d, sizeof(double)), *ref2 = xcalloc((uint64_t)H * d, 8);
    dense_attention(H, KH, d, n, q, k, v, ref);
    double rnorm = 0;
    for (uint64_t i = 0; i < (uint64_t)H * d; i++)
        rnorm += ref[i] * ref[i];

    kv_dir_entry_t *dir = xcalloc(npages, sizeof *dir);
    uint32_t *ids = xcalloc(npages, sizeof *ids), indptr[2] = {0, npages}, seq_len[1] = {n};
    for (uint32_t p = 0; p < npages; p++)
        ids[p] = p;
    kv_attn_batch_t b = {.batch = 1,
                         .q_heads = H,
                         .layer = 0,
                         .sm_scale = 1.0f / sqrtf((float)d),
                         .page_indptr = indptr,
                         .page_ids = ids,
                         .seq_len = seq_len};
    const uint32_t splits = 4, parts = kv_attn_num_parts(1, splits);
    float *pm = xcalloc((uint64_t)parts * H, 4), *pl = xcalloc((uint64_t)parts * H, 4);
    float *po = xcalloc((uint64_t)parts * H * d, 4), *out = xcalloc((uint64_t)H * d, 4);
    for (int mode = 0; mode < 3 && rc == KVK_OK; mode++) {
        for (uint32_t p = 0; p < npages; p++) {
            int fp8 = mode == 0 || (mode == 2 && (p == 0 || p + 2 >= npages));
            dir[p] = kv_dir_make(p, fp8 ? KV_FMT_FP8 : KV_FMT_TQ3, KV_DIR_VALID, 1);
        }
        rc = kv_attn_partial(g, &s.pools, dir, npages, &b, q, splits, pm, pl, po);
        if (rc == KVK_OK)
            rc = kv_attn_merge(1, parts, H, d, pm, pl, po, out);
        double e = 0;
        for (uint64_t i = 0; i < (uint64_t)H * d; i++)
            e += (out[i] - ref[i]) * (out[i] - ref[i]);
        res->rel[mode] = sqrt(e / rnorm);
        if (mode == 2 && rc == KVK_OK) {
            rc = kv_attn_reference(g, &s.pools, dir, npages, &b, q, ref2);
            double mx = 0, on = 0;
            for (uint64_t i = 0; i < (uint64_t)H * d; i++) {
                mx = fmax(mx, fabs(out[i] - ref2[i]));
                on = fmax(on, fabs(ref2[i]));
            }
            res->merge_vs_reference = mx / on;
        }
    }
    free(pm);
    free(pl);
    free(po);
    free(out);
    free(dir);
    free(ids);
    free(ref);
    free(ref2);
    free(k);
    free(v);
    free(q);
    store_free(&s);
    return rc;
}

/* ---- γ study ---------------------------------------------------------------------------- */
/* The codes of kv_tq3_encode_key do not depend on γ, so the three candidates are rebuilt here
 * from the stored codes and the key, rounded to FP16 like the real one, and compared on
 * softmax attention over nkeys Gaussian keys (values exact, so only the key error shows). */
enum { GAMMA_NORM, GAMMA_LSQ, GAMMA_DEBIAS, GAMMA_N };
static const char *const gamma_name[GAMMA_N] = {"norm", "lsq", "debias"};

typedef struct gamma_res_s {
    double key_nmse[GAMMA_N];
    double attn[2][GAMMA_N]; /* [temperature][candidate] */
    int shipped;             /* which candidate reproduces kv_tq3_encode_key's γ */
} gamma_res_t;

static const double gamma_qscale[2] = {1.0, 3.0};

static void measure_gamma(uint32_t d, uint64_t seed, gamma_res_t *res)
{
    const uint32_t nkeys = 4096, nq = 64; /* fewer queries leave the ranking in the noise */
    static const float cent[KV_TQ3_LEVELS] = KV_TQ3_CENTROIDS_INIT;
    float *k = xcalloc((uint64_t)nkeys * d, 4), *v = xcalloc((uint64_t)nkeys * d, 4);
    float *kh[GAMMA_N];
    rng_t r = {seed ^ 0x6A77Au};
    fill_rows(&r, k, nkeys, d, 0);
    fill_rows(&r, v, nkeys, d, 0);
    int match[GAMMA_N] = {0};
    double kerr[GAMMA_N] = {0}, ktot = 0;
    for (int m = 0; m < GAMMA_N; m++)
        kh[m] = xcalloc((uint64_t)nkeys * d, 4);
    for (uint32_t n = 0; n < nkeys; n++) {
        const float *x = k + (uint64_t)n * d;
        float y[KV_MAX_HEAD_DIM], ch[KV_MAX_HEAD_DIM];
        uint8_t codes[KV_MAX_HEAD_DIM];
        uint16_t shipped;
        kv_tq3_encode_key(seed, d, x, codes, &shipped);
        kv_rot_forward(seed, d, x, y);
        double nn = 0, beta = 0, c2 = 0;
        for (uint32_t i = 0; i < d; i++)
            nn += (double)x[i] * x[i];
        nn = sqrt(nn);
        for (uint32_t i = 0; i < d; i++) {
            ch[i] = cent[codes[i]] / sqrtf((float)d);
            beta += y[i] / nn * ch[i];
            c2 += (double)ch[i] * ch[i];
        }
        double gm[GAMMA_N] = {nn / sqrt(c2), nn * beta / c2, nn / beta};
        for (int m = 0; m < GAMMA_N; m++) {
            uint16_t h16 = kv_half_from_float((float)gm[m]);
            match[m] += h16 == shipped;
            kv_tq3_decode_key(seed, d, codes, h16, kh[m] + (uint64_t)n * d);
            for (uint32_t i = 0; i < d; i++) {
                double e = (double)x[i] - kh[m][(uint64_t)n * d + i];
                kerr[m] += e * e;
            }
        }
        ktot += nn * nn;
    }
    res->shipped = 0;
    for (int m = 0; m < GAMMA_N; m++) {
        res->key_nmse[m] = kerr[m] / ktot;
        if (match[m] > match[res->shipped])
            res->shipped = m;
    }
    float *q = xcalloc(d, 4);
    double *o = xcalloc(d, 8), *oh = xcalloc(d, 8);
    for (int temp = 0; temp < 2; temp++) {
        double err[GAMMA_N] = {0}, tot = 0;
        for (uint32_t j = 0; j < nq; j++) {
            for (uint32_t i = 0; i < d; i++)
                q[i] = (float)(rng_gauss(&r) * gamma_qscale[temp]);
            dense_attention(1, 1, d, nkeys, q, k, v, o);
            for (uint32_t i = 0; i < d; i++)
                tot += o[i] * o[i];
            for (int m = 0; m < GAMMA_N; m++) {
                dense_attention(1, 1, d, nkeys, q, kh[m], v, oh);
                for (uint32_t i = 0; i < d; i++)
                    err[m] += (oh[i] - o[i]) * (oh[i] - o[i]);
            }
        }
        for (int m = 0; m < GAMMA_N; m++)
            res->attn[temp][m] = sqrt(err[m] / tot);
    }
    free(q);
    free(o);
    free(oh);
    for (int m = 0; m < GAMMA_N; m++)
        free(kh[m]);
    free(k);
    free(v);
}

/* ---- throughput ------------------------------------------------------------------------- */
typedef struct tput_s {
    double append_tok_s, retier_mb_s, promote_mb_s;
} tput_t;

static int measure_throughput(const kv_geom_t *g, tput_t *res)
{
    uint32_t T = g->page_tokens, d = g->head_dim;
    uint64_t row = (uint64_t)g->kv_heads * d, fb = kv_page_bytes(g, KV_FMT_FP8);
    store_t s;
    store_init(&s, g, 1);
    float *k = xcalloc((uint64_t)T * row, 4), *v = xcalloc((uint64_t)T * row, 4);
    rng_t r = {g->seed ^ 0x7157u};
    fill_rows(&r, k, (uint64_t)T * g->kv_heads, d, 0);
    fill_rows(&r, v, (uint64_t)T * g->kv_heads, d, 0);
    int rc = KVK_OK;
    /* each phase runs until 0.2 s have passed: long enough to swamp timer noise */
    double t0 = now_s(), t1;
    uint64_t toks = 0;
    do {
        for (uint32_t l = 0; l < g->layers && rc == KVK_OK; l++)
            rc = store_append(&s, l, T, k, v);
        toks += T;
        t1 = now_s();
    } while (t1 - t0 < 0.2 && rc == KVK_OK);
    res->append_tok_s = (double)toks / (t1 - t0);
    uint64_t iters = 0;
    t0 = now_s();
    do {
        rc |= kv_page_retier(g, s.fp8, s.tq3);
        iters++;
        t1 = now_s();
    } while (t1 - t0 < 0.2 && rc == KVK_OK);
    res->retier_mb_s = (double)iters * (double)fb / 1e6 / (t1 - t0);
    iters = 0;
    t0 = now_s();
    do {
        rc |= kv_page_promote(g, s.tq3, s.fp8);
        iters++;
        t1 = now_s();
    } while (t1 - t0 < 0.2 && rc == KVK_OK);
    res->promote_mb_s = (double)iters * (double)fb / 1e6 / (t1 - t0);
    free(k);
    free(v);
    store_free(&s);
    return rc;
}

/* ---- flags ------------------------------------------------------------------------------ */
static int parse_u64(const char *name, const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long x = s ? strtoull(s, &end, 0) : 0;
    if (!s || !*s || *s == '-' || errno || *end || x < lo || x > hi) {
        fprintf(stderr,
                "kvcodec: %s: expected an integer in [%" PRIu64 ", %" PRIu64 "], got '%s'\n", name,
                lo, hi, s ? s : "");
        return -1;
    }
    *out = x;
    return 0;
}

static int parse_args(int argc, char **argv, opts_t *o)
{
    uint64_t v, qh = 0;
    o->g = (kv_geom_t){.layers = 4, .kv_heads = 8, .head_dim = 128, .page_tokens = 16, .seed = 1};
    o->tokens = 4096;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = NULL, *eq = strchr(a, '=');
        char name[32];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(usage, stdout);
            exit(0);
        }
        size_t len = eq ? (size_t)(eq - a) : strlen(a);
        if (len >= sizeof name) {
            fprintf(stderr, "kvcodec: unknown option '%s'\n%s", a, usage);
            return -1;
        }
        memcpy(name, a, len);
        name[len] = 0;
        val = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (strcmp(name, "--layers") == 0) {
            if (parse_u64(name, val, 1, KV_MAX_LAYERS, &v))
                return -1;
            o->g.layers = (uint32_t)v;
        } else if (strcmp(name, "--kv-heads") == 0) {
            if (parse_u64(name, val, 1, KV_MAX_KV_HEADS, &v))
                return -1;
            o->g.kv_heads = (uint32_t)v;
        } else if (strcmp(name, "--head-dim") == 0) {
            if (parse_u64(name, val, 64, 256, &v))
                return -1;
            if (v != 64 && v != 128 && v != 256) {
                fprintf(stderr, "kvcodec: --head-dim must be 64, 128 or 256, got %" PRIu64 "\n", v);
                return -1;
            }
            o->g.head_dim = (uint32_t)v;
        } else if (strcmp(name, "--page-tokens") == 0) {
            if (parse_u64(name, val, 1, KV_MAX_PAGE_TOKENS, &v))
                return -1;
            o->g.page_tokens = (uint32_t)v;
        } else if (strcmp(name, "--seed") == 0) {
            if (parse_u64(name, val, 0, UINT64_MAX, &v))
                return -1;
            o->g.seed = v;
        } else if (strcmp(name, "--tokens") == 0) {
            if (parse_u64(name, val, 1, 1u << 20, &v))
                return -1;
            o->tokens = (uint32_t)v;
        } else if (strcmp(name, "--q-heads") == 0) {
            if (parse_u64(name, val, 1, 4096, &qh))
                return -1;
        } else {
            fprintf(stderr, "kvcodec: unknown option '%s'\n%s", a, usage);
            return -1;
        }
    }
    o->q_heads = qh ? (uint32_t)qh : 4 * o->g.kv_heads;
    if (o->q_heads % o->g.kv_heads != 0) {
        fprintf(stderr, "kvcodec: --q-heads %u is not a multiple of --kv-heads %u\n", o->q_heads,
                o->g.kv_heads);
        return -1;
    }
    if (!kv_geom_valid(&o->g)) {
        fprintf(stderr, "kvcodec: invalid geometry\n");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    opts_t o;
    if (parse_args(argc, argv, &o) != 0)
        return 2;
    const kv_geom_t *g = &o.g;
    nmse_t ng, no;
    attn_res_t at;
    gamma_res_t gr;
    tput_t tp;
    memset(&ng, 0, sizeof ng);
    memset(&no, 0, sizeof no);
    memset(&at, 0, sizeof at);
    memset(&gr, 0, sizeof gr);
    memset(&tp, 0, sizeof tp);
    int rc = measure_nmse(g, g->seed, 0, &ng);
    if (rc == KVK_OK)
        rc = measure_nmse(g, g->seed + 1, 1, &no);
    if (rc == KVK_OK)
        rc = measure_attention(&o, &at);
    if (rc == KVK_OK) {
        measure_gamma(g->head_dim, g->seed, &gr);
        rc = measure_throughput(g, &tp);
    }
    if (rc != KVK_OK) {
        fprintf(stderr, "kvcodec: a libkvkern call failed (status %d)\n", rc);
        return 1;
    }

    double vals = (double)g->page_tokens * g->head_dim;
    printf("{\n  \"geometry\": {\"layers\": %u, \"kv_heads\": %u, \"head_dim\": %u, "
           "\"page_tokens\": %u, \"seed\": %" PRIu64 ", \"q_heads\": %u, \"tokens\": %u},\n",
           g->layers, g->kv_heads, g->head_dim, g->page_tokens, g->seed, o.q_heads, o.tokens);
    printf("  \"page_bytes\": {\"fp8\": %" PRIu64 ", \"tq3\": %" PRIu64 "},\n",
           kv_page_bytes(g, KV_FMT_FP8), kv_page_bytes(g, KV_FMT_TQ3));
    printf("  \"bits_per_value\": {\n");
    for (int f = 0; f < 2; f++)
        printf("    \"%s\": {\"page\": %.4f, \"k\": %.4f, \"v\": %.4f}%s\n", f ? "tq3" : "fp8",
               kv_page_bits_per_value(g, (kv_fmt_t)f),
               8.0 * (double)kv_block_bytes(g, (kv_fmt_t)f, KV_KIND_K) / vals,
               8.0 * (double)kv_block_bytes(g, (kv_fmt_t)f, KV_KIND_V) / vals, f ? "" : ",");
    printf("  },\n  \"nmse\": {\n");
    for (int s = 0; s < 2; s++) {
        const nmse_t *n = s ? &no : &ng;
        printf("    \"%s\": {\"fp8\": {\"k\": %.5f, \"v\": %.5f}, \"tq3\": {\"k\": %.5f, "
               "\"v\": %.5f}}%s\n",
               s ? "outlier_4ch_x20" : "gaussian", n->fp8[0], n->fp8[1], n->tq3[0], n->tq3[1],
               s ? "" : ",");
    }
    printf("  },\n  \"attention\": {\"reference\": \"float64 dense, unquantized K/V\", "
           "\"splits\": 4, \"rel_err\": {\"fp8\": %.5f, \"tq3\": %.5f, \"mix\": %.5f}, "
           "\"mix_merge_vs_kv_attn_reference\": %.2e},\n",
           at.rel[0], at.rel[1], at.rel[2], at.merge_vs_reference);
    printf("  \"gamma_study\": {\"head_dim\": %u, \"keys\": 4096, \"queries\": 64, "
           "\"shipped\": \"%s\",\n",
           g->head_dim, gamma_name[gr.shipped]);
    for (int m = 0; m < GAMMA_N; m++)
        printf("    \"%s\": {\"key_nmse\": %.5f, \"attn_rel_err_qscale1\": %.5f, "
               "\"attn_rel_err_qscale3\": %.5f}%s\n",
               gamma_name[m], gr.key_nmse[m], gr.attn[0][m], gr.attn[1][m],
               m + 1 < GAMMA_N ? "," : "");
    printf("  },\n  \"throughput\": {\"append_tokens_per_s\": %.0f, \"retier_mb_per_s\": %.1f, "
           "\"promote_mb_per_s\": %.1f}\n}\n",
           tp.append_tok_s, tp.retier_mb_s, tp.promote_mb_s);
    return 0;
}
