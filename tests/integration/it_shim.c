/* it_shim.c — libkvshim (engine-shim/kvshim.h) against the real daemon on the host backend.
 *
 * 1. Two processes, one prompt of 2.5 pages. A: nothing cached; extend, append every layer,
 *    commit (2 pages sealed), attention, checked against the float64 reference over the same
 *    pages. B (another process, while A still holds its sequence): 2 pages cached, its table
 *    starts with A's sealed pages, it computes only the last 8 tokens, and its attention equals
 *    A's bit for bit.
 * 2. Bad arguments: INVALID_ARGUMENT with a message naming the field (a misaligned k, v, q or
 *    out: the argument and the alignment it needs, on the host as on the GPU); misuse of the
 *    sequence state (attention or commit before every layer is appended, append into sealed
 *    pages): FAILED_PRECONDITION. kvs_close ends open sequences (no reference left).
 * 3. A sealed prefix outlives kvs_seq_end; a prompt that is wholly cached still leaves its last
 *    page to compute, and committing it deduplicates to the cached page.
 * 4. f16 and bf16 inputs give the same FP8 page bytes as float inputs of the same values.
 * 5. A seal that times out (the daemon stopped) loses the sequence: everything but kvs_seq_end
 *    refuses it, even once the daemon has deduplicated the page behind the shim's back.
 * 6. kvs_seq_extend is all or nothing: a request larger than the pool leaves no page held, and
 *    one larger than free + evictable pages evicts no cached prefix (its first chunk's reserve).
 * 7. An extend or a commit that would leave tokens without K/V for good is refused.
 * 8. kvs_close with many sequences and a stopped daemon waits one timeout, not one each;
 *    kvs_close ends the daemon session (goodbye): 70 open/close cycles in one process, more
 *    than max_sessions_per_pid, leave no session and no reference.
 * 9. Limits: a client name over 256 bytes, a batch over KVS_MAX_BATCH; a daemon error's code
 *    name appears once in the message.
 * 10. A daemon whose max_alloc is below the shim's 1024-page chunk still serves extends of
 *    more pages than max_alloc; one whose max_tokens is below a prompt still begins it, reusing
 *    the prefix its lookups can cover. The shim sizes both from the hello, so the first
 *    requests are not refused; a bound lowered later is still learnt from the refusal.
 * 11. kvs_append_batch writes, for sequences of different lengths (some crossing into a new page)
 *    and m = 2, 1, 1, 1 in f32, f16, bf16, the same page bytes and attention outputs as
 *    kvs_append of each; its refusals (and a lost sequence's, in 5) leave every page as it was
 *    and record no K/V.
 *
 * Geometry: itest's (2 layers, 2 KV heads, head_dim 64, 16-token pages).
 */
#include <inttypes.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "itest.h"
#include "kvkern.h"
#include "kvshim.h"

#define PT     ITEST_PT
#define LAYERS 2u
#define KVH    2u
#define HD     64u
#define QH     4u  /* two query heads per KV head */
#define NTOK   40u /* 2.5 pages */
#define ROW    (KVH * HD)
#define OUTN   (LAYERS * QH * HD)

