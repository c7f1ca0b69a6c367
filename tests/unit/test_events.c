/* test_events.c — index events, both halves.
 *
 * The core's index hook (kvd_core_set_index_hook): every way the prefix index changes is
 * driven and the exact event sequence asserted: seal of a chain (STORED with parent links,
 * tokens, extra), dedupe and unsealed pages (nothing), quota eviction, admin eviction, pressure
 * eviction (REMOVED with its reason and the hash STORED announced), conversions of cached
 * pages (FORMAT both ways) and of unbound pages (nothing), session close (nothing: the cache
 * keeps sealed pages), a snapshot restore (STORED marked restored, then its quota's REMOVED),
 * and removing the hook.
 *
 * The publisher (kvd/events.c) with a real SUB socket on a temporary ipc endpoint: the entries
 * of one flush arrive as one [namespace][Event] message with every field, seq contiguous,
 * batch_max splitting a flush into several messages in order, token ids off, CLEARED at stop,
 * the announcement of entries restored before the publisher existed, a resync (pending changes
 * first, then CLEARED and the whole index, split by batch_max), messages bounded in bytes
 * (KVD_EVENTS_MSG_BYTES) whatever the entries;
 * and a throughput figure (entries/s through encode, send, receive and decode), printed, not
 * asserted.
 */
#include "core_fixture.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>
#include <zmq.h>

#include "events.h"
#include "kvproto.h"

#define REC_MAX 64

typedef struct rec_s {
    kvd_index_ev_kind_t kind;
    uint32_t logical;
    kv_fmt_t fmt;
    uint8_t hash[KVD_HASH_BYTES];
    int has_parent;
    uint8_t parent[KVD_HASH_BYTES];
    uint32_t ntok, tok0;
    size_t extra_len;
    kvd_evict_why_t why;
    int restored;
} rec_t;

static rec_t recs[REC_MAX];
static int nrec;

static void record(const kvd_index_ev_t *ev, void *ud)
{
    int *calls = ud;
    (*calls)++;
    if (nrec >= REC_MAX)
        fail_msg("more than %d events", REC_MAX);
    rec_t *r = &recs[nrec++];
    memset(r, 0, sizeof *r);
    r->kind = ev->kind;
    r->logical = ev->logical;
    r->fmt = ev->fmt;
    memcpy(r->hash, ev->hash, KVD_HASH_BYTES);
    if (ev->parent) {
        r->has_parent = 1;
        memcpy(r->parent, ev->parent, KVD_HASH_BYTES);
    }
    r->ntok = ev->ntok;
    r->tok0 = ev->tokens ? ev->tokens[0] : UINT32_MAX;
    r->extra_len = ev->extra_len;
    r->why = ev->why;
    r->restored = ev->restored;
}

static int calls;

static kvd_core_t *ev_core(uint32_t quota_fp8)
{
    kvd_core_opts_t o;
    fx_opts(&o);
    if (quota_fp8)
        o.cache_quota_pages[KV_FMT_FP8] = quota_fp8;
    kvd_core_t *c = fx_core_opts(&o);
    nrec = 0;
    calls = 0;
    kvd_core_set_index_hook(c, record, &calls);
    return c;
}

/* Seal a prompt of n pages named by seed (prev-linked), held by session s; ids[n]. */
static void seal_chain(kvd_core_t *c, uint64_t s, uint32_t seed, uint32_t n, uint32_t *ids,
                       const uint8_t *extra, size_t elen)
{
    uint32_t tok[8 * FX_PT];
    assert_true(n <= 8);
    fx_tokens(seed, n, tok);
    FX_OK(kvd_core_alloc(c, s, n, ids));
    for (uint32_t i = 0; i < n; i++) {
        uint8_t h[KVD_HASH_BYTES];
        uint32_t canon;
        FX_OK(kvd_core_seal(c, s, ids[i], i ? ids[i - 1] : KVD_NONE, tok + i * FX_PT, FX_PT,
                            extra, elen, h, &canon));
        assert_int_equal(canon, ids[i]);
    }
}

static void assert_rec(int i, kvd_index_ev_kind_t kind, uint32_t lid)
{
    if (i >= nrec)
        fail_msg("event %d missing (%d recorded)", i, nrec);
    assert_int_equal(recs[i].kind, kind);
    assert_int_equal(recs[i].logical, lid);
}

