/* core.c — kvdcore's public operations: init, alloc/release, seal/lookup, cache admin,
 * conversions (Minima-KV Algorithm 1), the invariant checker and stats.
 *
 * Every operation validates everything and reserves every allocation it may need BEFORE it
 * changes state, so a failure (bad argument, out of memory) leaves the core exactly as it was.
 * Reference moves are done in the order "acquire new, then drop old", so a page can never be
 * retired in the middle of an operation that is about to take it back.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <sodium.h>

#include "core_int.h"

int kvd__fail(kvd_core_t *c, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof(c->err), fmt, ap);
    va_end(ap);
    return code;
}

uint64_t kvd__now(const kvd_core_t *c)
{
    if (c->now_ns)
        return c->now_ns(c->now_ud);
    return kvd_mono_ns();
}

const char *kvd_core_errmsg(const kvd_core_t *c)
{
    return c ? c->err : "no core";
}

const char *kvd_page_state_name(kvd_page_state_t s)
{
    switch (s) {
    case KVD_PAGE_FREE:
        return "free";
    case KVD_PAGE_OPEN:
        return "open";
    case KVD_PAGE_SEALED:
        return "sealed";
    case KVD_PAGE_RETIRED:
        return "retired";
    }
    return "unknown";
}

void kvd_core_opts_default(kvd_core_opts_t *o, const kv_geom_t *g, uint32_t fp8_pages,
                           uint32_t tq3_pages)
{
    memset(o, 0, sizeof(*o));
    o->geom = *g;
    o->pages[KV_FMT_FP8] = fp8_pages;
    o->pages[KV_FMT_TQ3] = tq3_pages;
    o->cache_quota_pages[KV_FMT_FP8] = fp8_pages;
    o->cache_quota_pages[KV_FMT_TQ3] = tq3_pages;
    o->backend = "host";
}

int kvd_core_init(kvd_core_t **out, const kvd_core_opts_t *o, char *err, size_t errlen)
{
    if (!out || !o) {
        kvd_fmt(err, errlen, "kvd_core_init: NULL argument");
        return KV_ERR_INVALID_ARGUMENT;
    }
    *out = NULL;
    kvd_backend_t *be = o->backend_obj;
    int rc = KV_ERR_OK;
    if (!kv_geom_valid(&o->geom)) {
        kvd_fmt(err, errlen, "invalid geometry (layers %u, kv_heads %u, head_dim %u, "
                             "page_tokens %u)", o->geom.layers, o->geom.kv_heads,
                o->geom.head_dim, o->geom.page_tokens);
        rc = KV_ERR_INVALID_ARGUMENT;
    } else if (o->pages[KV_FMT_FP8] == 0 || o->pages[KV_FMT_FP8] >= KVD_NONE ||
               o->pages[KV_FMT_TQ3] >= KVD_NONE) {
        kvd_fmt(err, errlen, "the FP8 pool needs at least one page, and pools < 2^32-1 pages");
        rc = KV_ERR_INVALID_ARGUMENT;
    } else {
        for (int f = 0; f < KV_FMT_COUNT; f++)
            if (o->cache_quota_pages[f] > o->pages[f]) {
                kvd_fmt(err, errlen, "cache quota of %s (%u pages) exceeds its pool (%u)",
                        kvd_fmt_name(f), o->cache_quota_pages[f], o->pages[f]);
                rc = KV_ERR_INVALID_ARGUMENT;
            }
    }
    uint64_t nlog = o->logical_ids ? o->logical_ids
                                   : (uint64_t)o->pages[KV_FMT_FP8] + o->pages[KV_FMT_TQ3];
    if (rc == KV_ERR_OK &&
        (nlog < (uint64_t)o->pages[KV_FMT_FP8] + o->pages[KV_FMT_TQ3] || nlog >= KVD_NONE)) {
        kvd_fmt(err, errlen, "logical ids must be in pages[FP8] + pages[TQ3] .. 2^32-2 (every "
                "physical page may need an id)");
        rc = KV_ERR_INVALID_ARGUMENT;
    }
    if (rc == KV_ERR_OK && sodium_init() < 0) {
        kvd_fmt(err, errlen, "sodium_init() failed");
        rc = KV_ERR_INTERNAL;
    }
    if (rc != KV_ERR_OK) {
        kvd_backend_free(&be);
        return rc;
    }
    if (!be) {
        rc = kvd_backend_create(&be, o->backend, &o->geom, o->pages, (uint32_t)nlog, err,
                                errlen);
        if (rc != KV_ERR_OK)
            return rc;
    } else if (be->exp.dir_entries < nlog || memcmp(&be->exp.geom, &o->geom, sizeof(o->geom)) ||
               be->exp.pages[KV_FMT_FP8] != o->pages[KV_FMT_FP8] ||
               be->exp.pages[KV_FMT_TQ3] != o->pages[KV_FMT_TQ3]) {
        kvd_fmt(err, errlen, "the given backend does not match the options (geometry, pages "
                             "or directory size)");
        kvd_backend_free(&be);
        return KV_ERR_INVALID_ARGUMENT;
    }
    kvd_core_t *c = kvd_calloc(1, sizeof(*c));
    if (!c) {
        kvd_backend_free(&be);
        kvd_fmt(err, errlen, "out of memory");
        return KV_ERR_NOMEM;
    }
    c->geom = o->geom;
    c->be = be;
    c->dir = be->dir;
    c->nlogical = (uint32_t)nlog;
    c->epoch = 1;
    c->next_sid = 1;
    c->next_seq = 1;
    c->now_ns = o->now_ns;
    c->now_ud = o->now_ud;
    memcpy(c->key, o->hash_key, sizeof(c->key));
    /* the lookup memo's SipHash key: derived from the salt, so secret like it */
    crypto_generichash(c->memo_skey, sizeof(c->memo_skey), c->key, sizeof(c->key),
                       (const unsigned char *)"kvd lookup memo", 15);
    kvd_map_init(&c->index);
    kvd_map_init(&c->memo);
    kvd_map_init(&c->sessions);
    kvd_map_init(&c->seqs);
    rc = kvd__pages_init(c, o->pages, o->cache_quota_pages);
    if (rc != KV_ERR_OK) {
        kvd_fmt(err, errlen, "out of memory for the page tables");
        kvd_core_free(&c);
        return rc;
    }
    *out = c;
    return KV_ERR_OK;
}

void kvd_core_free(kvd_core_t **cp)
{
    if (!cp || !*cp)
        return;
    kvd_core_t *c = *cp;
    kvd__sessions_fini(c);
    for (uint32_t l = 0; c->lp && l < c->nlogical; l++)
        kvd__memo_drop(c, l);
    kvd_map_fini(&c->memo);
    kvd_map_fini(&c->index);
    kvd__pages_fini(c);
    kvd_backend_free(&c->be);
    sodium_memzero(c->key, sizeof(c->key));
    kvd_free(c);
    *cp = NULL;
}

const kvd_export_t *kvd_core_export(const kvd_core_t *c)
{
    return &c->be->exp;
}

uint64_t kvd_core_epoch(kvd_core_t *c)
{
    kvd__epoch_publish(c);
    return c->epoch;
}

kvd_backend_t *kvd_core_backend(kvd_core_t *c)
{
    return c->be;
}

#define GET_SESSION(c, s, sid)                                                                     \
    kvd_session_t *s = kvd__session_get(c, sid);                                                   \
    if (!s)                                                                                        \
        return kvd__fail(c, KV_ERR_NO_SESSION, "session %llu does not exist",                      \
                         (unsigned long long)(sid));

