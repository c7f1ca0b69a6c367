/* server.c — see server.h for the handle map and the session rule.
 *
 * Request path (one message, all on the loop thread; the allocations are protobuf-c's unpack,
 * the lookup page buffer and the reply bodies: calloc'd pieces freed together after each
 * reply, ar_alloc):
 *
 *   frames = [routing id][envelope…][payload]     (DEALER sends just [payload]; a REQ peer's
 *                                                  empty delimiter is echoed back unchanged)
 *   kvp_request_decode(payload) → op, id          (the gate: every malformed input stops here)
 *   session lookup by routing id and pid          (ops that need one → NO_SESSION)
 *   optional safe-epoch report
 *   handler → kvd_core_*()                        (state change or error + message)
 *   reply: version, id, status, message, epoch, body → packed → [envelope…][reply]
 *
 * Replies are built in a per-request arena (srv->arena: a list of calloc'd blocks) so that
 * handlers that build nested messages (sessions, cache ls, config, stats) free in one place.
 */
#include "server.h"

#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <signal.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <zmq.h>

#include "core.h"
#include "events.h"
#include "fdpass.h"
#include "kvproto.h"
#include "lifecycle.h"
#include "log.h"
#include "metrics.h"
#include "snapshot.h"
#include "util.h"
#include "zap.h"

#define KVD_MAX_FRAMES 4
#define KVD_ROUTING_MAX 255

typedef struct kvd_sess_s {
    struct kvd_sess_s *next;
    kvd_server_t *srv;
    uint64_t sid;
    int32_t pid;
    uint32_t uid, gid;
    int pidfd;
    uv_poll_t poll;
    uint8_t rid[KVD_ROUTING_MAX];
    size_t rid_len;
    int fenced;    /* kvctl sessions fence: every request of it is refused */
    int connected; /* set by hello; libzmq does not tell a ROUTER that a peer's socket closed,
                    * so a session stays "connected" until its process exits (sessions end
                    * only then: DESIGN.md "Ownership") */
    char name[KVP_MAX_STRING + 1];
    uint64_t last_ns;
    int lease_expired;
} kvd_sess_t;

typedef struct kvd_arena_s {
    struct kvd_arena_s *next;
    max_align_t data[];
} kvd_arena_t;

struct kvd_server_s {
    uv_loop_t *loop;
    kvd_config_t *cfg;
    kvd_core_t *core;
    void *zctx, *router;
    uv_poll_t router_poll;
    kvd_zap_t zap;
    kvd_admit_t admit;
    int fds_listen;
    uv_poll_t fds_poll;
    char fds_path[256];
    char sock_path[256];
    int ep_lock, snap_lock; /* kvd_lock_file fds: the endpoint's and snapshot_dir's, or -1 */
    uv_timer_t epoch_timer, lease_timer, lifecycle_timer;
    kvd_lc_t *lc;             /* lifecycle controller (lifecycle.h); ticks on lifecycle_timer */
    kvd_events_t *events;     /* index event publisher (events.h); NULL when events are off */
    uint64_t lc_period_ms;    /* period lifecycle_timer runs at; 0 = stopped */
    uint32_t lc_window;       /* last Recent window logged */
    int lc_failing;           /* the last tick had conversion failures (already logged) */
    kvd_http_t http;
    kvd_sess_t *sessions;
    uint32_t nsessions;
    kvd_metrics_t metrics;
    kvp_limits_t lim;
    uint64_t instance, start_ns, fd_handovers, fd_refused;
    int draining, stopping;
    kvd_arena_t *arena;
    uint8_t *sendbuf;
    size_t sendcap;
    uint32_t *lookup_buf;
    size_t lookup_cap;
    uint32_t *tok_buf;
    size_t tok_cap;
    /* durable prefix cache (snapshot.h, docs/snapshot.md); persist = snapshot_dir is set */
    int persist;
    uint8_t salt[KVD_HASH_KEY_BYTES];
    kvd_snap_ident_t snap_id;
    uv_timer_t snapshot_timer;
    uint64_t snap_period_ms, snap_mark; /* timer period; cache-change mark of the last one */
    uint64_t snap_gen;                  /* generation of the last snapshot written */
    int snap_clean; /* the last snapshot WRITTEN holds the cache as it is (mark unchanged) */
    uint64_t snap_written, snap_failures, snap_pages, snap_bytes, snap_ms;
    uint64_t snap_load_pages, snap_load_skipped, snap_load_refused, snap_load_ms;
    struct kvd_snap_job_s *snap_job; /* the snapshot being written off the loop, or NULL */
    uint64_t snap_served;            /* requests answered while a snapshot job was in flight */
    uint64_t snap_slices;            /* slices written by the worker, all jobs */
    uint64_t snap_ends_on_loop;      /* jobs whose end (fsyncs, rename, unlinks) ran on the loop */
    uint64_t snap_hold; /* KVD_TEST_SNAPSHOT_HOLD: jobs stop after this many slices (0: off) */
    int reply_at_stop;  /* kvd_server_stop answered a kvctl snapshot: flush it before close */
    uint64_t nomem_ops; /* KVD_TEST_REPLY_NOMEM: bit op set = reply allocations of op fail */
    int ar_fail;        /* the request being handled is one of them */
    /* Memory bounds of the control socket (decision 54): the largest message it admits
     * (ZMQ_MAXMSGSIZE, fixed at bind: 0 = unlimited) and the replies dropped because a client
     * left reply_hwm of them unread (stats.h replies_dropped; the log line is rate-limited). */
    uint64_t msg_bytes; /* the one enforced limit (ZMQ_MAXMSGSIZE, HelloRep.max_msg_bytes) */
    uint64_t msg_slack; /* of it, kept for newer clients' fields: KVD_MSG_SLACK when derived */
    uint64_t replies_dropped, rdrop_unlogged, rdrop_log_ns;
};
_Static_assert(KVP_OP_COUNT <= 64, "nomem_ops has one bit per operation");

/* The core's figures plus the lifecycle controller's (stats.h lifecycle_*): what status,
 * metrics and kvctl show. */
static void kvd_server_stats(kvd_server_t *s, kvd_stats_t *st)
{
    kvd_core_stats(s->core, st);
    kvd_lc_stats(s->lc, st);
    kvd_events_stats(s->events, st);
    st->snapshots_written = s->snap_written;
    st->snapshot_failures = s->snap_failures;
    st->snapshot_pages = s->snap_pages;
    st->snapshot_bytes = s->snap_bytes;
    st->snapshot_ms = s->snap_ms;
    st->snapshot_load_pages = s->snap_load_pages;
    st->snapshot_load_skipped = s->snap_load_skipped;
    st->snapshot_load_refused = s->snap_load_refused;
    st->snapshot_load_ms = s->snap_load_ms;
    st->snapshot_requests_during = s->snap_served;
    st->snapshot_in_flight = s->snap_job != NULL;
    st->snapshot_slices = s->snap_slices;
    st->snapshot_ends_on_loop = s->snap_ends_on_loop;
    st->replies_dropped = s->replies_dropped;
}

/* ---- message size bound ------------------------------------------------------------------ */
/* A length-delimited protobuf field: tag, length, payload. */
static uint64_t kvd_ld_bytes(uint32_t field, uint64_t len)
{
    return kvp_varint_size((uint64_t)field << 3) + kvp_varint_size(len) + len;
}

/* The largest request a well-behaved client can send under these bounds (proto/kvd.proto,
 * every varint at its widest, every optional field present): what max_msg_bytes = 0 admits,
 * plus KVD_MSG_SLACK. The candidates are every request with a bound that grows: a lookup of
 * max_tokens tokens (4 bytes each) with KVP_MAX_EXTRA of extra; a seal of page_tokens ids;
 * a release or seq_append of max_pages ids below dir_entries; a hello or config_set with
 * KVP_MAX_STRING strings. With the defaults the lookup decides: 4 194 599 bytes. */
#define KVD_MSG_SLACK 4096u /* fields a newer client may append (they are appended, never
                               renumbered); an unknown field costs a byte or two each */
static uint64_t kvd_request_bytes_max(const kvp_limits_t *lim)
{
    const uint64_t u32 = 5, u64 = 10, str = KVP_MAX_STRING;
    _Static_assert(KVP_VERSION < 128, "a one-byte version varint");
    const uint64_t head = (1 + 1) + (1 + u64) + (1 + u64); /* version, id, completed_epoch */
    const uint64_t lookup =
        kvd_ld_bytes(1, 4ull * lim->max_tokens) + kvd_ld_bytes(2, KVP_MAX_EXTRA) + 2;
    const uint64_t seal = (1 + u32) + 2 + (1 + u32) +
                          kvd_ld_bytes(4, u32 * (lim->page_tokens ? lim->page_tokens : 4096)) +
                          kvd_ld_bytes(5, KVP_MAX_EXTRA);
    const uint64_t ids = (uint64_t)lim->max_pages *
                         kvp_varint_size(lim->dir_entries ? lim->dir_entries - 1 : UINT32_MAX);
    const uint64_t release = kvd_ld_bytes(1, ids), append = (1 + u64) + kvd_ld_bytes(2, ids);
    const uint64_t geom = 4 * (1 + u32) + (1 + u64);
    const uint64_t hello =
        kvd_ld_bytes(1, str) + (1 + u32) + kvd_ld_bytes(3, geom) + kvd_ld_bytes(4, str);
    const uint64_t cfg = kvd_ld_bytes(1, str) + kvd_ld_bytes(2, str);
    const uint64_t body[] = {kvd_ld_bytes(13, lookup),  kvd_ld_bytes(12, seal),
                             kvd_ld_bytes(14, release), kvd_ld_bytes(16, append),
                             kvd_ld_bytes(10, hello),   kvd_ld_bytes(37, cfg)};
    uint64_t m = 0;
    for (size_t i = 0; i < sizeof body / sizeof body[0]; i++)
        m = body[i] > m ? body[i] : m;
    return head + m;
}

/* ---- persistence (snapshot.h) ------------------------------------------------------------ */
/* A number that changes whenever the set of cache entries, their formats or their pins may
 * have changed: the periodic snapshot skips a cache that did not move. A sum of counters only
 * (a gauge such as pins comes back to its value when a pin moves). Over-approximate (a retier
 * of an uncached page counts too); never under. */
static uint64_t kvd_cache_mark(kvd_server_t *s)
{
    kvd_stats_t st;
    kvd_core_stats(s->core, &st);
    return st.seals + st.evictions_pressure + st.evictions_quota + st.evictions_admin +
           st.retiers + st.promotes + st.cache_restored + st.pin_changes;
}

static double kvd_mbps(uint64_t bytes, uint64_t ns)
{
    return ns ? (double)bytes / 1e6 / ((double)ns / 1e9) : 0.0;
}

/* Book a finished write (stats, log): the synchronous and the sliced path alike. */
static int kvd_server_snapshot_done(kvd_server_t *s, const char *why, uint64_t mark, int e,
                                    const kvd_snap_result_t *r, const char *err)
{
    if (e != KV_ERR_OK) {
        s->snap_failures++;
        KVD_LOGE("snapshot (%s) failed, previous generations kept: %s", why, err);
        return e;
    }
    s->snap_mark = mark;
    s->snap_gen = r->generation;
    s->snap_clean = 1;
    s->snap_written++;
    s->snap_pages = r->pages;
    s->snap_bytes = r->bytes;
    s->snap_ms = r->ns / 1000000u;
    KVD_LOGI("snapshot (%s): generation %" PRIu64 ", %" PRIu64 " pages, %.1f MB in %.1f ms "
             "(%.0f MB/s) -> %s",
             why, r->generation, r->pages, (double)r->bytes / 1e6, (double)r->ns / 1e6,
             kvd_mbps(r->bytes, r->ns), r->path);
    if (r->vanished)
        KVD_LOGI("snapshot (%s): %" PRIu64 " entries were evicted during the write and left out",
                 why, r->vanished);
    return KV_ERR_OK;
}

/* Write a snapshot now, blocking the loop for the whole write: only the shutdown snapshot
 * (the loop is about to end anyway; kvctl's goes through the job below, decision 42). */
static int kvd_server_snapshot(kvd_server_t *s, const char *why, kvd_snap_result_t *r,
                               char *err, size_t errlen)
{
    uint64_t mark = kvd_cache_mark(s);
    int e = kvd_snap_write(s->core, s->cfg->snapshot_dir, &s->snap_id, r, err, errlen);
    return kvd_server_snapshot_done(s, why, mark, e, r, err);
}

/* Snapshots written off the loop (docs/decisions.md 41, 42): the periodic one and `kvctl
 * snapshot`. The loop copies one slice of pages (kvd_snap_writer_fill, ≤ 8 MiB, a few ms) and
 * a libuv worker writes it (kvd_snap_writer_flush: the writer's own file only — the worker
 * never touches the core, the server or the loop). Its completion (after_work, on the loop)
 * copies the next slice. The worker's last flush also does the end of the write, in the
 * order snapshot.c's snap_writer_settle explains: header, fsync, close, rename, directory
 * fsync, then the unlink of the generation that falls out (≈ 0.3 s for a 400 MB file on
 * ext4) — or, after an error (a fill's too: it is still queued), the .tmp's removal. Only
 * then does after_work book the result and answer a waiting kvctl, on the loop
 * (kvd_snap_job_end: no filesystem call). `snapshot_ends_on_loop` counts the jobs whose end
 * work ran on the loop thread after all (no worker could be queued); 0 in normal operation,
 * and it_snapshot checks that. One job at a time: the timer skips while one runs, a `kvctl
 * snapshot` that finds one is refused (FAILED_PRECONDITION), and kvd_server_stop completes it
 * synchronously.
 *
 * A kvctl job carries a waiter: the request's routing envelope (zmq_msg_copy), id and receipt
 * time. The request handler sends no reply (kvd_req_ctx_t.deferred); kvd_snap_job_end answers
 * with the write's figures or its error when the write ends — in after_work, or inside
 * kvd_server_stop when SIGTERM came first (the router is still open then).
 *
 * mu guards `abandoned` against the worker: the worker flushes only while holding mu and only
 * when not abandoned, so once kvd_server_stop has set it (under mu) the writer is the loop's
 * alone, whether the queued work had started, finished, or not yet begun. `queued` (loop
 * only) says whether libuv owns j->req, i.e. whether an after_work is still to come: whoever
 * sees the job last frees it. */