static void test_chain_stored(void **state)
{
    kvd_core_t *c = ev_core(0);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[4];
    const uint8_t extra[3] = {1, 2, 3};
    seal_chain(c, a, 7, 4, ids, extra, sizeof extra);
    assert_int_equal(nrec, 4);
    assert_int_equal(calls, 4);
    uint32_t tok[4 * FX_PT];
    fx_tokens(7, 4, tok);
    for (int i = 0; i < 4; i++) {
        assert_rec(i, KVD_INDEX_EV_STORED, ids[i]);
        assert_int_equal(recs[i].fmt, KV_FMT_FP8);
        assert_int_equal(recs[i].ntok, FX_PT);
        assert_int_equal(recs[i].tok0, tok[i * FX_PT]);
        assert_int_equal(recs[i].extra_len, sizeof extra);
        kvd_page_info_t pi;
        FX_OK(kvd_core_page_info(c, ids[i], &pi));
        assert_memory_equal(recs[i].hash, pi.hash, KVD_HASH_BYTES);
        /* the parent of page i is the hash of page i-1; the first page has none */
        assert_int_equal(recs[i].has_parent, i > 0);
        if (i > 0)
            assert_memory_equal(recs[i].parent, recs[i - 1].hash, KVD_HASH_BYTES);
    }
    /* the same content sealed again by another session dedupes: no event */
    uint64_t b;
    FX_OK(kvd_core_session_open(c, 2, 0, &b));
    uint32_t dup[4];
    uint32_t t2[4 * FX_PT];
    fx_tokens(7, 4, t2);
    FX_OK(kvd_core_alloc(c, b, 2, dup));
    uint8_t h[KVD_HASH_BYTES];
    uint32_t canon;
    FX_OK(kvd_core_seal(c, b, dup[0], KVD_NONE, t2, FX_PT, extra, sizeof extra, h, &canon));
    assert_int_equal(canon, ids[0]);
    assert_int_equal(nrec, 4);
    /* an unsealed page released, a session closed holding sealed pages: the index keeps them */
    FX_OK(kvd_core_release(c, b, &dup[1], 1));
    FX_OK(kvd_core_session_close(c, b));
    FX_OK(kvd_core_session_close(c, a));
    assert_int_equal(nrec, 4);
    FX_CHECK(c);
    kvd_core_free(&c);
}

static void test_quota_admin_pressure(void **state)
{
    kvd_core_t *c = ev_core(2);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[4];
    /* four one-page prompts, each released after its seal: the third and fourth push the
     * oldest unreferenced entry out of the quota of 2 */
    for (uint32_t i = 0; i < 4; i++) {
        seal_chain(c, a, 20 + i, 1, &ids[i], NULL, 0);
        FX_OK(kvd_core_release(c, a, &ids[i], 1));
    }
    assert_int_equal(nrec, 6);
    assert_rec(0, KVD_INDEX_EV_STORED, ids[0]);
    assert_rec(1, KVD_INDEX_EV_STORED, ids[1]);
    assert_rec(2, KVD_INDEX_EV_STORED, ids[2]);
    assert_rec(3, KVD_INDEX_EV_REMOVED, ids[0]);
    assert_rec(4, KVD_INDEX_EV_STORED, ids[3]);
    assert_rec(5, KVD_INDEX_EV_REMOVED, ids[1]);
    assert_int_equal(recs[3].why, KVD_EVICT_QUOTA);
    assert_int_equal(recs[5].why, KVD_EVICT_QUOTA);
    assert_memory_equal(recs[3].hash, recs[0].hash, KVD_HASH_BYTES);
    assert_memory_equal(recs[5].hash, recs[1].hash, KVD_HASH_BYTES);
    assert_false(recs[0].has_parent);
    /* admin evict of ids[2]: exactly one REMOVED with its hash */
    FX_OK(kvd_core_cache_evict(c, ids[2]));
    assert_int_equal(nrec, 7);
    assert_rec(6, KVD_INDEX_EV_REMOVED, ids[2]);
    assert_int_equal(recs[6].why, KVD_EVICT_ADMIN);
    assert_memory_equal(recs[6].hash, recs[2].hash, KVD_HASH_BYTES);
    /* a refused admin evict (not cached) publishes nothing */
    assert_int_equal(kvd_core_cache_evict(c, ids[2]), KV_ERR_NOT_FOUND);
    assert_int_equal(nrec, 7);
    /* pressure: fill the FP8 pool (7 pages, 1 cached) so an alloc must evict ids[3] */
    fx_quiesce(c, a);
    kvd_core_collect(c);
    uint32_t got[FX_FP8];
    FX_OK(kvd_core_alloc(c, a, FX_FP8, got));
    assert_int_equal(nrec, 8);
    assert_rec(7, KVD_INDEX_EV_REMOVED, ids[3]);
    assert_int_equal(recs[7].why, KVD_EVICT_PRESSURE);
    assert_memory_equal(recs[7].hash, recs[4].hash, KVD_HASH_BYTES);
    assert_int_equal(fx_stats(c).evictions_pressure, 1);
    assert_int_equal(fx_stats(c).evictions_quota, 2);
    assert_int_equal(fx_stats(c).evictions_admin, 1);
    FX_CHECK(c);
    kvd_core_free(&c);
}