/* Reserve room for n new keys in both per-session maps. */
static int session_reserve(kvd_core_t *c, kvd_session_t *s, uint32_t n)
{
    if (kvd_map_reserve(&s->loose, n) != 0 || kvd_map_reserve(&s->held, n) != 0)
        return kvd__fail(c, KV_ERR_NOMEM, "out of memory for session references");
    return KV_ERR_OK;
}

/* Give the session one more loose ref on lid (maps reserved by the caller). */
/* `now`: the caller's clock reading, one per call rather than one per page (a 32K-token lookup
 * takes 2048 references). */
static void take_loose(kvd_core_t *c, kvd_session_t *s, uint32_t lid, uint64_t now)
{
    kvd_lpage_t *p = &c->lp[lid];
    p->req_loose++;
    p->last_use_ns = now;
    kvd__count_add(&s->loose, lid, 1);
    kvd__count_add(&s->held, lid, 1);
    s->loose_total++;
    kvd__refs_changed(c, lid);
}

/* ---- alloc / release --------------------------------------------------------------------- */
int kvd_core_alloc(kvd_core_t *c, uint64_t sid, uint32_t n, uint32_t *logical_out)
{
    return kvd_core_alloc_reserve(c, sid, n, 0, logical_out);
}

int kvd_core_alloc_reserve(kvd_core_t *c, uint64_t sid, uint32_t n, uint32_t reserve,
                           uint32_t *logical_out)
{
    GET_SESSION(c, s, sid);
    c->st.alloc_calls++;
    if (n == 0 || !logical_out || n > c->pool[KV_FMT_FP8].n)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT,
                         "alloc: asked %u pages (must be 1 .. %u, the FP8 pool size)", n,
                         c->pool[KV_FMT_FP8].n);
    if (reserve && reserve < n)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT,
                         "alloc: reserve %u is below the %u pages asked (0: none)", reserve, n);
    /* Before anything is evicted: a chunk that evicts cache entries and is followed by a chunk
     * that fails costs the cache for nothing (decision 57). A reserve beyond the pool fails
     * here too, as the chunks would (RESOURCE_EXHAUSTED, the pool size named). */
    if (reserve > n && kvd_core_can_provide(c, KV_FMT_FP8, reserve) != KV_ERR_OK) {
        char why[sizeof c->err];
        memcpy(why, c->err, sizeof why);
        c->st.alloc_exhausted++;
        return kvd__fail(c, KV_ERR_RESOURCE_EXHAUSTED,
                         "alloc: %u pages, reserve %u refused before allocating or evicting "
                         "anything: %s",
                         n, reserve, why);
    }
    int rc = session_reserve(c, s, n);
    if (rc != KV_ERR_OK)
        return rc;
    /* Physical pages first: ensure_free evicts FP8 cache entries, and an evicted entry gives
     * back its logical id too. Ids are never scarcer than free FP8 pages (kvd_core_init keeps
     * logical_ids ≥ both pools, and an id in use holds at least one physical page), so ids need
     * no eviction of their own. Checking ids first, as this did, refused every alloc once the
     * pools were all cache (no TQ3 pool, or a TQ3 pool full of retiered entries, or a restart
     * from a full snapshot), with the evictable entries right there. */
    rc = kvd__ensure_free(c, KV_FMT_FP8, n, KVD_NONE);
    if (rc != KV_ERR_OK) {
        c->st.alloc_exhausted++;
        return rc;
    }
    if (c->nlfree < n) { /* the bound above says this cannot happen; refuse, do not panic */
        c->st.alloc_exhausted++;
        return kvd__fail(c, KV_ERR_INTERNAL,
                         "alloc: %u FP8 pages free but only %u of %u logical ids", n, c->nlfree,
                         c->nlogical);
    }
    uint64_t now = kvd__now(c);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t lid = kvd__logical_alloc(c);
        uint32_t phys = kvd__phys_alloc(c, KV_FMT_FP8, lid);
        KVD_ASSERT(lid != KVD_NONE && phys != KVD_NONE);
        kvd_lpage_t *p = &c->lp[lid];
        p->state = KVD_PAGE_OPEN;
        p->fmt = KV_FMT_FP8;
        p->phys = phys;
        p->owner_sid = sid;
        p->stamp = 0;
        p->last_use_ns = now;
        c->pool[KV_FMT_FP8].pg[phys].state = KVD_PHYS_LIVE;
        kvd__dir_store(c, lid, KV_FMT_FP8, phys, KV_DIR_VALID);
        take_loose(c, s, lid, now);
        logical_out[i] = lid;
    }
    /* one push for the n entries (cuda: n stream writes, one wait) before the reply names them */
    kvd__dir_sync(c, logical_out, n);
    c->st.alloc_pages += n;
    return KV_ERR_OK;
}

int kvd_core_release(kvd_core_t *c, uint64_t sid, const uint32_t *ids, uint32_t n)
{
    GET_SESSION(c, s, sid);
    if (n == 0)
        return KV_ERR_OK;
    if (!ids)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "release: ids is NULL");
    uint32_t i, bad = kvd__loose_first_missing(c, s, ids, n);
    if (bad != KVD_NONE)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT,
                         "release: logical page %u (index %u) is not held loose by session %llu "
                         "(refs inside a sequence are released by closing the sequence)",
                         ids[bad], bad, (unsigned long long)sid);
    for (i = 0; i < n; i++) {
        kvd_lpage_t *p = &c->lp[ids[i]];
        if (p->req_loose == 0)
            KVD_PANIC("loose refcount of logical page %u below zero", ids[i]);
        p->req_loose--;
        kvd__count_add(&s->loose, ids[i], -1);
        kvd__count_add(&s->held, ids[i], -1);
        s->loose_total--;
        kvd__stamp_drop(c, ids[i]);
        kvd__refs_changed(c, ids[i]);
    }
    c->st.release_refs += n;
    kvd__epoch_publish(c);
    return KV_ERR_OK;
}

/* ---- seal / lookup ----------------------------------------------------------------------- */
/* Move every ref session s holds on `from` to `to` (same sequence positions), then drop from. */
static void move_refs(kvd_core_t *c, kvd_session_t *s, uint32_t from, uint32_t to)
{
    kvd_lpage_t *pf = &c->lp[from], *pt = &c->lp[to];
    uint64_t loose = kvd__count(&s->loose, from);
    uint64_t held = kvd__count(&s->held, from);
    uint64_t in_seq = held - loose, moved_seq = 0;
    /* Acquire on `to` first so it never looks unreferenced in between. */
    pt->req_loose += (uint32_t)loose;
    pt->req_seq += (uint32_t)in_seq;
    pt->last_use_ns = kvd__now(c);
    kvd__count_add(&s->loose, to, (int64_t)loose);
    kvd__count_add(&s->held, to, (int64_t)held);
    kvd__refs_changed(c, to);
    if (in_seq) {
        uint64_t pos = 0, k, v;
        while (kvd_map_next(&s->seqs, &pos, &k, &v)) {
            kvd_seq_t *q = kvd__seq_get(c, k);
            for (uint32_t i = 0; i < q->n; i++)
                if (q->lids[i] == from) {
                    q->lids[i] = to;
                    moved_seq++;
                }
        }
    }
    KVD_ASSERT(moved_seq == in_seq);
    KVD_ASSERT(pf->req_loose == loose && pf->req_seq == in_seq); /* OPEN: only the owner */
    pf->req_loose = 0;
    pf->req_seq = 0;
    kvd__count_add(&s->loose, from, -(int64_t)loose);
    kvd__count_add(&s->held, from, -(int64_t)held);
    kvd__stamp_drop(c, from);
    kvd__refs_changed(c, from);
}

