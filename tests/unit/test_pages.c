/* test_pages.c — kvd/pages.c through the core API: allocation and the directory, release and
 * the epoch-deferred free, logical id reuse, conversions (Algorithm 1) flipping the directory
 * and retiring the source, conversion failure keeping the source.
 */
#include "core_fixture.h"

#include <math.h>
#include <stdlib.h>

#include "kvkern.h"

static void test_alloc_maps_directory(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t sid;
    FX_OK(kvd_core_session_open(c, 100, 1000, &sid));
    uint32_t ids[3];
    FX_OK(kvd_core_alloc(c, sid, 3, ids));
    const kv_dir_entry_t *dir = kvd_core_backend(c)->dir;
    for (int i = 0; i < 3; i++) {
        kvd_page_info_t pi;
        FX_OK(kvd_core_page_info(c, ids[i], &pi));
        assert_int_equal(pi.state, KVD_PAGE_OPEN);
        assert_int_equal(pi.fmt, KV_FMT_FP8);
        assert_int_equal(pi.req_loose, 1);
        assert_int_equal(pi.owner_sid, sid);
        assert_int_equal(kv_dir_flags(dir[ids[i]]), KV_DIR_VALID);
        assert_int_equal(kv_dir_fmt(dir[ids[i]]), KV_FMT_FP8);
        assert_int_equal(kv_dir_phys(dir[ids[i]]), pi.phys);
        for (int j = 0; j < i; j++) {
            assert_int_not_equal(ids[i], ids[j]);
            assert_int_not_equal(kv_dir_phys(dir[ids[i]]), kv_dir_phys(dir[ids[j]]));
        }
    }
    kvd_stats_t st = fx_stats(c);
    assert_int_equal(st.pages_open[KV_FMT_FP8], 3);
    assert_int_equal(st.pages_free[KV_FMT_FP8], FX_FP8 - 3);
    assert_int_equal(st.request_refs, 3);
    FX_CHECK(c);
    /* bad input: errors, no state change */
    assert_int_equal(kvd_core_alloc(c, sid, 0, ids), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvd_core_alloc(c, sid, FX_FP8 + 1, ids), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvd_core_alloc(c, 999, 1, ids), KV_ERR_NO_SESSION);
    uint32_t bogus[2] = {ids[0], ids[0]}; /* held once, released twice */
    assert_int_equal(kvd_core_release(c, sid, bogus, 2), KV_ERR_INVALID_ARGUMENT);
    uint32_t out_of_range = FX_FP8 + FX_TQ3 + 10;
    assert_int_equal(kvd_core_release(c, sid, &out_of_range, 1), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(fx_stats(c).request_refs, 3);
    FX_CHECK(c);
    kvd_core_free(&c);
    assert_null(c);
}

/* A released page is not reusable until EVERY live session reported a newer epoch. */
static void test_release_deferred_by_epoch(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a, b;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    FX_OK(kvd_core_session_open(c, 2, 0, &b));
    uint32_t ids[FX_FP8];
    FX_OK(kvd_core_alloc(c, a, FX_FP8, ids));
    uint64_t e0 = kvd_core_epoch(c);
    const kv_dir_entry_t *dir = kvd_core_backend(c)->dir;
    kv_dir_entry_t before = dir[ids[2]];
    FX_OK(kvd_core_release(c, a, &ids[2], 1));
    uint64_t e1 = kvd_core_epoch(c);
    assert_int_equal(e1, e0 + 1); /* the release bumped the epoch */
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, ids[2], &pi));
    assert_int_equal(pi.state, KVD_PAGE_RETIRED);
    assert_int_equal(pi.stamp, e1);
    /* still mapped to the old physical page: a kernel in flight reads what it expects */
    assert_true(dir[ids[2]] == before);
    assert_int_equal(fx_stats(c).pages_retired[KV_FMT_FP8], 1);
    uint32_t more;
    assert_int_equal(kvd_core_alloc(c, a, 1, &more), KV_ERR_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(kvd_core_errmsg(c), "retired"));
    assert_int_equal(kvd_core_collect(c), 0);
    fx_quiesce(c, a); /* a is done with epoch < e1, but b still may have kernels */
    assert_int_equal(kvd_core_alloc(c, a, 1, &more), KV_ERR_RESOURCE_EXHAUSTED);
    FX_OK(kvd_core_page_info(c, ids[2], &pi));
    assert_int_equal(pi.state, KVD_PAGE_RETIRED);
    FX_CHECK(c);
    fx_quiesce(c, b); /* now every session is past the stamp: the report collects */
    FX_OK(kvd_core_page_info(c, ids[2], &pi));
    assert_int_equal(pi.state, KVD_PAGE_FREE);
    assert_int_equal(kv_dir_flags(dir[ids[2]]) & KV_DIR_VALID, 0);
    assert_int_equal(kv_dir_gen(dir[ids[2]]), (kv_dir_gen(before) + 1) & 0xffff);
    FX_OK(kvd_core_alloc(c, a, 1, &more));
    assert_int_equal(more, ids[2]); /* LIFO: the freed id comes back first */
    FX_CHECK(c);
    /* epoch reports out of range are refused */
    uint64_t now = kvd_core_epoch(c);
    assert_int_equal(kvd_core_session_report_epoch(c, a, now + 1), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvd_core_session_report_epoch(c, a, 0), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvd_core_session_report_epoch(c, 77, now), KV_ERR_NO_SESSION);
    kvd_core_free(&c);
}