static void test_convert(void **state)
{
    kvd_core_t *c = ev_core(0);
    uint64_t a;
    FX_OK(kvd_core_session_open(c, 1, 0, &a));
    uint32_t ids[2], open;
    seal_chain(c, a, 30, 2, ids, NULL, 0);
    FX_OK(kvd_core_alloc(c, a, 1, &open));
    nrec = 0;
    FX_OK(kvd_core_convert(c, ids[1], KV_FMT_TQ3));
    assert_int_equal(nrec, 1);
    assert_rec(0, KVD_INDEX_EV_FORMAT, ids[1]);
    assert_int_equal(recs[0].fmt, KV_FMT_TQ3);
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, ids[1], &pi));
    assert_memory_equal(recs[0].hash, pi.hash, KVD_HASH_BYTES);
    /* an unsealed page is not in the index: its conversion is invisible to a router */
    FX_OK(kvd_core_convert(c, open, KV_FMT_TQ3));
    assert_int_equal(nrec, 1);
    /* a refused conversion (already TQ3) publishes nothing; the promote back does */
    assert_int_equal(kvd_core_convert(c, ids[1], KV_FMT_TQ3), KV_ERR_INVALID_ARGUMENT);
    FX_OK(kvd_core_convert(c, ids[1], KV_FMT_FP8));
    assert_int_equal(nrec, 2);
    assert_rec(1, KVD_INDEX_EV_FORMAT, ids[1]);
    assert_int_equal(recs[1].fmt, KV_FMT_FP8);
    /* the hook removed: the core goes on, nothing recorded */
    kvd_core_set_index_hook(c, NULL, NULL);
    FX_OK(kvd_core_convert(c, ids[0], KV_FMT_TQ3));
    FX_OK(kvd_core_release(c, a, ids, 2));
    FX_OK(kvd_core_cache_evict(c, ids[0]));
    assert_int_equal(nrec, 2);
    assert_int_equal(calls, 4); /* 2 STORED + 2 FORMAT; nothing after the removal */
    FX_CHECK(c);
    kvd_core_free(&c);
}

/* Restore a cache entry with hash bytes all `tag` (page content zeros). */
static uint32_t restore(kvd_core_t *c, uint8_t tag)
{
    uint8_t h[KVD_HASH_BYTES];
    memset(h, tag, sizeof h);
    size_t len = (size_t)kvd_core_export(c)->page_bytes[KV_FMT_FP8];
    void *bytes = calloc(1, len);
    assert_non_null(bytes);
    uint32_t lid;
    FX_OK(kvd_core_cache_restore(c, h, KV_FMT_FP8, bytes, len, &lid));
    free(bytes);
    return lid;
}

/* A snapshot restore binds: STORED marked restored (no parent, no tokens); the quota it runs
 * afterwards REMOVEs the LRU head, after the STORED. */
static void test_restore(void **state)
{
    kvd_core_t *c = ev_core(1);
    uint32_t a = restore(c, 0xA1);
    assert_int_equal(nrec, 1);
    assert_rec(0, KVD_INDEX_EV_STORED, a);
    assert_true(recs[0].restored);
    assert_false(recs[0].has_parent);
    assert_int_equal(recs[0].ntok, FX_PT);
    assert_int_equal(recs[0].tok0, UINT32_MAX); /* no tokens */
    assert_int_equal(recs[0].hash[0], 0xA1);
    uint32_t b = restore(c, 0xB2);
    assert_int_equal(nrec, 3);
    assert_rec(1, KVD_INDEX_EV_STORED, b);
    assert_rec(2, KVD_INDEX_EV_REMOVED, a);
    assert_int_equal(recs[2].why, KVD_EVICT_QUOTA);
    assert_int_equal(recs[2].hash[0], 0xA1);
    /* a seal is not a restore */
    uint64_t s;
    FX_OK(kvd_core_session_open(c, 1, 0, &s));
    uint32_t id;
    seal_chain(c, s, 60, 1, &id, NULL, 0);
    assert_rec(3, KVD_INDEX_EV_STORED, id);
    assert_false(recs[3].restored);
    FX_CHECK(c);
    kvd_core_free(&c);
}

/* ---- the publisher ------------------------------------------------------------------------ */
typedef struct pubfx_s {
    char dir[64], ep[128];
    void *ctx, *sub;
    uv_loop_t loop;
    kvd_events_t *ev;
} pubfx_t;

static Kvd__Event *recv_event(pubfx_t *f, int timeout_ms)
{
    zmq_pollitem_t it = {.socket = f->sub, .events = ZMQ_POLLIN};
    if (zmq_poll(&it, 1, timeout_ms) <= 0)
        return NULL;
    zmq_msg_t topic, body;
    zmq_msg_init(&topic);
    zmq_msg_init(&body);
    assert_true(zmq_msg_recv(&topic, f->sub, 0) >= 0);
    assert_true(zmq_msg_more(&topic));
    assert_int_equal(zmq_msg_size(&topic), 4);
    assert_memory_equal(zmq_msg_data(&topic), "ns-x", 4);
    assert_true(zmq_msg_recv(&body, f->sub, 0) >= 0);
    Kvd__Event *e = kvd__event__unpack(NULL, zmq_msg_size(&body), zmq_msg_data(&body));
    assert_non_null(e);
    zmq_msg_close(&topic);
    zmq_msg_close(&body);
    return e;
}