int kvd_core_seal(kvd_core_t *c, uint64_t sid, uint32_t logical, uint32_t prev,
                  const uint32_t *tokens, uint32_t ntok, const uint8_t *extra, size_t extra_len,
                  uint8_t hash_out[KVD_HASH_BYTES], uint32_t *canonical_out)
{
    GET_SESSION(c, s, sid);
    if (!tokens || ntok != c->geom.page_tokens)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT,
                         "seal: %u tokens given, a page holds exactly %u", ntok,
                         c->geom.page_tokens);
    if (extra_len > KVD_EXTRA_MAX || (extra_len && !extra))
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "seal: extra of %zu bytes (max %d)",
                         extra_len, KVD_EXTRA_MAX);
    if (logical >= c->nlogical || (prev != KVD_NONE && prev >= c->nlogical) || prev == logical)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "seal: logical %u / prev %u out of range",
                         logical, prev);
    kvd_lpage_t *p = &c->lp[logical];
    if (p->state != KVD_PAGE_OPEN || p->owner_sid != sid || !kvd__count(&s->held, logical))
        return kvd__fail(c, KV_ERR_FAILED_PRECONDITION,
                         "seal: logical page %u is %s%s; only an unsealed page allocated and "
                         "held by this session can be sealed",
                         logical, kvd_page_state_name((kvd_page_state_t)p->state),
                         p->state == KVD_PAGE_OPEN ? " and owned by another session" : "");
    if (prev != KVD_NONE &&
        (c->lp[prev].state != KVD_PAGE_SEALED || !kvd__count(&s->held, prev)))
        return kvd__fail(c, KV_ERR_FAILED_PRECONDITION,
                         "seal: prev page %u must be sealed and held by this session (it is %s, "
                         "held %llu times)",
                         prev, kvd_page_state_name((kvd_page_state_t)c->lp[prev].state),
                         (unsigned long long)kvd__count(&s->held, prev));
    uint8_t h[KVD_HASH_BYTES];
    kvd_core_chain_hash(c, prev == KVD_NONE ? NULL : c->lp[prev].hash, tokens, ntok, extra,
                        extra_len, h);
    int collision = 0;
    uint32_t q = kvd__index_find(c, h, &collision);
    if (q != KVD_NONE) {
        /* Dedupe: the content is already cached as q. */
        if ((uint64_t)kvd__lp_client_refs(&c->lp[q]) + kvd__count(&s->held, logical) >
            KVD_PAGE_REFS_MAX)
            return kvd__fail(c, KV_ERR_RESOURCE_EXHAUSTED,
                             "seal: the cached page %u already holds %u request references "
                             "(release some)",
                             q, kvd__lp_client_refs(&c->lp[q]));
        if (session_reserve(c, s, 1) != KV_ERR_OK)
            return KV_ERR_NOMEM;
        move_refs(c, s, logical, q);
        c->st.seal_dedupes++;
        kvd__epoch_publish(c);
        memcpy(hash_out, h, KVD_HASH_BYTES);
        *canonical_out = q;
        return KV_ERR_OK;
    }
    if (!collision && kvd_map_reserve(&c->index, 1) != 0)
        return kvd__fail(c, KV_ERR_NOMEM, "seal: out of memory for the prefix index");
    p->state = KVD_PAGE_SEALED;
    p->owner_sid = 0;
    memcpy(p->hash, h, KVD_HASH_BYTES);
    kvd__dir_publish(c, logical, (kv_fmt_t)p->fmt, p->phys, KV_DIR_VALID | KV_DIR_SEALED);
    if (collision) {
        c->st.seal_collisions++; /* sealed and immutable, but not findable */
    } else {
        kvd_map_put(&c->index, kvd__index_key(h), logical);
        p->cached = 1;
        uint8_t in[KVD_MEMO_MAX];
        kvd__memo_set(c, logical, in,
                      kvd__memo_input(prev == KVD_NONE ? NULL : c->lp[prev].hash, tokens, ntok,
                                      extra, extra_len, in));
        c->pool[p->fmt].ncached++;
        c->st.cache_entries++;
        c->st.seals++;
        /* STORED before the quota runs, so a subscriber never sees a REMOVED for an entry it
         * was not told about */
        kvd_index_ev_t ev = {.kind = KVD_INDEX_EV_STORED, .logical = logical,
                             .fmt = (kv_fmt_t)p->fmt, .hash = p->hash,
                             .parent = prev == KVD_NONE ? NULL : c->lp[prev].hash,
                             .tokens = tokens, .ntok = ntok, .extra = extra,
                             .extra_len = extra_len};
        kvd__index_event(c, &ev);
        kvd__cache_enforce_quota(c, (kv_fmt_t)p->fmt);
    }
    memcpy(hash_out, h, KVD_HASH_BYTES);
    *canonical_out = logical;
    return KV_ERR_OK;
}

int kvd_core_lookup(kvd_core_t *c, uint64_t sid, const uint32_t *tokens, uint32_t ntok,
                    const uint8_t *extra, size_t extra_len, uint32_t *logical_out, uint32_t max,
                    uint32_t *npages_out, uint32_t *ntokens_hit)
{
    GET_SESSION(c, s, sid);
    if (extra_len > KVD_EXTRA_MAX || (extra_len && !extra) || (ntok && !tokens) ||
        (max && !logical_out) || !npages_out)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "lookup: bad arguments (extra %zu bytes, "
                                                     "max %d)", extra_len, KVD_EXTRA_MAX);
    uint32_t pt = c->geom.page_tokens, full = ntok / pt, hits = 0;
    uint8_t h[KVD_HASH_BYTES], in[KVD_MEMO_MAX];
    const uint8_t *prev = NULL;
    for (uint32_t i = 0; i < full && hits < max; i++) {
        const uint32_t *pg = tokens + (uint64_t)i * pt;
        size_t n = kvd__memo_input(prev, pg, pt, extra, extra_len, in);
        uint32_t lid = n ? kvd__memo_find(c, in, n) : KVD_NONE;
        if (lid == KVD_NONE) { /* not memoized (restored, long page): hash and probe */
            int collision;
            kvd_core_chain_hash(c, prev, pg, pt, extra, extra_len, h);
            lid = kvd__index_find(c, h, &collision);
            if (lid == KVD_NONE)
                break;
            kvd__memo_set(c, lid, in, n);
            c->st.lookup_pages_hashed++;
        }
        logical_out[hits++] = lid;
        prev = c->lp[lid].hash;
    }
    for (uint32_t i = 0; i < hits; i++)
        if (kvd__lp_client_refs(&c->lp[logical_out[i]]) >= KVD_PAGE_REFS_MAX)
            return kvd__fail(c, KV_ERR_RESOURCE_EXHAUSTED,
                             "lookup: page %u already holds %u request references (release "
                             "some)",
                             logical_out[i], kvd__lp_client_refs(&c->lp[logical_out[i]]));
    if (hits && session_reserve(c, s, hits) != KV_ERR_OK)
        return KV_ERR_NOMEM;
    uint64_t now = kvd__now(c);
    for (uint32_t i = 0; i < hits; i++)
        take_loose(c, s, logical_out[i], now);
    c->st.lookups++;
    c->st.lookup_pages_asked += full;
    c->st.lookup_pages_hit += hits;
    c->st.lookup_tokens_asked += ntok;
    c->st.lookup_tokens_hit += (uint64_t)hits * pt;
    *npages_out = hits;
    if (ntokens_hit)
        *ntokens_hit = hits * pt;
    return KV_ERR_OK;
}