/* dir_sync calls seen by a wrapper around the host backend's ops (whose dir_sync is NULL:
 * its directory IS the shared memory) */
static uint32_t g_sync_calls, g_sync_entries;
static int counting_dir_sync(kvd_backend_t *b, const uint32_t *lids, uint32_t n, char *err,
                             size_t errlen)
{
    (void)b, (void)lids, (void)err, (void)errlen;
    g_sync_calls++;
    g_sync_entries += n;
    return KV_ERR_OK;
}

/* A collect that frees many pages publishes their entries with one dir_sync (on cuda: one
 * stream wait instead of one per page), and before their ids come back. */
static void test_collect_publishes_once(void **state)
{
    (void)state;
    kvd_core_t *c = fx_core();
    kvd_backend_t *be = kvd_core_backend(c);
    kvd_backend_ops_t ops = *be->ops;
    const kvd_backend_ops_t *host_ops = be->ops;
    ops.dir_sync = counting_dir_sync;
    be->ops = &ops;
    uint64_t a, b;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    FX_OK(kvd_core_session_open(c, 2, 0, &b));
    uint32_t ids[FX_FP8];
    g_sync_calls = g_sync_entries = 0;
    FX_OK(kvd_core_alloc(c, a, FX_FP8, ids));
    assert_int_equal(g_sync_calls, 1); /* the alloc: one push for all its entries */
    assert_int_equal(g_sync_entries, FX_FP8);
    FX_OK(kvd_core_release(c, a, ids, FX_FP8));
    fx_quiesce(c, a);
    g_sync_calls = g_sync_entries = 0;
    fx_quiesce(c, b); /* every session past the stamp: this report collects all seven */
    assert_int_equal(g_sync_calls, 1);
    assert_int_equal(g_sync_entries, FX_FP8);
    /* the counters operators see (kvctl, Prometheus) say the same: the alloc's push, this one */
    kvd_stats_t st = fx_stats(c);
    assert_int_equal(st.dir_syncs, 2);
    assert_int_equal(st.dir_sync_entries, 2 * FX_FP8);
    const kv_dir_entry_t *dir = be->dir;
    for (uint32_t i = 0; i < FX_FP8; i++)
        assert_int_equal(kv_dir_flags(dir[ids[i]]) & KV_DIR_VALID, 0);
    g_sync_calls = 0;
    assert_int_equal(kvd_core_collect(c), 0);
    assert_int_equal(g_sync_calls, 0); /* nothing freed, nothing pushed */
    FX_CHECK(c);
    be->ops = host_ops;
    kvd_core_free(&c);
}

/* With no other session, closing the last one frees what it retired. */
static void test_close_last_session_frees(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[2];
    FX_OK(kvd_core_alloc(c, a, 2, ids));
    FX_OK(kvd_core_release(c, a, ids, 1));
    assert_int_equal(fx_stats(c).pages_retired[KV_FMT_FP8], 1);
    FX_OK(kvd_core_session_close(c, a));
    kvd_stats_t st = fx_stats(c);
    assert_int_equal(st.pages_retired[KV_FMT_FP8], 0);
    assert_int_equal(st.pages_free[KV_FMT_FP8], FX_FP8);
    assert_int_equal(st.logical_free, FX_FP8 + FX_TQ3);
    assert_int_equal(st.reclaimed_open_pages, 1);
    FX_CHECK(c);
    kvd_core_free(&c);
}