static void hook_stored(kvd_events_t *ev, uint32_t page, uint8_t tag, const uint8_t *parent)
{
    uint8_t h[KVD_HASH_BYTES];
    uint32_t tok[FX_PT] = {tag, tag + 1u, 0xFFFFFFFFu};
    const uint8_t extra[2] = {0xAB, tag};
    memset(h, tag, sizeof h);
    kvd_index_ev_t e = {.kind = KVD_INDEX_EV_STORED, .logical = page, .fmt = KV_FMT_FP8,
                        .hash = h, .parent = parent, .tokens = tok, .ntok = FX_PT,
                        .extra = extra, .extra_len = sizeof extra};
    kvd_events_hook(&e, ev);
}

/* Bind a publisher on a temp ipc path, connect a SUB, and beat the slow joiner by flushing a
 * probe until one arrives. Returns the seq of the last probe received. */
static uint64_t pub_open(pubfx_t *f, uint32_t batch_max, int tokens)
{
    memset(f, 0, sizeof *f);
    snprintf(f->dir, sizeof f->dir, "/tmp/kvd-ev-unit-XXXXXX");
    assert_non_null(mkdtemp(f->dir));
    snprintf(f->ep, sizeof f->ep, "ipc://%s/run/ev.sock", f->dir);
    assert_int_equal(uv_loop_init(&f->loop), 0);
    f->ctx = zmq_ctx_new();
    kvd_events_opts_t o = {.zctx = f->ctx, .endpoint = f->ep, .hwm = 0, .ns = "ns-x",
                           .instance = 0x1234, .tokens = tokens, .batch_max = batch_max};
    char err[256] = "";
    if (kvd_events_init(&f->ev, &f->loop, &o, err, sizeof err) != 0)
        fail_msg("kvd_events_init: %s", err);
    /* bad options are refused, not crashed on */
    kvd_events_t *bad = NULL;
    kvd_events_opts_t ob = o;
    ob.batch_max = 0;
    assert_int_equal(kvd_events_init(&bad, &f->loop, &ob, err, sizeof err), -1);
    assert_null(bad);
    f->sub = zmq_socket(f->ctx, ZMQ_SUB);
    assert_int_equal(zmq_setsockopt(f->sub, ZMQ_SUBSCRIBE, "ns-x", 4), 0);
    assert_int_equal(zmq_connect(f->sub, f->ep), 0);
    for (int i = 0; i < 600; i++) {
        hook_stored(f->ev, 1, 1, NULL);
        kvd_events_flush(f->ev);
        Kvd__Event *e = recv_event(f, 50);
        if (e) {
            uint64_t seq = e->seq;
            kvd__event__free_unpacked(e, NULL);
            return seq;
        }
    }
    fail_msg("no event reached the subscriber in 30 s");
    return 0;
}

static void pub_close(pubfx_t *f)
{
    kvd_events_stop(f->ev);
    uv_run(&f->loop, UV_RUN_NOWAIT);
    kvd_events_free(&f->ev);
    assert_null(f->ev);
    int zero = 0;
    zmq_setsockopt(f->sub, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(f->sub);
    zmq_ctx_term(f->ctx);
    assert_int_equal(uv_loop_close(&f->loop), 0);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->dir);
    if (system(cmd)) {
    }
}