/* ---- cache admin ------------------------------------------------------------------------- */
static void fill_info(const kvd_core_t *c, uint32_t lid, kvd_page_info_t *o)
{
    const kvd_lpage_t *p = &c->lp[lid];
    memset(o, 0, sizeof(*o));
    o->logical = lid;
    o->state = (kvd_page_state_t)p->state;
    o->fmt = (kv_fmt_t)p->fmt;
    o->phys = p->phys;
    o->req_loose = p->req_loose;
    o->req_seq = p->req_seq;
    o->cache = p->cached;
    o->pins = p->pins;
    o->conv = p->conv;
    o->on_lru = p->on_lru;
    o->owner_sid = p->owner_sid;
    o->stamp = p->stamp;
    o->last_use_ns = p->last_use_ns;
    if (p->state == KVD_PAGE_SEALED || (p->state == KVD_PAGE_RETIRED && p->cached))
        memcpy(o->hash, p->hash, KVD_HASH_BYTES);
    if (p->state == KVD_PAGE_RETIRED)
        o->stamp = c->pool[p->fmt].pg[p->phys].stamp;
}

int kvd_core_page_info(const kvd_core_t *c, uint32_t logical, kvd_page_info_t *out)
{
    if (logical >= c->nlogical || !out)
        return KV_ERR_INVALID_ARGUMENT;
    fill_info(c, logical, out);
    return KV_ERR_OK;
}

void kvd_core_cache_foreach(const kvd_core_t *c, void (*fn)(const kvd_page_info_t *p, void *ud),
                            void *ud)
{
    kvd_page_info_t info;
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        for (uint32_t l = c->pool[f].lru_head; l != KVD_NONE; l = c->lp[l].lru_next) {
            fill_info(c, l, &info);
            fn(&info, ud);
        }
        for (uint32_t l = 0; l < c->nlogical; l++)
            if (c->lp[l].cached && !c->lp[l].on_lru && c->lp[l].fmt == f) {
                fill_info(c, l, &info);
                fn(&info, ud);
            }
    }
}

int kvd_core_cache_find(const kvd_core_t *c, const uint8_t hash[KVD_HASH_BYTES],
                        uint32_t *logical_out)
{
    int collision;
    uint32_t l = kvd__index_find(c, hash, &collision);
    if (l == KVD_NONE)
        return KV_ERR_NOT_FOUND;
    *logical_out = l;
    return KV_ERR_OK;
}

static int check_cached(kvd_core_t *c, uint32_t logical, const char *what)
{
    if (logical >= c->nlogical)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "%s: logical page %u out of range (< %u)",
                         what, logical, c->nlogical);
    if (!c->lp[logical].cached)
        return kvd__fail(c, KV_ERR_NOT_FOUND, "%s: logical page %u is not in the prefix cache",
                         what, logical);
    return KV_ERR_OK;
}

int kvd_core_cache_evict(kvd_core_t *c, uint32_t logical)
{
    int rc = check_cached(c, logical, "evict");
    if (rc != KV_ERR_OK)
        return rc;
    if (c->lp[logical].pins)
        return kvd__fail(c, KV_ERR_FAILED_PRECONDITION,
                         "evict: logical page %u is pinned (%u pins); unpin it first", logical,
                         c->lp[logical].pins);
    kvd__cache_evict(c, logical, KVD_EVICT_ADMIN);
    return KV_ERR_OK;
}

int kvd_core_set_cache_quota(kvd_core_t *c, kv_fmt_t f, uint64_t pages)
{
    if ((unsigned)f >= KV_FMT_COUNT)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "cache quota: bad format %d", (int)f);
    kvd_pool_t *pl = &c->pool[f];
    pl->quota = pages == 0 || pages > pl->n ? pl->n : (uint32_t)pages;
    kvd__cache_enforce_quota(c, f);
    return KV_ERR_OK;
}

int kvd_core_pin(kvd_core_t *c, uint32_t logical)
{
    int rc = check_cached(c, logical, "pin");
    if (rc != KV_ERR_OK)
        return rc;
    /* bounded like request refs: a wrapped count would put a pinned page on the LRU */
    if (c->lp[logical].pins >= KVD_PAGE_REFS_MAX)
        return kvd__fail(c, KV_ERR_RESOURCE_EXHAUSTED,
                         "pin: logical page %u already holds %u pins (unpin some)", logical,
                         c->lp[logical].pins);
    c->lp[logical].pins++;
    c->st.pins++;
    c->st.pin_changes++;
    kvd__refs_changed(c, logical);
    return KV_ERR_OK;
}

int kvd_core_unpin(kvd_core_t *c, uint32_t logical)
{
    int rc = check_cached(c, logical, "unpin");
    if (rc != KV_ERR_OK)
        return rc;
    if (c->lp[logical].pins == 0)
        return kvd__fail(c, KV_ERR_FAILED_PRECONDITION, "unpin: logical page %u is not pinned",
                         logical);
    c->lp[logical].pins--;
    c->st.pins--;
    c->st.pin_changes++;
    kvd__refs_changed(c, logical);
    return KV_ERR_OK;
}

void kvd_core_set_index_hook(kvd_core_t *c, kvd_index_hook_fn fn, void *ud)
{
    c->hook = fn;
    c->hook_ud = fn ? ud : NULL;
}

/* ---- persistence ------------------------------------------------------------------------- */
int kvd_core_page_read(kvd_core_t *c, uint32_t logical, void *buf, size_t len)
{
    if (logical >= c->nlogical || !buf)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "page read: logical %u out of range",
                         logical);
    const kvd_lpage_t *p = &c->lp[logical];
    if (p->state != KVD_PAGE_OPEN && p->state != KVD_PAGE_SEALED)
        return kvd__fail(c, KV_ERR_FAILED_PRECONDITION, "page read: logical page %u is %s",
                         logical, kvd_page_state_name((kvd_page_state_t)p->state));
    if (len != c->be->exp.page_bytes[p->fmt])
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT,
                         "page read: buffer of %zu bytes, a %s page has %llu", len,
                         kvd_fmt_name(p->fmt), (unsigned long long)c->be->exp.page_bytes[p->fmt]);
    char err[256] = "";
    int rc = c->be->ops->page_read(c->be, (kv_fmt_t)p->fmt, p->phys, buf, err, sizeof(err));
    if (rc != KV_ERR_OK)
        return kvd__fail(c, rc, "page read of logical %u failed: %s", logical, err);
    return KV_ERR_OK;
}

