/* events.c — see events.h. The publisher of index events.
 *
 * Pending batch (all arrays grow by doubling and are kept for the daemon's life, so a steady
 * stream allocates nothing):
 *
 *   ent[n]        one entry per index change: kind, format, page, reason, hash, parent hash,
 *                 and offsets into the two pools below
 *   tok[ntok]     token ids of STORED entries (only when tokens are on)
 *   xb[nxb]       extra bytes of STORED entries
 *
 * Flush packs [namespace][Event{version, instance, seq, time_ns, namespace, entries}] and sends
 * both frames with ZMQ_DONTWAIT. A PUB socket never blocks: under its high-water mark it drops
 * the message for the slow subscriber only; that subscriber sees the gap in `seq`. The seq is
 * per message, not per entry, so a router checks one counter per message.
 *
 * Why one message per loop iteration rather than per change: a 32-page prompt sealed by a
 * pipelined client is 32 requests in one drain of the ROUTER; one message costs one protobuf
 * header, one topic frame and one wake-up of every subscriber instead of 32, and the order of
 * entries is still the order the index changed. batch_max bounds a message (and the memory a
 * huge admin evict queues) without reordering anything, and so does KVD_EVENTS_MSG_BYTES: each
 * entry carries an upper bound of its encoded size (`wire`), a batch closes before the entry
 * that would take it over the message budget, so a subscriber's queue of hwm messages has a
 * stated size whatever events_batch and the page size are (events.h "Memory").
 */
#include "events.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvproto.h"
#include "log.h"
#include "util.h"

typedef struct ev_ent_s {
    uint8_t kind;   /* Kvd__EventEntry__Kind */
    uint8_t fmt;
    uint8_t reason; /* Kvd__EventEntry__Reason */
    uint8_t has_parent;
    uint32_t page;
    uint32_t ntok;  /* token count of the page (STORED) */
    uint32_t nids;  /* token ids stored in tok[] for this entry (0 when tokens are off) */
    uint32_t xlen;
    uint32_t wire;  /* upper bound of the entry's encoded bytes inside the Event message */
    size_t tok_off, xb_off;
    uint8_t hash[KVD_HASH_BYTES];
    uint8_t parent[KVD_HASH_BYTES];
} ev_ent_t;

struct kvd_events_s {
    void *pub;
    char ipc_path[256]; /* ipc:// endpoints: the socket file, removed at free; else "" */
    int lock_fd;        /* kvd_lock_file of ipc_path + ".lock" (one daemon per socket), or -1 */
    uv_check_t check;     /* flushes what the poll phase's callbacks (requests) changed */
    uv_prepare_t prepare; /* flushes what timers (lifecycle ticks) changed, before poll sleeps */
    char *ns;
    uint64_t instance, seq;
    int tokens;
    uint32_t batch_max;
    size_t budget;     /* entry bytes per message: KVD_EVENTS_MSG_BYTES less the header */
    size_t pend_bytes; /* sum of `wire` over the pending entries */
    ev_ent_t *ent;
    size_t n, cap;
    uint32_t *tok;
    size_t ntok, tokcap;
    uint8_t *xb;
    size_t nxb, xbcap;
    /* packing scratch, grown like the batch */
    Kvd__EventEntry *pe;
    Kvd__EventEntry **pp;
    size_t pcap;
    uint8_t *buf;
    size_t bufcap;
    /* stats.h events_* */
    uint64_t published, batches, dropped, lost_msgs;
};

/* Grow *p (elements of size sz) to hold need elements. 0 or -1 (unchanged) on failure. */
static int grow(void **p, size_t *cap, size_t need, size_t sz)
{
    if (need <= *cap)
        return 0;
    size_t nc = *cap ? *cap : 64;
    while (nc < need)
        nc *= 2;
    void *q = realloc(*p, nc * sz);
    if (!q)
        return -1;
    *p = q;
    *cap = nc;
    return 0;
}

static uint64_t realtime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Encoded-size bounds (proto/kvd.proto EventEntry and Event, every varint at its widest): an
 * entry without token ids or extra is kind, hash, parent, format, tokens, page and reason,
 * framed in Event.entries (tag + a length of ≤ 3 bytes: an entry is < 2 MiB). */