static void test_publisher(void **state)
{
    pubfx_t f;
    uint64_t seq = pub_open(&f, 2, 1);
    uint8_t parent[KVD_HASH_BYTES], h9[KVD_HASH_BYTES];
    memset(parent, 7, sizeof parent);
    memset(h9, 9, sizeof h9);
    /* three changes, one flush, batch_max 2: two messages, in order, seq contiguous */
    hook_stored(f.ev, 42, 3, parent);
    kvd_index_ev_t rm = {.kind = KVD_INDEX_EV_REMOVED, .logical = 17, .fmt = KV_FMT_TQ3,
                         .hash = h9, .why = KVD_EVICT_QUOTA};
    kvd_events_hook(&rm, f.ev);
    kvd_index_ev_t fc = {.kind = KVD_INDEX_EV_FORMAT, .logical = 42, .fmt = KV_FMT_TQ3,
                         .hash = h9};
    kvd_events_hook(&fc, f.ev);
    kvd_events_flush(f.ev);
    Kvd__Event *e = recv_event(&f, 30000);
    assert_non_null(e);
    assert_int_equal(e->seq, seq + 1);
    assert_int_equal(e->version, KVP_VERSION);
    assert_int_equal(e->instance, 0x1234);
    assert_string_equal(e->namespace_, "ns-x");
    assert_int_equal(e->n_entries, 2);
    const Kvd__EventEntry *x = e->entries[0];
    assert_int_equal(x->kind, KVD__EVENT_ENTRY__KIND__KIND_STORED);
    assert_int_equal(x->page, 42);
    assert_int_equal(x->format, KVD__FORMAT__FORMAT_FP8);
    assert_int_equal(x->tokens, FX_PT);
    assert_int_equal(x->hash.len, KVD_HASH_BYTES);
    assert_int_equal(x->hash.data[31], 3);
    assert_int_equal(x->parent_hash.len, KVD_HASH_BYTES);
    assert_memory_equal(x->parent_hash.data, parent, KVD_HASH_BYTES);
    assert_int_equal(x->n_token_ids, FX_PT);
    assert_int_equal(x->token_ids[0], 3);
    assert_int_equal(x->token_ids[2], 0xFFFFFFFFu);
    assert_int_equal(x->extra.len, 2);
    assert_int_equal(x->extra.data[1], 3);
    x = e->entries[1];
    assert_int_equal(x->kind, KVD__EVENT_ENTRY__KIND__KIND_REMOVED);
    assert_int_equal(x->reason, KVD__EVENT_ENTRY__REASON__REASON_QUOTA);
    assert_int_equal(x->format, KVD__FORMAT__FORMAT_TQ3);
    assert_int_equal(x->page, 17);
    assert_memory_equal(x->hash.data, h9, KVD_HASH_BYTES);
    assert_int_equal(x->parent_hash.len, 0);
    kvd__event__free_unpacked(e, NULL);
    e = recv_event(&f, 30000);
    assert_non_null(e);
    assert_int_equal(e->seq, seq + 2);
    assert_int_equal(e->n_entries, 1);
    assert_int_equal(e->entries[0]->kind, KVD__EVENT_ENTRY__KIND__KIND_FORMAT_CHANGED);
    assert_int_equal(e->entries[0]->format, KVD__FORMAT__FORMAT_TQ3);
    kvd__event__free_unpacked(e, NULL);
    /* an empty flush publishes nothing: the next message is the next change */
    kvd_events_flush(f.ev);
    /* tokens off: STORED without token ids or extra; the count stays */
    kvd_events_configure(f.ev, 8, 0);
    hook_stored(f.ev, 5, 4, NULL);
    kvd_events_flush(f.ev);
    e = recv_event(&f, 30000);
    assert_non_null(e);
    assert_int_equal(e->seq, seq + 3);
    assert_int_equal(e->n_entries, 1);
    assert_int_equal(e->entries[0]->n_token_ids, 0);
    assert_int_equal(e->entries[0]->extra.len, 0);
    assert_int_equal(e->entries[0]->tokens, FX_PT);
    assert_int_equal(e->entries[0]->parent_hash.len, 0);
    kvd__event__free_unpacked(e, NULL);
    kvd_stats_t st;
    memset(&st, 0, sizeof st);
    kvd_events_stats(f.ev, &st);
    assert_int_equal(st.events_seq, seq + 3);
    assert_int_equal(st.events_dropped, 0);
    /* stop: CLEARED (shutdown) as the next message */
    kvd_events_stop(f.ev);
    e = recv_event(&f, 30000);
    assert_non_null(e);
    assert_int_equal(e->seq, seq + 4);
    assert_int_equal(e->n_entries, 1);
    assert_int_equal(e->entries[0]->kind, KVD__EVENT_ENTRY__KIND__KIND_CLEARED);
    assert_int_equal(e->entries[0]->reason, KVD__EVENT_ENTRY__REASON__REASON_SHUTDOWN);
    assert_int_equal(e->entries[0]->hash.len, 0);
    kvd__event__free_unpacked(e, NULL);
    pub_close(&f);
}

/* Entries bound before the publisher existed (a snapshot load at start) are announced once:
 * STORED, reason RESTORED, no parent and no token ids, in one message. */