int kvd_core_cache_restore(kvd_core_t *c, const uint8_t hash[KVD_HASH_BYTES], kv_fmt_t f,
                           const void *bytes, size_t len, uint32_t *logical_out)
{
    if (logical_out)
        *logical_out = KVD_NONE;
    if ((unsigned)f >= KV_FMT_COUNT || !hash || !bytes || c->pool[f].n == 0 ||
        len != c->be->exp.page_bytes[f])
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT,
                         "restore: format %d with %zu bytes (pool of %u pages of %llu bytes)",
                         (int)f, len, (unsigned)f < KV_FMT_COUNT ? c->pool[f].n : 0,
                         (unsigned long long)((unsigned)f < KV_FMT_COUNT
                                                  ? c->be->exp.page_bytes[f]
                                                  : 0));
    int collision = 0;
    if (kvd__index_find(c, hash, &collision) != KVD_NONE || collision)
        return kvd__fail(c, KV_ERR_FAILED_PRECONDITION,
                         "restore: hash %02x%02x%02x%02x… %s", hash[0], hash[1], hash[2],
                         hash[3], collision ? "collides with a bound hash on its 64-bit key"
                                            : "is already bound");
    if (c->nlfree == 0 || c->pool[f].nfree == 0)
        return kvd__fail(c, KV_ERR_RESOURCE_EXHAUSTED,
                         "restore: no free %s page or logical id (%u pages, %u ids free)",
                         kvd_fmt_name(f), c->pool[f].nfree, c->nlfree);
    if (kvd_map_reserve(&c->index, 1) != 0)
        return kvd__fail(c, KV_ERR_NOMEM, "restore: out of memory for the prefix index");
    uint32_t lid = kvd__logical_alloc(c);
    uint32_t phys = kvd__phys_alloc(c, f, lid);
    KVD_ASSERT(lid != KVD_NONE && phys != KVD_NONE);
    char err[256] = "";
    int rc = c->be->ops->page_write(c->be, f, phys, bytes, err, sizeof(err));
    if (rc != KV_ERR_OK) {
        /* never published: both go straight back to their free lists */
        kvd__phys_unfill(c, f, phys);
        kvd_lpage_t *p = &c->lp[lid];
        p->next_free = c->lfree_head;
        c->lfree_head = lid;
        c->nlfree++;
        return kvd__fail(c, rc, "restore: copying the page in failed: %s", err);
    }
    kvd_lpage_t *p = &c->lp[lid];
    p->state = KVD_PAGE_SEALED;
    p->fmt = (uint8_t)f;
    p->phys = phys;
    p->owner_sid = 0;
    p->stamp = 0; /* no client has ever seen it: evictable and freeable at once */
    p->last_use_ns = kvd__now(c);
    memcpy(p->hash, hash, KVD_HASH_BYTES);
    c->pool[f].pg[phys].state = KVD_PHYS_LIVE;
    kvd__dir_publish(c, lid, f, phys, KV_DIR_VALID | KV_DIR_SEALED);
    kvd_map_put(&c->index, kvd__index_key(hash), lid);
    p->cached = 1;
    c->pool[f].ncached++;
    c->st.cache_entries++;
    c->st.cache_restored++;
    kvd_index_ev_t ev = {.kind = KVD_INDEX_EV_STORED, .logical = lid, .fmt = f,
                         .hash = p->hash, .ntok = c->geom.page_tokens, .restored = 1};
    kvd__index_event(c, &ev); /* before refs_changed: its quota may REMOVE this very entry */
    if (logical_out)
        *logical_out = lid;
    kvd__refs_changed(c, lid); /* joins the LRU tail; the quota may evict from the head */
    if (!c->lp[lid].cached && logical_out)
        *logical_out = KVD_NONE;
    return KV_ERR_OK;
}

/* ---- conversions ------------------------------------------------------------------------- */
/* One page of a conversion batch after steps 1-2: conv ref taken, target allocated. */
typedef struct conv_item_s {
    uint32_t lid, src_phys, dst_phys;
    kv_fmt_t src, dst;
} conv_item_t;

/* Checks, a free target page (evicting as alloc does, never the page itself) and the conv ref
 * (the page leaves the LRU, so a later item's eviction cannot take it). */
static int conv_prepare(kvd_core_t *c, uint32_t logical, kv_fmt_t dst, conv_item_t *it)
{
    if (logical >= c->nlogical || (unsigned)dst >= KV_FMT_COUNT)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "convert: logical %u / format %d invalid",
                         logical, (int)dst);
    kvd_lpage_t *p = &c->lp[logical];
    if (p->state != KVD_PAGE_OPEN && p->state != KVD_PAGE_SEALED)
        return kvd__fail(c, KV_ERR_FAILED_PRECONDITION, "convert: logical page %u is %s",
                         logical, kvd_page_state_name((kvd_page_state_t)p->state));
    if (p->conv)
        return kvd__fail(c, KV_ERR_FAILED_PRECONDITION,
                         "convert: logical page %u is already being converted (twice in a batch)",
                         logical);
    kv_fmt_t src = (kv_fmt_t)p->fmt;
    if (src == dst)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "convert: logical page %u is already %s",
                         logical, kvd_fmt_name(dst));
    if (c->pool[dst].n == 0)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "convert: no %s pool configured",
                         kvd_fmt_name(dst));
    int rc = kvd__ensure_free(c, dst, 1, logical);
    if (rc != KV_ERR_OK)
        return rc;
    p->conv++;
    kvd__refs_changed(c, logical);
    it->lid = logical;
    it->src = src;
    it->dst = dst;
    it->src_phys = p->phys;
    it->dst_phys = kvd__phys_alloc(c, dst, logical);
    KVD_ASSERT(it->dst_phys != KVD_NONE);
    return KV_ERR_OK;
}

/* Step 3 for every prepared item: one backend call per direction, one wait. */
static int conv_run(kvd_core_t *c, const conv_item_t *it, uint32_t m, uint32_t *ids, char *err,
                    size_t errlen)
{
    int rc = KV_ERR_OK;
    for (int d = 0; d < KV_FMT_COUNT && rc == KV_ERR_OK; d++) { /* d: target format */
        uint32_t k = 0;
        for (uint32_t i = 0; i < m; i++) {
            if (it[i].dst == (kv_fmt_t)d) {
                ids[k] = it[i].src_phys;
                ids[m + k] = it[i].dst_phys;
                k++;
            }
        }
        if (k)
            rc = c->be->ops->convert(c->be, d == KV_FMT_FP8 ? KV_FMT_TQ3 : KV_FMT_FP8,
                                     (kv_fmt_t)d, k, ids, ids + m, err, errlen);
    }
    if (rc == KV_ERR_OK)
        return c->be->ops->sync(c->be, err, errlen);
    /* A call failed after an earlier one (the other direction, or an earlier piece of a long
     * batch on cuda) was launched: that work still writes its targets, which the caller is
     * about to put back on the free lists. Wait for it first, keeping the first error. A
     * failing wait means a broken device context (cuda errors are sticky): nothing will run
     * on it any more. */
    char ignored[64];
    (void)c->be->ops->sync(c->be, ignored, sizeof(ignored));
    return rc;
}

/* Steps 4-5 for every item: flip the entries, publish them with one backend call, retire the
 * sources under a new epoch, drop the conv refs. */
static void conv_commit(kvd_core_t *c, const conv_item_t *it, uint32_t m, uint32_t *lids,
                        uint64_t ns)
{
    int touched[KV_FMT_COUNT] = {0};
    for (uint32_t i = 0; i < m; i++) {
        kvd_lpage_t *p = &c->lp[it[i].lid];
        if (p->cached) {
            c->pool[it[i].src].ncached--;
            c->pool[it[i].dst].ncached++;
        }
        KVD_ASSERT(!p->on_lru);
        p->fmt = (uint8_t)it[i].dst;
        p->phys = it[i].dst_phys;
        c->pool[it[i].dst].pg[it[i].dst_phys].state = KVD_PHYS_LIVE;
        uint32_t flags = KV_DIR_VALID | (p->state == KVD_PAGE_SEALED ? KV_DIR_SEALED : 0);
        kvd__dir_store(c, it[i].lid, it[i].dst, it[i].dst_phys, flags);
        lids[i] = it[i].lid;
    }
    kvd__dir_sync(c, lids, m);
    for (uint32_t i = 0; i < m; i++) {
        kvd_lpage_t *p = &c->lp[it[i].lid];
        if (p->cached) {
            /* only bound pages: an unsealed or unbound page is invisible to a router */
            kvd_index_ev_t ev = {.kind = KVD_INDEX_EV_FORMAT, .logical = it[i].lid,
                                 .fmt = it[i].dst, .hash = p->hash};
            kvd__index_event(c, &ev);
        }
        /* any kernel that resolved the old entry is tagged < epoch + 1 */
        c->bump_pending = 1;
        kvd__phys_retire(c, it[i].src, it[i].src_phys, KVD_NONE, c->epoch + 1);
        p->conv--;
        p->lru_by_age = 1; /* it joins its new list by age, not as just used (prefix.c) */
        kvd__refs_changed(c, it[i].lid);
        p->lru_by_age = 0;
        /* the batch's real time, shared evenly: what a page cost including its wait */
        if (it[i].dst == KV_FMT_TQ3) {
            c->st.retiers++;
            c->st.retier_ns += ns / m;
        } else {
            c->st.promotes++;
            c->st.promote_ns += ns / m;
        }
        touched[it[i].dst] = 1;
    }
    for (int f = 0; f < KV_FMT_COUNT; f++)
        if (touched[f])
            kvd__cache_enforce_quota(c, (kv_fmt_t)f);
    kvd__epoch_publish(c);
}

