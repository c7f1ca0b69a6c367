/* session.c — sessions (one per attached client process) and their sequences.
 *
 * A session owns request references: "loose" ones (from alloc, lookup, seal dedupe) and those
 * moved into its sequences by seq_append. Both are counted per logical id in the session
 * (loose: lid → n, held: lid → loose + in-sequence n), so release, seal's "does this session
 * hold prev" and session close are O(refs of the session), never O(pool).
 *
 * A sequence is the daemon's copy of one request's block table: logical ids in order plus the
 * time each was appended, which the lifecycle controller turns into ages (Recent window).
 *
 * Closing a session (process exit) drops all of it at once WITHOUT stamping: the process is
 * gone, none of its kernels can still read, so its unsealed pages are freeable immediately.
 */
#include <string.h>

#include "core_int.h"

kvd_session_t *kvd__session_get(const kvd_core_t *c, uint64_t sid)
{
    uint64_t *v = kvd_map_get(&c->sessions, sid);
    return v ? (kvd_session_t *)(uintptr_t)*v : NULL;
}

kvd_seq_t *kvd__seq_get(const kvd_core_t *c, uint64_t seq)
{
    uint64_t *v = kvd_map_get(&c->seqs, seq);
    return v ? (kvd_seq_t *)(uintptr_t)*v : NULL;
}

uint64_t kvd__count(const kvd_map_t *m, uint32_t lid)
{
    uint64_t *v = kvd_map_get(m, lid);
    return v ? *v : 0;
}

void kvd__count_add(kvd_map_t *m, uint32_t lid, int64_t delta)
{
    uint64_t *v = kvd_map_get(m, lid);
    int64_t now = (v ? (int64_t)*v : 0) + delta;
    if (now < 0)
        KVD_PANIC("session count of logical page %u below zero", lid);
    if (now == 0) {
        if (v)
            kvd_map_del(m, lid);
        return;
    }
    if (v) {
        *v = (uint64_t)now;
        return;
    }
    /* Callers reserve before mutating, so this insert cannot fail. */
    if (kvd_map_put(m, lid, (uint64_t)now) != 0)
        KVD_PANIC("insert into a reserved session map failed");
}

static void seq_destroy(kvd_seq_t *q)
{
    kvd_free(q->lids);
    kvd_free(q->ts);
    kvd_free(q);
}

static void session_destroy(kvd_session_t *s)
{
    kvd_map_fini(&s->loose);
    kvd_map_fini(&s->held);
    kvd_map_fini(&s->seqs);
    kvd_free(s);
}

void kvd__sessions_fini(kvd_core_t *c)
{
    uint64_t pos = 0, k, v;
    while (kvd_map_next(&c->seqs, &pos, &k, &v))
        seq_destroy((kvd_seq_t *)(uintptr_t)v);
    pos = 0;
    while (kvd_map_next(&c->sessions, &pos, &k, &v))
        session_destroy((kvd_session_t *)(uintptr_t)v);
    kvd_map_fini(&c->seqs);
    kvd_map_fini(&c->sessions);
}

int kvd_core_session_open(kvd_core_t *c, int32_t pid, uint32_t uid, uint64_t *sid_out)
{
    if (!sid_out)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "session_open: sid_out is NULL");
    kvd_session_t *s = kvd_calloc(1, sizeof(*s));
    if (!s || kvd_map_reserve(&c->sessions, 1) != 0) {
        kvd_free(s);
        return kvd__fail(c, KV_ERR_NOMEM, "session_open: out of memory");
    }
    kvd__epoch_publish(c);
    s->sid = c->next_sid++;
    s->pid = pid;
    s->uid = uid;
    s->safe_epoch = c->epoch; /* it has launched nothing; later kernels are tagged ≥ epoch */
    s->opened_ns = kvd__now(c);
    kvd_map_init(&s->loose);
    kvd_map_init(&s->held);
    kvd_map_init(&s->seqs);
    kvd_map_put(&c->sessions, s->sid, (uint64_t)(uintptr_t)s); /* reserved: cannot fail */
    c->st.sessions_opened++;
    *sid_out = s->sid;
    return KV_ERR_OK;
}