static double rel_err_block(kvd_core_t *c, uint32_t lid, const float *ref)
{
    kvd_backend_t *be = kvd_core_backend(c);
    kv_geom_t g = fx_geom();
    kv_dir_entry_t e = be->dir[lid];
    uint32_t T = g.page_tokens, H = g.kv_heads, d = g.head_dim;
    float out[FX_PT * 64];
    double num = 0, den = 0;
    for (uint32_t h = 0; h < H; h++) {
        assert_int_equal(kv_page_decode_block(&g, kv_dir_fmt(e),
                                              kvd_backend_host_page(be, kv_dir_fmt(e),
                                                                    kv_dir_phys(e)),
                                              0, KV_KIND_K, h, out),
                         KVK_OK);
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t i = 0; i < d; i++) {
                double x = ref[((uint64_t)t * H + h) * d + i], y = out[t * d + i];
                num += (x - y) * (x - y);
                den += x * x;
            }
    }
    return sqrt(num / den);
}

static void test_convert_flips_directory(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t lid;
    FX_OK(kvd_core_alloc(c, a, 1, &lid));
    float ref[FX_PT * 2 * 64];
    fx_fill_page(c, lid, 11, ref);
    const kv_dir_entry_t *dir = kvd_core_backend(c)->dir;
    kv_dir_entry_t e0 = dir[lid];
    /* FP8 holds the data to e4m3 precision: relative RMS error ≈ 2^-4 / sqrt(3) ≈ 0.036 for a
     * per-token-head scale; 0.06 leaves room for the shape of the distribution. */
    assert_true(rel_err_block(c, lid, ref) < 0.06);
    uint64_t ep = kvd_core_epoch(c);
    FX_OK(kvd_core_convert(c, lid, KV_FMT_TQ3));
    kv_dir_entry_t e1 = dir[lid];
    assert_int_equal(kv_dir_fmt(e1), KV_FMT_TQ3);
    assert_int_equal(kv_dir_flags(e1), KV_DIR_VALID);
    assert_int_equal(kv_dir_gen(e1), kv_dir_gen(e0) + 1);
    assert_int_equal(kvd_core_epoch(c), ep + 1);
    /* 3-bit uniform grid on unit-variance coordinates: distortion ≈ 0.037 per coordinate plus the
     * FP8 step before it, i.e. relative RMS ≈ 0.19; 0.3 is a generous bound that still catches a
     * wrong page, a wrong layout or a missing rotation (those give ≈ 1). */
    double err = rel_err_block(c, lid, ref);
    print_message("relative RMS error of layer-0 K after retier: %.4f\n", err);
    assert_true(err < 0.3);
    kvd_stats_t st = fx_stats(c);
    assert_int_equal(st.pages_retired[KV_FMT_FP8], 1);
    assert_int_equal(st.pages_open[KV_FMT_TQ3], 1);
    assert_int_equal(st.pages_free[KV_FMT_TQ3], FX_TQ3 - 1);
    assert_int_equal(st.retiers, 1);
    /* the conversion's latency is counted on the real clock (the CPU twin takes > 0 ns) */
    assert_true(st.retier_ns > 0);
    assert_int_equal(st.promote_ns, 0);
    FX_CHECK(c);
    /* the retired FP8 source is freed only once the session reports the new epoch */
    fx_quiesce(c, a);
    assert_int_equal(fx_stats(c).pages_free[KV_FMT_FP8], FX_FP8);
    /* promote back: FP8 again, TQ3 source retired, data still close to the original */
    FX_OK(kvd_core_convert(c, lid, KV_FMT_FP8));
    assert_int_equal(kv_dir_fmt(dir[lid]), KV_FMT_FP8);
    assert_int_equal(kv_dir_gen(dir[lid]), kv_dir_gen(e0) + 2);
    assert_true(rel_err_block(c, lid, ref) < 0.3);
    assert_int_equal(fx_stats(c).pages_retired[KV_FMT_TQ3], 1);
    assert_int_equal(fx_stats(c).promotes, 1);
    assert_true(fx_stats(c).promote_ns > 0);
    FX_CHECK(c);
    /* bad conversions */
    assert_int_equal(kvd_core_convert(c, lid, KV_FMT_FP8), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvd_core_convert(c, lid, (kv_fmt_t)9), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvd_core_convert(c, FX_FP8 + 3, KV_FMT_TQ3), KV_ERR_FAILED_PRECONDITION);
    kvd_core_free(&c);
}

