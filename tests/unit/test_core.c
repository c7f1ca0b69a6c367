/* test_core.c — kvd/core.c and kvd/session.c as a whole: session close reclaims request refs,
 * frees unsealed pages and keeps sealed ones cached; sequences, their ages and their
 * enumeration (kvd_core_seq_foreach, the lifecycle controller's walk); the stats
 * table; the fault-injection loop (fail the N-th allocation for N = 1.. until an operation
 * succeeds: each failure must leave the state unchanged and nothing leaked); kvd_core_check
 * noticing deliberately corrupted state; the host backend's export (sizes, seals: no resize,
 * no writable directory mapping, no seals added by a client).
 */
#include "core_fixture.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

static void test_session_close_reclaims(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a, b, q;
    FX_OK(kvd_core_session_open(c, 10, 1, &a));
    FX_OK(kvd_core_session_open(c, 11, 1, &b));
    /* a: 2 sealed pages (one in a sequence), 2 unsealed (one in a sequence, one loose twice) */
    uint32_t ids[4], tok[2 * FX_PT], canon;
    uint8_t h[32];
    fx_tokens(3, 2, tok);
    FX_OK(kvd_core_alloc(c, a, 4, ids));
    FX_OK(kvd_core_seal(c, a, ids[0], KVD_NONE, tok, FX_PT, NULL, 0, h, &canon));
    FX_OK(kvd_core_seal(c, a, ids[1], ids[0], tok + FX_PT, FX_PT, NULL, 0, h, &canon));
    FX_OK(kvd_core_seq_open(c, a, &q));
    uint32_t app[2] = {ids[0], ids[2]};
    FX_OK(kvd_core_seq_append(c, a, q, app, 2));
    /* b shares a's sealed prefix through a lookup */
    uint32_t got[2], np, nt;
    FX_OK(kvd_core_lookup(c, b, tok, 2 * FX_PT, NULL, 0, got, 2, &np, &nt));
    assert_int_equal(np, 2);
    FX_CHECK(c);
    kvd_stats_t before = fx_stats(c);
    FX_OK(kvd_core_session_close(c, a));
    assert_int_equal(kvd_core_session_close(c, a), KV_ERR_NO_SESSION);
    kvd_stats_t st = fx_stats(c);
    assert_int_equal(st.sessions, 1);
    assert_int_equal(st.sequences, 0);
    assert_int_equal(st.reclaimed_refs, 4);
    assert_int_equal(st.reclaimed_open_pages, 2);
    /* unsealed pages freed at once (a is dead: nothing to wait for) */
    assert_int_equal(st.pages_free[KV_FMT_FP8], before.pages_free[KV_FMT_FP8] + 2);
    assert_int_equal(st.pages_open[KV_FMT_FP8], 0);
    /* sealed pages stay cached and b still holds them */
    assert_int_equal(st.cache_entries, 2);
    assert_int_equal(st.request_refs, 2);
    assert_int_equal(kvd_core_seq_pages(c, q, NULL, 0, &np, NULL), KV_ERR_NOT_FOUND);
    FX_CHECK(c);
    FX_OK(kvd_core_session_close(c, b));
    st = fx_stats(c);
    assert_int_equal(st.pages_lru[KV_FMT_FP8], 2);
    assert_int_equal(st.pages_free[KV_FMT_FP8], FX_FP8 - 2);
    FX_CHECK(c);
    kvd_core_free(&c);
}