/* Drop every ref of sequence q (stamp: 1 for a live finish, 0 for a dead session). */
static void seq_drop(kvd_core_t *c, kvd_session_t *s, kvd_seq_t *q, int stamp)
{
    for (uint32_t i = 0; i < q->n; i++) {
        uint32_t lid = q->lids[i];
        kvd_lpage_t *p = &c->lp[lid];
        if (p->req_seq == 0)
            KVD_PANIC("sequence refcount of logical page %u below zero", lid);
        p->req_seq--;
        s->seq_total--;
        kvd__count_add(&s->held, lid, -1);
        int was_open = p->state == KVD_PAGE_OPEN;
        if (stamp)
            kvd__stamp_drop(c, lid);
        else
            c->st.reclaimed_refs++;
        kvd__refs_changed(c, lid);
        if (!stamp && was_open && p->state == KVD_PAGE_RETIRED)
            c->st.reclaimed_open_pages++;
    }
    kvd_map_del(&s->seqs, q->id);
    kvd_map_del(&c->seqs, q->id);
    seq_destroy(q);
}

int kvd_core_session_close(kvd_core_t *c, uint64_t sid)
{
    kvd_session_t *s = kvd__session_get(c, sid);
    if (!s)
        return kvd__fail(c, KV_ERR_NO_SESSION, "session %llu does not exist",
                         (unsigned long long)sid);
    /* Both maps drained with kvd_map_pop: restarting kvd_map_next at slot 0 after every
     * delete made a close quadratic in the map's size (65536 loose pages: 3.1 s of a blocked
     * loop on the 2-core dev machine, 56 ms with pop; 9.8 s in the review's measurement). seq_drop deletes the sequence from s->seqs again: a no-op. */
    uint64_t pos = 0, k, v;
    while (kvd_map_pop(&s->seqs, &pos, &k, &v))
        seq_drop(c, s, kvd__seq_get(c, k), 0);
    /* Loose refs: copy nothing, just drain the map key by key. */
    pos = 0;
    while (kvd_map_pop(&s->loose, &pos, &k, &v)) {
        uint32_t lid = (uint32_t)k;
        kvd_lpage_t *p = &c->lp[lid];
        if (p->req_loose < v)
            KVD_PANIC("loose refcount of logical page %u below zero", lid);
        int was_open = p->state == KVD_PAGE_OPEN;
        p->req_loose -= (uint32_t)v;
        kvd__count_add(&s->held, lid, -(int64_t)v);
        c->st.reclaimed_refs += v;
        kvd__refs_changed(c, lid);
        if (was_open && p->state == KVD_PAGE_RETIRED)
            c->st.reclaimed_open_pages++;
    }
    KVD_ASSERT(s->held.len == 0);
    kvd_map_del(&c->sessions, sid);
    session_destroy(s);
    c->st.sessions_closed++;
    kvd_core_collect(c);
    kvd__epoch_publish(c);
    return KV_ERR_OK;
}

int kvd_core_session_report_epoch(kvd_core_t *c, uint64_t sid, uint64_t safe_epoch)
{
    kvd_session_t *s = kvd__session_get(c, sid);
    if (!s)
        return kvd__fail(c, KV_ERR_NO_SESSION, "session %llu does not exist",
                         (unsigned long long)sid);
    kvd__epoch_publish(c);
    if (safe_epoch < s->safe_epoch || safe_epoch > c->epoch)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT,
                         "epoch report %llu out of range: must be >= the previous report %llu "
                         "and <= the current epoch %llu",
                         (unsigned long long)safe_epoch, (unsigned long long)s->safe_epoch,
                         (unsigned long long)c->epoch);
    uint64_t before = kvd__min_safe_epoch(c);
    s->safe_epoch = safe_epoch;
    if (kvd__min_safe_epoch(c) != before)
        kvd_core_collect(c);
    return KV_ERR_OK;
}