int kvd_core_convert_batch(kvd_core_t *c, uint32_t n, const uint32_t *logical,
                           const kv_fmt_t *dst, int *rc_out)
{
    if (n == 0)
        return KV_ERR_OK;
    if (!logical || !dst || !rc_out)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "convert batch: NULL arguments");
    conv_item_t *it = kvd_malloc((size_t)n * sizeof(*it));
    uint32_t *ids = kvd_malloc((size_t)n * 2 * sizeof(uint32_t));
    int *slot = kvd_malloc((size_t)n * sizeof(int)); /* item index of request i, or −1 */
    if (!it || !ids || !slot) {
        kvd_free(it);
        kvd_free(ids);
        kvd_free(slot);
        for (uint32_t i = 0; i < n; i++)
            rc_out[i] = KV_ERR_NOMEM; /* nothing was touched */
        return kvd__fail(c, KV_ERR_NOMEM, "convert batch: no memory for %u items", n);
    }
    /* Latency on the real clock, not the injected one (which only ages pages). */
    const uint64_t t0 = kvd_mono_ns();
    int first = KV_ERR_OK, full[KV_FMT_COUNT] = {0};
    char first_msg[sizeof c->err] = "";
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++) {
        slot[i] = -1;
        int rc;
        if ((unsigned)dst[i] < KV_FMT_COUNT && full[dst[i]])
            rc = KV_ERR_RESOURCE_EXHAUSTED; /* the first one said why; no second LRU walk */
        else
            rc = conv_prepare(c, logical[i], dst[i], &it[m]);
        if (rc == KV_ERR_OK)
            slot[i] = (int)m++;
        else if (rc == KV_ERR_RESOURCE_EXHAUSTED)
            full[dst[i]] = 1;
        rc_out[i] = rc;
        if (rc != KV_ERR_OK && first == KV_ERR_OK) {
            first = rc;
            kvd_fmt(first_msg, sizeof first_msg, "%s", c->err);
        }
    }
    if (m > 0) {
        char err[256] = "";
        int brc = conv_run(c, it, m, ids, err, sizeof(err));
        if (brc != KV_ERR_OK) {
            for (uint32_t k = 0; k < m; k++) {
                kvd__phys_unfill(c, it[k].dst, it[k].dst_phys); /* never published */
                kvd_lpage_t *p = &c->lp[it[k].lid];
                p->conv--;
                /* not a use: an idle entry goes back by age, as after a finished conversion,
                 * not to the warm end as after a release */
                p->lru_by_age = 1;
                kvd__refs_changed(c, it[k].lid);
                p->lru_by_age = 0;
            }
            c->st.conversion_failures += m;
            for (uint32_t i = 0; i < n; i++)
                if (slot[i] >= 0)
                    rc_out[i] = brc;
            if (m == 1)
                kvd__fail(c, brc, "convert of logical page %u to %s failed, source kept: %s",
                          it[0].lid, kvd_fmt_name(it[0].dst), err);
            else
                kvd__fail(c, brc, "convert of %u pages (first: logical %u to %s) failed, "
                          "sources kept: %s", m, it[0].lid, kvd_fmt_name(it[0].dst), err);
            if (first == KV_ERR_OK) {
                first = brc;
                kvd_fmt(first_msg, sizeof first_msg, "%s", c->err);
            }
        } else {
            conv_commit(c, it, m, ids, kvd_mono_ns() - t0);
        }
    }
    kvd_free(it);
    kvd_free(ids);
    kvd_free(slot);
    if (first != KV_ERR_OK)
        kvd_fmt(c->err, sizeof c->err, "%s", first_msg); /* the first failure's reason */
    return first;
}

int kvd_core_convert(kvd_core_t *c, uint32_t logical, kv_fmt_t dst)
{
    int rc;
    return kvd_core_convert_batch(c, 1, &logical, &dst, &rc);
}

/* ---- checker ----------------------------------------------------------------------------- */
typedef struct check_s {
    char *buf;
    size_t len, used;
    int n;
} check_t;

static void KVD_PRINTF(2, 3) bad(check_t *k, const char *fmt, ...)
{
    k->n++;
    if (!k->buf || k->used + 1 >= k->len)
        return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(k->buf + k->used, k->len - k->used, fmt, ap);
    va_end(ap);
    if (w > 0)
        k->used += (size_t)w < k->len - k->used ? (size_t)w : k->len - k->used - 1;
    if (k->used + 1 < k->len)
        k->buf[k->used++] = '\n', k->buf[k->used] = '\0';
}