/* In a child: report and exit with a code (cmocka's assertions belong to the parent). */
#define CK(c)                                                                                      \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #c);                  \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)
#define CKE(s, call)                                                                               \
    do {                                                                                           \
        kv_err_t e_ = (call);                                                                      \
        if (e_ != KV_ERR_OK) {                                                                     \
            fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call, kv_err_name(e_),    \
                    kvs_errmsg(s));                                                                \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

static void prompt(uint32_t seed, uint32_t *t, size_t n)
{
    for (size_t i = 0; i < n; i++)
        t[i] = seed * 100000u + 5000u + (uint32_t)i * 13u;
}

/* K/V value of (layer, position, kind, head, coordinate): multiples of 1/16 in [-1.875, 1.875],
 * exact in f16 and bf16, so the three input types carry the same numbers. */
static float kv_value(uint32_t l, size_t pos, int kind, uint32_t h, uint32_t i)
{
    uint64_t x = (uint64_t)pos * 131u + l * 31u + (uint32_t)kind * 17u + h * 7u + i * 3u;
    return (float)((int)(x % 61u) - 30) / 16.0f;
}

static uint16_t bf16_bits(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return (uint16_t)(b >> 16); /* exact for the values above */
}

/* Append tokens [from, from + m) of every layer, as dtype dt. */
static kv_err_t fill(kvs_seq_t *q, size_t from, size_t m, kvs_dtype_t dt)
{
    size_t n = m * ROW;
    float *kf = malloc(2 * n * sizeof *kf);
    uint16_t *kh = malloc(2 * n * sizeof *kh);
    assert_non_null(kf);
    assert_non_null(kh);
    kv_err_t e = KV_ERR_OK;
    for (uint32_t l = 0; l < LAYERS && e == KV_ERR_OK; l++) {
        for (size_t t = 0; t < m; t++)
            for (int kind = 0; kind < 2; kind++)
                for (uint32_t h = 0; h < KVH; h++)
                    for (uint32_t i = 0; i < HD; i++) {
                        size_t at = (size_t)kind * n + t * ROW + h * HD + i;
                        kf[at] = kv_value(l, from + t, kind, h, i);
                        kh[at] = dt == KVS_F16 ? kv_half_from_float(kf[at]) : bf16_bits(kf[at]);
                    }
        if (dt == KVS_F32)
            e = kvs_append(q, l, kf, kf + n, dt, m);
        else
            e = kvs_append(q, l, kh, kh + n, dt, m);
    }
    free(kf);
    free(kh);
    return e;
}

static void query(float *q)
{
    for (uint32_t h = 0; h < QH; h++)
        for (uint32_t i = 0; i < HD; i++)
            q[h * HD + i] = (float)((int)((h * 37u + i * 11u) % 23u) - 11) / 8.0f;
}

/* Attention of every layer for one sequence: out[LAYERS][QH][HD]. */
static kv_err_t attend(kvs_t *s, kvs_seq_t *q, float *out)
{
    float qv[QH * HD];
    query(qv);
    for (uint32_t l = 0; l < LAYERS; l++) {
        kv_err_t e = kvs_attention(s, &q, 1, l, QH, qv, 0.0f, out + l * QH * HD);
        if (e != KV_ERR_OK)
            return e;
    }
    return KV_ERR_OK;
}

static kvs_t *shim_open_t(const itest_kvd_t *k, const char *name, int timeout_ms)
{
    kvs_t *s = NULL;
    kv_err_t e = kvs_open(
        &s, &(kvs_opts_t){.endpoint = k->endpoint, .name = name, .timeout_ms = timeout_ms});
    if (e != KV_ERR_OK)
        fprintf(stderr, "kvs_open: %s\n", kvs_errmsg(NULL));
    return s;
}

static kvs_t *shim_open(const itest_kvd_t *k, const char *name)
{
    return shim_open_t(k, name, 30000);
}

/* ---- 1. two processes --------------------------------------------------------------------- */

typedef struct a_report_s {
    uint32_t pages[3];
    float out[OUTN];
} a_report_t;

/* Relative L2 error of out against the float64 reference over the pages, read through a
 * separate libkvc mapping of the same pools. */
static double ref_err(const itest_kvd_t *k, const uint32_t *pages, uint32_t np, uint32_t len,
                      const float *out)
{
    kvc_t *c = itest_connect(k, "reference");
    kv_pools_t pools;
    kvc_pools(c, &pools);
    uint32_t indptr[2] = {0, np};
    float qv[QH * HD];
    query(qv);
    double num = 0, den = 0, ref[QH * HD];
    for (uint32_t l = 0; l < LAYERS; l++) {
        kv_attn_batch_t b = {.batch = 1,
                             .q_heads = QH,
                             .layer = l,
                             .sm_scale = 1.0f / sqrtf((float)HD),
                             .page_indptr = indptr,
                             .page_ids = pages,
                             .seq_len = &len};
        if (kv_attn_reference(kvc_geom(c), &pools, (const kv_dir_entry_t *)kvc_directory(c),
                              kvc_dir_entries(c), &b, qv, ref) != KVK_OK)
            return INFINITY;
        for (uint32_t i = 0; i < QH * HD; i++) {
            double dlt = out[l * QH * HD + i] - ref[i];
            num += dlt * dlt;
            den += ref[i] * ref[i];
        }
    }
    kvc_close(&c);
    return den > 0 ? sqrt(num / den) : INFINITY;
}

static int child_a(const itest_kvd_t *k, int wfd, int rfd)
{
    kvs_t *s = shim_open(k, "shim-A");
    CK(s);
    CK(!kvs_on_device(s) && kvs_geom(s)->page_tokens == PT && kvs_geom(s)->layers == LAYERS);
    uint32_t tok[NTOK];
    prompt(1, tok, NTOK);
    kvs_seq_t *q;
    size_t cached = 99;
    CKE(s, kvs_seq_begin(s, tok, NTOK, &q, &cached));
    CK(cached == 0);
    CKE(s, kvs_seq_extend(q, tok, NTOK));
    CK(kvs_seq_len(q) == NTOK);
    CKE(s, fill(q, 0, NTOK, KVS_F32));
    CKE(s, kvs_seq_commit(q));
    a_report_t r;
    CK(kvs_seq_pages(q, r.pages, 3) == 3);
    /* two pages sealed, the third still open (read through our own directory mapping) */
    kvc_t *c = itest_connect(k, "A-dir");
    for (int i = 0; i < 3; i++)
        CK(!!(kv_dir_flags(kvc_directory(c)[r.pages[i]]) & KV_DIR_SEALED) == (i < 2));
    kvc_close(&c);
    CKE(s, attend(s, q, r.out));
    /* Tolerance 1e-4: both sides read the same FP8 pages, so the only difference is the
     * arithmetic (the twin accumulates in float with an online softmax, the reference in
     * double); over 40 tokens that stays near 1e-6, far below 1e-4. */
    double err = ref_err(k, r.pages, 3, NTOK, r.out);
    fprintf(stderr, "[ shim ] A: attention vs float64 reference: rel err %.3g (tol 1e-4)\n", err);
    CK(err <= 1e-4);
    CK(write(wfd, &r, sizeof r) == (ssize_t)sizeof r);
    char go;
    CK(read(rfd, &go, 1) == 1); /* keep the sequence until B is done */
    kvs_seq_end(&q);
    CK(q == NULL && kvs_errmsg(s)[0] == '\0');
    kvs_close(&s);
    CK(s == NULL);
    return 0;
}

static int child_b(const itest_kvd_t *k, const a_report_t *a)
{
    kvs_t *s = shim_open(k, "shim-B");
    CK(s);
    uint32_t tok[NTOK];
    prompt(1, tok, NTOK);
    kvs_seq_t *q;
    size_t cached = 0;
    CKE(s, kvs_seq_begin(s, tok, NTOK, &q, &cached));
    CK(cached == 2 * PT);
    uint32_t pages[4];
    CK(kvs_seq_pages(q, pages, 4) == 2 && kvs_seq_len(q) == 2 * PT);
    CK(pages[0] == a->pages[0] && pages[1] == a->pages[1]);
    CKE(s, kvs_seq_extend(q, tok + cached, NTOK - cached));
    CKE(s, fill(q, cached, NTOK - cached, KVS_F32));
    CKE(s, kvs_seq_commit(q)); /* no page became full */
    CK(kvs_seq_pages(q, pages, 4) == 3);
    CK(pages[0] == a->pages[0] && pages[1] == a->pages[1] && pages[2] != a->pages[2]);
    float out[OUTN];
    CKE(s, attend(s, q, out));
    CK(memcmp(out, a->out, sizeof out) == 0);
    kvs_close(&s); /* ends q */
    return 0;
}

static void wait_ok(pid_t p)
{
    int st;
    assert_int_equal(waitpid(p, &st, 0), p);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
}

static void test_two_processes_share_a_prefix(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    int a2p[2], p2a[2];
    assert_int_equal(pipe(a2p), 0);
    assert_int_equal(pipe(p2a), 0);
    pid_t a = fork();
    assert_true(a >= 0);
    if (a == 0)
        _exit(child_a(&k, a2p[1], p2a[0]));
    a_report_t r;
    assert_int_equal(read(a2p[0], &r, sizeof r), (ssize_t)sizeof r);
    assert_int_equal(itest_stat(&k, "cache_entries"), 2);
    pid_t b = fork();
    assert_true(b >= 0);
    if (b == 0)
        _exit(child_b(&k, &r));
    wait_ok(b);
    assert_int_equal(write(p2a[1], "g", 1), 1);
    wait_ok(a);
    assert_true(itest_wait_stat(&k, "sessions", 0, 30000) >= 0);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    assert_int_equal(itest_stat(&k, "cache_entries"), 2);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
    close(a2p[0]);
    close(a2p[1]);
    close(p2a[0]);
    close(p2a[1]);
}

/* ---- 2. bad arguments --------------------------------------------------------------------- */

static void expect(kv_err_t got, kv_err_t want, const kvs_t *s, const char *words)
{
    if (got != want || !strstr(kvs_errmsg(s), words))
        fail_msg("got %s \"%s\", want %s with \"%s\"", kv_err_name(got), kvs_errmsg(s),
                 kv_err_name(want), words);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    const kv_err_t INV = KV_ERR_INVALID_ARGUMENT, PRE = KV_ERR_FAILED_PRECONDITION;
    kvs_t *s = NULL;
    expect(kvs_open(NULL, &(kvs_opts_t){.endpoint = "ipc:///nowhere"}), INV, NULL, "out");
    expect(kvs_open(&s, NULL), INV, NULL, "opts");
    expect(kvs_open(&s, &(kvs_opts_t){0}), INV, NULL, "endpoint");
    assert_null(s);
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    /* a wrong namespace is the daemon's error, carried through */
    assert_int_not_equal(kvs_open(&s, &(kvs_opts_t){.endpoint = k.endpoint, .ns = "other"}),
                         KV_ERR_OK);
    assert_null(s);
    assert_true(strstr(kvs_errmsg(NULL), "kvc_hello") != NULL);
    s = shim_open(&k, "bad-args");
    assert_non_null(s);
    uint32_t tok[NTOK];
    prompt(2, tok, NTOK);
    kvs_seq_t *q = NULL;
    size_t cached;
    expect(kvs_seq_begin(NULL, tok, 4, &q, &cached), INV, NULL, "s is NULL");
    expect(kvs_seq_begin(s, NULL, 4, &q, &cached), INV, s, "tokens");
    expect(kvs_seq_begin(s, tok, 0, &q, &cached), INV, s, "n is 0");
    expect(kvs_seq_begin(s, tok, 4, NULL, &cached), INV, s, "out");
    expect(kvs_seq_begin(s, tok, 4, &q, NULL), INV, s, "cached");
    assert_null(q);
    assert_int_equal(kvs_seq_begin(s, tok, 20, &q, &cached), KV_ERR_OK);
    assert_string_equal(kvs_errmsg(s), "");
    float qv[QH * HD] = {0}, out[QH * HD];
    /* nothing cached, nothing extended: said as such, not "K/V for 0 of its 0 tokens" */
    expect(kvs_attention(s, &q, 1, 0, QH, qv, 0, out), PRE, s,
           "seqs[0] is empty (no token cached or extended yet)");
    expect(kvs_seq_extend(q, NULL, 3), INV, s, "tokens");
    expect(kvs_seq_extend(q, tok, 0), INV, s, "m is 0");
    float kv[21 * ROW] = {0};
    expect(kvs_append(q, 0, kv, kv, KVS_F32, 1), INV, s, "the last kvs_seq_extend added 0");
    assert_int_equal(kvs_seq_extend(q, tok, 20), KV_ERR_OK);
    expect(kvs_append(q, LAYERS, kv, kv, KVS_F32, 20), INV, s, "layer 2");
    expect(kvs_append(q, 0, kv, kv, (kvs_dtype_t)7, 20), INV, s, "dtype 7");
    expect(kvs_append(q, 0, kv, kv, KVS_F32, 21), INV, s, "m = 21");
    expect(kvs_append(q, 0, NULL, kv, KVS_F32, 20), INV, s, "k is NULL");
    expect(kvs_append(q, 0, kv, NULL, KVS_F32, 20), INV, s, "v is NULL");
    /* Misaligned rows: the GPU's append kernel refused them and the shim said "a page of the
     * table is not a valid unsealed FP8 page"; the host read them unaligned (undefined). Now
     * refused on every backend, naming the argument and the alignment (failed before: OK). */
    const char *kvb = (const char *)kv;
    expect(kvs_append(q, 0, kvb + 2, kv, KVS_F32, 20), INV, s, "k (");
    expect(kvs_append(q, 0, kvb + 2, kv, KVS_F32, 20), INV, s, "not 4-byte aligned");
    expect(kvs_append(q, 0, kv, kvb + 1, KVS_F16, 20), INV, s, "v (");
    expect(kvs_append(q, 0, kv, kvb + 1, KVS_BF16, 20), INV, s, "not 2-byte aligned");
    expect(kvs_attention(s, &q, 1, 0, QH, qv, 0, out), PRE, s, "kvs_append first");
    expect(kvs_seq_commit(q), PRE, s, "layer 0");
    assert_int_equal(fill(q, 0, 20, KVS_F32), KV_ERR_OK);
    expect(kvs_attention(s, &q, 1, 0, 3, qv, 0, out), INV, s, "q_heads = 3");
    expect(kvs_attention(s, &q, 1, 0, 0, qv, 0, out), INV, s, "q_heads = 0");
    expect(kvs_attention(s, &q, 0, 0, QH, qv, 0, out), INV, s, "nseq is 0");
    expect(kvs_attention(s, NULL, 1, 0, QH, qv, 0, out), INV, s, "seqs is NULL");
    expect(kvs_attention(s, &q, 1, 5, QH, qv, 0, out), INV, s, "layer 5");
    expect(kvs_attention(s, &q, 1, 0, QH, NULL, 0, out), INV, s, "q is NULL");
    expect(kvs_attention(s, &q, 1, 0, QH, qv, 0, NULL), INV, s, "out is NULL");
    expect(kvs_attention(s, &q, 1, 0, QH, qv, -1.0f, out), INV, s, "sm_scale");
    kvs_seq_t *none[1] = {NULL};
    expect(kvs_attention(s, none, 1, 0, QH, qv, 0, out), INV, s, "seqs[0] is NULL");
    /* Misaligned q and out: the GPU kernels refused them and the shim blamed a page or a grid
     * limit; the host computed. Now refused on every backend with the alignment (failed
     * before: OK on the host). */
    _Alignas(16) float qa[QH * HD + 4] = {0}, oa[QH * HD + 1];
    expect(kvs_attention(s, &q, 1, 0, QH, qa + 1, 0, oa), INV, s, "q (");
    expect(kvs_attention(s, &q, 1, 0, QH, qa + 2, 0, oa), INV, s, "not 16-byte aligned");
    float *oddout = (float *)(void *)((char *)oa + 2);
    expect(kvs_attention(s, &q, 1, 0, QH, qa, 0, oddout), INV, s, "out (");
    expect(kvs_attention(s, &q, 1, 0, QH, qa, 0, oddout), INV, s, "not 4-byte aligned");
    assert_int_equal(kvs_attention(s, &q, 1, 0, QH, qa, 0, oa + 1), KV_ERR_OK); /* 4 is enough */
    assert_int_equal(kvs_attention(s, &q, 1, 0, QH, qv, 0, out), KV_ERR_OK);
    /* after the commit the first page is sealed: the same extend cannot be written again */
    assert_int_equal(kvs_seq_commit(q), KV_ERR_OK);
    expect(kvs_append(q, 0, kv, kv, KVS_F32, 20), PRE, s, "sealed");
    /* a sequence of another kvs_t */
    kvs_t *s2 = shim_open(&k, "bad-args-2");
    assert_non_null(s2);
    expect(kvs_attention(s2, &q, 1, 0, QH, qv, 0, out), INV, s2, "another kvs_t");
    /* a layer left out: the page cannot be sealed */
    kvs_seq_t *q2;
    assert_int_equal(kvs_seq_begin(s2, tok + 20, 16, &q2, &cached), KV_ERR_OK);
    assert_int_equal(kvs_seq_extend(q2, tok + 20, 16), KV_ERR_OK);
    assert_int_equal(kvs_append(q2, 0, kv, kv, KVS_F32, 16), KV_ERR_OK);
    expect(kvs_seq_commit(q2), PRE, s2, "layer 1 has K/V for 0 of the 16");
    /* kvs_close ends the open sequences: no request reference is left behind */
    kvs_close(&s2);
    assert_null(s2);
    kvs_close(&s);
    assert_null(s);
    kvs_close(&s); /* NULL-safe */
    kvs_seq_end(NULL);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* ---- 3. prefix after end; a wholly cached prompt ------------------------------------------ */

static void test_prefix_outlives_end_and_full_hit_leaves_a_page(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvs_t *s = shim_open(&k, "reuse");
    assert_non_null(s);
    uint32_t tok[NTOK], p1[2], p2[2], p3[3];
    prompt(3, tok, NTOK);
    float out1[OUTN], out2[OUTN];
    kvs_seq_t *q;
    size_t cached;
    /* exactly two pages, computed and sealed, then ended */
    assert_int_equal(kvs_seq_begin(s, tok, 2 * PT, &q, &cached), KV_ERR_OK);
    assert_int_equal(cached, 0);
    assert_int_equal(kvs_seq_extend(q, tok, 2 * PT), KV_ERR_OK);
    assert_int_equal(fill(q, 0, 2 * PT, KVS_F32), KV_ERR_OK);
    assert_int_equal(kvs_seq_commit(q), KV_ERR_OK);
    assert_int_equal(kvs_seq_pages(q, p1, 2), 2);
    assert_int_equal(attend(s, q, out1), KV_ERR_OK);
    kvs_seq_end(&q);
    assert_null(q);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    assert_int_equal(itest_stat(&k, "cache_entries"), 2);
    /* the same prompt: wholly cached, yet the last page is left to compute */
    uint64_t dd0 = itest_stat(&k, "seal_dedupes");
    assert_int_equal(kvs_seq_begin(s, tok, 2 * PT, &q, &cached), KV_ERR_OK);
    assert_int_equal(cached, PT);
    assert_int_equal(kvs_seq_pages(q, p2, 2), 1);
    assert_int_equal(p2[0], p1[0]);
    assert_int_equal(kvs_seq_extend(q, tok + PT, PT), KV_ERR_OK);
    assert_int_equal(fill(q, PT, PT, KVS_F32), KV_ERR_OK);
    assert_int_equal(kvs_seq_pages(q, p2, 2), 2);
    assert_int_not_equal(p2[1], p1[1]); /* a fresh page before the commit */
    assert_int_equal(kvs_seq_commit(q), KV_ERR_OK);
    assert_int_equal(itest_stat(&k, "seal_dedupes"), dd0 + 1);
    assert_int_equal(kvs_seq_pages(q, p2, 2), 2);
    assert_int_equal(p2[1], p1[1]); /* the duplicate was replaced by the cached page */
    assert_int_equal(attend(s, q, out2), KV_ERR_OK);
    assert_memory_equal(out1, out2, sizeof out1);
    kvs_seq_end(&q);
    /* one page: nothing to reuse (the last token's page is always computed) */
    assert_int_equal(kvs_seq_begin(s, tok, PT, &q, &cached), KV_ERR_OK);
    assert_int_equal(cached, 0);
    assert_int_equal(kvs_seq_pages(q, NULL, 0), 0);
    kvs_seq_end(&q);
    /* a longer prompt hits both pages */
    assert_int_equal(kvs_seq_begin(s, tok, 2 * PT + 1, &q, &cached), KV_ERR_OK);
    assert_int_equal(cached, 2 * PT);
    assert_int_equal(kvs_seq_pages(q, p3, 3), 2);
    assert_memory_equal(p3, p1, sizeof p1);
    kvs_close(&s);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    assert_int_equal(itest_stat(&k, "cache_entries"), 2);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* ---- 4. input types ----------------------------------------------------------------------- */

static void test_f16_bf16_inputs_write_the_float_pages(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvs_t *s = shim_open(&k, "dtypes");
    assert_non_null(s);
    kvc_t *c = itest_connect(&k, "dtypes-read");
    const kvs_dtype_t dts[3] = {KVS_F32, KVS_F16, KVS_BF16};
    kvs_seq_t *q[3];
    uint32_t pages[3][2], tok[2 * PT];
    prompt(4, tok, 2 * PT);
    size_t cached;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvs_seq_begin(s, tok, 2 * PT, &q[i], &cached), KV_ERR_OK);
        assert_int_equal(kvs_seq_extend(q[i], tok, 2 * PT), KV_ERR_OK);
        assert_int_equal(fill(q[i], 0, 2 * PT, dts[i]), KV_ERR_OK);
        assert_int_equal(kvs_seq_pages(q[i], pages[i], 2), 2);
    }
    uint64_t pb = kvc_page_bytes(c, KV_FMT_FP8);
    for (int i = 1; i < 3; i++)
        for (int p = 0; p < 2; p++) {
            const uint8_t *a = kvc_page_ptr(c, pages[0][p]), *b = kvc_page_ptr(c, pages[i][p]);
            assert_non_null(a);
            assert_non_null(b);
            assert_ptr_not_equal(a, b);
            assert_memory_equal(a, b, pb);
        }
    /* and the pages are not trivially equal: the data made it in */
    const uint8_t *a = kvc_page_ptr(c, pages[0][0]);
    size_t nz = 0;
    for (uint64_t i = 0; i < pb; i++)
        nz += a[i] != 0;
    assert_true(nz > pb / 2);
    float o[3][OUTN];
    for (int i = 0; i < 3; i++)
        assert_int_equal(attend(s, q[i], o[i]), KV_ERR_OK);
    assert_memory_equal(o[0], o[1], sizeof o[0]);
    assert_memory_equal(o[0], o[2], sizeof o[0]);
    kvc_close(&c);
    kvs_close(&s);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* ---- 5. a seal that times out ------------------------------------------------------------ */

/* Reviewer's scenario (e8/e9): A seals a prompt; B computes the same two pages and commits
 * while the daemon is stopped, past B's timeout. The daemon then deduplicates B's first page
 * to A's and retires B's, which another session may be given next; before the fix B kept the
 * retired id in its table, attended over it and could write it. Now B's sequence is lost. */
static void test_seal_timeout_loses_the_sequence(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvs_t *a = shim_open(&k, "sealer A");
    kvs_t *b = shim_open_t(&k, "stalled B", 1000);
    assert_non_null(a);
    assert_non_null(b);
    uint32_t tok[2 * PT];
    prompt(5, tok, 2 * PT);
    kvs_seq_t *qa, *qb, *other;
    size_t cached;
    assert_int_equal(kvs_seq_begin(a, tok, 2 * PT, &qa, &cached), KV_ERR_OK);
    assert_int_equal(kvs_seq_extend(qa, tok, 2 * PT), KV_ERR_OK);
    assert_int_equal(fill(qa, 0, 2 * PT, KVS_F32), KV_ERR_OK);
    assert_int_equal(kvs_seq_commit(qa), KV_ERR_OK);
    /* B starts from one token so that nothing is cached for it */
    assert_int_equal(kvs_seq_begin(b, tok, 1, &qb, &cached), KV_ERR_OK);
    assert_int_equal(kvs_seq_extend(qb, tok, 2 * PT), KV_ERR_OK);
    assert_int_equal(fill(qb, 0, 2 * PT, KVS_F32), KV_ERR_OK);
    assert_int_equal(kvs_seq_begin(b, tok, 1, &other, &cached), KV_ERR_OK);
    assert_int_equal(kvs_seq_extend(other, tok, 3), KV_ERR_OK);
    assert_int_equal(fill(other, 0, 3, KVS_F32), KV_ERR_OK);
    const uint64_t dd0 = itest_stat(&k, "seal_dedupes");
    assert_int_equal(kill(k.pid, SIGSTOP), 0);
    kv_err_t e = kvs_seq_commit(qb);
    assert_int_equal(kill(k.pid, SIGCONT), 0);
    expect(e, KV_ERR_TIMEOUT, b, "is lost: end it with kvs_seq_end");
    /* the daemon did the seal after all: B's page 0 was replaced by A's */
    assert_true(itest_wait_stat(&k, "seal_dedupes", dd0 + 1, 30000) >= 0);
    const kv_err_t PRE = KV_ERR_FAILED_PRECONDITION;
    const char *lost = "a seal timed out, its page table is no longer known";
    float kv[2 * PT * ROW] = {0}, qv[2 * QH * HD] = {0}, out[2 * QH * HD];
    expect(kvs_seq_commit(qb), PRE, b, lost);
    expect(kvs_append(qb, 0, kv, kv, KVS_F32, 1), PRE, b, lost);
    expect(kvs_seq_extend(qb, tok, 1), PRE, b, lost);
    kvs_seq_t *batch[2] = {other, qb};
    expect(kvs_attention(b, batch, 2, 0, QH, qv, 0, out), PRE, b, "seqs[1] is sequence");
    /* a batched append refuses it before writing the other sequence's token (all or nothing) */
    uint32_t opage;
    assert_int_equal(kvs_seq_pages(other, &opage, 1), 1);
    kvc_t *c = itest_connect(&k, "lost-read");
    uint64_t pb = kvc_page_bytes(c, KV_FMT_FP8);
    uint8_t *was = malloc(pb);
    assert_non_null(was);
    memcpy(was, kvc_page_ptr(c, opage), pb);
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        kv[i] = 1.5f; /* fill wrote other values: a write would show */
    expect(kvs_append_batch(b, batch, 2, 0, kv, kv, KVS_F32, 1), PRE, b, "seqs[1] is sequence");
    expect(kvs_append_batch(b, batch, 2, 0, kv, kv, KVS_F32, 1), PRE, b, lost);
    assert_memory_equal(kvc_page_ptr(c, opage), was, pb);
    free(was);
    kvc_close(&c);
    assert_int_equal(kvs_seq_pages(qb, NULL, 0), 0);
    /* the session's other sequence is unaffected */
    assert_int_equal(kvs_attention(b, batch, 1, 0, QH, qv, 0, out), KV_ERR_OK);
    assert_int_equal(kvs_seq_end(&qb), KV_ERR_OK);
    assert_null(qb);
    assert_int_equal(kvs_seq_end(&other), KV_ERR_OK);
    /* B holds nothing now: only A's two pages are referenced */
    assert_int_equal(itest_stat(&k, "request_refs"), 2);
    kvs_close(&b);
    kvs_close(&a);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* ---- 6. extend is all or nothing ---------------------------------------------------------- */

/* Reviewer's scenario (e1/e11): 2000 pages asked of a 1500-page pool. The shim allocates in
 * chunks of 1024; the second chunk failed. Before the fix the first 1024 pages stayed in the
 * sequence (request_refs 1024) and starved every other client until kvs_seq_end. Since
 * decision 57 the first chunk carries reserve = 2000 and is refused itself. */
static void test_extend_larger_than_the_pool_holds_nothing(void **state)
{
    (void)state;
    const char *const extra[] = {"--pages_fp8", "1500", NULL};
    itest_kvd_t k;
    itest_kvd_start(&k, extra);
    kvs_t *s = shim_open(&k, "greedy");
    assert_non_null(s);
    const size_t n = 2000 * PT;
    uint32_t *tok = malloc(n * sizeof *tok);
    assert_non_null(tok);
    prompt(6, tok, n);
    kvs_seq_t *q;
    size_t cached;
    assert_int_equal(kvs_seq_begin(s, tok, 3, &q, &cached), KV_ERR_OK);
    kv_err_t e = kvs_seq_extend(q, tok, n);
    expect(e, KV_ERR_RESOURCE_EXHAUSTED, s, "kvs_seq_extend: kvc_alloc_reserve: ");
    /* the code is the return value; the message does not repeat it */
    assert_null(strstr(kvs_errmsg(s), "RESOURCE_EXHAUSTED"));
    assert_int_equal(kvs_seq_len(q), 0);
    assert_int_equal(kvs_seq_pages(q, NULL, 0), 0);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    assert_int_equal(itest_stat(&k, "alloc_pages"), 0); /* even the first chunk: reserve */
    /* another client gets the whole pool at once, while the shim makes no further call: the
     * released pages wait for every session's epoch report (docs/protocol.md "Epochs"), and
     * the shim reported after its release */
    kvc_t *c = itest_connect(&k, "the rest");
    uint32_t *pages = malloc(1500 * sizeof *pages);
    assert_non_null(pages);
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1500, pages), KV_ERR_OK);
    assert_int_equal(kvc_goodbye(c, NULL), KV_ERR_OK); /* its 1500 pages freed at once */
    kvc_close(&c);
    /* a refusal leaves the sequence usable */
    assert_int_equal(kvs_seq_extend(q, tok, 3), KV_ERR_OK);
    assert_int_equal(kvs_seq_pages(q, NULL, 0), 1);
    assert_int_equal(kvs_seq_end(&q), KV_ERR_OK);
    kvs_close(&s);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
    free(pages);
    free(tok);
}

/* The "Not done" of docs/engine-shim.md until decision 57: a chunk of a large extend evicted
 * unreferenced prefixes to find its pages, then a later chunk failed, and the prefixes were
 * lost for nothing. Pool 1500; a client's 8-page prompt cached and released; 1020 pages free.
 * An extend of 2000 pages (chunks 1024 + 976) is refused before its first chunk evicts; one of
 * 1028 (what free + evictable give) succeeds and evicts what it needs. */
static void test_failed_extend_keeps_the_cache(void **state)
{
    (void)state;
    const char *const extra[] = {"--pages_fp8", "1500", NULL};
    itest_kvd_t k;
    itest_kvd_start(&k, extra);
    kvc_t *c = itest_connect(&k, "cacher");
    uint32_t known[8], ktok[8 * PT], hit[8];
    itest_seal_known(c, 61, 8, known);
    assert_int_equal(kvc_release(c, known, 8), KV_ERR_OK);
    itest_prompt_tokens(61, 8, ktok);
    uint32_t *held = malloc(472 * sizeof *held);
    assert_non_null(held);
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 472, held), KV_ERR_OK);
    assert_int_equal(itest_stat(&k, "pages_free.fp8"), 1020);
    kvs_t *s = shim_open(&k, "large extend");
    assert_non_null(s);
    const size_t n = 2000 * PT;
    uint32_t *tok = malloc(n * sizeof *tok);
    assert_non_null(tok);
    prompt(8, tok, n);
    kvs_seq_t *q;
    size_t cached, np = 0;
    assert_int_equal(kvs_seq_begin(s, tok, 3, &q, &cached), KV_ERR_OK);
    const uint64_t a0 = itest_stat(&k, "alloc_pages");
    kv_err_t e = kvs_seq_extend(q, tok, n);
    print_message("refused: %s\n", kvs_errmsg(s));
    assert_int_equal(itest_stat(&k, "evictions_pressure"), 0); /* was 4: the first chunk's */
    expect(e, KV_ERR_RESOURCE_EXHAUSTED, s,
           "reserve 2000 refused before allocating or evicting anything");
    assert_int_equal(itest_stat(&k, "alloc_pages"), a0);
    assert_int_equal(itest_stat(&k, "cache_entries"), 8);
    assert_int_equal(kvc_lookup(c, ktok, 8 * PT, NULL, 0, 1, hit, 8, &np, NULL), KV_ERR_OK);
    assert_int_equal(np, 8);
    assert_memory_equal(hit, known, sizeof known);
    assert_int_equal(kvs_seq_len(q), 0);
    /* what the pool can give: 1020 free + 8 evictable */
    assert_int_equal(kvs_seq_extend(q, tok, 1028 * PT), KV_ERR_OK);
    assert_int_equal(kvs_seq_pages(q, NULL, 0), 1028);
    assert_int_equal(itest_stat(&k, "evictions_pressure"), 8);
    assert_int_equal(kvs_seq_end(&q), KV_ERR_OK);
    kvs_close(&s);
    assert_int_equal(kvc_release(c, held, 472), KV_ERR_OK);
    kvc_close(&c);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
    free(held);
    free(tok);
}