#define EV_ENT_FIXED ((1 + 1) + (1 + 1 + KVD_HASH_BYTES) * 2 + (1 + 1) + (1 + 5) * 2 + (1 + 1))
#define EV_ENT_FRAME (1 + 3)

static uint32_t ent_wire(uint32_t nids, size_t xlen)
{
    size_t w = EV_ENT_FIXED + EV_ENT_FRAME;
    if (nids)
        w += 1 + kvp_varint_size(5ull * nids) + 5ull * nids;
    if (xlen)
        w += 1 + kvp_varint_size(xlen) + xlen;
    return (uint32_t)w;
}

/* A message that will never reach anyone: burn its sequence number so subscribers see a gap. */
static void lose(kvd_events_t *e, size_t entries)
{
    e->dropped += entries;
    e->lost_msgs++;
    e->seq++;
}

/* Pack entries ent[first, first + n) as one message and send it. */
static void publish(kvd_events_t *e, size_t first, size_t n)
{
    if (grow((void **)&e->pe, &e->pcap, n, sizeof *e->pe) != 0) {
        lose(e, n);
        return;
    }
    /* pp shares pcap: grown right after pe, to the same capacity */
    Kvd__EventEntry **pp = realloc(e->pp, e->pcap * sizeof *pp);
    if (!pp) {
        lose(e, n);
        return;
    }
    e->pp = pp;
    for (size_t i = 0; i < n; i++) {
        const ev_ent_t *s = &e->ent[first + i];
        Kvd__EventEntry *m = &e->pe[i];
        kvd__event_entry__init(m);
        m->kind = (Kvd__EventEntry__Kind)s->kind;
        m->reason = (Kvd__EventEntry__Reason)s->reason;
        m->format = (Kvd__Format)s->fmt;
        m->page = s->page;
        if (s->kind != KVD__EVENT_ENTRY__KIND__KIND_CLEARED) {
            m->hash.data = (uint8_t *)s->hash;
            m->hash.len = KVD_HASH_BYTES;
        }
        if (s->has_parent) {
            m->parent_hash.data = (uint8_t *)s->parent;
            m->parent_hash.len = KVD_HASH_BYTES;
        }
        m->tokens = s->ntok;
        m->n_token_ids = s->nids;
        m->token_ids = s->nids ? e->tok + s->tok_off : NULL;
        if (s->xlen) {
            m->extra.data = e->xb + s->xb_off;
            m->extra.len = s->xlen;
        }
        e->pp[i] = m;
    }
    Kvd__Event ev = KVD__EVENT__INIT;
    ev.version = KVP_VERSION;
    ev.instance = e->instance;
    ev.seq = ++e->seq;
    ev.time_ns = realtime_ns();
    ev.namespace_ = e->ns;
    ev.n_entries = n;
    ev.entries = e->pp;
    size_t len = kvd__event__get_packed_size(&ev);
    if (grow((void **)&e->buf, &e->bufcap, len ? len : 1, 1) != 0) {
        e->seq--; /* lose() takes the number again */
        lose(e, n);
        return;
    }
    kvd__event__pack(&ev, e->buf);
    size_t nslen = strlen(e->ns);
    if (zmq_send(e->pub, e->ns, nslen, ZMQ_SNDMORE | ZMQ_DONTWAIT) != (int)nslen ||
        zmq_send(e->pub, e->buf, len, ZMQ_DONTWAIT) != (int)len) {
        /* PUB does not refuse at the HWM (it drops per subscriber); getting here means the
         * socket itself failed. The seq was consumed: subscribers see the gap. */
        KVD_LOGD("events: zmq_send failed: %s", zmq_strerror(errno));
        e->dropped += n;
        e->lost_msgs++;
        return;
    }
    e->published += n;
    e->batches++;
}