static void test_announce(void **state)
{
    kvd_core_t *c = ev_core(0);
    kvd_core_set_index_hook(c, NULL, NULL);
    uint32_t a = restore(c, 0x11), b = restore(c, 0x22);
    pubfx_t f;
    uint64_t seq = pub_open(&f, 64, 1);
    kvd_events_announce(f.ev, c);
    kvd_events_flush(f.ev);
    Kvd__Event *e = recv_event(&f, 30000);
    assert_non_null(e);
    assert_int_equal(e->seq, seq + 1);
    assert_int_equal(e->n_entries, 2);
    int seen_a = 0, seen_b = 0;
    for (size_t i = 0; i < 2; i++) {
        const Kvd__EventEntry *x = e->entries[i];
        assert_int_equal(x->kind, KVD__EVENT_ENTRY__KIND__KIND_STORED);
        assert_int_equal(x->reason, KVD__EVENT_ENTRY__REASON__REASON_RESTORED);
        assert_int_equal(x->parent_hash.len, 0);
        assert_int_equal(x->n_token_ids, 0);
        assert_int_equal(x->tokens, FX_PT);
        assert_int_equal(x->hash.len, KVD_HASH_BYTES);
        if (x->page == a && x->hash.data[0] == 0x11)
            seen_a++;
        if (x->page == b && x->hash.data[0] == 0x22)
            seen_b++;
    }
    assert_int_equal(seen_a, 1);
    assert_int_equal(seen_b, 1);
    kvd__event__free_unpacked(e, NULL);
    pub_close(&f);
    kvd_core_free(&c);
}

/* events_sync: pending changes go out first, then CLEARED (resync) and one STORED (resync) per
 * bound entry, split by batch_max, in order. */
static void test_resync(void **state)
{
    kvd_core_t *c = ev_core(0);
    kvd_core_set_index_hook(c, NULL, NULL);
    uint64_t sid;
    FX_OK(kvd_core_session_open(c, 1, 0, &sid));
    uint32_t ids[2];
    seal_chain(c, sid, 70, 2, ids, NULL, 0);
    pubfx_t f;
    uint64_t seq = pub_open(&f, 2, 1);
    uint8_t h9[KVD_HASH_BYTES];
    memset(h9, 9, sizeof h9);
    kvd_index_ev_t rm = {.kind = KVD_INDEX_EV_REMOVED, .logical = 17, .fmt = KV_FMT_FP8,
                         .hash = h9, .why = KVD_EVICT_ADMIN};
    kvd_events_hook(&rm, f.ev); /* pending when the resync comes */
    uint64_t rseq;
    uint32_t n;
    kvd_events_resync(f.ev, c, &rseq, &n);
    assert_int_equal(rseq, seq + 2);
    assert_int_equal(n, 2);
    Kvd__Event *e = recv_event(&f, 30000);
    assert_non_null(e);
    assert_int_equal(e->seq, seq + 1);
    assert_int_equal(e->n_entries, 1);
    assert_int_equal(e->entries[0]->kind, KVD__EVENT_ENTRY__KIND__KIND_REMOVED);
    kvd__event__free_unpacked(e, NULL);
    e = recv_event(&f, 30000);
    assert_non_null(e);
    assert_int_equal(e->seq, seq + 2);
    assert_int_equal(e->n_entries, 2); /* batch_max 2: CLEARED + the first STORED */
    assert_int_equal(e->entries[0]->kind, KVD__EVENT_ENTRY__KIND__KIND_CLEARED);
    assert_int_equal(e->entries[0]->reason, KVD__EVENT_ENTRY__REASON__REASON_RESYNC);
    const Kvd__EventEntry *x1 = e->entries[1];
    assert_int_equal(x1->kind, KVD__EVENT_ENTRY__KIND__KIND_STORED);
    assert_int_equal(x1->reason, KVD__EVENT_ENTRY__REASON__REASON_RESYNC);
    assert_int_equal(x1->n_token_ids, 0);
    assert_int_equal(x1->parent_hash.len, 0);
    uint32_t first = x1->page;
    kvd__event__free_unpacked(e, NULL);
    e = recv_event(&f, 30000);
    assert_non_null(e);
    assert_int_equal(e->seq, seq + 3);
    assert_int_equal(e->n_entries, 1);
    assert_int_equal(e->entries[0]->reason, KVD__EVENT_ENTRY__REASON__REASON_RESYNC);
    uint32_t second = e->entries[0]->page;
    assert_true((first == ids[0] && second == ids[1]) || (first == ids[1] && second == ids[0]));
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, second, &pi));
    assert_memory_equal(e->entries[0]->hash.data, pi.hash, KVD_HASH_BYTES);
    kvd__event__free_unpacked(e, NULL);
    pub_close(&f);
    kvd_core_free(&c);
}

/* events_batch lowered (config set) while more entries than the new value are pending: the
 * flush splits them, in order. Regression: they went out as one message of 5 over a setting
 * of 2 (push() only bounds a batch as it grows). */