typedef struct kvd_snap_waiter_s {
    zmq_msg_t env[KVD_MAX_FRAMES - 1]; /* routing envelope of the request */
    int nenv;
    uint64_t id, t0; /* request id; receipt time (the latency histogram covers the write) */
} kvd_snap_waiter_t;

typedef struct kvd_snap_job_s {
    uv_work_t req;
    kvd_server_t *s;
    kvd_snap_writer_t *w;
    uint64_t mark, slices;     /* cache mark at collection; slices the worker wrote */
    const char *why;           /* "timer" or "kvctl": log lines */
    kvd_snap_waiter_t *waiter; /* kvctl: the request answered at the end; NULL for the timer */
    uv_mutex_t mu;
    int abandoned; /* kvd_server_stop took the writer over: after_work only frees the job */
    int queued;    /* a work request is with libuv (after_work will run) */
} kvd_snap_job_t;

static void kvd_reply_finish(kvd_server_t *s, zmq_msg_t *env, int nenv, Kvd__Reply *rep,
                             kvp_op_t op, uint64_t id, kv_err_t e, const char *msg, uint64_t t0);

static void kvd_snap_waiter_free(kvd_snap_waiter_t **pw)
{
    kvd_snap_waiter_t *w = *pw;
    if (!w)
        return;
    for (int i = 0; i < w->nenv; i++)
        zmq_msg_close(&w->env[i]);
    free(w);
    *pw = NULL;
}

/* Answer a kvctl snapshot whose write ended: SnapshotRep as the synchronous path built it, or
 * the error with the writer's message. */
static void kvd_snap_waiter_reply(kvd_server_t *s, kvd_snap_waiter_t *w, int e,
                                  const kvd_snap_result_t *r, const char *err)
{
    Kvd__Reply rep = KVD__REPLY__INIT;
    Kvd__SnapshotRep body = KVD__SNAPSHOT_REP__INIT;
    char msg[1200] = "";
    if (e == KV_ERR_OK) {
        body.pages = r->pages;
        body.bytes = r->bytes;
        body.ms = r->ns / 1000000u;
        body.generation = r->generation;
        body.path = (char *)r->path;
        rep.body_case = KVD__REPLY__BODY_SNAPSHOT;
        rep.snapshot = &body;
    } else {
        snprintf(msg, sizeof msg, "snapshot failed, previous generations kept: %s", err);
    }
    kvd_reply_finish(s, w->env, w->nenv, &rep, KVP_OP_SNAPSHOT, w->id, (kv_err_t)e, msg, w->t0);
}

static void kvd_snap_job_free(kvd_snap_job_t *j)
{
    KVD_ASSERT(!j->w && !j->waiter && !j->queued);
    uv_mutex_destroy(&j->mu);
    free(j);
}

static void kvd_snap_job_work(uv_work_t *req)
{
    kvd_snap_job_t *j = req->data;
    uv_mutex_lock(&j->mu);
    if (!j->abandoned)
        kvd_snap_writer_flush(j->w); /* an error is sticky in the writer: after_work sees it */
    uv_mutex_unlock(&j->mu);
}

static void kvd_snap_job_after(uv_work_t *req, int status);

/* End the job's writer on the loop, book the result, answer the waiter. The job itself is
 * freed by the caller (or by after_work when one is still to come). */
static void kvd_snap_job_end(kvd_snap_job_t *j, const char *why)
{
    kvd_server_t *s = j->s;
    kvd_snap_result_t r;
    char err[1024];
    int e = kvd_snap_writer_end(&j->w, &r, err, sizeof err);
    if (r.settled_here && !j->abandoned) /* the loop stalled on them (at stop: no matter) */
        s->snap_ends_on_loop++;
    kvd_server_snapshot_done(s, why, j->mark, e, &r, err);
    s->snap_job = NULL;
    if (j->waiter) {
        kvd_snap_waiter_reply(s, j->waiter, e, &r, err);
        kvd_snap_waiter_free(&j->waiter);
    }
}

/* The next slice: staged here and handed to a worker. Returns 1 while the job goes on (a
 * write queued, or held by KVD_TEST_SNAPSHOT_HOLD), 0 when it has ended here — finished, a
 * sticky error, or no worker to queue on (the rest is then written synchronously); the caller
 * frees it. */
static int kvd_snap_job_step(kvd_snap_job_t *j)
{
    kvd_server_t *s = j->s;
    if (!kvd_snap_writer_finished(j->w)) {
        if (s->snap_hold && j->slices >= s->snap_hold)
            return 1; /* test hook: in flight until kvd_server_stop completes it */
        /* a fill error is sticky: the queued flush then removes the .tmp off the loop */
        kvd_snap_writer_fill(j->w, s->core);
        if (uv_queue_work(s->loop, &j->req, kvd_snap_job_work, kvd_snap_job_after) == 0) {
            j->queued = 1;
            return 1;
        }
        kvd_snap_writer_run(j->w, s->core); /* no worker: the rest here, blocking */
    }
    kvd_snap_job_end(j, j->why);
    return 0;
}

static void kvd_snap_job_after(uv_work_t *req, int status)
{
    kvd_snap_job_t *j = req->data;
    (void)status; /* never cancelled: uv_cancel is not used */
    j->queued = 0;
    if (j->abandoned) { /* kvd_server_stop finished the write (and answered) itself */
        kvd_snap_job_free(j);
        return;
    }
    j->slices++;
    j->s->snap_slices++;
    if (!kvd_snap_job_step(j))
        kvd_snap_job_free(j);
}

/* Start a sliced write: the timer's (waiter NULL) or kvctl's (the job takes the waiter). Returns
 * KV_ERR_OK when the job started — it may already have ended, waiter answered — or begin's
 * error with err filled: no job, nothing booked, the waiter still the caller's. */
static int kvd_snap_job_start(kvd_server_t *s, const char *why, kvd_snap_waiter_t *waiter,
                              char *err, size_t errlen)
{
    kvd_snap_job_t *j = calloc(1, sizeof *j);
    if (!j || uv_mutex_init(&j->mu) != 0) {
        free(j);
        snprintf(err, errlen, "out of memory for the snapshot job");
        return KV_ERR_NOMEM;
    }
    j->s = s;
    j->req.data = j;
    j->why = why;
    j->mark = kvd_cache_mark(s);
    int e = kvd_snap_writer_begin(&j->w, s->core, s->cfg->snapshot_dir, &s->snap_id, err, errlen);
    if (e != KV_ERR_OK) {
        kvd_snap_job_free(j);
        return e;
    }
    j->waiter = waiter;
    s->snap_job = j;
    if (!kvd_snap_job_step(j))
        kvd_snap_job_free(j);
    return KV_ERR_OK;
}

static void kvd_snapshot_cb(uv_timer_t *t)
{
    kvd_server_t *s = t->data;
    if (s->snap_job || kvd_cache_mark(s) == s->snap_mark)
        return; /* one in flight (the next tick retries), or nothing changed since the last */
    char err[1024];
    int e = kvd_snap_job_start(s, "timer", NULL, err, sizeof err);
    if (e != KV_ERR_OK) {
        kvd_snap_result_t r;
        memset(&r, 0, sizeof r);
        kvd_server_snapshot_done(s, "timer", 0, e, &r, err);
    }
}

/* At stop: the snapshot in flight (periodic or kvctl) is finished synchronously (the worker's
 * current write, if any, first: mu), its kvctl waiter answered, so the shutdown path below
 * sees its result. */
static void kvd_snap_job_finish_now(kvd_server_t *s)
{
    kvd_snap_job_t *j = s->snap_job;
    if (!j)
        return;
    uv_mutex_lock(&j->mu);
    j->abandoned = 1; /* from here on the worker leaves the writer alone */
    uv_mutex_unlock(&j->mu);
    if (j->waiter)
        s->reply_at_stop = 1; /* kvd_server_free lets the router flush that reply */
    kvd_snap_writer_run(j->w, s->core);
    char why[64];
    snprintf(why, sizeof why, "%s, completed at shutdown", j->why);
    kvd_snap_job_end(j, why);
    if (!j->queued) /* else libuv still owns j->req: after_work frees the job */
        kvd_snap_job_free(j);
}

static void kvd_snap_refused_log(void *ud, const char *line)
{
    KVD_LOGW("snapshot refused, trying the next older generation: %s", line);
}

/* At start, before any client can attach: the newest generation that passes every check. */
static void kvd_server_snapshot_load(kvd_server_t *s)
{
    kvd_snap_result_t r;
    char err[1024];
    int e = kvd_snap_load(s->core, s->cfg->snapshot_dir, &s->snap_id, kvd_snap_refused_log, s,
                          &r, err, sizeof err);
    s->snap_load_refused = r.refused;
    s->snap_load_ms = r.ns / 1000000u;
    s->snap_mark = kvd_cache_mark(s);
    if (e != KV_ERR_OK) {
        KVD_LOGE("snapshot load: %s; the cache starts empty", err);
        return;
    }
    s->snap_load_pages = r.pages;
    s->snap_load_skipped = r.skipped;
    if (r.path[0])
        KVD_LOGI("snapshot loaded: generation %" PRIu64 " from %s: %" PRIu64 " pages restored, "
                 "%" PRIu64 " left out (no room), %.1f MB in %.1f ms (%.0f MB/s)",
                 r.generation, r.path, r.pages, r.skipped, (double)r.bytes / 1e6,
                 (double)r.ns / 1e6, kvd_mbps(r.bytes, r.ns));
    else if (r.refused)
        KVD_LOGW("snapshot: all %u generations in %s refused; the cache starts empty", r.refused,
                 s->cfg->snapshot_dir);
    else
        KVD_LOGI("snapshot: none in %s yet; the cache starts empty", s->cfg->snapshot_dir);
}

/* ---- arena ------------------------------------------------------------------------------- */
static void *ar_alloc(kvd_server_t *s, size_t n)
{
    if (s->ar_fail) /* test hook (KVD_TEST_REPLY_NOMEM): as if calloc had failed */
        return NULL;
    kvd_arena_t *a = calloc(1, sizeof *a + (n ? n : 1));
    if (!a)
        return NULL;
    a->next = s->arena;
    s->arena = a;
    return a->data;
}

static char *ar_strdup(kvd_server_t *s, const char *str)
{
    size_t n = strlen(str);
    char *p = ar_alloc(s, n + 1);
    if (p)
        memcpy(p, str, n + 1);
    return p;
}

static void ar_reset(kvd_server_t *s)
{
    while (s->arena) {
        kvd_arena_t *a = s->arena;
        s->arena = a->next;
        free(a);
    }
}

/* ---- sessions ---------------------------------------------------------------------------- */
/* The session of a message: its routing id AND, where the kernel reported the sender (every
 * ipc peer, through ZAP), the pid that opened the session. The routing id alone is the
 * client's choice (ZMQ_ROUTING_ID): another admitted process that connected with the id of one
 * that had closed its socket would otherwise act on that process's session (release its
 * pages, seal, append). pid < 0: no credentials, routing id only. */
static kvd_sess_t *kvd_sess_by_rid(kvd_server_t *s, const uint8_t *rid, size_t len, int32_t pid)
{
    /* Linear: sessions are engine processes on one host (tens); a hash map would cost more in
     * code than it saves in nanoseconds. */
    for (kvd_sess_t *x = s->sessions; x; x = x->next)
        if (x->rid_len == len && memcmp(x->rid, rid, len) == 0 && (pid < 0 || x->pid == pid))
            return x;
    return NULL;
}

static kvd_sess_t *kvd_sess_by_sid(kvd_server_t *s, uint64_t sid)
{
    for (kvd_sess_t *x = s->sessions; x; x = x->next)
        if (x->sid == sid)
            return x;
    return NULL;
}

static kvd_sess_t *kvd_sess_by_pid(kvd_server_t *s, int32_t pid)
{
    for (kvd_sess_t *x = s->sessions; x; x = x->next)
        if (x->pid == pid)
            return x;
    return NULL;
}

static void kvd_sess_closed(uv_handle_t *h)
{
    kvd_sess_t *x = h->data;
    close(x->pidfd);
    free(x);
}

static void kvd_sess_unlink(kvd_server_t *s, kvd_sess_t *x)
{
    for (kvd_sess_t **pp = &s->sessions; *pp; pp = &(*pp)->next)
        if (*pp == x) {
            *pp = x->next;
            s->nsessions--;
            break;
        }
}