int kvd_core_check(const kvd_core_t *c, char *report, size_t len)
{
    check_t k = {.buf = report, .len = len};
    if (report && len)
        report[0] = '\0';
    uint32_t nl = c->nlogical;
    /* Recomputed refcounts: [0] loose, [1] seq, from the sessions and sequences. */
    uint32_t *loose = kvd_calloc(nl, sizeof(uint32_t)), *seq = kvd_calloc(nl, sizeof(uint32_t));
    uint8_t *mark = kvd_calloc(nl, 1);
    uint64_t *mine = kvd_calloc(nl, sizeof(uint64_t)); /* one session's refs per id, then 0 */
    if (!loose || !seq || !mark || !mine) {
        kvd_free(loose);
        kvd_free(seq);
        kvd_free(mark);
        kvd_free(mine);
        bad(&k, "check: out of memory");
        return k.n;
    }
    /* Nothing is stamped beyond the epoch the next reply carries: a later stamp would keep its
     * page from every collection until the last session closes. */
    const uint64_t epoch_next = c->epoch + (c->bump_pending ? 1 : 0);
    uint64_t pos = 0, key, val;
    while (kvd_map_next(&c->sessions, &pos, &key, &val)) {
        const kvd_session_t *s = (const kvd_session_t *)(uintptr_t)val;
        uint64_t p2 = 0, l, n, lt = 0, st = 0;
        while (kvd_map_next(&s->loose, &p2, &l, &n)) {
            if (l >= nl) {
                bad(&k, "session %llu holds out-of-range id %llu", (unsigned long long)s->sid,
                    (unsigned long long)l);
                continue;
            }
            loose[l] += (uint32_t)n;
            mine[l] += n;
            lt += n;
        }
        uint64_t held_sum = 0;
        p2 = 0;
        while (kvd_map_next(&s->held, &p2, &l, &n))
            held_sum += n;
        p2 = 0;
        while (kvd_map_next(&s->seqs, &p2, &l, &n)) {
            const kvd_seq_t *q = kvd__seq_get(c, l);
            if (!q || q->sid != s->sid) {
                bad(&k, "session %llu lists sequence %llu it does not own",
                    (unsigned long long)s->sid, (unsigned long long)l);
                continue;
            }
            for (uint32_t i = 0; i < q->n; i++) {
                if (q->lids[i] < nl) {
                    seq[q->lids[i]]++;
                    mine[q->lids[i]]++;
                } else {
                    bad(&k, "sequence %llu holds out-of-range id %u at %u",
                        (unsigned long long)q->id, q->lids[i], i);
                }
            }
            st += q->n;
        }
        /* held is per id what seal ("does it hold prev"), dedupe (in_seq = held - loose) and
         * close rely on: compare it id by id, not only its sum. */
        p2 = 0;
        while (kvd_map_next(&s->held, &p2, &l, &n)) {
            if (l >= nl || mine[l] != n)
                bad(&k, "session %llu: held count of logical %llu is %llu, it holds %llu",
                    (unsigned long long)s->sid, (unsigned long long)l, (unsigned long long)n,
                    (unsigned long long)(l < nl ? mine[l] : 0));
            if (l < nl)
                mine[l] = 0;
        }
        p2 = 0;
        while (kvd_map_next(&s->loose, &p2, &l, &n))
            if (l < nl && mine[l]) {
                bad(&k, "session %llu holds logical %llu but its held map lacks it",
                    (unsigned long long)s->sid, (unsigned long long)l);
                mine[l] = 0;
            }
        p2 = 0;
        while (kvd_map_next(&s->seqs, &p2, &l, &n)) {
            const kvd_seq_t *q = kvd__seq_get(c, l);
            for (uint32_t i = 0; q && q->sid == s->sid && i < q->n; i++)
                if (q->lids[i] < nl && mine[q->lids[i]]) {
                    bad(&k, "session %llu holds logical %u in sequence %llu but its held map "
                        "lacks it",
                        (unsigned long long)s->sid, q->lids[i], (unsigned long long)q->id);
                    mine[q->lids[i]] = 0;
                }
        }
        if (s->safe_epoch > c->epoch)
            bad(&k, "session %llu reported safe epoch %llu beyond the current %llu",
                (unsigned long long)s->sid, (unsigned long long)s->safe_epoch,
                (unsigned long long)c->epoch);
        if (lt != s->loose_total || st != s->seq_total || held_sum != lt + st)
            bad(&k, "session %llu totals: loose %llu/%llu seq %llu/%llu held %llu",
                (unsigned long long)s->sid, (unsigned long long)lt,
                (unsigned long long)s->loose_total, (unsigned long long)st,
                (unsigned long long)s->seq_total, (unsigned long long)held_sum);
    }
    pos = 0;
    while (kvd_map_next(&c->seqs, &pos, &key, &val)) {
        const kvd_seq_t *q = (const kvd_seq_t *)(uintptr_t)val;
        const kvd_session_t *s = kvd__session_get(c, q->sid);
        if (!s)
            bad(&k, "sequence %llu belongs to dead session %llu", (unsigned long long)q->id,
                (unsigned long long)q->sid);
        else if (!kvd_map_get(&s->seqs, q->id)) /* its refs would be counted nowhere */
            bad(&k, "sequence %llu is not listed by its session %llu", (unsigned long long)q->id,
                (unsigned long long)q->sid);
    }
    /* Logical free list. */
    uint32_t nfree = 0;
    for (uint32_t l = c->lfree_head; l != KVD_NONE && nfree <= nl; l = c->lp[l].next_free) {
        if (c->lp[l].state != KVD_PAGE_FREE || mark[l])
            bad(&k, "logical %u on the free list twice or not free", l);
        mark[l] = 1;
        nfree++;
    }
    if (nfree != c->nlfree)
        bad(&k, "logical free list has %u entries, counter says %u", nfree, c->nlfree);
    /* Physical lists, per format. */
    /* The lookup memo: only cached pages, each under its own key. */
    uint32_t memos = 0;
    for (uint32_t l = 0; l < nl; l++) {
        const kvd_lpage_t *p = &c->lp[l];
        if (!p->memo)
            continue;
        memos++;
        const uint64_t *v = kvd_map_get(&c->memo, p->memo_key);
        if (!p->cached || !v || *v != l)
            bad(&k, "logical %u has a lookup memo but is %s / not under its key", l,
                p->cached ? "cached" : "not cached");
    }
    if (memos != c->memo.len)
        bad(&k, "lookup memo map holds %llu entries, pages hold %u",
            (unsigned long long)c->memo.len, memos);
    uint32_t cached_total = 0, pins_total = 0;
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        const kvd_pool_t *pl = &c->pool[f];
        uint8_t *pm = kvd_calloc(pl->n ? pl->n : 1, 1);
        if (!pm) {
            bad(&k, "check: out of memory");
            break;
        }
        uint32_t cnt = 0;
        for (uint32_t p = pl->free_head; p != KVD_NONE && cnt <= pl->n; p = pl->pg[p].next) {
            if (pl->pg[p].state != KVD_PHYS_FREE || pm[p])
                bad(&k, "%s phys %u on the free list twice or not free", kvd_fmt_name(f), p);
            pm[p] = 1;
            cnt++;
        }
        if (cnt != pl->nfree)
            bad(&k, "%s free list has %u entries, counter says %u", kvd_fmt_name(f), cnt,
                pl->nfree);
        cnt = 0;
        for (uint32_t p = pl->retire_head; p != KVD_NONE && cnt <= pl->n; p = pl->pg[p].next) {
            if (pl->pg[p].state != KVD_PHYS_RETIRED || pm[p])
                bad(&k, "%s phys %u on the retire list twice or not retired", kvd_fmt_name(f),
                    p);
            pm[p] = 2;
            cnt++;
            if (pl->pg[p].stamp > epoch_next)
                bad(&k, "%s retired phys %u stamped %llu, beyond epoch %llu", kvd_fmt_name(f), p,
                    (unsigned long long)pl->pg[p].stamp, (unsigned long long)epoch_next);
            uint32_t l = pl->pg[p].lid;
            if (l != KVD_NONE && (l >= nl || c->lp[l].state != KVD_PAGE_RETIRED ||
                                  c->lp[l].phys != p || c->lp[l].fmt != f))
                bad(&k, "%s retired phys %u names logical %u which does not map it",
                    kvd_fmt_name(f), p, l);
        }
        if (cnt != pl->nretired)
            bad(&k, "%s retire list has %u entries, counter says %u", kvd_fmt_name(f), cnt,
                pl->nretired);
        for (uint32_t p = 0; p < pl->n; p++) {
            const kvd_ppage_t *pp = &pl->pg[p];
            if (pp->state == KVD_PHYS_FILLING)
                bad(&k, "%s phys %u left FILLING outside a conversion", kvd_fmt_name(f), p);
            else if (pp->state == KVD_PHYS_LIVE) {
                const kvd_lpage_t *lp = pp->lid < nl ? &c->lp[pp->lid] : NULL;
                if (!lp || lp->phys != p || lp->fmt != f ||
                    (lp->state != KVD_PAGE_OPEN && lp->state != KVD_PAGE_SEALED))
                    bad(&k, "%s live phys %u names logical %u which does not map it",
                        kvd_fmt_name(f), p, pp->lid);
            } else if (pm[p] == 0)
                bad(&k, "%s phys %u (state %d) is on no list", kvd_fmt_name(f), p, pp->state);
        }
        uint32_t lru = 0, cached = 0;
        uint32_t prev = KVD_NONE;
        for (uint32_t l = pl->lru_head; l != KVD_NONE && lru <= nl; l = c->lp[l].lru_next) {
            if (c->lp[l].lru_prev != prev || !c->lp[l].on_lru || c->lp[l].fmt != f)
                bad(&k, "%s LRU broken at logical %u", kvd_fmt_name(f), l);
            prev = l;
            lru++;
        }
        if (lru != pl->nlru || prev != pl->lru_tail)
            bad(&k, "%s LRU has %u entries, counter says %u", kvd_fmt_name(f), lru, pl->nlru);
        for (uint32_t l = 0; l < nl; l++)
            if (c->lp[l].cached && c->lp[l].fmt == f && c->lp[l].state == KVD_PAGE_SEALED)
                cached++;
        if (cached != pl->ncached)
            bad(&k, "%s cache has %u entries, counter says %u", kvd_fmt_name(f), cached,
                pl->ncached);
        cached_total += cached;
        kvd_free(pm);
    }
    /* Every logical page. */
    for (uint32_t l = 0; l < nl; l++) {
        const kvd_lpage_t *p = &c->lp[l];
        kv_dir_entry_t e = __atomic_load_n(&c->dir[l], __ATOMIC_ACQUIRE);
        pins_total += p->pins;
        if (p->req_loose != loose[l] || p->req_seq != seq[l])
            bad(&k, "logical %u refcounts loose %u seq %u, sessions hold loose %u seq %u", l,
                p->req_loose, p->req_seq, loose[l], seq[l]);
        if (p->stamp > epoch_next || p->lru_by_age)
            bad(&k, "logical %u stamped %llu (epoch %llu) or left ordered by age", l,
                (unsigned long long)p->stamp, (unsigned long long)epoch_next);
        switch (p->state) {
        case KVD_PAGE_FREE:
            if (!mark[l])
                bad(&k, "logical %u is free but not on the free list", l);
            if (kvd__lp_total(p) || (kv_dir_flags(e) & KV_DIR_VALID))
                bad(&k, "free logical %u has references or a valid directory entry", l);
            break;
        case KVD_PAGE_OPEN:
        case KVD_PAGE_SEALED: {
            const kvd_pool_t *pl = &c->pool[p->fmt];
            if (p->fmt >= KV_FMT_COUNT || p->phys >= pl->n || pl->pg[p->phys].lid != l ||
                pl->pg[p->phys].state != KVD_PHYS_LIVE)
                bad(&k, "logical %u maps %s phys %u which is not its live page", l,
                    kvd_fmt_name(p->fmt), p->phys);
            uint32_t flags = KV_DIR_VALID | (p->state == KVD_PAGE_SEALED ? KV_DIR_SEALED : 0);
            if (kv_dir_phys(e) != p->phys || kv_dir_fmt(e) != p->fmt || kv_dir_flags(e) != flags)
                bad(&k, "directory entry of logical %u disagrees (phys %u fmt %u flags %u)", l,
                    kv_dir_phys(e), (unsigned)kv_dir_fmt(e), kv_dir_flags(e));
            if (kvd__lp_total(p) == 0)
                bad(&k, "live logical %u has no reference", l);
            if (p->conv)
                bad(&k, "logical %u holds a conversion ref outside a conversion", l);
            int eligible = p->cached && !p->req_loose && !p->req_seq && !p->pins && !p->conv;
            if (eligible != p->on_lru)
                bad(&k, "logical %u: on LRU %d but eligible %d", l, p->on_lru, eligible);
            if (p->state == KVD_PAGE_OPEN && (p->cached || p->pins))
                bad(&k, "unsealed logical %u is cached or pinned", l);
            if (p->state == KVD_PAGE_OPEN) {
                /* only its owner can reach an unsealed page (seal, dedupe and the "freed at
                 * once on close" rule rely on it) */
                const kvd_session_t *o = kvd__session_get(c, p->owner_sid);
                if (!o || kvd__count(&o->held, l) != (uint64_t)p->req_loose + p->req_seq)
                    bad(&k, "unsealed logical %u is held by others than its owner %llu%s", l,
                        (unsigned long long)p->owner_sid, o ? "" : " (dead)");
            }
            if (p->pins && !p->cached)
                bad(&k, "logical %u pinned but not cached", l);
            if (p->cached) {
                uint64_t *v = kvd_map_get(&c->index, kvd__index_key(p->hash));
                if (!v || *v != l)
                    bad(&k, "cached logical %u is not bound in the index", l);
            }
            break;
        }
        case KVD_PAGE_RETIRED: {
            const kvd_pool_t *pl = &c->pool[p->fmt];
            if (p->phys >= pl->n || pl->pg[p->phys].state != KVD_PHYS_RETIRED ||
                pl->pg[p->phys].lid != l)
                bad(&k, "retired logical %u is not carried by a retired phys", l);
            /* kernels still in flight resolve it: the entry keeps its last mapping until the
             * collection that frees both */
            if (!(kv_dir_flags(e) & KV_DIR_VALID) || kv_dir_phys(e) != p->phys ||
                kv_dir_fmt(e) != p->fmt)
                bad(&k, "directory entry of retired logical %u no longer maps its page (phys %u "
                    "fmt %u flags %u)",
                    l, kv_dir_phys(e), (unsigned)kv_dir_fmt(e), kv_dir_flags(e));
            if (kvd__lp_total(p) || p->on_lru)
                bad(&k, "retired logical %u still has references", l);
            break;
        }
        default:
            bad(&k, "logical %u in unknown state %u", l, p->state);
        }
    }
    pos = 0;
    uint64_t bound = 0;
    while (kvd_map_next(&c->index, &pos, &key, &val)) {
        bound++;
        if (val >= nl || !c->lp[val].cached || kvd__index_key(c->lp[val].hash) != key)
            bad(&k, "index key %016llx points at logical %llu which is not cached under it",
                (unsigned long long)key, (unsigned long long)val);
    }
    if (bound != cached_total || bound != c->st.cache_entries)
        bad(&k, "index has %llu entries, pages say %u, counter %llu", (unsigned long long)bound,
            cached_total, (unsigned long long)c->st.cache_entries);
    if (pins_total != c->st.pins)
        bad(&k, "pins: pages hold %u, counter %llu", pins_total, (unsigned long long)c->st.pins);
    kvd_free(loose);
    kvd_free(seq);
    kvd_free(mark);
    kvd_free(mine);
    return k.n;
}