static void test_batch_lowered_while_pending(void **state)
{
    pubfx_t f;
    uint64_t seq = pub_open(&f, 8, 1);
    for (uint32_t i = 0; i < 5; i++)
        hook_stored(f.ev, 100 + i, (uint8_t)(10 + i), NULL);
    kvd_events_configure(f.ev, 2, 1);
    kvd_events_flush(f.ev);
    const size_t want[3] = {2, 2, 1};
    uint32_t page = 100;
    for (int m = 0; m < 3; m++) {
        Kvd__Event *e = recv_event(&f, 30000);
        assert_non_null(e);
        assert_int_equal(e->seq, seq + 1 + (uint64_t)m);
        if (e->n_entries != want[m])
            fail_msg("message %d holds %zu entries, events_batch is 2", m, e->n_entries);
        for (size_t i = 0; i < e->n_entries; i++, page++) {
            assert_int_equal(e->entries[i]->page, page);
            assert_int_equal(e->entries[i]->n_token_ids, FX_PT);
            assert_int_equal(e->entries[i]->token_ids[0], page - 100 + 10);
            assert_int_equal(e->entries[i]->extra.data[1], page - 100 + 10);
        }
        kvd__event__free_unpacked(e, NULL);
    }
    kvd_stats_t st;
    memset(&st, 0, sizeof st);
    kvd_events_stats(f.ev, &st);
    assert_int_equal(st.events_seq, seq + 3);
    pub_close(&f);
}

static uint64_t real_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* Event.time_ns's clock */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

typedef struct timer_change_s {
    kvd_events_t *ev;
    uint64_t at_ns; /* when the change was made */
} timer_change_t;

static void change_from_timer(uv_timer_t *t)
{
    timer_change_t *x = t->data;
    uint8_t h[KVD_HASH_BYTES];
    memset(h, 0x5A, sizeof h);
    kvd_index_ev_t fc = {.kind = KVD_INDEX_EV_FORMAT, .logical = 8, .fmt = KV_FMT_TQ3, .hash = h};
    x->at_ns = real_ns();
    kvd_events_hook(&fc, x->ev); /* what a lifecycle tick's retier of a cached page does */
}

static void stop_loop(uv_timer_t *t)
{
    uv_stop(t->loop);
}

/* A change made in a timer callback (the lifecycle tick) goes out before the loop sleeps
 * again. Regression: only a uv_check handle flushed, and libuv runs timers outside the
 * poll → check window, so the tick's FORMAT_CHANGED waited in the pending batch while poll
 * slept, until the next timer or request woke the loop: here 1.5 s, in an idle daemon a whole
 * lifecycle_ms (or epoch_ms). */