/* ---- 7. tokens that could never get K/V --------------------------------------------------- */

/* Reviewer's scenario (e4): extend 20, append only 10 of them, extend 1 more. kvs_append
 * writes only the last extend's tokens, so tokens 10..19 could never be written and the
 * sequence could never be committed or attended. Now that extend is refused; so is a commit
 * that would seal into an extend whose tokens are not all appended. */
static void test_extend_or_commit_before_append_refused(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvs_t *s = shim_open(&k, "hasty");
    assert_non_null(s);
    uint32_t tok[NTOK];
    prompt(7, tok, NTOK);
    kvs_seq_t *q;
    size_t cached;
    const kv_err_t PRE = KV_ERR_FAILED_PRECONDITION;
    float kv[NTOK * ROW] = {0};
    assert_int_equal(kvs_seq_begin(s, tok, 20, &q, &cached), KV_ERR_OK);
    assert_int_equal(kvs_seq_extend(q, tok, 20), KV_ERR_OK);
    assert_int_equal(kvs_append(q, 0, kv, kv, KVS_F32, 20), KV_ERR_OK);
    expect(kvs_seq_extend(q, tok + 20, 1), PRE, s, "layer 1 has K/V for 0 of the sequence's 20");
    assert_int_equal(kvs_append(q, 1, kv, kv, KVS_F32, 10), KV_ERR_OK);
    expect(kvs_seq_extend(q, tok + 20, 1), PRE, s, "layer 1 has K/V for 10 of the sequence's 20");
    /* page 0 is fully written, but sealing it would strand tokens 17..19 of layer 1 */
    assert_int_equal(fill(q, 0, 17, KVS_F32), KV_ERR_OK);
    expect(kvs_seq_commit(q), PRE, s, "sealing would leave the rest unwritable");
    assert_int_equal(fill(q, 0, 20, KVS_F32), KV_ERR_OK);
    assert_int_equal(kvs_seq_commit(q), KV_ERR_OK);
    assert_int_equal(kvs_seq_extend(q, tok + 20, 1), KV_ERR_OK);
    assert_int_equal(fill(q, 20, 1, KVS_F32), KV_ERR_OK);
    float out[OUTN];
    assert_int_equal(attend(s, q, out), KV_ERR_OK);
    kvs_close(&s);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* ---- 8. kvs_close against a stopped daemon ------------------------------------------------ */

/* Reviewer's scenario (e5): 8 live sequences and a daemon that does not answer; kvs_close sent
 * one seq_close each and waited a full timeout for each (8 s at 1 s). Now it stops after the
 * first timeout. Bound: 3 timeouts, well below the 8 of before on a loaded machine. */
static void test_close_waits_one_timeout(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    const int timeout_ms = 500;
    kvs_t *s = shim_open_t(&k, "closing", timeout_ms);
    assert_non_null(s);
    uint32_t tok[3] = {1, 2, 3};
    for (int i = 0; i < 8; i++) {
        kvs_seq_t *q;
        size_t cached;
        assert_int_equal(kvs_seq_begin(s, tok, 3, &q, &cached), KV_ERR_OK);
    }
    assert_int_equal(kill(k.pid, SIGSTOP), 0);
    int64_t t0 = itest_now_us();
    kvs_close(&s);
    int64_t ms = (itest_now_us() - t0) / 1000;
    assert_int_equal(kill(k.pid, SIGCONT), 0);
    fprintf(stderr, "[ shim ] kvs_close, 8 sequences, daemon stopped: %" PRId64
                    " ms (timeout %d)\n",
            ms, timeout_ms);
    assert_null(s);
    assert_true(ms < 3 * timeout_ms);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* Reviewer's scenario (e2/e3): kvs_close left the session alive until the process exited, so
 * the 65th kvs_open of a process was refused (max_sessions_per_pid 64) and a closed kvs_t held
 * back the recycling of every page others released. kvs_close now says goodbye. */
static void test_close_ends_the_session(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    uint32_t tok[2 * PT];
    prompt(8, tok, 2 * PT);
    for (int i = 0; i < 70; i++) {
        kvs_t *s = shim_open(&k, "one per request");
        assert_non_null(s);
        kvs_seq_t *q;
        size_t cached;
        assert_int_equal(kvs_seq_begin(s, tok, 2 * PT, &q, &cached), KV_ERR_OK);
        assert_int_equal(kvs_seq_extend(q, tok + cached, 2 * PT - cached), KV_ERR_OK);
        kvs_close(&s); /* q still open, holding two pages */
    }
    assert_int_equal(itest_stat(&k, "sessions"), 0);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    assert_int_equal(itest_stat(&k, "sequences"), 0);
    /* a kvs_open that fails after the daemon answered its hello (here: the fd socket is gone,
     * so the pools cannot be handed over) leaves no session behind either */
    char fds[400], away[420];
    snprintf(fds, sizeof fds, "%s/run/kvd.sock.fds", k.dir);
    snprintf(away, sizeof away, "%s.away", fds);
    assert_int_equal(rename(fds, away), 0);
    assert_null(shim_open_t(&k, "no fds", 2000));
    assert_int_equal(rename(away, fds), 0);
    assert_int_equal(itest_stat(&k, "sessions"), 0);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* ---- 9. limits ---------------------------------------------------------------------------- */

static void test_name_and_batch_limits(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    /* 256 bytes (the protocol's limit) go through whole; 257 are refused, not cut */
    char name[258];
    memset(name, 'n', sizeof name);
    name[256] = '\0';
    kvs_t *s = shim_open(&k, name);
    assert_non_null(s);
    char out[8192];
    const char *sessions[] = {"sessions", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, sessions), 0);
    assert_non_null(strstr(out, name));
    kvs_t *s2 = NULL;
    name[256] = 'n';
    name[257] = '\0';
    expect(kvs_open(&s2, &(kvs_opts_t){.endpoint = k.endpoint, .name = name}),
           KV_ERR_INVALID_ARGUMENT, NULL, "opts.name is 257 bytes (the protocol allows 256)");
    assert_null(s2);
    /* one batch at most KVS_MAX_BATCH sequences, whatever the backend */
    uint32_t tok[PT];
    prompt(9, tok, PT);
    kvs_seq_t *q;
    size_t cached;
    assert_int_equal(kvs_seq_begin(s, tok, PT, &q, &cached), KV_ERR_OK);
    size_t nseq = (size_t)KVS_MAX_BATCH + 1;
    kvs_seq_t **many = malloc(nseq * sizeof *many);
    assert_non_null(many);
    for (size_t i = 0; i < nseq; i++)
        many[i] = q;
    /* refused before q and out are read: one query's worth is enough */
    float qv[QH * HD] = {0}, o[QH * HD];
    expect(kvs_attention(s, many, nseq, 0, QH, qv, 0, o), KV_ERR_INVALID_ARGUMENT, s,
           "at most KVS_MAX_BATCH = 32767");
    free(many);
    kvs_close(&s);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* ---- 10. the daemon's request bounds ------------------------------------------------------ */

/* kvd with `extra` and a metrics listener on a free port; returns the port */
static int start_with_metrics(itest_kvd_t *k, const char *const *extra)
{
    char port[16];
    const int p = itest_free_port();
    snprintf(port, sizeof port, "%d", p);
    const char *argv[16];
    size_t n = 0;
    while (extra[n]) {
        assert_true(n < 13);
        argv[n] = extra[n];
        n++;
    }
    argv[n++] = "--metrics_port";
    argv[n++] = port;
    argv[n] = NULL;
    itest_kvd_start(k, argv);
    return p;
}

/* Requests the daemon refused with INVALID_ARGUMENT so far (its request gate among them). */
static uint64_t invalid_replies(int port)
{
    static char out[1 << 20];
    assert_true(itest_scrape(port, out, sizeof out) > 1000);
    const char *key = "\nkvd_rpc_errors_total{code=\"INVALID_ARGUMENT\"} ";
    const char *at = strstr(out, key);
    if (!at)
        fail_msg("no INVALID_ARGUMENT count in the metrics");
    return strtoull(at + strlen(key), NULL, 10);
}

/* Set a daemon directive through kvctl. */
static void config_set(const itest_kvd_t *k, const char *key, const char *value)
{
    char out[4096];
    const char *set[] = {"config", "set", key, value, NULL};
    if (itest_kvctl(k, out, sizeof out, set) != 0)
        fail_msg("kvctl config set %s %s: %s", key, value, out);
}

/* max_alloc (a daemon directive, runtime-mutable, 4096 by default) below the shim's chunk of
 * 1024 pages: every extend of more than max_alloc pages failed with INVALID_ARGUMENT ("alloc:
 * count 300, allowed 1..100"), so the engine could not serve a 4800-token prompt at all. */
static void test_extend_beyond_a_lower_max_alloc(void **state)
{
    (void)state;
    const char *const extra[] = {"--pages_fp8", "1500", "--max_alloc", "100", NULL};
    itest_kvd_t k;
    const int port = start_with_metrics(&k, extra);
    kvs_t *s = shim_open(&k, "max_alloc 100");
    assert_non_null(s);
    const size_t n = 300 * PT;
    uint32_t *tok = malloc((n + 200 + 100 * PT) * sizeof *tok);
    assert_non_null(tok);
    prompt(10, tok, n + 200 + 100 * PT);
    kvs_seq_t *q;
    size_t cached;
    assert_int_equal(kvs_seq_begin(s, tok, n, &q, &cached), KV_ERR_OK);
    kv_err_t e = kvs_seq_extend(q, tok, n);
    if (e != KV_ERR_OK)
        fail_msg("extend of 300 pages, max_alloc 100: %s (%s)", kv_err_name(e), kvs_errmsg(s));
    assert_string_equal(kvs_errmsg(s), "");
    assert_int_equal(kvs_seq_pages(q, NULL, 0), 300);
    assert_int_equal(itest_stat(&k, "request_refs"), 300);
    /* chunks of the max_alloc the hello told: 3 allocs, none refused (before HelloRep.max_alloc
     * the shim sent 300 and 150, both refused, before 75 was taken) */
    assert_int_equal(itest_stat(&k, "alloc_calls"), 3);
    assert_int_equal(invalid_replies(port), 0);
    assert_int_equal(fill(q, 0, n, KVS_F32), KV_ERR_OK);
    uint64_t calls = itest_stat(&k, "alloc_calls");
    assert_int_equal(kvs_seq_extend(q, tok + n, 200), KV_ERR_OK); /* 12.5 pages: 13 */
    assert_int_equal(kvs_seq_pages(q, NULL, 0), 313);
    assert_int_equal(itest_stat(&k, "alloc_calls"), calls + 1);
    assert_int_equal(fill(q, n, 200, KVS_F32), KV_ERR_OK);
    /* max_alloc lowered after the hello: the chunk of 100 is refused, and the shim halves it
     * (100 -> 50 -> 25) for this extend and the next ones */
    config_set(&k, "max_alloc", "40");
    e = kvs_seq_extend(q, tok + n + 200, 100 * PT); /* the last page's 8 slots + 100 pages */
    if (e != KV_ERR_OK)
        fail_msg("extend of 100 pages, max_alloc 40 since: %s (%s)", kv_err_name(e), kvs_errmsg(s));
    assert_int_equal(kvs_seq_pages(q, NULL, 0), 413);
    assert_int_equal(invalid_replies(port), 2);
    /* more than the pool: still refused, and nothing held */
    kvs_seq_t *q2;
    assert_int_equal(kvs_seq_begin(s, tok, 3, &q2, &cached), KV_ERR_OK);
    uint32_t *big = malloc(1600 * PT * sizeof *big);
    assert_non_null(big);
    prompt(11, big, 1600 * PT);
    assert_int_not_equal(kvs_seq_extend(q2, big, 1600 * PT), KV_ERR_OK);
    assert_int_equal(kvs_seq_pages(q2, NULL, 0), 0);
    assert_int_equal(itest_stat(&k, "request_refs"), 413);
    kvs_close(&s);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
    free(big);
    free(tok);
}

/* max_tokens (the most tokens one lookup may carry; 1 048 576 by default, runtime-mutable)
 * below a prompt: kvs_seq_begin failed with INVALID_ARGUMENT ("lookup: 288 tokens, max 100"),
 * so the engine could not serve a prompt longer than that at all, cached or not. */
static void test_begin_beyond_a_lower_max_tokens(void **state)
{
    (void)state;
    const char *const extra[] = {"--max_tokens", "100", NULL};
    itest_kvd_t k;
    const int port = start_with_metrics(&k, extra);
    kvs_t *s = shim_open(&k, "max_tokens 100");
    assert_non_null(s);
    enum { N = 300 }; /* 18 whole pages before the last token */
    uint32_t tok[N];
    prompt(12, tok, N);
    kvs_seq_t *q;
    size_t cached = 99;
    kv_err_t e = kvs_seq_begin(s, tok, N, &q, &cached);
    if (e != KV_ERR_OK)
        fail_msg("begin of %d tokens, max_tokens 100: %s (%s)", N, kv_err_name(e), kvs_errmsg(s));
    assert_int_equal(cached, 0);
    assert_int_equal(kvs_seq_extend(q, tok, N), KV_ERR_OK);
    assert_int_equal(fill(q, 0, N, KVS_F32), KV_ERR_OK);
    assert_int_equal(kvs_seq_commit(q), KV_ERR_OK);
    assert_int_equal(kvs_seq_end(&q), KV_ERR_OK);
    assert_int_equal(itest_stat(&k, "cache_entries"), 18);
    /* the same prompt again: the lookup covers what max_tokens, told at hello, allows (6 pages,
     * 96 tokens; before HelloRep.max_tokens, 18 and 9 pages were refused first, then 4 taken),
     * and the rest is computed as for a miss */
    assert_int_equal(kvs_seq_begin(s, tok, N, &q, &cached), KV_ERR_OK);
    assert_string_equal(kvs_errmsg(s), "");
    assert_int_equal(cached, 6 * PT);
    assert_int_equal(itest_stat(&k, "lookups"), 2);
    assert_int_equal(invalid_replies(port), 0);
    assert_int_equal(kvs_seq_extend(q, tok + cached, N - cached), KV_ERR_OK);
    assert_int_equal(fill(q, cached, N - cached, KVS_F32), KV_ERR_OK);
    assert_int_equal(kvs_seq_commit(q), KV_ERR_OK); /* pages 6..17 deduplicate */
    float out[OUTN];
    assert_int_equal(attend(s, q, out), KV_ERR_OK);
    assert_int_equal(itest_stat(&k, "cache_entries"), 18);
    assert_int_equal(kvs_seq_end(&q), KV_ERR_OK);
    /* max_tokens lowered after the hello: 6 and 3 pages are refused, 1 page (16 tokens) taken */
    config_set(&k, "max_tokens", "40");
    assert_int_equal(kvs_seq_begin(s, tok, N, &q, &cached), KV_ERR_OK);
    assert_int_equal(cached, PT);
    assert_int_equal(invalid_replies(port), 2);
    assert_int_equal(kvs_seq_end(&q), KV_ERR_OK);
    /* below one page when the shim opens: no lookup could be taken, so none is sent and the
     * prompt begins uncached (before, the lookup was refused down to one page and the begin
     * failed: no prompt longer than a page could begin) */
    config_set(&k, "max_tokens", "8");
    kvs_t *s2 = shim_open(&k, "max_tokens 8");
    assert_non_null(s2);
    const uint64_t lookups = itest_stat(&k, "lookups");
    e = kvs_seq_begin(s2, tok, N, &q, &cached);
    if (e != KV_ERR_OK)
        fail_msg("begin of %d tokens, max_tokens 8: %s (%s)", N, kv_err_name(e), kvs_errmsg(s2));
    assert_int_equal(cached, 0);
    assert_int_equal(itest_stat(&k, "lookups"), lookups);
    assert_int_equal(invalid_replies(port), 2);
    assert_int_equal(kvs_seq_end(&q), KV_ERR_OK);
    /* the same limit reached by the first shim at run time (its lookup is down to one page):
     * that page is refused, and the prompt begins uncached, as for s2, instead of failing */
    e = kvs_seq_begin(s, tok, N, &q, &cached);
    if (e != KV_ERR_OK)
        fail_msg("begin of %d tokens after max_tokens was lowered to 8: %s (%s)", N,
                 kv_err_name(e), kvs_errmsg(s));
    assert_int_equal(cached, 0);
    assert_int_equal(invalid_replies(port), 3);
    assert_int_equal(kvs_seq_end(&q), KV_ERR_OK);
    /* and it sends no lookup after that */
    assert_int_equal(kvs_seq_begin(s, tok, N, &q, &cached), KV_ERR_OK);
    assert_int_equal(invalid_replies(port), 3);
    assert_int_equal(itest_stat(&k, "lookups"), lookups);
    assert_int_equal(kvs_seq_end(&q), KV_ERR_OK);
    kvs_close(&s2);
    kvs_close(&s);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* ---- 11. batched append -------------------------------------------------------------------- */

#define BN 5u /* sequences in the batch */

/* K/V of sequence j (of the batch) at pos: kv_value shifted per sequence, so that rows handed
 * to the wrong sequence or slot change the pages. */
static float bval(uint32_t j, uint32_t l, size_t pos, int kind, uint32_t h, uint32_t i)
{
    return kv_value(l, pos + 1000u * j, kind, h, i);
}

static size_t pages_total(kvs_seq_t *const *q, size_t n)
{
    size_t total = 0;
    for (size_t j = 0; j < n; j++)
        total += kvs_seq_pages(q[j], NULL, 0);
    return total;
}

/* The FP8 bytes of every page of the sequences, concatenated into a fresh buffer. */
static uint8_t *pages_of(kvc_t *c, kvs_seq_t *const *q, size_t n)
{
    uint64_t pb = kvc_page_bytes(c, KV_FMT_FP8);
    uint32_t ids[8];
    uint8_t *out = malloc(pages_total(q, n) * pb), *at = out;
    assert_non_null(out);
    for (size_t j = 0; j < n; j++) {
        size_t np = kvs_seq_pages(q[j], ids, 8);
        assert_true(np <= 8);
        for (size_t p = 0; p < np; p++, at += pb)
            memcpy(at, kvc_page_ptr(c, ids[p]), pb);
    }
    return out;
}

/* One batched append of m tokens per sequence (rows [BN][m][ROW], as dt) into a[], and the same
 * values as f32 through kvs_append into b[], one sequence after another, for every layer. */
static void append_both(kvs_t *s, kvs_seq_t **a, kvs_seq_t **b, size_t m, kvs_dtype_t dt)
{
    const size_t n = BN * m * ROW;
    float *kf = malloc(2 * n * sizeof *kf);
    uint16_t *kh = malloc(2 * n * sizeof *kh);
    assert_non_null(kf);
    assert_non_null(kh);
    for (uint32_t l = 0; l < LAYERS; l++) {
        for (uint32_t j = 0; j < BN; j++) {
            size_t from = kvs_seq_len(a[j]) - m; /* the extend was of m tokens */
            for (size_t t = 0; t < m; t++)
                for (int kind = 0; kind < 2; kind++)
                    for (uint32_t h = 0; h < KVH; h++)
                        for (uint32_t i = 0; i < HD; i++) {
                            size_t at = (size_t)kind * n + ((size_t)j * m + t) * ROW + h * HD + i;
                            kf[at] = bval(j, l, from + t, kind, h, i);
                            kh[at] = dt == KVS_F16 ? kv_half_from_float(kf[at]) : bf16_bits(kf[at]);
                        }
        }
        const void *k = dt == KVS_F32 ? (const void *)kf : (const void *)kh;
        const void *v = dt == KVS_F32 ? (const void *)(kf + n) : (const void *)(kh + n);
        kv_err_t e = kvs_append_batch(s, a, BN, l, k, v, dt, m);
        if (e != KV_ERR_OK)
            fail_msg("kvs_append_batch: %s (%s)", kv_err_name(e), kvs_errmsg(s));
        for (uint32_t j = 0; j < BN; j++)
            assert_int_equal(
                kvs_append(b[j], l, kf + j * m * ROW, kf + n + j * m * ROW, KVS_F32, m), KV_ERR_OK);
    }
    free(kf);
    free(kh);
}

static void test_append_batch(void **state)
{
    (void)state;
    const kv_err_t INV = KV_ERR_INVALID_ARGUMENT, PRE = KV_ERR_FAILED_PRECONDITION;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvs_t *s = shim_open(&k, "batch"), *s2 = shim_open(&k, "batch-other");
    assert_non_null(s);
    assert_non_null(s2);
    kvc_t *c = itest_connect(&k, "batch-read");
    const uint64_t pb = kvc_page_bytes(c, KV_FMT_FP8);
    /* a[j] appended in batches, b[j] one by one; the same prompts (never committed, so
     * nothing is shared), 13 + j tokens: the first extend of 2 takes 3 of them into page 1 */
    kvs_seq_t *a[BN], *b[BN];
    uint32_t tok[64];
    size_t cached;
    for (uint32_t j = 0; j < BN; j++) {
        prompt(20 + j, tok, 64);
        assert_int_equal(kvs_seq_begin(s, tok, 13 + j, &a[j], &cached), KV_ERR_OK);
        assert_int_equal(kvs_seq_begin(s, tok, 13 + j, &b[j], &cached), KV_ERR_OK);
        assert_int_equal(kvs_seq_extend(a[j], tok, 13 + j), KV_ERR_OK);
        assert_int_equal(kvs_seq_extend(b[j], tok, 13 + j), KV_ERR_OK);
        assert_int_equal(fill(a[j], 0, 13 + j, KVS_F32), KV_ERR_OK);
        assert_int_equal(fill(b[j], 0, 13 + j, KVS_F32), KV_ERR_OK);
    }
    const size_t ms[4] = {2, 1, 1, 1};
    const kvs_dtype_t dts[4] = {KVS_F32, KVS_F16, KVS_BF16, KVS_F32};
    for (int r = 0; r < 4; r++) {
        for (uint32_t j = 0; j < BN; j++) {
            prompt(20 + j, tok, 64);
            size_t len = kvs_seq_len(a[j]);
            assert_int_equal(kvs_seq_extend(a[j], tok + len, ms[r]), KV_ERR_OK);
            assert_int_equal(kvs_seq_extend(b[j], tok + len, ms[r]), KV_ERR_OK);
        }
        append_both(s, a, b, ms[r], dts[r]);
    }
    /* the same bytes in every page, and the same attention, bit for bit */
    assert_int_equal(pages_total(a, BN), pages_total(b, BN));
    uint8_t *pa = pages_of(c, a, BN), *pbb = pages_of(c, b, BN);
    assert_memory_equal(pa, pbb, pages_total(a, BN) * pb);
    free(pbb);
    for (uint32_t j = 0; j < BN; j++) {
        float oa[OUTN], ob[OUTN];
        assert_int_equal(attend(s, a[j], oa), KV_ERR_OK); /* every token has K/V recorded */
        assert_int_equal(attend(s, b[j], ob), KV_ERR_OK);
        assert_memory_equal(oa, ob, sizeof oa);
    }
    free(pa);

    /* Refusals write nothing: a[0..BN-2] extended by 2, a[BN-1] by 1, the bad entry last in
     * each list, so a call that wrote before it checked everything would change the pages */
    for (uint32_t j = 0; j < BN; j++) {
        prompt(20 + j, tok, 64);
        size_t len = kvs_seq_len(a[j]), m = j + 1 < BN ? 2 : 1;
        assert_int_equal(kvs_seq_extend(a[j], tok + len, m), KV_ERR_OK);
    }
    kvs_seq_t *sealed, *foreign;
    prompt(40, tok, 64);
    assert_int_equal(kvs_seq_begin(s, tok, PT, &sealed, &cached), KV_ERR_OK);
    assert_int_equal(kvs_seq_extend(sealed, tok, PT), KV_ERR_OK);
    assert_int_equal(fill(sealed, 0, PT, KVS_F32), KV_ERR_OK);
    assert_int_equal(kvs_seq_commit(sealed), KV_ERR_OK); /* its last extend is sealed now */
    assert_int_equal(kvs_seq_begin(s2, tok, 1, &foreign, &cached), KV_ERR_OK);
    assert_int_equal(kvs_seq_extend(foreign, tok, 3), KV_ERR_OK);
    static float kv[BN * 2 * ROW];
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        kv[i] = 1.5f; /* unlike any bval row: a write would show */
    const char *kvb = (const char *)kv;
    uint8_t *before = pages_of(c, a, BN);
    const size_t nbytes = pages_total(a, BN) * pb;
    expect(kvs_append_batch(NULL, a, BN, 0, kv, kv, KVS_F32, 1), INV, NULL, "s is NULL");
    expect(kvs_append_batch(s, NULL, BN, 0, kv, kv, KVS_F32, 1), INV, s, "seqs is NULL");
    expect(kvs_append_batch(s, a, 0, 0, kv, kv, KVS_F32, 1), INV, s, "nseq is 0");
    expect(kvs_append_batch(s, a, BN, 0, NULL, kv, KVS_F32, 1), INV, s, "k is NULL");
    expect(kvs_append_batch(s, a, BN, 0, kv, NULL, KVS_F32, 1), INV, s, "v is NULL");
    expect(kvs_append_batch(s, a, BN, LAYERS, kv, kv, KVS_F32, 1), INV, s, "layer 2");
    expect(kvs_append_batch(s, a, BN, 0, kv, kv, (kvs_dtype_t)7, 1), INV, s, "dtype 7");
    expect(kvs_append_batch(s, a, BN, 0, kvb + 2, kv, KVS_F32, 1), INV, s, "k (");
    expect(kvs_append_batch(s, a, BN, 0, kv, kvb + 1, KVS_F16, 1), INV, s, "not 2-byte aligned");
    expect(kvs_append_batch(s, a, BN, 0, kv, kv, KVS_F32, 0), INV, s, "m is 0");
    expect(kvs_append_batch(s, a, BN, 0, kv, kv, KVS_F32, 2), INV, s,
           "m = 2; the last kvs_seq_extend of seqs[4] added 1 tokens");
    kvs_seq_t *other_s[3] = {a[0], a[1], foreign};
    expect(kvs_append_batch(s, other_s, 3, 0, kv, kv, KVS_F32, 1), INV, s,
           "seqs[2] is a sequence of another kvs_t");
    kvs_seq_t *twice[3] = {a[0], a[1], a[0]};
    expect(kvs_append_batch(s, twice, 3, 0, kv, kv, KVS_F32, 1), INV, s,
           "seqs[2] is seqs[0] again");
    kvs_seq_t *with_null[3] = {a[0], a[1], NULL};
    expect(kvs_append_batch(s, with_null, 3, 0, kv, kv, KVS_F32, 1), INV, s, "seqs[2] is NULL");
    kvs_seq_t *with_sealed[3] = {a[0], a[1], sealed};
    expect(kvs_append_batch(s, with_sealed, 3, 0, kv, kv, KVS_F32, 1), PRE, s,
           "the last extend of seqs[2] are in pages already sealed");
    uint8_t *after = pages_of(c, a, BN);
    assert_memory_equal(after, before, nbytes);
    free(after);
    /* and no K/V was recorded */
    float qv[QH * HD] = {0}, out[BN * QH * HD];
    expect(kvs_attention(s, a, BN, 0, QH, qv, 0, out), PRE, s, "kvs_append first");
    /* the refused calls' duplicate marks do not outlive them: the full list goes through now,
     * and writes (m = 1 ≤ every extend) */
    assert_int_equal(kvs_append_batch(s, a, BN, 0, kv, kv, KVS_F32, 1), KV_ERR_OK);
    after = pages_of(c, a, BN);
    assert_memory_not_equal(after, before, nbytes);
    free(after);
    free(before);
    assert_int_equal(kvs_attention(s, a + BN - 1, 1, 0, QH, qv, 0, out), KV_ERR_OK);
    kvc_close(&c);
    kvs_close(&s2);
    kvs_close(&s);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_processes_share_a_prefix),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_prefix_outlives_end_and_full_hit_leaves_a_page),
        cmocka_unit_test(test_f16_bf16_inputs_write_the_float_pages),
        cmocka_unit_test(test_seal_timeout_loses_the_sequence),
        cmocka_unit_test(test_extend_larger_than_the_pool_holds_nothing),
        cmocka_unit_test(test_failed_extend_keeps_the_cache),
        cmocka_unit_test(test_extend_or_commit_before_append_refused),
        cmocka_unit_test(test_close_waits_one_timeout),
        cmocka_unit_test(test_close_ends_the_session),
        cmocka_unit_test(test_name_and_batch_limits),
        cmocka_unit_test(test_extend_beyond_a_lower_max_alloc),
        cmocka_unit_test(test_begin_beyond_a_lower_max_tokens),
        cmocka_unit_test(test_append_batch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