/* ---- stats ------------------------------------------------------------------------------- */
void kvd_core_stats(const kvd_core_t *c, kvd_stats_t *o)
{
    *o = c->st;
    o->epoch = c->epoch + (c->bump_pending ? 1 : 0);
    uint64_t m = kvd__min_safe_epoch(c);
    o->min_safe_epoch = m == UINT64_MAX ? 0 : m;
    o->sessions = c->sessions.len;
    o->sequences = c->seqs.len;
    o->logical_free = c->nlfree;
    o->logical_total = c->nlogical;
    o->request_refs = 0;
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        const kvd_pool_t *pl = &c->pool[f];
        uint64_t pb = c->be->exp.page_bytes[f];
        o->pages_total[f] = pl->n;
        o->pages_free[f] = pl->nfree;
        o->pages_cached[f] = pl->ncached;
        o->pages_lru[f] = pl->nlru;
        o->pages_retired[f] = pl->nretired;
        o->page_bytes[f] = pb;
        o->bytes_total[f] = (uint64_t)pl->n * pb;
        o->bytes_used[f] = (uint64_t)(pl->n - pl->nfree) * pb;
        o->cache_quota_pages[f] = pl->quota;
        o->pages_open[f] = o->pages_sealed[f] = o->pages_pinned[f] = o->pages_referenced[f] = 0;
    }
    /* O(logical ids): fine for a scrape every few seconds, not for a per-request path. */
    for (uint32_t l = 0; l < c->nlogical; l++) {
        const kvd_lpage_t *p = &c->lp[l];
        if (p->state != KVD_PAGE_OPEN && p->state != KVD_PAGE_SEALED)
            continue;
        o->pages_open[p->fmt] += p->state == KVD_PAGE_OPEN;
        o->pages_sealed[p->fmt] += p->state == KVD_PAGE_SEALED;
        o->pages_pinned[p->fmt] += p->pins > 0;
        o->pages_referenced[p->fmt] += kvd__lp_client_refs(p) > 0;
        o->request_refs += kvd__lp_client_refs(p);
    }
}