/* The pidfd is readable: the process has exited. This is the only reclaim path. */
static void kvd_sess_exit_cb(uv_poll_t *h, int status, int events)
{
    kvd_sess_t *x = h->data;
    kvd_server_t *s = x->srv;
    kvd_session_info_t si;
    memset(&si, 0, sizeof si);
    kvd_core_session_info(s->core, x->sid, &si);
    uint64_t t0 = kvd_mono_ns();
    int e = kvd_core_session_close(s->core, x->sid);
    KVD_LOGI("session %" PRIu64 " (pid %d) exited: reclaimed %" PRIu64 " refs in %.3f ms%s%s",
             x->sid, (int)x->pid, si.loose_refs + si.seq_refs, (double)(kvd_mono_ns() - t0) / 1e6,
             e ? ": " : "", e ? kvd_core_errmsg(s->core) : "");
    kvd_sess_unlink(s, x);
    uv_poll_stop(h);
    uv_close((uv_handle_t *)h, kvd_sess_closed);
}

/* ---- reply helpers ----------------------------------------------------------------------- */
typedef struct kvd_req_ctx_s {
    kvd_server_t *s;
    kvd_sess_t *sess;
    const Kvd__Request *req;
    Kvd__Reply *rep;
    uint32_t uid, gid;
    int32_t pid;
    int have_cred;
    const uint8_t *rid;
    size_t rid_len;
    zmq_msg_t *env; /* the routing envelope: [nenv] frames before the payload */
    int nenv;
    uint64_t id, t0; /* request id; receipt time */
    int deferred;    /* the handler answers later itself (kvctl snapshot): no reply now */
    char msg[1024];
} kvd_req_ctx_t;

static kv_err_t kvd_fail(kvd_req_ctx_t *c, kv_err_t e, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static kv_err_t kvd_fail(kvd_req_ctx_t *c, kv_err_t e, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->msg, sizeof c->msg, fmt, ap);
    va_end(ap);
    return e;
}

/* Wrap a core error: its message is the reply's. */
static kv_err_t kvd_core_fail(kvd_req_ctx_t *c, int e)
{
    snprintf(c->msg, sizeof c->msg, "%s", kvd_core_errmsg(c->s->core));
    return (kv_err_t)e;
}

#define KVD_BODY(c, Type, INIT, field, CASE)                                                       \
    Type *b_ = ar_alloc((c)->s, sizeof(Type));                                                     \
    if (!b_)                                                                                       \
        return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");                      \
    *b_ = (Type)INIT;                                                                              \
    (c)->rep->body_case = KVD__REPLY__BODY_##CASE;                                                 \
    (c)->rep->field = b_

static Kvd__Geometry *kvd_geom_msg(kvd_server_t *s, const kv_geom_t *g)
{
    Kvd__Geometry *m = ar_alloc(s, sizeof *m);
    if (!m)
        return NULL;
    *m = (Kvd__Geometry)KVD__GEOMETRY__INIT;
    m->layers = g->layers;
    m->kv_heads = g->kv_heads;
    m->head_dim = g->head_dim;
    m->page_tokens = g->page_tokens;
    m->seed = g->seed;
    return m;
}

/* ---- engine operations ------------------------------------------------------------------- */
static kv_err_t kvd_op_hello(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    const Kvd__HelloReq *h = c->req->hello;
    /* drain refuses new sessions; a second hello of a connection returns the one it has */
    if (s->draining && !c->sess)
        return kvd_fail(c, KV_ERR_DRAINING, "the daemon is draining: no new sessions");
    if (!c->have_cred)
        return kvd_fail(c, KV_ERR_PERMISSION_DENIED,
                        "no kernel credentials for this connection (ipc transport only)");
    if (h->namespace_ && h->namespace_[0] && strcmp(h->namespace_, s->cfg->namespace) != 0)
        return kvd_fail(c, KV_ERR_NOT_FOUND, "namespace '%s' is not served here (this daemon "
                        "serves '%s')", h->namespace_, s->cfg->namespace);
    const kvd_export_t *ex = kvd_core_export(s->core);
    if (h->geometry) {
        const Kvd__Geometry *g = h->geometry;
        if (g->layers != ex->geom.layers || g->kv_heads != ex->geom.kv_heads ||
            g->head_dim != ex->geom.head_dim || g->page_tokens != ex->geom.page_tokens ||
            g->seed != ex->geom.seed)
            return kvd_fail(c, KV_ERR_GEOMETRY_MISMATCH,
                            "client geometry %u layers x %u heads x %u dim, %u tokens/page, seed "
                            "%" PRIu64 "; namespace has %u x %u x %u, %u, seed %" PRIu64,
                            g->layers, g->kv_heads, g->head_dim, g->page_tokens, g->seed,
                            ex->geom.layers, ex->geom.kv_heads, ex->geom.head_dim,
                            ex->geom.page_tokens, ex->geom.seed);
    }
    /* the whole reply before a session is opened: a NOMEM must not leave one behind */
    KVD_BODY(c, Kvd__HelloRep, KVD__HELLO_REP__INIT, hello, HELLO);
    b_->geometry = kvd_geom_msg(s, &ex->geom);
    b_->fd_socket = s->fds_path;
    b_->lease_ms = (uint32_t)s->cfg->lease_ms;
    b_->instance = s->instance;
    b_->events_endpoint = s->cfg->events_endpoint;
    b_->max_msg_bytes = s->msg_bytes;
    /* what the request gate enforces now (s->lim follows the config table at every config
     * set); a later `kvctl config set` can lower them, so clients still handle a refusal */
    b_->max_alloc = s->lim.max_alloc;
    b_->max_tokens = s->lim.max_tokens;
    b_->backend = (char *)ex->backend; /* how the client imports the fds (kvc_cuda.c) */
    Kvd__PoolDesc **pd = ar_alloc(s, sizeof(*pd) * (KV_FMT_COUNT + 1));
    if (!pd || !b_->geometry)
        return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");
    size_t np = 0;
    uint32_t fdi = 0;
    Kvd__PoolDesc *d = ar_alloc(s, sizeof *d);
    if (!d)
        return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");
    *d = (Kvd__PoolDesc)KVD__POOL_DESC__INIT;
    d->kind = KVD__POOL_DESC__KIND__KIND_DIRECTORY;
    d->pages = ex->dir_entries;
    d->bytes = ex->dir_bytes;
    d->fd_index = fdi++;
    pd[np++] = d;
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        if (!ex->pages[f] || ex->pool_fd[f] < 0)
            continue;
        d = ar_alloc(s, sizeof *d);
        if (!d)
            return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");
        *d = (Kvd__PoolDesc)KVD__POOL_DESC__INIT;
        d->kind = KVD__POOL_DESC__KIND__KIND_POOL;
        d->format = (Kvd__Format)f;
        d->pages = ex->pages[f];
        d->page_bytes = ex->page_bytes[f];
        d->bytes = ex->pool_bytes[f];
        d->fd_index = fdi++;
        pd[np++] = d;
    }
    b_->pools = pd;
    b_->n_pools = np;
    kvd_sess_t *x = c->sess;
    if (!x) {
        uint64_t mine = 0; /* sessions of this process: each keeps a pidfd until it exits */
        for (kvd_sess_t *y = s->sessions; y; y = y->next)
            mine += y->pid == c->pid;
        if (mine >= s->cfg->max_sessions_per_pid)
            return kvd_fail(c, KV_ERR_RESOURCE_EXHAUSTED,
                            "process %d already holds %" PRIu64 " sessions (max_sessions_per_pid "
                            "%" PRIu64 "); a session ends when its process exits",
                            (int)c->pid, mine, s->cfg->max_sessions_per_pid);
        x = calloc(1, sizeof *x);
        if (!x)
            return kvd_fail(c, KV_ERR_NOMEM, "out of memory opening a session");
        x->pidfd = (int)syscall(SYS_pidfd_open, (pid_t)c->pid, 0);
        if (x->pidfd < 0) {
            int en = errno;
            free(x);
            if (en == ESRCH)
                return kvd_fail(c, KV_ERR_FAILED_PRECONDITION, "process %d has already exited",
                                (int)c->pid);
            return kvd_fail(c, KV_ERR_INTERNAL, "pidfd_open(%d) failed: %s", (int)c->pid,
                            strerror(en));
        }
        int e = kvd_core_session_open(s->core, c->pid, c->uid, &x->sid);
        if (e != KV_ERR_OK) {
            close(x->pidfd);
            free(x);
            return kvd_core_fail(c, e);
        }
        x->srv = s;
        x->pid = c->pid;
        x->uid = c->uid;
        x->gid = c->gid;
        memcpy(x->rid, c->rid, c->rid_len);
        x->rid_len = c->rid_len;
        x->connected = 1;
        uv_poll_init(s->loop, &x->poll, x->pidfd);
        x->poll.data = x;
        uv_poll_start(&x->poll, UV_READABLE, kvd_sess_exit_cb);
        x->next = s->sessions;
        s->sessions = x;
        s->nsessions++;
        c->sess = x;
        KVD_LOGI("session %" PRIu64 " opened: pid %d uid %u gid %u '%s'", x->sid, (int)x->pid,
                 x->uid, x->gid, h->client_name ? h->client_name : "");
    }
    snprintf(x->name, sizeof x->name, "%s", h->client_name ? h->client_name : "");
    x->last_ns = kvd_mono_ns();

    b_->session_id = x->sid;
    b_->pid = (uint32_t)x->pid;
    b_->epoch = kvd_core_epoch(s->core);
    return KV_ERR_OK;
}

static kv_err_t kvd_op_alloc(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    const Kvd__AllocReq *a = c->req->alloc;
    if (s->draining)
        return kvd_fail(c, KV_ERR_DRAINING, "the daemon is draining: no new pages");
    if (a->format != KVD__FORMAT__FORMAT_FP8)
        return kvd_fail(c, KV_ERR_INVALID_ARGUMENT,
                        "alloc: clients allocate FP8 pages only (TQ3 pages come from retier)");
    KVD_BODY(c, Kvd__AllocRep, KVD__ALLOC_REP__INIT, alloc, ALLOC);
    b_->pages = ar_alloc(s, sizeof(uint32_t) * a->count);
    if (!b_->pages)
        return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");
    /* reserve > count: the core checks the pool for the whole chunked allocation first */
    int e = kvd_core_alloc_reserve(s->core, c->sess->sid, a->count, a->reserve, b_->pages);
    if (e != KV_ERR_OK)
        return kvd_core_fail(c, e);
    b_->n_pages = a->count;
    return KV_ERR_OK;
}

static kv_err_t kvd_op_seal(kvd_req_ctx_t *c)
{
    const Kvd__SealReq *r = c->req->seal;
    if (c->s->draining)
        return kvd_fail(c, KV_ERR_DRAINING, "the daemon is draining: no new cache entries");
    uint8_t hash[KVD_HASH_BYTES];
    uint32_t canon = KVD_NONE;
    KVD_BODY(c, Kvd__SealRep, KVD__SEAL_REP__INIT, seal, SEAL);
    int e = kvd_core_seal(c->s->core, c->sess->sid, r->page, r->has_prev ? r->prev : KVD_NONE,
                          r->tokens, (uint32_t)r->n_tokens, r->extra.data, r->extra.len, hash,
                          &canon);
    if (e != KV_ERR_OK)
        return kvd_core_fail(c, e);
    b_->page = canon;
    b_->deduplicated = canon != r->page;
    return KV_ERR_OK;
}

static kv_err_t kvd_op_lookup(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    const Kvd__LookupReq *r = c->req->lookup;
    uint32_t pt = kvd_core_export(s->core)->geom.page_tokens;
    uint32_t ntok = (uint32_t)(r->tokens.len / 4);
    uint32_t max = ntok / pt;
    /* tokens arrive as little-endian bytes (kvproto.h); copy into an aligned array */
    if (ntok > s->tok_cap) {
        uint32_t *nb = realloc(s->tok_buf, sizeof(uint32_t) * ntok);
        if (!nb)
            return kvd_fail(c, KV_ERR_NOMEM, "out of memory for %u lookup tokens", ntok);
        s->tok_buf = nb;
        s->tok_cap = ntok;
    }
    const uint32_t *tokens = s->tok_buf;
    if (ntok)
        memcpy(s->tok_buf, r->tokens.data, r->tokens.len);
    if (max + 1 > s->lookup_cap) {
        uint32_t *nb = realloc(s->lookup_buf, sizeof(uint32_t) * (max + 1));
        if (!nb)
            return kvd_fail(c, KV_ERR_NOMEM, "out of memory for %u lookup pages", max);
        s->lookup_buf = nb;
        s->lookup_cap = max + 1;
    }
    uint32_t np = 0, nt = 0;
    int e;
    KVD_BODY(c, Kvd__LookupRep, KVD__LOOKUP_REP__INIT, lookup, LOOKUP);
    if (r->peek) {
        /* peek: walk the chain with cache_find, take nothing */
        uint8_t h[KVD_HASH_BYTES], prev[KVD_HASH_BYTES];
        for (uint32_t i = 0; i < max; i++) {
            kvd_core_chain_hash(s->core, i ? prev : NULL, tokens + (uint64_t)i * pt, pt,
                                r->extra.data, r->extra.len, h);
            uint32_t lg;
            if (kvd_core_cache_find(s->core, h, &lg) != KV_ERR_OK)
                break;
            s->lookup_buf[np++] = lg;
            memcpy(prev, h, sizeof prev);
        }
        nt = np * pt;
    } else {
        e = kvd_core_lookup(s->core, c->sess->sid, tokens, ntok,
                            r->extra.data, r->extra.len, s->lookup_buf, max, &np, &nt);
        if (e != KV_ERR_OK)
            return kvd_core_fail(c, e);
    }
    b_->pages = s->lookup_buf;
    b_->n_pages = np;
    b_->tokens_matched = nt;
    return KV_ERR_OK;
}