void kvd_events_flush(kvd_events_t *e)
{
    if (!e || e->n == 0)
        return;
    size_t n = e->n;
    e->n = e->ntok = e->nxb = 0; /* the pools keep their bytes until the next push */
    e->pend_bytes = 0;
    /* push() keeps a batch within batch_max and the byte budget, but an events_batch lowered
     * at run time finds more than that pending: split, so that no message exceeds either */
    for (size_t at = 0; at < n;) {
        size_t k = 0, bytes = 0;
        while (at + k < n && k < e->batch_max &&
               (k == 0 || bytes + e->ent[at + k].wire <= e->budget))
            bytes += e->ent[at + k++].wire;
        publish(e, at, k);
        at += k;
    }
}

/* Reserve one pending entry of at most `wire` encoded bytes (flushing first when the batch is
 * full in entries or in bytes). NULL on allocation failure: the caller counts the loss. */
static ev_ent_t *push(kvd_events_t *e, uint32_t wire)
{
    if (e->n >= e->batch_max || (e->n && e->pend_bytes + wire > e->budget))
        kvd_events_flush(e);
    if (grow((void **)&e->ent, &e->cap, e->n + 1, sizeof *e->ent) != 0)
        return NULL;
    ev_ent_t *s = &e->ent[e->n];
    memset(s, 0, sizeof *s);
    s->wire = wire;
    return s;
}

/* The entry push() returned is complete: it joins the batch. */
static void commit(kvd_events_t *e, const ev_ent_t *s)
{
    e->pend_bytes += s->wire;
    e->n++;
}

void kvd_events_hook(const kvd_index_ev_t *ev, void *ud)
{
    kvd_events_t *e = ud;
    const int ids = ev->kind == KVD_INDEX_EV_STORED && !ev->restored && e->tokens;
    ev_ent_t *s = push(e, ent_wire(ids ? ev->ntok : 0, ids ? ev->extra_len : 0));
    if (!s) {
        lose(e, 1);
        return;
    }
    s->page = ev->logical;
    s->fmt = (uint8_t)ev->fmt;
    memcpy(s->hash, ev->hash, KVD_HASH_BYTES);
    switch (ev->kind) {
    case KVD_INDEX_EV_STORED:
        s->kind = KVD__EVENT_ENTRY__KIND__KIND_STORED;
        s->ntok = ev->ntok;
        if (ev->restored) {
            s->reason = KVD__EVENT_ENTRY__REASON__REASON_RESTORED;
            break; /* a snapshot keeps neither parent nor tokens */
        }
        if (ev->parent) {
            s->has_parent = 1;
            memcpy(s->parent, ev->parent, KVD_HASH_BYTES);
        }
        if (e->tokens) {
            if (grow((void **)&e->tok, &e->tokcap, e->ntok + ev->ntok, sizeof *e->tok) != 0 ||
                grow((void **)&e->xb, &e->xbcap, e->nxb + ev->extra_len + 1, 1) != 0) {
                lose(e, 1);
                return; /* entry not committed (e->n unchanged) */
            }
            s->tok_off = e->ntok;
            s->nids = ev->ntok;
            memcpy(e->tok + e->ntok, ev->tokens, (size_t)ev->ntok * sizeof *e->tok);
            e->ntok += ev->ntok;
            s->xb_off = e->nxb;
            s->xlen = (uint32_t)ev->extra_len;
            if (ev->extra_len)
                memcpy(e->xb + e->nxb, ev->extra, ev->extra_len);
            e->nxb += ev->extra_len;
        }
        break;
    case KVD_INDEX_EV_REMOVED:
        s->kind = KVD__EVENT_ENTRY__KIND__KIND_REMOVED;
        s->reason = ev->why == KVD_EVICT_PRESSURE ? KVD__EVENT_ENTRY__REASON__REASON_PRESSURE
                    : ev->why == KVD_EVICT_QUOTA  ? KVD__EVENT_ENTRY__REASON__REASON_QUOTA
                                                  : KVD__EVENT_ENTRY__REASON__REASON_ADMIN;
        break;
    case KVD_INDEX_EV_FORMAT:
        s->kind = KVD__EVENT_ENTRY__KIND__KIND_FORMAT_CHANGED;
        break;
    default:
        KVD_PANIC("index event of unknown kind %d", (int)ev->kind);
    }
    commit(e, s);
}