static void test_sequences(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a, b, q, q2;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    FX_OK(kvd_core_session_open(c, 2, 0, &b));
    FX_OK(kvd_core_seq_open(c, a, &q));
    FX_OK(kvd_core_seq_open(c, a, &q2));
    assert_int_not_equal(q, q2);
    uint32_t ids[3];
    FX_OK(kvd_core_alloc(c, a, 3, ids));
    fx_clock = 5000000;
    FX_OK(kvd_core_seq_append(c, a, q, ids, 2));
    fx_clock = 9000000;
    FX_OK(kvd_core_seq_append(c, a, q, ids + 2, 1));
    /* not held loose any more / not a's sequence / unknown */
    assert_int_equal(kvd_core_seq_append(c, a, q2, ids, 1), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvd_core_seq_append(c, b, q, ids, 1), KV_ERR_NOT_FOUND);
    assert_int_equal(kvd_core_release(c, a, ids, 1), KV_ERR_INVALID_ARGUMENT);
    kvd_seq_page_t sp[2];
    uint32_t n;
    uint64_t owner;
    FX_OK(kvd_core_seq_pages(c, q, sp, 2, &n, &owner));
    assert_int_equal(n, 3); /* total, only 2 written */
    assert_int_equal(owner, a);
    assert_int_equal(sp[0].logical, ids[0]);
    assert_int_equal(sp[1].logical, ids[1]);
    assert_true(sp[0].appended_ns > 5000000 && sp[0].appended_ns < 9000000);
    kvd_seq_page_t sp3[3];
    FX_OK(kvd_core_seq_pages(c, q, sp3, 3, &n, NULL));
    assert_true(sp3[2].appended_ns > 9000000);
    kvd_session_info_t si;
    FX_OK(kvd_core_session_info(c, a, &si));
    assert_int_equal(si.seq_refs, 3);
    assert_int_equal(si.loose_refs, 0);
    assert_int_equal(si.sequences, 2);
    FX_CHECK(c);
    FX_OK(kvd_core_seq_close(c, a, q));
    assert_int_equal(kvd_core_seq_close(c, a, q), KV_ERR_NOT_FOUND);
    assert_int_equal(fx_stats(c).pages_retired[KV_FMT_FP8], 3);
    FX_CHECK(c);
    kvd_core_free(&c);
}

/* kvd_core_seq_foreach: every live sequence once, with its owner and its pages in order. */
typedef struct seen_s {
    int n;
    uint64_t seq[4], sid[4];
    uint32_t npages[4], first[4];
    uint64_t first_ts[4];
} seen_t;

static void seen_cb(uint64_t seq, uint64_t sid, const uint32_t *lids, const uint64_t *ts,
                    uint32_t n, void *ud)
{
    seen_t *s = ud;
    assert_true(s->n < 4);
    s->seq[s->n] = seq, s->sid[s->n] = sid, s->npages[s->n] = n;
    s->first[s->n] = n ? lids[0] : KVD_NONE;
    s->first_ts[s->n] = n ? ts[0] : 0;
    s->n++;
}

static void test_seq_foreach(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a, b, qa, qb, qe;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    FX_OK(kvd_core_session_open(c, 2, 0, &b));
    FX_OK(kvd_core_seq_open(c, a, &qa));
    FX_OK(kvd_core_seq_open(c, b, &qb));
    FX_OK(kvd_core_seq_open(c, b, &qe)); /* empty sequences are visited too */
    uint32_t ids[3];
    FX_OK(kvd_core_alloc(c, a, 2, ids));
    FX_OK(kvd_core_alloc(c, b, 1, ids + 2));
    FX_OK(kvd_core_seq_append(c, a, qa, ids, 2));
    FX_OK(kvd_core_seq_append(c, b, qb, ids + 2, 1));
    seen_t s = {0};
    kvd_core_seq_foreach(c, seen_cb, &s);
    assert_int_equal(s.n, 3);
    int got = 0;
    for (int i = 0; i < s.n; i++) {
        kvd_seq_page_t sp;
        uint32_t n;
        uint64_t owner;
        FX_OK(kvd_core_seq_pages(c, s.seq[i], &sp, 1, &n, &owner));
        assert_int_equal(s.sid[i], owner);
        assert_int_equal(s.npages[i], n);
        if (n) {
            assert_int_equal(s.first[i], sp.logical);
            assert_int_equal(s.first_ts[i], sp.appended_ns);
        }
        got |= s.seq[i] == qa ? 1 : s.seq[i] == qb ? 2 : s.seq[i] == qe ? 4 : 8;
    }
    assert_int_equal(got, 7);
    FX_OK(kvd_core_session_close(c, b)); /* closes qb and qe */
    s.n = 0;
    kvd_core_seq_foreach(c, seen_cb, &s);
    assert_int_equal(s.n, 1);
    assert_int_equal(s.seq[0], qa);
    kvd_core_free(&c);
}