/* kvd_core_convert_batch: retiers and promotes in one call convert exactly like single calls
 * (same directory flips and bytes as page-by-page conversion of a twin core), one new epoch
 * for the whole batch, per-page results for a duplicate, a bad id and a page already in the
 * target format without stopping the others, and an injected backend failure rolls back
 * every prepared page. */
static void test_convert_batch(void **state)
{
    kvd_core_t *c = fx_core(), *t = fx_core();
    uint64_t a, b;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    FX_OK(kvd_core_session_open(t, 1, 0, &b));
    uint32_t ids[4], tid[4];
    FX_OK(kvd_core_alloc(c, a, 4, ids));
    FX_OK(kvd_core_alloc(t, b, 4, tid));
    for (uint32_t i = 0; i < 4; i++) {
        assert_int_equal(ids[i], tid[i]); /* same ids: the two cores are twins */
        fx_fill_page(c, ids[i], 40 + i, NULL);
        fx_fill_page(t, tid[i], 40 + i, NULL);
    }
    /* ids[2], ids[3] go TQ3 first so that the batch can promote them */
    FX_OK(kvd_core_convert(c, ids[2], KV_FMT_TQ3));
    FX_OK(kvd_core_convert(c, ids[3], KV_FMT_TQ3));
    FX_OK(kvd_core_convert(t, tid[2], KV_FMT_TQ3));
    FX_OK(kvd_core_convert(t, tid[3], KV_FMT_TQ3));
    fx_quiesce(c, a);
    fx_quiesce(t, b);
    const kv_dir_entry_t *dir = kvd_core_backend(c)->dir, *tdir = kvd_core_backend(t)->dir;
    uint64_t ep = kvd_core_epoch(c);
    uint32_t lid[7] = {ids[0], ids[2], ids[1], ids[0], FX_FP8 + FX_TQ3 + 5, ids[3], ids[2]};
    kv_fmt_t dst[7] = {KV_FMT_TQ3, KV_FMT_FP8, KV_FMT_TQ3, KV_FMT_TQ3,
                       KV_FMT_TQ3, KV_FMT_FP8, KV_FMT_TQ3};
    int rc[7];
    assert_int_equal(kvd_core_convert_batch(c, 7, lid, dst, rc), KV_ERR_FAILED_PRECONDITION);
    assert_int_equal(rc[0], KV_ERR_OK);
    assert_int_equal(rc[1], KV_ERR_OK);
    assert_int_equal(rc[2], KV_ERR_OK);
    assert_int_equal(rc[3], KV_ERR_FAILED_PRECONDITION); /* ids[0] twice */
    assert_int_equal(rc[4], KV_ERR_INVALID_ARGUMENT);    /* beyond the directory */
    assert_int_equal(rc[5], KV_ERR_OK);
    assert_int_equal(rc[6], KV_ERR_FAILED_PRECONDITION); /* ids[2] twice */
    assert_non_null(strstr(kvd_core_errmsg(c), "already being converted"));
    assert_int_equal(kvd_core_epoch(c), ep + 1); /* one epoch for the batch */
    kvd_stats_t st = fx_stats(c);
    assert_int_equal(st.retiers, 4);
    assert_int_equal(st.promotes, 2);
    FX_CHECK(c);
    /* the same conversions one by one on the twin: the same entries and page bytes */
    FX_OK(kvd_core_convert(t, tid[0], KV_FMT_TQ3));
    FX_OK(kvd_core_convert(t, tid[2], KV_FMT_FP8));
    FX_OK(kvd_core_convert(t, tid[1], KV_FMT_TQ3));
    FX_OK(kvd_core_convert(t, tid[3], KV_FMT_FP8));
    for (uint32_t i = 0; i < 4; i++) {
        kv_fmt_t f = kv_dir_fmt(dir[ids[i]]);
        assert_int_equal(f, kv_dir_fmt(tdir[tid[i]]));
        assert_int_equal(kv_dir_flags(dir[ids[i]]), kv_dir_flags(tdir[tid[i]]));
        const kv_geom_t *g = &kvd_core_backend(c)->exp.geom;
        kvd_backend_t *bc = kvd_core_backend(c), *bt = kvd_core_backend(t);
        const uint8_t *pc = kvd_backend_host_page(bc, f, kv_dir_phys(dir[ids[i]]));
        const uint8_t *pt = kvd_backend_host_page(bt, f, kv_dir_phys(tdir[tid[i]]));
        assert_memory_equal(pc, pt, (size_t)kv_page_bytes(g, f));
    }
    /* a backend failure fails every prepared page, sources kept, targets freed */
    fx_quiesce(c, a);
    kv_dir_entry_t e0 = dir[ids[0]], e1 = dir[ids[1]];
    uint32_t two[2] = {ids[0], ids[1]};
    kv_fmt_t back[2] = {KV_FMT_FP8, KV_FMT_FP8};
    uint32_t free8 = fx_stats(c).pages_free[KV_FMT_FP8];
    kvd_core_backend(c)->test_fail_convert = 1;
    assert_int_equal(kvd_core_convert_batch(c, 2, two, back, rc), KV_ERR_DEVICE);
    assert_int_equal(rc[0], KV_ERR_DEVICE);
    assert_int_equal(rc[1], KV_ERR_DEVICE);
    assert_non_null(strstr(kvd_core_errmsg(c), "sources kept"));
    assert_true(dir[ids[0]] == e0 && dir[ids[1]] == e1);
    assert_int_equal(fx_stats(c).pages_free[KV_FMT_FP8], free8);
    assert_int_equal(fx_stats(c).conversion_failures, 2);
    FX_CHECK(c);
    kvd_core_free(&c);
    kvd_core_free(&t);
}