static void clear(kvd_events_t *e, Kvd__EventEntry__Reason why)
{
    ev_ent_t *s = push(e, ent_wire(0, 0));
    if (!s) {
        lose(e, 1);
        return;
    }
    s->kind = KVD__EVENT_ENTRY__KIND__KIND_CLEARED;
    s->reason = (uint8_t)why;
    s->page = UINT32_MAX;
    commit(e, s);
}

typedef struct announce_s {
    kvd_events_t *e;
    uint32_t ntok, n;
    uint8_t reason;
} announce_t;

/* One STORED for a bound entry whose parent and tokens are unknown (the core keeps hashes). */
static void announce_cb(const kvd_page_info_t *p, void *ud)
{
    announce_t *a = ud;
    ev_ent_t *s = push(a->e, ent_wire(0, 0));
    if (!s) {
        lose(a->e, 1);
        return;
    }
    s->kind = KVD__EVENT_ENTRY__KIND__KIND_STORED;
    s->reason = a->reason;
    s->fmt = (uint8_t)p->fmt;
    s->page = p->logical;
    s->ntok = a->ntok;
    memcpy(s->hash, p->hash, KVD_HASH_BYTES);
    commit(a->e, s);
    a->n++;
}

static uint32_t announce(kvd_events_t *e, const kvd_core_t *c, uint8_t reason)
{
    announce_t a = {.e = e, .ntok = kvd_core_export(c)->geom.page_tokens, .reason = reason};
    kvd_core_cache_foreach(c, announce_cb, &a);
    return a.n;
}

void kvd_events_announce(kvd_events_t *e, const kvd_core_t *c)
{
    if (e)
        announce(e, c, KVD__EVENT_ENTRY__REASON__REASON_RESTORED);
}

void kvd_events_resync(kvd_events_t *e, const kvd_core_t *c, uint64_t *seq_out,
                       uint32_t *entries_out)
{
    kvd_events_flush(e); /* changes made before the request go out first, as they happened */
    *seq_out = e->seq + 1;
    clear(e, KVD__EVENT_ENTRY__REASON__REASON_RESYNC);
    *entries_out = announce(e, c, KVD__EVENT_ENTRY__REASON__REASON_RESYNC);
    kvd_events_flush(e);
}

static void check_cb(uv_check_t *h)
{
    kvd_events_flush(h->data);
}

/* libuv runs timers (and closing handles) outside the poll → check window: a check handle alone
 * left a lifecycle tick's FORMAT_CHANGED (and the REMOVED of the evictions its conversions
 * caused) pending while poll slept, until a request or the next timer woke the loop (a whole
 * lifecycle_ms on an idle daemon). prepare runs right before poll blocks. */
static void prepare_cb(uv_prepare_t *h)
{
    kvd_events_flush(h->data);
}

/* ipc: the socket file's directory is created 0700, like the control socket's. */
static int prepare_ipc(const char *endpoint, char *err, size_t errlen)
{
    if (strncmp(endpoint, "ipc://", 6) != 0)
        return 0;
    char dir[256];
    if (snprintf(dir, sizeof dir, "%s", endpoint + 6) >= (int)sizeof dir) {
        snprintf(err, errlen, "events_endpoint '%s': path too long", endpoint);
        return -1;
    }
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir)
        return 0;
    *slash = '\0';
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        snprintf(err, errlen, "events_endpoint: mkdir(%s, 0700) failed: %s", dir,
                 strerror(errno));
        return -1;
    }
    return 0;
}