static kv_err_t kvd_op_release(kvd_req_ctx_t *c)
{
    const Kvd__ReleaseReq *r = c->req->release;
    KVD_BODY(c, Kvd__ReleaseRep, KVD__RELEASE_REP__INIT, release, RELEASE);
    int e = kvd_core_release(c->s->core, c->sess->sid, r->pages, (uint32_t)r->n_pages);
    if (e != KV_ERR_OK)
        return kvd_core_fail(c, e);
    b_->released = (uint32_t)r->n_pages;
    return KV_ERR_OK;
}

static kv_err_t kvd_op_seq_open(kvd_req_ctx_t *c)
{
    if (c->s->draining)
        return kvd_fail(c, KV_ERR_DRAINING, "the daemon is draining: no new sequences");
    uint64_t seq;
    KVD_BODY(c, Kvd__SeqOpenRep, KVD__SEQ_OPEN_REP__INIT, seq_open, SEQ_OPEN);
    int e = kvd_core_seq_open(c->s->core, c->sess->sid, &seq);
    if (e != KV_ERR_OK)
        return kvd_core_fail(c, e);
    b_->seq_id = seq;
    return KV_ERR_OK;
}

static kv_err_t kvd_op_seq_append(kvd_req_ctx_t *c)
{
    const Kvd__SeqAppendReq *r = c->req->seq_append;
    KVD_BODY(c, Kvd__SeqAppendRep, KVD__SEQ_APPEND_REP__INIT, seq_append, SEQ_APPEND);
    int e = kvd_core_seq_append(c->s->core, c->sess->sid, r->seq_id, r->pages,
                                (uint32_t)r->n_pages);
    if (e != KV_ERR_OK)
        return kvd_core_fail(c, e);
    uint32_t n = 0;
    kvd_core_seq_pages(c->s->core, r->seq_id, NULL, 0, &n, NULL);
    b_->length = n;
    return KV_ERR_OK;
}

static kv_err_t kvd_op_seq_close(kvd_req_ctx_t *c)
{
    const Kvd__SeqCloseReq *r = c->req->seq_close;
    uint32_t n = 0;
    uint64_t owner = 0;
    if (kvd_core_seq_pages(c->s->core, r->seq_id, NULL, 0, &n, &owner) != KV_ERR_OK ||
        owner != c->sess->sid)
        return kvd_fail(c, KV_ERR_NOT_FOUND, "seq_close: sequence %" PRIu64
                        " is not open in this session", r->seq_id);
    KVD_BODY(c, Kvd__SeqCloseRep, KVD__SEQ_CLOSE_REP__INIT, seq_close, SEQ_CLOSE);
    int e = kvd_core_seq_close(c->s->core, c->sess->sid, r->seq_id);
    if (e != KV_ERR_OK)
        return kvd_core_fail(c, e);
    b_->length = n;
    return KV_ERR_OK;
}

static kv_err_t kvd_op_heartbeat(kvd_req_ctx_t *c)
{
    const Kvd__HeartbeatReq *r = c->req->heartbeat;
    KVD_BODY(c, Kvd__HeartbeatRep, KVD__HEARTBEAT_REP__INIT, heartbeat, HEARTBEAT);
    if (r->completed_epoch) {
        int e = kvd_core_session_report_epoch(c->s->core, c->sess->sid, r->completed_epoch);
        if (e != KV_ERR_OK)
            return kvd_core_fail(c, e);
    }
    b_->epoch = kvd_core_epoch(c->s->core);
    b_->lease_ms = (uint32_t)c->s->cfg->lease_ms;
    return KV_ERR_OK;
}

/* The client ends its session (GoodbyeReq: none of its kernels is in flight), as its exit
 * would, so that an engine closing one of several clients does not keep a session that holds
 * back recycling and counts against max_sessions_per_pid until the process ends. */
static kv_err_t kvd_op_goodbye(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    kvd_sess_t *x = c->sess;
    kvd_session_info_t si;
    memset(&si, 0, sizeof si);
    kvd_core_session_info(s->core, x->sid, &si);
    /* the reply first: a NOMEM after the close would tell the client it still has a session */
    KVD_BODY(c, Kvd__GoodbyeRep, KVD__GOODBYE_REP__INIT, goodbye, GOODBYE);
    b_->released = si.loose_refs + si.seq_refs;
    int e = kvd_core_session_close(s->core, x->sid);
    KVD_ASSERT(e == KV_ERR_OK); /* fails only for an unknown sid, and x names a live one */
    KVD_LOGI("session %" PRIu64 " (pid %d '%s') said goodbye: released %" PRIu64 " refs",
             x->sid, (int)x->pid, x->name, si.loose_refs + si.seq_refs);
    kvd_sess_unlink(s, x);
    uv_poll_stop(&x->poll);
    uv_close((uv_handle_t *)&x->poll, kvd_sess_closed); /* x is freed on the next iteration */
    c->sess = NULL;
    return KV_ERR_OK;
}