static void test_convert_failure_keeps_source(void **state)
{
    kvd_core_t *c = fx_core();
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t lid;
    FX_OK(kvd_core_alloc(c, a, 1, &lid));
    fx_fill_page(c, lid, 3, NULL);
    const kv_dir_entry_t *dir = kvd_core_backend(c)->dir;
    kv_dir_entry_t e0 = dir[lid];
    kvd_core_backend(c)->test_fail_convert = 1;
    assert_int_equal(kvd_core_convert(c, lid, KV_FMT_TQ3), KV_ERR_DEVICE);
    assert_non_null(strstr(kvd_core_errmsg(c), "source kept"));
    assert_true(dir[lid] == e0);
    kvd_stats_t st = fx_stats(c);
    assert_int_equal(st.pages_free[KV_FMT_TQ3], FX_TQ3);
    assert_int_equal(st.pages_retired[KV_FMT_FP8], 0);
    assert_int_equal(st.conversion_failures, 1);
    FX_CHECK(c);
    /* TQ3 pool full of live pages: RESOURCE_EXHAUSTED, source kept */
    uint32_t ids[FX_TQ3];
    FX_OK(kvd_core_alloc(c, a, FX_TQ3, ids));
    for (uint32_t i = 0; i < FX_TQ3; i++) {
        fx_fill_page(c, ids[i], 20 + i, NULL);
        FX_OK(kvd_core_convert(c, ids[i], KV_FMT_TQ3));
    }
    assert_int_equal(kvd_core_convert(c, lid, KV_FMT_TQ3), KV_ERR_RESOURCE_EXHAUSTED);
    assert_true(dir[lid] == e0);
    FX_CHECK(c);
    kvd_core_free(&c);
}

/* An asynchronous backend, as cuda is: convert() only queues the work (checks and the failure
 * hook first), sync() runs the queue. Built on the host backend's ops. */