static void test_stats_table(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t id;
    FX_OK(kvd_core_alloc(c, a, 1, &id));
    kvd_stats_t st = fx_stats(c);
    /* iterate the X-macro the way the metrics endpoint does; every name is printable */
    char line[256];
    int n = 0;
#define P_(name, kind, help)                                                                       \
    snprintf(line, sizeof(line), "kvd_%s %llu", #name, (unsigned long long)st.name);              \
    assert_non_null(strstr(line, #name));                                                          \
    n++;
    KVD_STATS_MAP(P_)
#undef P_
#define PF_(name, kind, help)                                                                      \
    for (int f = 0; f < KV_FMT_COUNT; f++)                                                         \
        n += snprintf(line, sizeof(line), "kvd_%s{format=\"%s\"} %llu", #name, kvd_fmt_name(f),  \
                      (unsigned long long)st.name[f]) > 0;
    KVD_STATS_FMT_MAP(PF_)
#undef PF_
    assert_true(n > 40);
    assert_int_equal(st.alloc_pages, 1);
    assert_int_equal(st.bytes_used[KV_FMT_FP8], st.page_bytes[KV_FMT_FP8]);
    kv_geom_t g = fx_geom();
    assert_int_equal(st.page_bytes[KV_FMT_TQ3], kv_page_bytes(&g, KV_FMT_TQ3));
    assert_int_equal(st.epoch, kvd_core_epoch(c));
    kvd_core_free(&c);
}

/* One scenario touching every allocating path. Returns KV_ERR_OK or the first error; on error
 * the state must be as before the failing call. */
static int scenario(kvd_core_t *c, int *step)
{
    uint64_t a, b, q;
    uint32_t ids[3], tok[3 * FX_PT], canon, got[3], np, nt;
    uint8_t h[32];
    int rc;
    fx_tokens(9, 3, tok);
#define S_(expr)                                                                                   \
    do {                                                                                           \
        (*step)++;                                                                                 \
        if ((rc = (expr)) != KV_ERR_OK)                                                            \
            return rc;                                                                             \
    } while (0)
    S_(kvd_core_session_open(c, 1, 0, &a));
    S_(kvd_core_session_open(c, 2, 0, &b));
    S_(kvd_core_alloc(c, a, 3, ids));
    S_(kvd_core_seq_open(c, a, &q));
    S_(kvd_core_seq_append(c, a, q, ids, 3));
    S_(kvd_core_seal(c, a, ids[0], KVD_NONE, tok, FX_PT, NULL, 0, h, &canon));
    S_(kvd_core_seal(c, a, ids[1], ids[0], tok + FX_PT, FX_PT, NULL, 0, h, &canon));
    S_(kvd_core_lookup(c, b, tok, 3 * FX_PT, NULL, 0, got, 3, &np, &nt));
    uint32_t dup;
    S_(kvd_core_alloc(c, b, 1, &dup));
    S_(kvd_core_seal(c, b, dup, KVD_NONE, tok, FX_PT, NULL, 0, h, &canon)); /* dedupe */
    S_(kvd_core_convert(c, ids[1], KV_FMT_TQ3));
    S_(kvd_core_pin(c, ids[0]));
    S_(kvd_core_seq_close(c, a, q));
    S_(kvd_core_session_close(c, a));
    S_(kvd_core_release(c, b, got, np));
#undef S_
    return KV_ERR_OK;
}

static void test_fault_injection(void **state)
{
    int succeeded = 0;
    for (uint64_t n = 1; n < 500 && !succeeded; n++) {
        int64_t live0 = kvd_alloc_live();
        kvd_core_t *c = fx_core();
        int step = 0;
        kvd_alloc_fail_after(n);
        int rc = scenario(c, &step);
        kvd_alloc_fail_after(0);
        if (rc == KV_ERR_OK) {
            succeeded = 1;
            print_message("scenario succeeded with the first failure at allocation %llu "
                          "(%llu failing runs checked)\n", (unsigned long long)n,
                          (unsigned long long)n - 1);
        }
        else if (rc != KV_ERR_NOMEM)
            fail_msg("N=%llu: step %d failed with %s, not NOMEM: %s", (unsigned long long)n,
                     step, kv_err_name(rc), kvd_core_errmsg(c));
        FX_CHECK(c); /* a failed step left a consistent state */
        kvd_core_free(&c);
        assert_int_equal(kvd_alloc_live(), live0); /* nothing leaked */
    }
    assert_true(succeeded);
}

/* kvd_core_init itself under allocation failure: clean error, no leak. */
static void test_init_fault_injection(void **state)
{
    int64_t live0 = kvd_alloc_live();
    for (uint64_t n = 1; n < 50; n++) {
        kvd_core_opts_t o;
        fx_opts(&o);
        kvd_core_t *c = NULL;
        char err[256];
        kvd_alloc_fail_after(n);
        int rc = kvd_core_init(&c, &o, err, sizeof(err));
        kvd_alloc_fail_after(0);
        if (rc == KV_ERR_OK) {
            kvd_core_free(&c);
            break;
        }
        assert_int_equal(rc, KV_ERR_NOMEM);
        assert_null(c);
        assert_int_equal(kvd_alloc_live(), live0);
    }
    assert_int_equal(kvd_alloc_live(), live0);
}

/* Corrupt one thing at a time through the internals; check() must say so. */
static void test_check_detects_corruption(void **state)
{
    char rep[1024];
    for (int kind = 0; kind < 7; kind++) {
        kvd_core_t *c = fx_core();
        uint64_t a;
        uint32_t ids[2], tok[FX_PT], canon;
        uint8_t h[32];
        fx_tokens(1, 1, tok);
        FX_OK(kvd_core_session_open(c, 1, 0, &a));
        FX_OK(kvd_core_alloc(c, a, 2, ids));
        FX_OK(kvd_core_seal(c, a, ids[0], KVD_NONE, tok, FX_PT, NULL, 0, h, &canon));
        FX_OK(kvd_core_release(c, a, ids, 1)); /* ids[0] cached, on the LRU */
        FX_CHECK(c);
        switch (kind) {
        case 0: c->lp[ids[1]].req_loose++; break;                    /* refcount drift */
        case 1: c->pool[KV_FMT_FP8].pg[c->lp[ids[1]].phys].state = KVD_PHYS_FREE; break;
        case 2: c->dir[ids[1]] ^= 1; break;                          /* directory phys */
        case 3: c->lp[ids[0]].on_lru = 0; break;                     /* LRU flag */
        case 4: c->pool[KV_FMT_FP8].nfree--; break;                  /* free counter */
        case 5: c->lp[ids[0]].hash[0] ^= 0xff; break;                /* index vs page hash */
        case 6: c->lp[ids[1]].pins = 1; c->st.pins = 1; break;       /* pin on unsealed */
        }
        int n = kvd_core_check(c, rep, sizeof(rep));
        if (n == 0)
            fail_msg("corruption kind %d not detected", kind);
        assert_true(strlen(rep) > 0);
        kvd_core_free(&c); /* free never looks at refcounts */
    }
}

/* Violation classes kvd_core_check missed before (each corruption below went unreported):
 * a per-id drift of a session's held map that keeps its sum, a sequence naming an id beyond
 * the directory, a sequence its session does not list, a retired page whose directory entry
 * was invalidated before its collection, an unsealed page held by someone other than its
 * owner, a safe epoch beyond the current one, and stamps beyond the next epoch. */
static void test_check_detects_more_corruption(void **state)
{
    (void)state;
    char rep[1024];
    for (int kind = 0; kind < 8; kind++) {
        kvd_core_t *c = fx_core();
        uint64_t a, b, q;
        uint32_t ids[3], tok[FX_PT], canon;
        uint8_t h[32];
        fx_tokens(1, 1, tok);
        FX_OK(kvd_core_session_open(c, 1, 0, &a));
        FX_OK(kvd_core_session_open(c, 2, 0, &b));
        FX_OK(kvd_core_alloc(c, a, 3, ids));
        FX_OK(kvd_core_seal(c, a, ids[0], KVD_NONE, tok, FX_PT, NULL, 0, h, &canon));
        FX_OK(kvd_core_seq_open(c, a, &q));
        FX_OK(kvd_core_seq_append(c, a, q, &ids[1], 1));
        FX_OK(kvd_core_release(c, a, &ids[2], 1)); /* retired; b has not reported: kept */
        FX_CHECK(c);
        kvd_session_t *sa = kvd__session_get(c, a);
        kvd_seq_t *sq = kvd__seq_get(c, q);
        switch (kind) {
        case 0: /* held: ids[0] one more, ids[1] one less; the sum is unchanged */
            kvd__count_add(&sa->held, ids[0], 1);
            kvd__count_add(&sa->held, ids[1], -1);
            break;
        case 1: { /* a sequence entry beyond the directory, with a matching held entry */
            uint32_t far = c->nlogical + 5;
            assert_int_equal(kvd_map_put(&sa->held, far, 1), 0);
            sq->lids[sq->n++] = far;
            sa->seq_total++;
            break;
        }
        case 2: /* the session forgets its (empty) sequence */
            FX_OK(kvd_core_seq_close(c, a, q));
            FX_OK(kvd_core_seq_open(c, b, &q));
            kvd_map_del(&kvd__session_get(c, b)->seqs, q);
            break;
        case 3: /* the retired page's entry invalidated while kernels may resolve it */
            c->dir[ids[2]] = kv_dir_make(0, KV_FMT_FP8, 0, kv_dir_gen(c->dir[ids[2]]) + 1);
            break;
        case 4: /* an unsealed page that another session holds */
            c->lp[ids[1]].owner_sid = b;
            break;
        case 5: c->lp[ids[0]].stamp = kvd_core_epoch(c) + 3; break;
        case 6: c->pool[KV_FMT_FP8].pg[c->lp[ids[2]].phys].stamp = kvd_core_epoch(c) + 3; break;
        case 7: sa->safe_epoch = kvd_core_epoch(c) + 1; break;
        }
        int n = kvd_core_check(c, rep, sizeof(rep));
        if (n == 0)
            fail_msg("corruption kind %d not detected", kind);
        print_message("kind %d: %s", kind, rep);
        kvd_core_free(&c);
    }
}

static void test_backend_export(void **state)
{
    kvd_core_t *c = fx_core();
    const kvd_export_t *ex = kvd_core_export(c);
    kv_geom_t g = fx_geom();
    assert_string_equal(ex->backend, "host");
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        assert_int_equal(ex->page_bytes[f], kv_page_bytes(&g, (kv_fmt_t)f));
        assert_int_equal(ex->pool_bytes[f], ex->page_bytes[f] * ex->pages[f]);
        assert_true(ex->pool_fd[f] >= 0);
        /* a client cannot resize a pool under the daemon */
        assert_int_equal(ftruncate(ex->pool_fd[f], 4096), -1);
        /* nor add seals of its own: F_SEAL_FUTURE_WRITE on a pool would refuse every later
         * client its read-write mapping (F_SEAL_SEAL) */
        assert_true(fcntl(ex->pool_fd[f], F_GET_SEALS) & F_SEAL_SEAL);
        assert_int_equal(fcntl(ex->pool_fd[f], F_ADD_SEALS, F_SEAL_FUTURE_WRITE), -1);
        assert_int_equal(errno, EPERM);
        void *rw = mmap(NULL, ex->pool_bytes[f], PROT_READ | PROT_WRITE, MAP_SHARED,
                        ex->pool_fd[f], 0);
        assert_true(rw != MAP_FAILED);
        munmap(rw, ex->pool_bytes[f]);
    }
    assert_int_equal(ex->dir_entries, FX_FP8 + FX_TQ3);
    assert_true(fcntl(ex->dir_fd, F_GET_SEALS) & F_SEAL_SEAL);
    assert_int_equal(ex->dir_sealed, 1); /* Linux ≥ 5.1 here */
    /* the directory: read-only mapping works and sees the daemon's writes; writable refused */
    void *w = mmap(NULL, ex->dir_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, ex->dir_fd, 0);
    assert_true(w == MAP_FAILED && errno == EPERM);
    const kv_dir_entry_t *r = mmap(NULL, ex->dir_bytes, PROT_READ, MAP_SHARED, ex->dir_fd, 0);
    assert_true(r != MAP_FAILED);
    uint64_t a;
    uint32_t id;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    FX_OK(kvd_core_alloc(c, a, 1, &id));
    assert_true(r[id] == kvd_core_backend(c)->dir[id]);
    assert_int_equal(kv_dir_flags(r[id]), KV_DIR_VALID);
    munmap((void *)r, ex->dir_bytes);
    kvd_core_free(&c);
    /* cuda is refused with a clear error, never a silent host fallback */
    kvd_core_opts_t o;
    fx_opts(&o);
    o.backend = "cuda";
    char err[256] = "";
    assert_int_equal(kvd_core_init(&c, &o, err, sizeof(err)), KV_ERR_DEVICE);
    assert_non_null(strstr(err, "cuda"));
    o.backend = "host";
    o.cache_quota_pages[KV_FMT_TQ3] = FX_TQ3 + 1;
    assert_int_equal(kvd_core_init(&c, &o, err, sizeof(err)), KV_ERR_INVALID_ARGUMENT);
    o.cache_quota_pages[KV_FMT_TQ3] = 0;
    o.geom.head_dim = 96;
    assert_int_equal(kvd_core_init(&c, &o, err, sizeof(err)), KV_ERR_INVALID_ARGUMENT);
    assert_null(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_session_close_reclaims),
        cmocka_unit_test(test_sequences),
        cmocka_unit_test(test_seq_foreach),
        cmocka_unit_test(test_stats_table),
        cmocka_unit_test(test_fault_injection),
        cmocka_unit_test(test_init_fault_injection),
        cmocka_unit_test(test_check_detects_corruption),
        cmocka_unit_test(test_check_detects_more_corruption),
        cmocka_unit_test(test_backend_export),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