static void test_timer_change_not_held(void **state)
{
    pubfx_t f;
    uint64_t seq = pub_open(&f, 64, 1);
    timer_change_t x = {.ev = f.ev};
    uv_timer_t change, stop;
    uv_timer_init(&f.loop, &change);
    uv_timer_init(&f.loop, &stop);
    change.data = &x;
    uv_timer_start(&change, change_from_timer, 10, 0);
    uv_timer_start(&stop, stop_loop, 1500, 0); /* the next wake-up of an idle loop */
    uv_run(&f.loop, UV_RUN_DEFAULT);
    Kvd__Event *e = recv_event(&f, 30000);
    assert_non_null(e);
    assert_int_equal(e->seq, seq + 1);
    assert_int_equal(e->n_entries, 1);
    assert_int_equal(e->entries[0]->kind, KVD__EVENT_ENTRY__KIND__KIND_FORMAT_CHANGED);
    assert_true(x.at_ns > 0);
    uint64_t late_ms = (e->time_ns - x.at_ns) / 1000000u;
    if (e->time_ns < x.at_ns || late_ms > 700)
        fail_msg("the timer's change was published %llu ms after it was made",
                 (unsigned long long)late_ms);
    kvd__event__free_unpacked(e, NULL);
    uv_close((uv_handle_t *)&change, NULL);
    uv_close((uv_handle_t *)&stop, NULL);
    pub_close(&f);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Throughput of the publisher: rounds of 1024 STORED entries (3 token ids, 2 bytes of extra, a
 * parent), each flushed (as messages of at most KVD_EVENTS_MSG_BYTES), received and decoded by
 * the subscriber before the next round (so nothing is dropped and the figure includes the
 * consumer). Printed, not asserted: the machine's load decides it; every message must still
 * arrive in order. */
static void test_publisher_rate(void **state)
{
    pubfx_t f;
    uint64_t seq = pub_open(&f, 1024, 1);
    const uint32_t rounds = 200, per = 1024;
    uint8_t parent[KVD_HASH_BYTES];
    memset(parent, 5, sizeof parent);
    double pub_s = 0, t0 = now_s();
    uint64_t entries = 0, msgs = 0;
    for (uint32_t m = 0; m < rounds; m++) {
        double a = now_s();
        for (uint32_t i = 0; i < per; i++)
            hook_stored(f.ev, i, (uint8_t)i, parent);
        kvd_events_flush(f.ev);
        pub_s += now_s() - a;
        for (uint32_t got = 0; got < per;) {
            Kvd__Event *e = recv_event(&f, 30000);
            assert_non_null(e);
            assert_int_equal(e->seq, seq + 1 + msgs);
            assert_int_equal(e->entries[0]->page, got);
            got += (uint32_t)e->n_entries;
            entries += e->n_entries;
            msgs++;
            kvd__event__free_unpacked(e, NULL);
        }
    }
    double all_s = now_s() - t0;
    printf("events publisher: %llu STORED entries in %llu messages: publisher side (hook + "
           "encode + send) %.0f entries/s; end to end with an ipc subscriber decoding %.0f "
           "entries/s\n",
           (unsigned long long)entries, (unsigned long long)msgs, (double)entries / pub_s,
           (double)entries / all_s);
    pub_close(&f);
}

/* The worst STORED entries (page_tokens token ids of 5-byte varints, 256 bytes of extra, a
 * parent): each message stays within KVD_EVENTS_MSG_BYTES, entries in order, seq contiguous,
 * nothing lost. Regression: a message was bounded only by events_batch entries, so 1024 such
 * entries made one ~1.7 MB message here (and hwm of them queued per stuck subscriber: with
 * the old default 10000 and page_tokens 16, ~4.3 GB), and events_batch 65536 with page_tokens
 * 4096 one of ~1.4 GB. The entries' token ids go through the same path as the daemon's. */
static void test_message_bytes_bounded(void **state)
{
    pubfx_t f;
    uint64_t seq = pub_open(&f, 1024, 1);
    enum { NTOK = 256, N = 1024 };
    static uint32_t tok[NTOK];
    uint8_t extra[KVP_MAX_EXTRA], h[KVD_HASH_BYTES], parent[KVD_HASH_BYTES];
    for (int i = 0; i < NTOK; i++)
        tok[i] = 0xF0000000u + (uint32_t)i; /* 5-byte varints */
    memset(extra, 0xEE, sizeof extra);
    memset(parent, 0x11, sizeof parent);
    for (uint32_t i = 0; i < N; i++) {
        memset(h, (int)(i & 0xFF), sizeof h);
        kvd_index_ev_t e = {.kind = KVD_INDEX_EV_STORED, .logical = 0xFFFFFFF0u - i,
                            .fmt = KV_FMT_TQ3, .hash = h, .parent = parent, .tokens = tok,
                            .ntok = NTOK, .extra = extra, .extra_len = sizeof extra};
        kvd_events_hook(&e, f.ev);
    }
    kvd_events_flush(f.ev);
    uint32_t got = 0, msgs = 0;
    while (got < N) {
        zmq_pollitem_t it = {.socket = f.sub, .events = ZMQ_POLLIN};
        assert_true(zmq_poll(&it, 1, 30000) > 0);
        zmq_msg_t topic, body;
        zmq_msg_init(&topic);
        zmq_msg_init(&body);
        assert_true(zmq_msg_recv(&topic, f.sub, 0) >= 0);
        assert_true(zmq_msg_recv(&body, f.sub, 0) >= 0);
        if (zmq_msg_size(&body) > KVD_EVENTS_MSG_BYTES)
            fail_msg("message %u is %zu bytes, over %u", msgs, zmq_msg_size(&body),
                     KVD_EVENTS_MSG_BYTES);
        Kvd__Event *e = kvd__event__unpack(NULL, zmq_msg_size(&body), zmq_msg_data(&body));
        assert_non_null(e);
        assert_int_equal(e->seq, seq + 1 + msgs);
        assert_true(e->n_entries >= 1);
        for (size_t i = 0; i < e->n_entries; i++, got++) {
            assert_int_equal(e->entries[i]->page, 0xFFFFFFF0u - got);
            assert_int_equal(e->entries[i]->n_token_ids, NTOK);
            assert_int_equal(e->entries[i]->token_ids[NTOK - 1], tok[NTOK - 1]);
            assert_int_equal(e->entries[i]->extra.len, KVP_MAX_EXTRA);
        }
        msgs++;
        kvd__event__free_unpacked(e, NULL);
        zmq_msg_close(&topic);
        zmq_msg_close(&body);
    }
    assert_int_equal(got, N);
    /* ~1.6 KB an entry: about ten a message, not one message of all */
    assert_true(msgs >= N / 12);
    kvd_stats_t st;
    memset(&st, 0, sizeof st);
    kvd_events_stats(f.ev, &st);
    assert_int_equal(st.events_dropped, 0);
    assert_int_equal(st.events_seq, seq + msgs);
    pub_close(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chain_stored),
        cmocka_unit_test(test_quota_admin_pressure),
        cmocka_unit_test(test_convert),
        cmocka_unit_test(test_restore),
        cmocka_unit_test(test_publisher),
        cmocka_unit_test(test_announce),
        cmocka_unit_test(test_resync),
        cmocka_unit_test(test_timer_change_not_held),
        cmocka_unit_test(test_batch_lowered_while_pending),
        cmocka_unit_test(test_publisher_rate),
        cmocka_unit_test(test_message_bytes_bounded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