int kvd_events_init(kvd_events_t **out, uv_loop_t *loop, const kvd_events_opts_t *o, char *err,
                    size_t errlen)
{
    *out = NULL;
    if (!o->endpoint || !o->endpoint[0] || !o->zctx || !o->ns || o->batch_max == 0) {
        snprintf(err, errlen, "events: endpoint, context, namespace and batch_max are required");
        return -1;
    }
    if (prepare_ipc(o->endpoint, err, errlen) != 0)
        return -1;
    kvd_events_t *e = calloc(1, sizeof *e);
    if (!e || !(e->ns = strdup(o->ns))) {
        free(e);
        snprintf(err, errlen, "events: out of memory");
        return -1;
    }
    e->lock_fd = -1;
    if (strncmp(o->endpoint, "ipc://", 6) == 0) { /* prepare_ipc checked the length */
        char lock[300];
        snprintf(e->ipc_path, sizeof e->ipc_path, "%s", o->endpoint + 6);
        snprintf(lock, sizeof lock, "%s.lock", e->ipc_path);
        e->lock_fd = kvd_lock_file(lock, o->endpoint, "events_endpoint", err, errlen);
        if (e->lock_fd < 0) {
            e->ipc_path[0] = '\0'; /* the other daemon's socket: not ours to remove */
            goto fail;
        }
    }
    e->instance = o->instance;
    e->tokens = o->tokens;
    e->batch_max = o->batch_max;
    /* Event header at its widest: version, instance, seq, time_ns, namespace */
    const size_t nslen = strlen(o->ns);
    const size_t head = (1 + 5) + (1 + 10) * 3 + 1 + kvp_varint_size(nslen) + nslen;
    e->budget = head < KVD_EVENTS_MSG_BYTES ? KVD_EVENTS_MSG_BYTES - head : 1;
    e->pub = zmq_socket(o->zctx, ZMQ_PUB);
    if (!e->pub) {
        snprintf(err, errlen, "events: zmq_socket(PUB) failed: %s", zmq_strerror(errno));
        goto fail;
    }
    /* Linger: long enough for the CLEARED of a shutdown to leave, short enough that a stuck
     * subscriber cannot hold the daemon's exit. */
    int linger = 200, hwm = o->hwm > (uint64_t)INT32_MAX ? INT32_MAX : (int)o->hwm;
    zmq_setsockopt(e->pub, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(e->pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
    if (o->zap && strncmp(o->endpoint, "ipc://", 6) == 0)
        zmq_setsockopt(e->pub, ZMQ_ZAP_DOMAIN, "kvd", 3);
    if (zmq_bind(e->pub, o->endpoint) != 0) {
        snprintf(err, errlen, "events: zmq_bind(%s) failed: %s", o->endpoint,
                 zmq_strerror(errno));
        goto fail;
    }
    if (strncmp(o->endpoint, "ipc://", 6) == 0)
        chmod(o->endpoint + 6, 0600);
    uv_check_init(loop, &e->check);
    e->check.data = e;
    uv_check_start(&e->check, check_cb);
    uv_prepare_init(loop, &e->prepare);
    e->prepare.data = e;
    uv_prepare_start(&e->prepare, prepare_cb);
    clear(e, KVD__EVENT_ENTRY__REASON__REASON_START);
    *out = e;
    return 0;
fail:
    if (e->pub)
        zmq_close(e->pub);
    if (e->lock_fd >= 0)
        close(e->lock_fd);
    free(e->ns);
    free(e);
    return -1;
}

void kvd_events_configure(kvd_events_t *e, uint32_t batch_max, int tokens)
{
    if (!e)
        return;
    e->batch_max = batch_max ? batch_max : 1;
    e->tokens = tokens;
}

void kvd_events_stop(kvd_events_t *e)
{
    if (!e || !e->check.loop || uv_is_closing((uv_handle_t *)&e->check))
        return;
    clear(e, KVD__EVENT_ENTRY__REASON__REASON_SHUTDOWN);
    kvd_events_flush(e);
    uv_close((uv_handle_t *)&e->check, NULL);
    uv_close((uv_handle_t *)&e->prepare, NULL);
}

void kvd_events_free(kvd_events_t **ep)
{
    if (!ep || !*ep)
        return;
    kvd_events_t *e = *ep;
    if (e->pub)
        zmq_close(e->pub);
    if (e->ipc_path[0]) /* after the close: a clean exit leaves no stale socket file */
        unlink(e->ipc_path);
    if (e->lock_fd >= 0)
        close(e->lock_fd);
    free(e->ns);
    free(e->ent);
    free(e->tok);
    free(e->xb);
    free(e->pe);
    free(e->pp);
    free(e->buf);
    free(e);
    *ep = NULL;
}

void kvd_events_stats(const kvd_events_t *e, kvd_stats_t *st)
{
    if (!e)
        return;
    st->events_published = e->published;
    st->events_batches = e->batches;
    st->events_dropped = e->dropped;
    st->events_seq = e->seq;
}