typedef struct async_job_s {
    kv_fmt_t src, dst;
    uint32_t n, s[8], d[8];
} async_job_t;
static const kvd_backend_ops_t *g_async_base;
static async_job_t g_async_q[4];
static uint32_t g_async_n;
static int async_convert(kvd_backend_t *b, kv_fmt_t src, kv_fmt_t dst, uint32_t n,
                         const uint32_t *sp, const uint32_t *dp, char *err, size_t errlen)
{
    int rc = kvd_backend_convert_check(b, src, dst, n, sp, dp, err, errlen);
    if (rc != KV_ERR_OK)
        return rc;
    assert_true(n <= 8 && g_async_n < 4);
    async_job_t *j = &g_async_q[g_async_n++];
    j->src = src, j->dst = dst, j->n = n;
    memcpy(j->s, sp, n * sizeof(uint32_t));
    memcpy(j->d, dp, n * sizeof(uint32_t));
    return KV_ERR_OK; /* "launched": it writes its targets whenever the device gets to it */
}
static int async_sync(kvd_backend_t *b, char *err, size_t errlen)
{
    const kvd_backend_ops_t *mine = b->ops;
    b->ops = g_async_base; /* kvd_backend_host_page knows the host backend by its ops */
    for (uint32_t i = 0; i < g_async_n; i++) {
        async_job_t *j = &g_async_q[i];
        int rc = g_async_base->convert(b, j->src, j->dst, j->n, j->s, j->d, err, errlen);
        if (rc != KV_ERR_OK)
            fail_msg("queued conversion failed: %s", err);
    }
    b->ops = mine;
    g_async_n = 0;
    return KV_ERR_OK;
}

/* A batch with a promote and a retier whose second backend call fails after the first was
 * launched: the launched promote must be waited for before its target goes back to the free
 * list. The old code skipped the wait, so the next alloc got that page (free lists are LIFO)
 * and the promote, still queued on the stream, overwrote what the client then wrote. */
static void test_convert_failure_waits_for_launched_work(void **state)
{
    (void)state;
    kvd_core_t *c = fx_core();
    kvd_backend_t *be = kvd_core_backend(c);
    kvd_backend_ops_t ops = *be->ops;
    g_async_base = be->ops;
    ops.convert = async_convert;
    ops.sync = async_sync;
    be->ops = &ops;
    g_async_n = 0;
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[2];
    FX_OK(kvd_core_alloc(c, a, 2, ids));
    fx_fill_page(c, ids[0], 5, NULL);
    fx_fill_page(c, ids[1], 6, NULL);
    FX_OK(kvd_core_convert(c, ids[0], KV_FMT_TQ3)); /* to promote back below */
    fx_quiesce(c, a);
    uint32_t lid[2] = {ids[0], ids[1]};
    kv_fmt_t dst[2] = {KV_FMT_FP8, KV_FMT_TQ3}; /* promotes are issued first (FP8 targets) */
    int rc[2];
    be->test_fail_convert = 2; /* the second backend call, the retier, fails */
    assert_int_equal(kvd_core_convert_batch(c, 2, lid, dst, rc), KV_ERR_DEVICE);
    assert_int_equal(rc[0], KV_ERR_DEVICE);
    assert_int_equal(rc[1], KV_ERR_DEVICE);
    assert_int_equal(g_async_n, 0); /* the launched promote was waited for */
    FX_CHECK(c);
    /* a client gets the promote's target page and writes it; a later wait must not change it */
    uint32_t mine;
    FX_OK(kvd_core_alloc(c, a, 1, &mine));
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, mine, &pi));
    be->ops = g_async_base;
    uint8_t *pg = kvd_backend_host_page(be, KV_FMT_FP8, pi.phys);
    be->ops = &ops;
    assert_non_null(pg);
    size_t bytes = (size_t)be->exp.page_bytes[KV_FMT_FP8];
    memset(pg, 0x5a, bytes);
    char err[256];
    assert_int_equal(be->ops->sync(be, err, sizeof(err)), KV_ERR_OK);
    for (size_t i = 0; i < bytes; i++)
        if (pg[i] != 0x5a)
            fail_msg("byte %zu of the client's page was overwritten by a conversion", i);
    be->ops = g_async_base;
    kvd_core_free(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_maps_directory),
        cmocka_unit_test(test_release_deferred_by_epoch),
        cmocka_unit_test(test_collect_publishes_once),
        cmocka_unit_test(test_close_last_session_frees),
        cmocka_unit_test(test_convert_flips_directory),
        cmocka_unit_test(test_convert_batch),
        cmocka_unit_test(test_convert_failure_keeps_source),
        cmocka_unit_test(test_convert_failure_waits_for_launched_work),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