int kvd_core_session_fence(kvd_core_t *c, uint64_t sid)
{
    kvd_session_t *s = kvd__session_get(c, sid);
    if (!s)
        return kvd__fail(c, KV_ERR_NO_SESSION, "session %llu does not exist",
                         (unsigned long long)sid);
    s->fenced = 1;
    kvd_core_collect(c);
    return KV_ERR_OK;
}

static void session_fill_info(const kvd_session_t *s, kvd_session_info_t *o)
{
    memset(o, 0, sizeof(*o));
    o->sid = s->sid;
    o->pid = s->pid;
    o->uid = s->uid;
    o->safe_epoch = s->safe_epoch;
    o->loose_refs = s->loose_total;
    o->seq_refs = s->seq_total;
    o->sequences = (uint32_t)s->seqs.len;
    o->opened_ns = s->opened_ns;
    o->fenced = s->fenced;
}

int kvd_core_session_info(const kvd_core_t *c, uint64_t sid, kvd_session_info_t *out)
{
    const kvd_session_t *s = kvd__session_get(c, sid);
    if (!s || !out)
        return s ? KV_ERR_INVALID_ARGUMENT : KV_ERR_NO_SESSION;
    session_fill_info(s, out);
    return KV_ERR_OK;
}

void kvd_core_session_foreach(const kvd_core_t *c,
                              void (*fn)(const kvd_session_info_t *s, void *ud), void *ud)
{
    uint64_t pos = 0, k, v;
    kvd_session_info_t info;
    while (kvd_map_next(&c->sessions, &pos, &k, &v)) {
        session_fill_info((const kvd_session_t *)(uintptr_t)v, &info);
        fn(&info, ud);
    }
}

/* ---- sequences --------------------------------------------------------------------------- */
int kvd_core_seq_open(kvd_core_t *c, uint64_t sid, uint64_t *seq_out)
{
    kvd_session_t *s = kvd__session_get(c, sid);
    if (!s)
        return kvd__fail(c, KV_ERR_NO_SESSION, "session %llu does not exist",
                         (unsigned long long)sid);
    if (!seq_out)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "seq_open: seq_out is NULL");
    kvd_seq_t *q = kvd_calloc(1, sizeof(*q));
    if (!q || kvd_map_reserve(&c->seqs, 1) != 0 || kvd_map_reserve(&s->seqs, 1) != 0) {
        kvd_free(q);
        return kvd__fail(c, KV_ERR_NOMEM, "seq_open: out of memory");
    }
    q->id = c->next_seq++;
    q->sid = sid;
    kvd_map_put(&c->seqs, q->id, (uint64_t)(uintptr_t)q);
    kvd_map_put(&s->seqs, q->id, 1);
    *seq_out = q->id;
    return KV_ERR_OK;
}

static kvd_seq_t *seq_of(kvd_core_t *c, uint64_t sid, uint64_t seq)
{
    kvd_seq_t *q = kvd__seq_get(c, seq);
    return q && q->sid == sid ? q : NULL;
}