/* ---- admin operations -------------------------------------------------------------------- */
static kv_err_t kvd_op_status(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    kvd_stats_t st;
    kvd_server_stats(s, &st);
    KVD_BODY(c, Kvd__StatusRep, KVD__STATUS_REP__INIT, status_rep, STATUS_REP);
    b_->version = ar_strdup(s, "kvd 0.1.0 protocol 1");
    b_->uptime_ms = (kvd_mono_ns() - s->start_ns) / 1000000u;
    b_->epoch = kvd_core_epoch(s->core);
    b_->sessions = s->nsessions;
    b_->draining = s->draining != 0;
    const kvd_export_t *ex = kvd_core_export(s->core);
    b_->geometry = kvd_geom_msg(s, &ex->geom);
    b_->namespace_ = s->cfg->namespace;
    b_->backend = (char *)ex->backend;
    size_t n = 0, cap = 0;
#define KVD_CNT_(name, kind, help) cap++;
    KVD_STATS_MAP(KVD_CNT_)
#undef KVD_CNT_
#define KVD_CNT_(name, kind, help) cap += KV_FMT_COUNT;
    KVD_STATS_FMT_MAP(KVD_CNT_)
#undef KVD_CNT_
    Kvd__Stat *arr = ar_alloc(s, sizeof *arr * cap);
    Kvd__Stat **ptr = ar_alloc(s, sizeof *ptr * cap);
    if (!arr || !ptr || !b_->version || !b_->geometry)
        return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");
#define KVD_ST_(nm, kind, hl)                                                                      \
    arr[n] = (Kvd__Stat)KVD__STAT__INIT;                                                           \
    arr[n].name = (char *)#nm;                                                                     \
    arr[n].value = st.nm;                                                                          \
    arr[n].help = (char *)hl;                                                                      \
    ptr[n] = &arr[n];                                                                              \
    n++;
    KVD_STATS_MAP(KVD_ST_)
#undef KVD_ST_
#define KVD_ST_(nm, kind, hl)                                                                      \
    for (int f = 0; f < KV_FMT_COUNT; f++) {                                                       \
        arr[n] = (Kvd__Stat)KVD__STAT__INIT;                                                       \
        arr[n].name = ar_strdup(s, f == KV_FMT_FP8 ? #nm ".fp8" : #nm ".tq3");                     \
        arr[n].value = st.nm[f];                                                                   \
        arr[n].help = (char *)hl;                                                                  \
        ptr[n] = &arr[n];                                                                          \
        if (!arr[n].name)                                                                          \
            return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");                  \
        n++;                                                                                       \
    }
    KVD_STATS_FMT_MAP(KVD_ST_)
#undef KVD_ST_
    b_->stats = ptr;
    b_->n_stats = n;
    return KV_ERR_OK;
}

static kv_err_t kvd_op_sessions(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    KVD_BODY(c, Kvd__SessionsRep, KVD__SESSIONS_REP__INIT, sessions, SESSIONS);
    Kvd__SessionInfo **ptr = ar_alloc(s, sizeof *ptr * (s->nsessions + 1));
    if (!ptr)
        return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");
    size_t n = 0;
    uint64_t now = kvd_mono_ns();
    for (kvd_sess_t *x = s->sessions; x; x = x->next) {
        Kvd__SessionInfo *m = ar_alloc(s, sizeof *m);
        if (!m)
            return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");
        *m = (Kvd__SessionInfo)KVD__SESSION_INFO__INIT;
        kvd_session_info_t si;
        memset(&si, 0, sizeof si);
        kvd_core_session_info(s->core, x->sid, &si);
        m->id = x->sid;
        m->pid = (uint32_t)x->pid;
        m->uid = x->uid;
        m->gid = x->gid;
        m->client_name = x->name;
        m->refs = si.loose_refs + si.seq_refs;
        m->sequences = si.sequences;
        m->completed_epoch = si.safe_epoch;
        m->idle_ms = (now - x->last_ns) / 1000000u;
        m->lease_expired = m->idle_ms > s->cfg->lease_ms;
        m->connected = x->connected != 0;
        m->exited = 0;
        m->fenced = x->fenced != 0;
        ptr[n++] = m;
    }
    b_->sessions = ptr;
    b_->n_sessions = n;
    return KV_ERR_OK;
}

typedef struct kvd_cache_walk_s {
    kvd_server_t *s;
    Kvd__CacheEntry **ptr;
    size_t n, cap;
    uint64_t total;
    int oom;
    /* evict all: collect candidates */
    uint32_t *evict;
} kvd_cache_walk_t;

static void kvd_cache_ls_cb(const kvd_page_info_t *p, void *ud)
{
    kvd_cache_walk_t *w = ud;
    w->total++;
    if (w->n >= w->cap || w->oom)
        return;
    Kvd__CacheEntry *m = ar_alloc(w->s, sizeof *m);
    uint8_t *h = ar_alloc(w->s, KVD_HASH_BYTES);
    if (!m || !h) {
        w->oom = 1;
        return;
    }
    *m = (Kvd__CacheEntry)KVD__CACHE_ENTRY__INIT;
    m->page = p->logical;
    m->format = (Kvd__Format)p->fmt;
    memcpy(h, p->hash, KVD_HASH_BYTES);
    m->hash.data = h;
    m->hash.len = KVD_HASH_BYTES;
    m->refs = p->req_loose + p->req_seq;
    m->pinned = p->pins > 0;
    m->last_use = p->last_use_ns;
    w->ptr[w->n++] = m;
}

static kv_err_t kvd_op_cache_ls(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    uint32_t limit = c->req->cache_ls->limit ? c->req->cache_ls->limit : 1000;
    if (limit > 100000)
        limit = 100000;
    KVD_BODY(c, Kvd__CacheLsRep, KVD__CACHE_LS_REP__INIT, cache_ls, CACHE_LS);
    kvd_cache_walk_t w = {.s = s, .cap = limit};
    w.ptr = ar_alloc(s, sizeof *w.ptr * limit);
    if (!w.ptr)
        return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");
    kvd_core_cache_foreach(s->core, kvd_cache_ls_cb, &w);
    if (w.oom)
        return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");
    b_->entries = w.ptr;
    b_->n_entries = w.n;
    b_->total = w.total;
    return KV_ERR_OK;
}

static void kvd_cache_evictable_cb(const kvd_page_info_t *p, void *ud)
{
    kvd_cache_walk_t *w = ud;
    if (p->on_lru && p->pins == 0 && w->n < w->cap)
        w->evict[w->n++] = p->logical;
}

static kv_err_t kvd_op_cache_evict(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    const Kvd__CacheEvictReq *r = c->req->cache_evict;
    uint32_t evicted = 0;
    KVD_BODY(c, Kvd__CacheEvictRep, KVD__CACHE_EVICT_REP__INIT, cache_evict, CACHE_EVICT);
    if (r->all) {
        kvd_stats_t st;
        kvd_core_stats(s->core, &st);
        kvd_cache_walk_t w = {.s = s, .cap = st.cache_entries + 1};
        w.evict = malloc(sizeof(uint32_t) * w.cap);
        if (!w.evict)
            return kvd_fail(c, KV_ERR_NOMEM, "out of memory");
        kvd_core_cache_foreach(s->core, kvd_cache_evictable_cb, &w);
        for (size_t i = 0; i < w.n; i++)
            if (kvd_core_cache_evict(s->core, w.evict[i]) == KV_ERR_OK)
                evicted++;
        free(w.evict);
    } else {
        int e = kvd_core_cache_evict(s->core, r->page);
        if (e != KV_ERR_OK)
            return kvd_core_fail(c, e);
        evicted = 1;
    }
    b_->evicted = evicted;
    return KV_ERR_OK;
}

static kv_err_t kvd_op_cache_pin(kvd_req_ctx_t *c)
{
    const Kvd__CachePinReq *r = c->req->cache_pin;
    KVD_BODY(c, Kvd__CachePinRep, KVD__CACHE_PIN_REP__INIT, cache_pin, CACHE_PIN);
    (void)b_;
    int e = r->pin ? kvd_core_pin(c->s->core, r->page) : kvd_core_unpin(c->s->core, r->page);
    if (e != KV_ERR_OK)
        return kvd_core_fail(c, e);
    return KV_ERR_OK;
}

static kv_err_t kvd_op_page_info(kvd_req_ctx_t *c)
{
    kvd_page_info_t p;
    int e = kvd_core_page_info(c->s->core, c->req->page_info->page, &p);
    if (e != KV_ERR_OK)
        return kvd_core_fail(c, e);
    KVD_BODY(c, Kvd__PageInfoRep, KVD__PAGE_INFO_REP__INIT, page_info, PAGE_INFO);
    b_->page = p.logical;
    b_->state = (char *)kvd_page_state_name(p.state);
    b_->format = (Kvd__Format)p.fmt;
    b_->phys = p.phys;
    b_->refs = p.req_loose + p.req_seq;
    b_->sealed = p.state == KVD_PAGE_SEALED;
    b_->pinned = p.pins > 0;
    b_->retire_epoch = p.stamp;
    uint8_t *h = ar_alloc(c->s, KVD_HASH_BYTES);
    char *det = ar_alloc(c->s, 256);
    if (!h || !det)
        return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");
    memcpy(h, p.hash, KVD_HASH_BYTES);
    b_->hash.data = h;
    b_->hash.len = KVD_HASH_BYTES;
    b_->generation = (uint32_t)kv_dir_gen(kvd_core_backend(c->s->core)->dir[p.logical]);
    snprintf(det, 256,
             "loose=%u seq=%u cache=%u pins=%u conv=%u on_lru=%d owner_session=%" PRIu64,
             p.req_loose, p.req_seq, p.cache, p.pins, p.conv, p.on_lru, p.owner_sid);
    b_->detail = det;
    return KV_ERR_OK;
}

#define KVD_CONFIG_VALUE_MAX 4200

/* An empty item with room for any value: config_set allocates it before it changes anything. */
static Kvd__ConfigItem *kvd_config_item_alloc(kvd_server_t *s)
{
    Kvd__ConfigItem *m = ar_alloc(s, sizeof *m);
    char *v = ar_alloc(s, KVD_CONFIG_VALUE_MAX);
    if (!m || !v)
        return NULL;
    *m = (Kvd__ConfigItem)KVD__CONFIG_ITEM__INIT;
    m->value = v;
    return m;
}

static Kvd__ConfigItem *kvd_config_item_fill(kvd_server_t *s, Kvd__ConfigItem *m,
                                             const kvd_config_desc_t *d)
{
    kvd_config_get(s->cfg, d->name, m->value, KVD_CONFIG_VALUE_MAX);
    m->key = (char *)d->name;
    m->type = (char *)kvd_config_type_name(d->type);
    m->mutable_ = d->mutable_ != 0;
    m->help = (char *)d->help;
    m->default_value = (char *)d->def;
    return m;
}

static Kvd__ConfigItem *kvd_config_item(kvd_server_t *s, const kvd_config_desc_t *d)
{
    Kvd__ConfigItem *m = kvd_config_item_alloc(s);
    return m ? kvd_config_item_fill(s, m, d) : NULL;
}

static kv_err_t kvd_op_config_get(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    const char *key = c->req->config_get->key;
    KVD_BODY(c, Kvd__ConfigGetRep, KVD__CONFIG_GET_REP__INIT, config_get, CONFIG_GET);
    size_t cap = kvd_config_count();
    Kvd__ConfigItem **ptr = ar_alloc(s, sizeof *ptr * cap);
    if (!ptr)
        return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");
    size_t n = 0;
    for (size_t i = 0; i < cap; i++) {
        const kvd_config_desc_t *d = kvd_config_desc(i);
        if (key && key[0] && strcmp(key, d->name) != 0)
            continue;
        if (!(ptr[n++] = kvd_config_item(s, d)))
            return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");
    }
    if (key && key[0] && n == 0)
        return kvd_fail(c, KV_ERR_NOT_FOUND, "unknown directive '%s' (kvctl config get lists them)",
                        key);
    b_->items = ptr;
    b_->n_items = n;
    return KV_ERR_OK;
}

static void kvd_server_apply_config(kvd_server_t *s);

static kv_err_t kvd_op_config_set(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    const Kvd__ConfigSetReq *r = c->req->config_set;
    KVD_BODY(c, Kvd__ConfigSetRep, KVD__CONFIG_SET_REP__INIT, config_set, CONFIG_SET);
    b_->item = kvd_config_item_alloc(s);
    if (!b_->item)
        return kvd_fail(c, KV_ERR_NOMEM, "out of memory building the reply");
    char was[KVD_CONFIG_VALUE_MAX] = "";
    kvd_config_get(s->cfg, r->key, was, sizeof was);
    const uint64_t need0 = kvd_request_bytes_max(&s->lim);
    int e = kvd_config_set(s->cfg, r->key, r->value, 1, c->msg, sizeof c->msg);
    if (e == KVD_CFG_UNKNOWN)
        return KV_ERR_NOT_FOUND;
    if (e == KVD_CFG_IMMUTABLE)
        return KV_ERR_FAILED_PRECONDITION;
    if (e != KVD_CFG_OK)
        return KV_ERR_INVALID_ARGUMENT;
    /* a periodic snapshot without snapshot_dir would be accepted and never written */
    if (!s->persist && !strcmp(r->key, "snapshot_ms") && s->cfg->snapshot_ms) {
        KVD_ASSERT(kvd_config_set(s->cfg, r->key, was, 1, NULL, 0) == KVD_CFG_OK);
        return kvd_fail(c, KV_ERR_FAILED_PRECONDITION,
                        "persistence is off: start kvd with snapshot_dir set (docs/snapshot.md); "
                        "snapshot_ms would do nothing without it");
    }
    /* A bound that lets requests outgrow the messages the control socket admits (fixed when
     * it was bound; less the slack kept for newer clients' fields when derived) is refused:
     * such a request would drop its client's connection, with no reply to say why. Lowering
     * stays allowed, even while still over an explicit max_msg_bytes. The message names the
     * enforced limit, msg_bytes, and the slack apart (it gave msg_bytes less the slack as the
     * socket's size: a figure 4 KiB below the one --help, the docs and the log line give). */
    kvp_limits_t lim = s->lim;
    lim.max_tokens = (uint32_t)s->cfg->max_tokens;
    const uint64_t need = kvd_request_bytes_max(&lim);
    if (s->msg_bytes && need > s->msg_bytes - s->msg_slack && need > need0) {
        KVD_ASSERT(kvd_config_set(s->cfg, r->key, was, 1, NULL, 0) == KVD_CFG_OK);
        char slack[96] = "";
        if (s->msg_slack)
            snprintf(slack, sizeof slack,
                     "; %" PRIu64 " of it kept for fields newer clients append", s->msg_slack);
        return kvd_fail(c, KV_ERR_FAILED_PRECONDITION,
                        "%s = %s allows requests of %" PRIu64 " bytes, more than fit in the "
                        "control socket's max_msg_bytes of %" PRIu64 " bytes (%s at startup%s): "
                        "set both in the config and restart",
                        r->key, r->value, need, s->msg_bytes,
                        s->msg_slack ? "derived and fixed" : "fixed", slack);
    }
    kvd_server_apply_config(s);
    KVD_LOGI("config set %s = %s", r->key, r->value);
    kvd_config_item_fill(s, b_->item, kvd_config_find(r->key));
    return KV_ERR_OK;
}

static kv_err_t kvd_op_drain(kvd_req_ctx_t *c)
{
    KVD_BODY(c, Kvd__DrainRep, KVD__DRAIN_REP__INIT, drain, DRAIN);
    if (!c->s->draining)
        KVD_LOGI("draining: no new sessions, pages, seals or sequences");
    c->s->draining = 1;
    b_->sessions = c->s->nsessions;
    return KV_ERR_OK;
}

static kv_err_t kvd_op_check(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    char *report = ar_alloc(s, 8192);
    if (!report)
        return kvd_fail(c, KV_ERR_NOMEM, "out of memory");
    int bad = kvd_core_check(s->core, report, 8192);
    KVD_BODY(c, Kvd__CheckRep, KVD__CHECK_REP__INIT, check, CHECK);
    b_->ok = bad == 0;
    b_->leaked_pages = (uint64_t)(bad > 0 ? bad : 0);
    if (bad > 0) {
        size_t cap = 64, n = 0;
        char **lines = ar_alloc(s, sizeof *lines * cap);
        if (!lines)
            return kvd_fail(c, KV_ERR_NOMEM, "out of memory");
        for (char *save = NULL, *l = strtok_r(report, "\n", &save); l && n < cap;
             l = strtok_r(NULL, "\n", &save))
            lines[n++] = l;
        b_->problems = lines;
        b_->n_problems = n;
        KVD_LOGE("check: %d invariant violations; first: %s", bad, n ? lines[0] : "?");
    }
    return KV_ERR_OK;
}

/* Off the loop, answered when the write ends (decision 42): the job takes a copy of the
 * envelope and replies from kvd_snap_job_end. */
static kv_err_t kvd_op_snapshot(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    if (!s->persist)
        return kvd_fail(c, KV_ERR_FAILED_PRECONDITION,
                        "persistence is off: start kvd with snapshot_dir set (docs/snapshot.md)");
    if (s->snap_job) /* one at a time; joining it would answer with an older collection */
        return kvd_fail(c, KV_ERR_FAILED_PRECONDITION,
                        "a snapshot is being written, generation %" PRIu64
                        " (%s): try again when it completes",
                        kvd_snap_writer_generation(s->snap_job->w), s->snap_job->why);
    kvd_snap_waiter_t *w = calloc(1, sizeof *w);
    if (!w)
        return kvd_fail(c, KV_ERR_NOMEM, "out of memory for the snapshot request");
    KVD_ASSERT(c->nenv >= 1 && c->nenv <= KVD_MAX_FRAMES - 1);
    for (; w->nenv < c->nenv; w->nenv++) {
        zmq_msg_init(&w->env[w->nenv]);
        if (zmq_msg_copy(&w->env[w->nenv], &c->env[w->nenv]) != 0) {
            zmq_msg_close(&w->env[w->nenv]);
            kvd_snap_waiter_free(&w);
            return kvd_fail(c, KV_ERR_NOMEM, "zmq_msg_copy of the envelope failed: %s",
                            zmq_strerror(errno));
        }
    }
    w->id = c->id;
    w->t0 = c->t0;
    char err[1024];
    int e = kvd_snap_job_start(s, "kvctl", w, err, sizeof err);
    if (e != KV_ERR_OK) { /* no job: the waiter is still ours, the reply goes out now */
        kvd_snap_waiter_free(&w);
        kvd_snap_result_t r;
        memset(&r, 0, sizeof r);
        kvd_server_snapshot_done(s, "kvctl", 0, e, &r, err);
        return kvd_fail(c, (kv_err_t)e, "snapshot failed, previous generations kept: %s", err);
    }
    c->deferred = 1;
    return KV_ERR_OK;
}

/* Republish the whole index on the events socket (docs/protocol.md "Index events"). Published
 * before the reply is built: a router that gets the reply has had every message sent. */
static kv_err_t kvd_op_events_sync(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    if (!s->events)
        return kvd_fail(c, KV_ERR_FAILED_PRECONDITION,
                        "events are off: start kvd with events_endpoint set");
    uint64_t seq;
    uint32_t n;
    KVD_BODY(c, Kvd__EventsSyncRep, KVD__EVENTS_SYNC_REP__INIT, events_sync, EVENTS_SYNC);
    kvd_events_resync(s->events, s->core, &seq, &n);
    b_->seq = seq;
    b_->entries = n;
    return KV_ERR_OK;
}

/* The operator fences a live but silent session (kvd_core_session_fence): its pages stay, it
 * no longer holds back recycling, and it is refused from now on, so that an engine that wakes
 * up learns it may have read recycled pages instead of carrying on. */
static kv_err_t kvd_op_session_fence(kvd_req_ctx_t *c)
{
    kvd_server_t *s = c->s;
    const uint64_t sid = c->req->session_fence->session_id;
    kvd_sess_t *x = kvd_sess_by_sid(s, sid);
    if (!x)
        return kvd_fail(c, KV_ERR_NO_SESSION, "session %" PRIu64 " does not exist", sid);
    KVD_BODY(c, Kvd__SessionFenceRep, KVD__SESSION_FENCE_REP__INIT, session_fence,
             SESSION_FENCE);
    int e = kvd_core_session_fence(s->core, sid);
    if (e != KV_ERR_OK)
        return kvd_core_fail(c, e);
    if (!x->fenced)
        KVD_LOGW("session %" PRIu64 " (pid %d '%s') fenced by the operator: it no longer holds "
                 "back page recycling, its requests are refused, its pages stay until the "
                 "process exits",
                 sid, (int)x->pid, x->name);
    x->fenced = 1;
    kvd_stats_t st;
    kvd_core_stats(s->core, &st);
    b_->session_id = sid;
    b_->min_safe_epoch = st.min_safe_epoch;
    return KV_ERR_OK;
}

typedef kv_err_t (*kvd_op_fn)(kvd_req_ctx_t *c);
static const kvd_op_fn kvd_ops[KVP_OP_COUNT] = {
#define KVD_OP_FN_(cs, nm, sess, adm) kvd_op_##nm,
    KVP_OP_MAP(KVD_OP_FN_)
#undef KVD_OP_FN_
};

/* ---- message loop ------------------------------------------------------------------------ */
static int kvd_send_reply(kvd_server_t *s, zmq_msg_t *frames, int nenv, const Kvd__Reply *rep)
{
    size_t n = kvd__reply__get_packed_size(rep);
    if (n > s->sendcap) {
        uint8_t *nb = realloc(s->sendbuf, n);
        if (!nb)
            return -1;
        s->sendbuf = nb;
        s->sendcap = n;
    }
    kvd__reply__pack(rep, s->sendbuf);
    for (int i = 0; i < nenv; i++)
        if (zmq_send(s->router, zmq_msg_data(&frames[i]), zmq_msg_size(&frames[i]),
                     ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
            return -1;
    return zmq_send(s->router, s->sendbuf, n, ZMQ_DONTWAIT) < 0 ? -1 : 0;
}

/* A reply the client's connection had no room for (reply_hwm replies unread: EAGAIN under
 * ZMQ_ROUTER_MANDATORY). Its request took effect and stays in effect: nothing is undone, since
 * the client may yet read the replies before it, and references an alloc or a lookup took are
 * the session's like any others, released at goodbye or reclaimed when its process exits
 * (DESIGN.md "Ownership": death is process exit). The client sees TIMEOUT for that call. One
 * log line per second at most: a client that never reads would otherwise flood the log. */
static void kvd_reply_dropped(kvd_server_t *s, const zmq_msg_t *rid, kvp_op_t op, uint64_t id)
{
    s->replies_dropped++;
    s->rdrop_unlogged++;
    const uint64_t now = kvd_mono_ns();
    if (s->rdrop_log_ns && now - s->rdrop_log_ns < 1000000000ull)
        return;
    const kvd_sess_t *x = kvd_sess_by_rid(s, zmq_msg_data((zmq_msg_t *)rid),
                                          zmq_msg_size((zmq_msg_t *)rid), -1);
    char who[96] = "a connection without a session";
    if (x)
        snprintf(who, sizeof who, "session %" PRIu64 " (pid %d)", x->sid, (int)x->pid);
    KVD_LOGW("reply to request %" PRIu64 " (%s) of %s dropped: %" PRIu64 " replies already wait "
             "unread (reply_hwm); the request took effect (references it took stay with the "
             "session until goodbye or process exit); %" PRIu64 " replies dropped since the last "
             "such line, %" PRIu64 " in all",
             id, kvp_op_name(op), who, s->cfg->reply_hwm, s->rdrop_unlogged, s->replies_dropped);
    s->rdrop_log_ns = now;
    s->rdrop_unlogged = 0;
}

/* Complete a reply (status, ids, epoch, instance; an error clears the body and carries msg),
 * send it after the envelope and count it in the latency histogram (t0: receipt). */
static void kvd_reply_finish(kvd_server_t *s, zmq_msg_t *env, int nenv, Kvd__Reply *rep,
                             kvp_op_t op, uint64_t id, kv_err_t e, const char *msg, uint64_t t0)
{
    if (e != KV_ERR_OK) {
        rep->body_case = KVD__REPLY__BODY__NOT_SET;
        rep->message = msg && msg[0] ? (char *)msg : (char *)kv_err_msg((int)e);
        KVD_LOGD("request %" PRIu64 " (%s) failed: %s: %s", id, kvp_op_name(op),
                 kv_err_name((int)e), rep->message);
    }
    rep->version = KVP_VERSION;
    rep->id = id;
    rep->status = kvp_status(e);
    rep->epoch = kvd_core_epoch(s->core);
    rep->instance = s->instance; /* lets a client see a restart on any call, admin ones too */
    if (kvd_send_reply(s, env, nenv, rep) != 0) {
        if (errno == EAGAIN)
            kvd_reply_dropped(s, &env[0], op, id);
        else /* EHOSTUNREACH: the client's connection is gone (its process may live on) */
            KVD_LOGD("reply to request %" PRIu64 " not sent: %s", id, zmq_strerror(errno));
    }
    kvd_metrics_observe(&s->metrics, op, kvd_mono_ns() - t0, e);
}

static void kvd_handle_message(kvd_server_t *s)
{
    zmq_msg_t fr[KVD_MAX_FRAMES];
    int nf = 0, more = 1, dropped = 0;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, s->router, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (nf < KVD_MAX_FRAMES)
            fr[nf++] = m; /* zmq_msg_t is movable by value until closed */
        else {
            dropped = 1;
            zmq_msg_close(&m);
        }
    }
    if (nf < 1)
        return;
    uint64_t t0 = kvd_mono_ns();
    if (s->snap_job)
        s->snap_served++; /* answered while a snapshot is written: the loop was not blocked */
    kvd_req_ctx_t c;
    memset(&c, 0, sizeof c);
    c.s = s;
    c.rid = zmq_msg_data(&fr[0]);
    c.rid_len = zmq_msg_size(&fr[0]);
    Kvd__Reply rep = KVD__REPLY__INIT;
    c.rep = &rep;
    Kvd__Request *req = NULL;
    kvp_op_t op = KVP_OP_INVALID;
    uint64_t id = 0;
    kv_err_t e;
    if (nf < 2) {
        e = KV_ERR_MALFORMED;
        snprintf(c.msg, sizeof c.msg, "message has no payload frame");
    } else if (dropped) {
        e = KV_ERR_MALFORMED;
        snprintf(c.msg, sizeof c.msg, "message has more than %d frames", KVD_MAX_FRAMES - 1);
    } else {
        zmq_msg_t *pl = &fr[nf - 1];
        e = kvp_request_decode(zmq_msg_data(pl), zmq_msg_size(pl), &s->lim, &req, &op, &id, c.msg,
                               sizeof c.msg);
        const char *cred = zmq_msg_gets(pl, "User-Id");
        if (cred && kvd_peer_parse(cred, &c.uid, &c.gid, &c.pid) == 0)
            c.have_cred = 1;
    }
    if (e == KV_ERR_OK) {
        c.req = req;
        c.sess = kvd_sess_by_rid(s, c.rid, c.rid_len, c.have_cred ? c.pid : -1);
        if (c.sess)
            c.sess->last_ns = t0;
        if (c.sess && c.sess->fenced) {
            e = KV_ERR_FAILED_PRECONDITION;
            snprintf(c.msg, sizeof c.msg,
                     "session %" PRIu64 " was fenced by the operator (kvctl sessions fence): "
                     "pages it read may have been recycled; restart the process",
                     c.sess->sid);
        } else if (kvp_op_needs_session(op) && !c.sess) {
            e = KV_ERR_NO_SESSION;
            /* A client of a previous instance lands here after a restart: the message says
             * what to do, and Reply.instance tells it that the daemon is a new one. */
            snprintf(c.msg, sizeof c.msg,
                     "%s needs a session: this connection has none (send hello; a client of a "
                     "restarted daemon must hello again, daemon instance %016" PRIx64 ")",
                     kvp_op_name(op), s->instance);
        } else {
            /* A heartbeat that carries its own completed_epoch reports that one (an error
             * when bad); the envelope's is not applied first: libkvc puts the latest epoch it
             * saw there, which made a heartbeat's older but valid report fail as decreasing
             * and let the envelope's claim stand instead of the heartbeat's. */
            const int hb_reports = op == KVP_OP_HEARTBEAT && req->heartbeat->completed_epoch;
            if (c.sess && req->completed_epoch && !hb_reports &&
                kvd_core_session_report_epoch(s->core, c.sess->sid, req->completed_epoch) != 0)
                KVD_LOGD("session %" PRIu64 ": epoch report %" PRIu64 " ignored: %s",
                         c.sess->sid, req->completed_epoch, kvd_core_errmsg(s->core));
            c.env = fr;
            c.nenv = nf - 1;
            c.id = id;
            c.t0 = t0;
            s->ar_fail = (int)((s->nomem_ops >> op) & 1);
            e = kvd_ops[op](&c);
            s->ar_fail = 0;
        }
    }
    if (!c.deferred)
        kvd_reply_finish(s, fr, nf - 1 > 0 ? nf - 1 : 1, &rep, op, id, e, c.msg, t0);
    kvp_request_free(&req);
    ar_reset(s);
    for (int i = 0; i < nf; i++)
        zmq_msg_close(&fr[i]);
}

/* ZMQ_FD is edge-triggered: one readable event may stand for many messages, and a send can
 * consume the edge. So: drain until ZMQ_EVENTS shows no POLLIN, re-reading it after each reply. */
static void kvd_router_cb(uv_poll_t *h, int status, int events)
{
    kvd_server_t *s = h->data;
    for (;;) {
        int ev = 0;
        size_t sz = sizeof ev;
        if (zmq_getsockopt(s->router, ZMQ_EVENTS, &ev, &sz) != 0 || !(ev & ZMQ_POLLIN))
            break;
        kvd_handle_message(s);
    }
}

/* ---- fd socket --------------------------------------------------------------------------- */
static void kvd_fds_cb(uv_poll_t *h, int status, int events)
{
    kvd_server_t *s = h->data;
    for (;;) {
        int fd = accept4(s->fds_listen, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            return;
        uint32_t uid = 0, gid = 0;
        int32_t pid = 0;
        kvd_sess_t *x = NULL;
        if (kvd_fdpass_peer(fd, &uid, &gid, &pid) != 0) {
            s->fd_refused++;
            KVD_LOGW("fd socket: refused a peer whose credentials could not be read "
                     "(getsockopt SO_PEERCRED: %s)", strerror(errno));
            close(fd);
            continue;
        }
        const int admitted = kvd_admit_ok(&s->admit, uid, gid);
        if (admitted)
            x = kvd_sess_by_pid(s, pid);
        if (!x) {
            s->fd_refused++;
            KVD_LOGW("fd socket: refused peer pid %d uid %u gid %u (%s)", (int)pid, uid, gid,
                     admitted ? "no session of that pid" : "not admitted");
            close(fd);
            continue;
        }
        const kvd_export_t *ex = kvd_core_export(s->core);
        int fds[KV_FMT_COUNT + 1], n = 0;
        fds[n++] = ex->dir_fd;
        for (int f = 0; f < KV_FMT_COUNT; f++)
            if (ex->pages[f] && ex->pool_fd[f] >= 0)
                fds[n++] = ex->pool_fd[f];
        if (kvd_fdpass_send(fd, x->sid, fds, n) != 0)
            KVD_LOGW("fd socket: sendmsg to pid %d failed: %s", (int)pid, strerror(errno));
        else
            s->fd_handovers++;
        close(fd);
    }
}

/* ---- timers ------------------------------------------------------------------------------ */
static void kvd_epoch_cb(uv_timer_t *t)
{
    kvd_server_t *s = t->data;
    kvd_core_collect(s->core);
}

static void kvd_lease_cb(uv_timer_t *t)
{
    kvd_server_t *s = t->data;
    uint64_t now = kvd_mono_ns();
    for (kvd_sess_t *x = s->sessions; x; x = x->next) {
        int exp = (now - x->last_ns) / 1000000u > s->cfg->lease_ms;
        if (exp && !x->lease_expired)
            KVD_LOGW("session %" PRIu64 " (pid %d) lease expired: silent for more than %" PRIu64
                     " ms; its pages are kept until the process exits",
                     x->sid, (int)x->pid, s->cfg->lease_ms);
        x->lease_expired = exp;
    }
}

/* One lifecycle tick: plan + at most retier_batch conversions, each BLOCKING the loop until
 * the backend is done (CPU twin on host; kernel + stream sync on cuda). Logs what an operator
 * must know once, not every tick. */
static void kvd_lifecycle_cb(uv_timer_t *t)
{
    kvd_server_t *s = t->data;
    kvd_lc_result_t r;
    if (kvd_lc_tick(s->lc, s->core, kvd_mono_ns(), &r) != KV_ERR_OK)
        return; /* cannot fail today (planning allocates nothing); next tick retries */
    if (r.tq3_full_new)
        KVD_LOGW("lifecycle: TQ3 pool full and nothing evictable: Stale pages stay FP8 until "
                 "TQ3 space frees (counted in lifecycle_skipped_tq3_full): %s", r.msg);
    /* once per episode: a broken device would otherwise log every tick */
    if (r.failures && !s->lc_failing)
        KVD_LOGW("lifecycle: %u conversions failed, sources kept (counted in "
                 "conversion_failures; logged again after a tick without failures): %s",
                 r.failures, r.msg);
    s->lc_failing = r.failures != 0;
    kvd_stats_t st;
    memset(&st, 0, sizeof st);
    kvd_lc_stats(s->lc, &st);
    /* shrinking is what an operator acts on (info); growing back is routine (debug) */
    if (st.lifecycle_window < s->lc_window)
        KVD_LOGI("lifecycle: FP8 pool under pressure: Recent window %u -> %" PRIu64 " pages",
                 s->lc_window, st.lifecycle_window);
    else if (st.lifecycle_window > s->lc_window)
        KVD_LOGD("lifecycle: FP8 pressure gone: Recent window %u -> %" PRIu64 " pages",
                 s->lc_window, st.lifecycle_window);
    s->lc_window = (uint32_t)st.lifecycle_window;
    if (r.retiered || r.promoted)
        KVD_LOGD("lifecycle tick: %u retiers, %u promotes, backlog %" PRIu64 ", %.3f ms",
                 r.retiered, r.promoted, st.lifecycle_backlog, (double)r.tick_ns / 1e6);
}

static void kvd_lifecycle_params(const kvd_config_t *cfg, kvd_lc_params_t *p)
{
    kvd_lc_params_default(p);
    p->recent_pages = (uint32_t)cfg->recent_pages;
    p->anchor_pages = (uint32_t)cfg->anchor_pages;
    p->batch = (uint32_t)cfg->retier_batch;
    p->fp8_low_pct = (uint32_t)cfg->fp8_low_watermark;
    p->cache_retier_ns = cfg->cache_retier_ms * 1000000ull;
}

static void kvd_snapshot_timer_apply(kvd_server_t *s);

static void kvd_server_apply_config(kvd_server_t *s)
{
    kvd_log_set_level(s->cfg->log_level);
    s->lim.max_alloc = (uint32_t)s->cfg->max_alloc;
    s->lim.max_tokens = (uint32_t)s->cfg->max_tokens;
    kvd_events_configure(s->events, (uint32_t)s->cfg->events_batch, s->cfg->events_tokens);
    if (s->core) /* the table's bounds were checked; only the format could fail */
        for (int f = 0; f < KV_FMT_COUNT; f++)
            KVD_ASSERT(kvd_core_set_cache_quota(s->core, (kv_fmt_t)f, s->cfg->cache_quota) ==
                       KV_ERR_OK);
    /* restarted, not uv_timer_set_repeat: that waits out the old period first (a lease_ms of a
     * day set by mistake and set back kept the lease check idle for 6 h) */
    const uint64_t lt = s->cfg->lease_ms / 4 ? s->cfg->lease_ms / 4 : 1;
    if (uv_is_active((uv_handle_t *)&s->epoch_timer) &&
        uv_timer_get_repeat(&s->epoch_timer) != s->cfg->epoch_ms)
        uv_timer_start(&s->epoch_timer, kvd_epoch_cb, s->cfg->epoch_ms, s->cfg->epoch_ms);
    if (uv_is_active((uv_handle_t *)&s->lease_timer) && uv_timer_get_repeat(&s->lease_timer) != lt)
        uv_timer_start(&s->lease_timer, kvd_lease_cb, lt, lt);
    if (s->lc) {
        kvd_lc_params_t p;
        kvd_lifecycle_params(s->cfg, &p);
        /* the table's bounds are the controller's (recent_pages, retier_batch ≥ 1, ≤ 100%) */
        KVD_ASSERT(kvd_lc_set_params(s->lc, &p) == KV_ERR_OK);
        kvd_stats_t st;
        memset(&st, 0, sizeof st);
        kvd_lc_stats(s->lc, &st);
        s->lc_window = (uint32_t)st.lifecycle_window; /* log only changes pressure makes */
    }
    /* lifecycle_ms: 0 stops the controller, anything else (re)starts it at that period */
    if (s->lifecycle_timer.loop && !s->stopping && s->cfg->lifecycle_ms != s->lc_period_ms) {
        uv_timer_stop(&s->lifecycle_timer);
        s->lc_period_ms = s->cfg->lifecycle_ms;
        if (s->lc_period_ms)
            uv_timer_start(&s->lifecycle_timer, kvd_lifecycle_cb, s->lc_period_ms,
                           s->lc_period_ms);
    }
    kvd_snapshot_timer_apply(s);
}

/* snapshot_ms: 0 stops the periodic snapshot, anything else (re)starts it (persistence on). */
static void kvd_snapshot_timer_apply(kvd_server_t *s)
{
    if (!s->snapshot_timer.loop || s->stopping || !s->persist ||
        s->cfg->snapshot_ms == s->snap_period_ms)
        return;
    uv_timer_stop(&s->snapshot_timer);
    s->snap_period_ms = s->cfg->snapshot_ms;
    if (s->snap_period_ms)
        uv_timer_start(&s->snapshot_timer, kvd_snapshot_cb, s->snap_period_ms, s->snap_period_ms);
}

/* ---- metrics ----------------------------------------------------------------------------- */
static int kvd_render_metrics(void *ud, char **out)
{
    kvd_server_t *s = ud;
    kvd_stats_t st;
    kvd_server_stats(s, &st);
    kvd_metrics_extra_t x;
    memset(&x, 0, sizeof x);
    uint64_t now = kvd_mono_ns();
    for (kvd_sess_t *p = s->sessions; p; p = p->next) {
        x.sessions_connected++;
        if ((now - p->last_ns) / 1000000u > s->cfg->lease_ms)
            x.sessions_lease_expired++;
    }
    x.zap_admitted = s->zap.admitted;
    x.zap_refused = s->zap.refused;
    x.fd_handovers = s->fd_handovers;
    x.fd_refused = s->fd_refused;
    x.uptime_s = (now - s->start_ns) / 1000000000u;
    x.draining = (uint64_t)s->draining;
    double bytes = 0, tokens = 0;
    const kvd_export_t *ex = kvd_core_export(s->core);
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        bytes += (double)st.pages_referenced[f] * (double)st.page_bytes[f];
        tokens += (double)st.pages_referenced[f] * ex->geom.page_tokens;
    }
    x.bytes_per_live_token = tokens > 0 ? bytes / tokens : 0;
    return kvd_metrics_render(&s->metrics, &st, &x, out);
}

/* ---- init / shutdown --------------------------------------------------------------------- */
static void kvd_close_if_open(uv_handle_t *h)
{
    if (h->loop && !uv_is_closing(h))
        uv_close(h, NULL);
}

static void kvd_server_close_handles(kvd_server_t *s)
{
    kvd_close_if_open((uv_handle_t *)&s->router_poll);
    kvd_close_if_open((uv_handle_t *)&s->fds_poll);
    kvd_close_if_open((uv_handle_t *)&s->epoch_timer);
    kvd_close_if_open((uv_handle_t *)&s->lease_timer);
    kvd_close_if_open((uv_handle_t *)&s->lifecycle_timer);
    kvd_close_if_open((uv_handle_t *)&s->snapshot_timer);
    kvd_close_if_open((uv_handle_t *)&s->zap.poll);
    kvd_http_stop(&s->http);
    kvd_events_stop(s->events); /* publishes CLEARED (shutdown) first */
    for (kvd_sess_t *x = s->sessions; x; x = x->next)
        kvd_close_if_open((uv_handle_t *)&x->poll);
}

static int kvd_prepare_ipc_dir(const char *path, char *err, size_t errlen)
{
    char dir[256];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir)
        return 0;
    *slash = '\0';
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        /* the default endpoint's /run/kvd is root's to create: say what to do */
        snprintf(err, errlen,
                 "endpoint: mkdir(%s, 0700) failed: %s (kvd creates the socket's directory, "
                 "not its parents: give an endpoint whose parent directory exists and is "
                 "writable by uid %u, --endpoint ipc://PATH)",
                 dir, strerror(errno), (unsigned)getuid());
        return -1;
    }
    struct stat st;
    if (stat(dir, &st) == 0 && (st.st_mode & 077))
        KVD_LOGW("endpoint directory %s is mode %03o: other users may reach the socket file "
                 "(ZAP still checks their uid)", dir, (unsigned)(st.st_mode & 0777));
    return 0;
}

/* socket_group: file permissions are checked before ZAP sees a peer, so an engine running as
 * another uid cannot even connect to a 0600 socket in a 0700 directory. With a group the
 * directory becomes 0750 and the socket files 0660, group-owned; who is admitted is still
 * decided by ZAP (admit_uids / admit_gids). */
static int kvd_group_lookup(const char *name, gid_t *gid, char *err, size_t errlen)
{
    struct group *g = getgrnam(name);
    if (!g) {
        snprintf(err, errlen, "socket_group '%s': no such group", name);
        return -1;
    }
    *gid = g->gr_gid;
    return 0;
}

static int kvd_share_path(const char *path, gid_t gid, mode_t mode, char *err, size_t errlen)
{
    if (chown(path, (uid_t)-1, gid) != 0 || chmod(path, mode) != 0) {
        snprintf(err, errlen, "socket_group: giving %s to gid %u mode %03o failed: %s (the "
                 "daemon must be root or a member of the group)", path, (unsigned)gid,
                 (unsigned)mode, strerror(errno));
        return -1;
    }
    return 0;
}

/* The directory of an ipc path and the path itself, shared with the group. */
static int kvd_share_ipc(const char *path, gid_t gid, char *err, size_t errlen)
{
    char dir[256];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = '\0';
        if (kvd_share_path(dir, gid, 0750, err, errlen) != 0)
            return -1;
    }
    return kvd_share_path(path, gid, 0660, err, errlen);
}