int kvd_core_seq_append(kvd_core_t *c, uint64_t sid, uint64_t seq, const uint32_t *ids,
                        uint32_t n)
{
    kvd_session_t *s = kvd__session_get(c, sid);
    if (!s)
        return kvd__fail(c, KV_ERR_NO_SESSION, "session %llu does not exist",
                         (unsigned long long)sid);
    kvd_seq_t *q = seq_of(c, sid, seq);
    if (!q)
        return kvd__fail(c, KV_ERR_NOT_FOUND, "sequence %llu is not a sequence of session %llu",
                         (unsigned long long)seq, (unsigned long long)sid);
    if (n == 0)
        return KV_ERR_OK;
    if (!ids)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "seq_append: ids is NULL");
    uint32_t i, bad = kvd__loose_first_missing(c, s, ids, n);
    if (bad != KVD_NONE)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT,
                         "seq_append: logical page %u (index %u) is not held loose by session "
                         "%llu (alloc, lookup or seal it first; each id once per ref)",
                         ids[bad], bad, (unsigned long long)sid);
    if ((uint64_t)q->n + n > UINT32_MAX)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "seq_append: sequence too long");
    if (q->n + n > q->cap) {
        uint32_t cap = q->cap ? q->cap : 16;
        while (cap < q->n + n)
            cap = cap > UINT32_MAX / 2 ? UINT32_MAX : cap * 2;
        uint32_t *l = kvd_realloc(q->lids, (size_t)cap * sizeof(uint32_t));
        if (!l)
            return kvd__fail(c, KV_ERR_NOMEM, "seq_append: out of memory");
        q->lids = l;
        uint64_t *t = kvd_realloc(q->ts, (size_t)cap * sizeof(uint64_t));
        if (!t)
            return kvd__fail(c, KV_ERR_NOMEM, "seq_append: out of memory");
        q->ts = t;
        q->cap = cap;
    }
    uint64_t now = kvd__now(c);
    for (i = 0; i < n; i++) {
        kvd_lpage_t *p = &c->lp[ids[i]];
        kvd__count_add(&s->loose, ids[i], -1);
        p->req_loose--;
        p->req_seq++;
        s->loose_total--;
        s->seq_total++;
        q->lids[q->n] = ids[i];
        q->ts[q->n] = now;
        q->n++;
    }
    return KV_ERR_OK;
}

int kvd_core_seq_close(kvd_core_t *c, uint64_t sid, uint64_t seq)
{
    kvd_session_t *s = kvd__session_get(c, sid);
    if (!s)
        return kvd__fail(c, KV_ERR_NO_SESSION, "session %llu does not exist",
                         (unsigned long long)sid);
    kvd_seq_t *q = seq_of(c, sid, seq);
    if (!q)
        return kvd__fail(c, KV_ERR_NOT_FOUND, "sequence %llu is not a sequence of session %llu",
                         (unsigned long long)seq, (unsigned long long)sid);
    seq_drop(c, s, q, 1);
    kvd__epoch_publish(c);
    return KV_ERR_OK;
}

int kvd_core_seq_pages(const kvd_core_t *c, uint64_t seq, kvd_seq_page_t *out, uint32_t max,
                       uint32_t *n_out, uint64_t *sid_out)
{
    const kvd_seq_t *q = kvd__seq_get(c, seq);
    if (!q)
        return KV_ERR_NOT_FOUND;
    for (uint32_t i = 0; i < q->n && i < max && out; i++) {
        out[i].logical = q->lids[i];
        out[i].fmt = (kv_fmt_t)c->lp[q->lids[i]].fmt;
        out[i].appended_ns = q->ts[i];
    }
    if (n_out)
        *n_out = q->n;
    if (sid_out)
        *sid_out = q->sid;
    return KV_ERR_OK;
}

void kvd_core_seq_foreach(const kvd_core_t *c, kvd_seq_visit_fn fn, void *ud)
{
    uint64_t pos = 0, k, v;
    while (kvd_map_next(&c->seqs, &pos, &k, &v)) {
        const kvd_seq_t *q = (const kvd_seq_t *)(uintptr_t)v;
        fn(q->id, q->sid, q->lids, q->ts, q->n, ud);
    }
}

uint32_t kvd__loose_first_missing(const kvd_core_t *c, kvd_session_t *s, const uint32_t *ids,
                                  uint32_t n)
{
    /* A tentative decrement of the loose counts, undone before returning, so that an id
     * listed k times needs k loose references. */
    uint32_t i, bad = KVD_NONE;
    for (i = 0; i < n; i++) {
        uint64_t *v = ids[i] < c->nlogical ? kvd_map_get(&s->loose, ids[i]) : NULL;
        if (!v || *v == 0) {
            bad = i;
            break;
        }
        (*v)--;
    }
    for (uint32_t j = 0; j < i; j++)
        (*kvd_map_get(&s->loose, ids[j]))++;
    return bad;
}