int kvd_server_init(kvd_server_t **out, uv_loop_t *loop, kvd_config_t *cfg, char *err,
                    size_t errlen)
{
    *out = NULL;
    if (strncmp(cfg->endpoint, "ipc://", 6) != 0) {
        snprintf(err, errlen, "endpoint '%s': only ipc:// is supported (peer credentials come "
                 "from SO_PEERCRED)", cfg->endpoint);
        return -1;
    }
    if (sodium_init() < 0) {
        snprintf(err, errlen, "sodium_init failed");
        return -1;
    }
    kvd_server_t *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    s->loop = loop;
    s->cfg = cfg;
    s->fds_listen = s->ep_lock = s->snap_lock = -1;
    s->start_ns = kvd_mono_ns();
    /* One daemon per endpoint and per snapshot_dir, settled before anything is allocated or
     * touched: a second kvd binding the same path took the socket file from the first and, at
     * its exit, unlinked it, leaving the first running but unreachable (and two writers in one
     * snapshot_dir). The locks are held until the process ends. */
    char lock_path[512];
    snprintf(s->sock_path, sizeof s->sock_path, "%s", cfg->endpoint + 6);
    if (snprintf(s->fds_path, sizeof s->fds_path, "%s.fds", s->sock_path) >=
        (int)sizeof s->fds_path) {
        snprintf(err, errlen, "endpoint path too long");
        goto fail;
    }
    if (kvd_prepare_ipc_dir(s->sock_path, err, errlen) != 0)
        goto fail;
    snprintf(lock_path, sizeof lock_path, "%s.lock", s->sock_path);
    s->ep_lock = kvd_lock_file(lock_path, cfg->endpoint, "endpoint", err, errlen);
    if (s->ep_lock < 0)
        goto fail;
    if (cfg->snapshot_dir[0]) {
        if (mkdir(cfg->snapshot_dir, 0700) != 0 && errno != EEXIST) {
            snprintf(err, errlen, "snapshot_dir: mkdir(%s, 0700) failed: %s", cfg->snapshot_dir,
                     strerror(errno));
            goto fail;
        }
        if (snprintf(lock_path, sizeof lock_path, "%s/lock", cfg->snapshot_dir) >=
            (int)sizeof lock_path) {
            snprintf(err, errlen, "snapshot_dir path too long");
            goto fail;
        }
        s->snap_lock = kvd_lock_file(lock_path, "snapshot_dir", "snapshot_dir", err, errlen);
        if (s->snap_lock < 0)
            goto fail;
    }
    randombytes_buf(&s->instance, sizeof s->instance);
    kvd_log_set_level(cfg->log_level);
    if (kvd_admit_init(&s->admit, cfg->admit_uids, cfg->admit_gids) != 0) {
        snprintf(err, errlen, "admit_uids/admit_gids: at most 64 numeric ids each");
        goto fail;
    }

    kv_geom_t g = {.layers = (uint32_t)cfg->layers, .kv_heads = (uint32_t)cfg->kv_heads,
                   .head_dim = (uint32_t)cfg->head_dim, .page_tokens = (uint32_t)cfg->page_tokens,
                   .seed = cfg->seed};
    kvd_core_opts_t o;
    kvd_core_opts_default(&o, &g, (uint32_t)cfg->pages_fp8, (uint32_t)cfg->pages_tq3);
    /* cache_quota is applied with the other runtime-mutable keys (kvd_server_apply_config) */
    /* The namespace salt keys the chain hash. With persistence it lives in snapshot_dir (made
     * once, 0600) so that reloaded entries stay findable; without, it is random per start. */
    if (cfg->snapshot_dir[0]) {
        int created = 0;
        char serr[1024];
        if (kvd_snap_salt_load(cfg->snapshot_dir, s->salt, &created, serr, sizeof serr) !=
            KV_ERR_OK) {
            snprintf(err, errlen, "snapshot_dir: %s", serr);
            goto fail;
        }
        if (created)
            KVD_LOGI("snapshot_dir %s: new namespace salt created (%s/salt, mode 0600)",
                     cfg->snapshot_dir, cfg->snapshot_dir);
        s->persist = 1;
        memcpy(o.hash_key, s->salt, sizeof o.hash_key);
    } else {
        randombytes_buf(o.hash_key, sizeof o.hash_key);
        if (cfg->snapshot_ms)
            KVD_LOGW("snapshot_ms = %" PRIu64 " does nothing: persistence is off (snapshot_dir "
                     "is empty; docs/snapshot.md)",
                     (uint64_t)cfg->snapshot_ms);
    }
    o.backend = cfg->backend;
    if (kvd_core_init(&s->core, &o, err, errlen) != KV_ERR_OK)
        goto fail;
    kvd_lc_params_t lp;
    kvd_lifecycle_params(cfg, &lp);
    if (kvd_lc_init(&s->lc, s->core, &lp) != KV_ERR_OK) {
        snprintf(err, errlen, "out of memory for the lifecycle controller");
        goto fail;
    }
    const kvd_export_t *ex = kvd_core_export(s->core);

    kvp_limits_default(&s->lim);
    s->lim.page_tokens = ex->geom.page_tokens;
    s->lim.dir_entries = ex->dir_entries;
    s->lim.max_pages = ex->dir_entries > 65536 ? ex->dir_entries : 65536;
    kvd_server_apply_config(s);
    /* The largest message the control socket admits, fixed when it binds (libzmq copies
     * ZMQ_MAXMSGSIZE into each connection): 0 derives it from the request bounds, so every
     * request they allow fits and nothing larger does; ≥ 2^63 is no bound at all. */
    const uint64_t need = kvd_request_bytes_max(&s->lim);
    if (cfg->max_msg_bytes == 0) {
        s->msg_bytes = need + KVD_MSG_SLACK;
        s->msg_slack = KVD_MSG_SLACK;
    } else {
        s->msg_bytes = cfg->max_msg_bytes > (uint64_t)INT64_MAX ? 0 : cfg->max_msg_bytes;
        s->msg_slack = 0;
    }
    s->lim.max_msg_bytes = (size_t)s->msg_bytes;
    if (s->msg_bytes && s->msg_bytes < need)
        KVD_LOGW("max_msg_bytes %" PRIu64 " is below the largest request the bounds allow (%"
                 PRIu64 " bytes: a lookup of max_tokens %" PRIu64 " tokens, a release of %u "
                 "ids): such a request drops its client's connection",
                 s->msg_bytes, need, cfg->max_tokens, s->lim.max_pages);
    if (!s->msg_bytes || !cfg->reply_hwm || !cfg->request_hwm)
        KVD_LOGW("control socket:%s%s%s: one client can make the daemon queue without limit",
                 s->msg_bytes ? "" : " max_msg_bytes unlimited",
                 cfg->reply_hwm ? "" : " reply_hwm 0", cfg->request_hwm ? "" : " request_hwm 0");
    /* Test hook (tests/integration/it_snapshot.c): every asynchronous snapshot write stops
     * after N slices and stays in flight until kvd_server_stop completes it, so that a test
     * can deliver SIGTERM (or a second kvctl snapshot) during a write without a timing race.
     * An environment variable, not a directive: it is no operator setting. */
    const char *hold = getenv("KVD_TEST_SNAPSHOT_HOLD");
    if (hold && hold[0]) {
        s->snap_hold = strtoull(hold, NULL, 10);
        KVD_LOGW("KVD_TEST_SNAPSHOT_HOLD=%" PRIu64 ": test hook, snapshot writes stop after %"
                 PRIu64 " slices until shutdown (never set this in production)",
                 s->snap_hold, s->snap_hold);
    }
    /* Test hook (it_malformed): the reply allocations of the named operations fail, as under
     * memory exhaustion, so that a test can check that such an operation changes nothing
     * (the reply is built before the state changes). Comma-separated op names. */
    const char *nomem = getenv("KVD_TEST_REPLY_NOMEM");
    if (nomem && nomem[0]) {
        for (int i = 0; i < KVP_OP_COUNT; i++) {
            const char *nm = kvp_op_name((kvp_op_t)i), *p = nomem;
            size_t l = strlen(nm);
            while ((p = strstr(p, nm)) != NULL) {
                if ((p == nomem || p[-1] == ',') && (p[l] == ',' || p[l] == '\0'))
                    s->nomem_ops |= 1ull << i;
                p += l;
            }
        }
        KVD_LOGW("KVD_TEST_REPLY_NOMEM=%s: test hook, replies of these operations fail with "
                 "NOMEM (never set this in production)", nomem);
    }
    if (s->persist) { /* after the quota is applied, before any client or event subscriber */
        kvd_snap_ident(&s->snap_id, s->core, cfg->namespace, s->salt);
        kvd_server_snapshot_load(s);
    }

    s->zctx = zmq_ctx_new();
    if (!s->zctx) {
        snprintf(err, errlen, "zmq_ctx_new failed: %s", zmq_strerror(errno));
        goto fail;
    }
    if (kvd_zap_start(&s->zap, s->zctx, loop, &s->admit, err, errlen) != 0)
        goto fail;
    s->router = zmq_socket(s->zctx, ZMQ_ROUTER);
    if (!s->router) {
        snprintf(err, errlen, "zmq_socket(ROUTER) failed: %s", zmq_strerror(errno));
        goto fail;
    }
    /* Per-connection memory bounds (decision 54). SNDHWM: at most reply_hwm replies wait for a
     * client that does not read them; ROUTER_MANDATORY makes the one over it fail with EAGAIN
     * (counted and logged in kvd_reply_finish) instead of vanishing silently. RCVHWM: at most
     * request_hwm requests wait to be handled; beyond it libzmq stops reading that connection
     * (the client's own queue holds the rest: nothing is lost). MAXMSGSIZE: one request is at
     * most msg_bytes, so the requests queued cost at most request_hwm × msg_bytes. */
    int zero = 0, one = 1;
    int sndhwm = cfg->reply_hwm > INT32_MAX ? INT32_MAX : (int)cfg->reply_hwm;
    int rcvhwm = cfg->request_hwm > INT32_MAX ? INT32_MAX : (int)cfg->request_hwm;
    int64_t maxmsg = s->msg_bytes ? (int64_t)s->msg_bytes : -1;
    zmq_setsockopt(s->router, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(s->router, ZMQ_SNDHWM, &sndhwm, sizeof sndhwm);
    zmq_setsockopt(s->router, ZMQ_RCVHWM, &rcvhwm, sizeof rcvhwm);
    zmq_setsockopt(s->router, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    zmq_setsockopt(s->router, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    zmq_setsockopt(s->router, ZMQ_ZAP_DOMAIN, "kvd", 3);
    if (zmq_bind(s->router, cfg->endpoint) != 0) {
        snprintf(err, errlen, "zmq_bind(%s) failed: %s", cfg->endpoint, zmq_strerror(errno));
        goto fail;
    }
    chmod(s->sock_path, 0600);
    gid_t sock_gid = 0;
    if (cfg->socket_group[0] &&
        (kvd_group_lookup(cfg->socket_group, &sock_gid, err, errlen) != 0 ||
         kvd_share_ipc(s->sock_path, sock_gid, err, errlen) != 0))
        goto fail;
    int zfd;
    size_t zsz = sizeof zfd;
    zmq_getsockopt(s->router, ZMQ_FD, &zfd, &zsz);
    uv_poll_init(loop, &s->router_poll, zfd);
    s->router_poll.data = s;
    uv_poll_start(&s->router_poll, UV_READABLE, kvd_router_cb);

    if (cfg->events_endpoint[0]) {
        kvd_events_opts_t eo = {.zctx = s->zctx, .endpoint = cfg->events_endpoint,
                                .hwm = cfg->events_hwm, .ns = cfg->namespace,
                                .instance = s->instance, .tokens = cfg->events_tokens,
                                .batch_max = (uint32_t)cfg->events_batch, .zap = 1};
        if (kvd_events_init(&s->events, loop, &eo, err, errlen) != 0)
            goto fail;
        if (cfg->socket_group[0] && strncmp(cfg->events_endpoint, "ipc://", 6) == 0 &&
            kvd_share_ipc(cfg->events_endpoint + 6, sock_gid, err, errlen) != 0)
            goto fail;
        if (!cfg->events_hwm)
            KVD_LOGW("events_hwm 0: a subscriber that stops reading makes the daemon queue "
                     "event messages without limit (each up to %u bytes)",
                     KVD_EVENTS_MSG_BYTES);
        kvd_core_set_index_hook(s->core, kvd_events_hook, s->events);
        kvd_events_announce(s->events, s->core); /* what the snapshot load restored */
    }

    uv_timer_init(loop, &s->epoch_timer);
    s->epoch_timer.data = s;
    uv_timer_start(&s->epoch_timer, kvd_epoch_cb, cfg->epoch_ms, cfg->epoch_ms);
    uv_timer_init(loop, &s->lease_timer);
    s->lease_timer.data = s;
    uint64_t lt = cfg->lease_ms / 4 ? cfg->lease_ms / 4 : 1;
    uv_timer_start(&s->lease_timer, kvd_lease_cb, lt, lt);
    uv_timer_init(loop, &s->lifecycle_timer);
    s->lifecycle_timer.data = s;
    kvd_server_apply_config(s); /* starts the lifecycle timer unless lifecycle_ms = 0 */
    uv_timer_init(loop, &s->snapshot_timer);
    s->snapshot_timer.data = s;
    kvd_snapshot_timer_apply(s);
    if (cfg->metrics_port &&
        kvd_http_start(&s->http, loop, cfg->metrics_addr, (int)cfg->metrics_port,
                       kvd_render_metrics, s, err, errlen) != 0)
        goto fail;

    /* The fd socket comes last (after the metrics port too): its file appearing is what
     * clients, kvd-svc and the tests take as "ready". */
    s->fds_listen = kvd_fdpass_listen(s->fds_path, err, errlen);
    if (s->fds_listen < 0)
        goto fail;
    if (cfg->socket_group[0] && kvd_share_path(s->fds_path, sock_gid, 0660, err, errlen) != 0)
        goto fail;
    uv_poll_init(loop, &s->fds_poll, s->fds_listen);
    s->fds_poll.data = s;
    uv_poll_start(&s->fds_poll, UV_READABLE, kvd_fds_cb);

    char metrics_at[320] = "";
    if (cfg->metrics_port)
        snprintf(metrics_at, sizeof metrics_at, "; metrics on http://%s:%u/metrics",
                 cfg->metrics_addr, (unsigned)cfg->metrics_port);
    KVD_LOGI("serving namespace '%s' on %s (backend %s, %u FP8 + %u TQ3 pages of %" PRIu64
             " / %" PRIu64 " bytes, %u logical ids; messages up to %" PRIu64
             " bytes, %" PRIu64 " requests and %" PRIu64 " replies queued per client)%s",
             cfg->namespace, cfg->endpoint, ex->backend, ex->pages[KV_FMT_FP8],
             ex->pages[KV_FMT_TQ3], ex->page_bytes[KV_FMT_FP8], ex->page_bytes[KV_FMT_TQ3],
             ex->dir_entries, s->msg_bytes, cfg->request_hwm, cfg->reply_hwm, metrics_at);
    if (strcmp(ex->backend, "host") == 0 && !ex->dir_sealed)
        KVD_LOGW("the page directory could not be sealed against writable mappings (Linux < "
                 "5.1?): clients are trusted to map it read-only");
    *out = s;
    return 0;
fail:
    /* close whatever handles were initialised (a calloc'd handle has loop == NULL), let one
     * loop iteration run their close phase, then free */
    kvd_server_close_handles(s);
    uv_run(loop, UV_RUN_NOWAIT);
    kvd_server_free(&s);
    return -1;
}

void kvd_server_stop(kvd_server_t *s)
{
    if (!s || s->stopping)
        return;
    KVD_LOGI("stopping: %u sessions attached", s->nsessions);
    kvd_snap_job_finish_now(s); /* a snapshot in flight completes (kvctl's is answered) */
    if (s->persist && s->snap_clean && kvd_cache_mark(s) == s->snap_mark) {
        /* e.g. `kvctl snapshot` just before SIGTERM: rewriting the same pages would only
         * lengthen the shutdown and push an older generation out */
        KVD_LOGI("snapshot (shutdown): cache unchanged since generation %" PRIu64
                 ", not rewritten", s->snap_gen);
    } else if (s->persist) { /* the clean-shutdown snapshot: sealed pages are immutable, so
                                taking it with sessions still attached is consistent */
        kvd_snap_result_t r;
        char err[1024];
        kvd_server_snapshot(s, "shutdown", &r, err, sizeof err);
    }
    s->stopping = 1;
    kvd_server_close_handles(s);
}

void kvd_server_free(kvd_server_t **ps)
{
    if (!ps || !*ps)
        return;
    kvd_server_t *s = *ps;
    /* Sessions still attached at shutdown: their processes live on, but this daemon's pools
     * die with it; their DEALERs reconnect to the next instance, whose replies carry a new
     * Reply.instance (libkvc: NO_SESSION "daemon restarted", then kvc_rehello). */
    while (s->sessions) {
        kvd_sess_t *x = s->sessions;
        s->sessions = x->next;
        close(x->pidfd);
        free(x);
    }
    if (s->router) {
        /* LINGER is 0 so that a stop never waits on a dead peer; but a kvctl snapshot answered
         * during the stop (kvd_snap_job_finish_now) may still sit in the router's queue, and
         * its client is waiting for it: bounded time for the I/O thread to deliver it
         * (zmq_ctx_term waits at most that long; a gone peer's messages are dropped at once). */
        if (s->reply_at_stop) {
            int linger = 2000;
            zmq_setsockopt(s->router, ZMQ_LINGER, &linger, sizeof linger);
        }
        zmq_close(s->router);
    }
    if (s->core)
        kvd_core_set_index_hook(s->core, NULL, NULL);
    kvd_events_free(&s->events);
    kvd_zap_free(&s->zap);
    if (s->zctx)
        zmq_ctx_term(s->zctx);
    if (s->fds_listen >= 0) {
        close(s->fds_listen);
        unlink(s->fds_path);
    }
    if (s->sock_path[0] && s->router)
        unlink(s->sock_path);
    if (s->snap_lock >= 0)
        close(s->snap_lock);
    if (s->ep_lock >= 0)
        close(s->ep_lock);
    kvd_lc_free(&s->lc);
    kvd_core_free(&s->core);
    sodium_memzero(s->salt, sizeof s->salt);
    ar_reset(s);
    free(s->sendbuf);
    free(s->lookup_buf);
    free(s->tok_buf);
    free(s);
    *ps = NULL;
}
