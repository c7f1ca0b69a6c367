/* kvc.c — libkvc. See kvc.h for the contract.
 *
 * Wire: one DEALER socket; a request is one frame holding a packed Kvd__Request (no empty
 * delimiter: docs/protocol.md, "Framing"). Replies are matched by id; early replies to other
 * ids wait in a list (`stash`, at most KVC_STASH_MAX) until kvc_recv() asks for them, which
 * is what makes pipelining order-free for the caller. A reply in another protocol version is
 * refused whole (kvc_recv_one).
 *
 * Admission failure: with the NULL mechanism a refused peer's connection is just closed by the
 * daemon after the ZAP handler says 400, so a plain recv would only time out. A socket monitor
 * (inproc PAIR) reports ZMQ_EVENT_HANDSHAKE_FAILED_AUTH, which turns that into an immediate,
 * explained PERMISSION_DENIED.
 *
 * Fd handover: after hello, connect to the Unix socket named in HelloRep.fd_socket; the daemon
 * checks that our SO_PEERCRED pid owns a live session and sends one message: 16 bytes
 * ("KVDFDS01" + that session's id, little endian) with SCM_RIGHTS carrying the fds in
 * PoolDesc.fd_index order. We map and close them at once. The id may be another session of
 * this process (kvc_fds): the fds are the same for all of them.
 *
 * Daemon restarts (docs/protocol.md "Daemon restarts"): every reply carries the daemon's
 * random instance id. A reply whose instance differs from the one hello saw (or, from a daemon
 * too old to send it, NO_SESSION while we hold a session) means the daemon restarted: our
 * session, page ids, sequences and references died with the old one, and our mappings show
 * pools nobody serves any more. kvc_reply_status() turns that into NO_SESSION with a message
 * naming both instances, on every call until the caller runs kvc_rehello() — never a hidden
 * retry, because the engine must rebuild its block tables and has to know. The DEALER itself
 * reconnects on its own (ZMQ_RECONNECT_IVL below); requests written while the daemon is down
 * wait in the pipe and reach the new daemon, which answers NO_SESSION; a request the old
 * daemon took and never answered ends in TIMEOUT. Replies to requests sent before the last
 * hello (`id_floor`) are dropped on arrival instead of stashed forever, and so are late
 * replies to synchronous calls that failed without them (kvc_late, a list that grows as
 * needed), whose alloc or lookup references are released. A late seal reply that is a dedupe
 * cannot be undone: the caller's reference now lives on the cached page, so requests naming
 * the sealed page are sent with the cached one (kvc_moved_t, kvc_settle), until a reply the
 * caller receives grants it that id again (kvc_granted).
 */
#include "kvc.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvc_cuda.h"

#define KVC_MAX_FDS 8
/* Replies kept for kvc_recv (the stash). A pipelining engine keeps tens in flight (kvbench
 * rpc: 64); the bound is for a daemon that answers one request many times, or a caller that
 * never collects: past it the reply is dropped and the call that met it fails, explained,
 * instead of memory growing for ever. */
#define KVC_STASH_MAX 65536
/* How long a failed fd handover waits for the daemon's pidfd to show that it exited (below
 * that, a live daemon that closed on purpose: no session for our pid). A dying daemon closes
 * its files in do_exit just before it becomes a zombie, microseconds apart. */
#define KVC_EXIT_GRACE_MS 100

typedef struct kvc_stash_s {
    Kvd__Reply *rep;
    struct kvc_stash_s *next;
} kvc_stash_t;

/* A synchronous call that ended without its reply (TIMEOUT, an undecodable frame, ...):
 * nobody will ask for the reply, so kvc_late consumes it when it comes, and undoes what the
 * caller never learned about. */
typedef enum {
    KVC_LATE_DROP, /* nothing to undo (a release, a status, ...) */
    KVC_LATE_REFS, /* alloc, lookup without peek: the reply's pages hold references */
    KVC_LATE_SEAL  /* seal of `page`: a dedupe moved the caller's reference elsewhere */
} kvc_late_kind_t;

typedef struct kvc_late_s {
    uint64_t id;
    uint32_t page;
    uint8_t kind;    /* kvc_late_kind_t */
    uint8_t gave_up; /* SEAL: kvc_settle waited for it once in vain and no longer does */
} kvc_late_t;

/* A late seal reply said the content of `from` was already cached as `to`: the daemon moved
 * every reference of ours on `from` to `to` (kvd_core_seal) and retired `from`, while the
 * caller, who saw a TIMEOUT, still names `from`. Requests that name `from` get `to` instead
 * (kvc_moved_map).
 *
 * Invariant: a move from→to stands exactly as long as the caller may still name its old
 * `from`. Only one thing gives the caller another meaning for the id: a reply the CALLER
 * receives that grants it `from` anew (the daemon reused the id): the pages of an OK alloc
 * reply, of an OK lookup without peek, the page of an OK seal reply (kvc_granted). Nothing
 * else ends a move: not a late reply libkvc consumes itself (kvc_late: the pages of a late
 * alloc or lookup are released by libkvc, the caller never sees them), not a reply libkvc
 * refuses and gives back (MALFORMED, pages beyond a lookup's cap), not a peek lookup (no
 * reference: the caller's `from` still means `to`). Forgetting too early sends the caller's
 * old `from` as itself (a second release of the reused page, `to`'s reference leaked);
 * forgetting too late sends the new page as `to` (it leaks, `to` loses a reference in use,
 * and a seal naming it as prev chains onto the wrong parent). */
typedef struct kvc_moved_s {
    uint32_t from, to;
} kvc_moved_t;

struct kvc_s {
    void *ctx, *sock, *mon;
    int timeout_ms;
    uint64_t next_id;
    kvc_stash_t *stash;
    char err[512];
    int auth_failed;
    /* session */
    uint64_t session, epoch, instance;
    /* the daemon's max_msg_bytes (HelloRep; 0: not told, nothing checked): a request over it
     * would be dropped unanswered with the connection, losing the session (decision 54) */
    uint64_t max_msg;
    /* HelloRep.max_alloc, max_tokens (0: not told); libkvc checks nothing against them: the
     * daemon's gate refuses an oversized request cleanly, and the bounds may change later */
    uint32_t max_alloc, max_tokens;
    int manual_epoch;    /* 0: report the latest epoch seen (no asynchronous kernels) */
    uint64_t safe_epoch; /* manual mode: what the engine last declared */
    uint32_t pid_seen;
    kv_geom_t geom;
    uint8_t *pool[KV_FMT_COUNT];
    uint64_t pool_map_bytes[KV_FMT_COUNT], page_bytes[KV_FMT_COUNT];
    uint32_t pool_pages[KV_FMT_COUNT];
    kv_dir_entry_t *dir;
    uint64_t dir_map_bytes;
    uint32_t dir_entries;
    /* backend "cuda"/"cuda-ipc": pool[] and dir are device addresses (kvc_cuda.c) */
    kvc_cuda_t *cuda;
    char backend[16];
    char events_endpoint[256]; /* HelloRep.events_endpoint ("" = events off) */
    /* what kvc_rehello() repeats */
    char hello_ns[KVP_MAX_STRING + 1], hello_name[KVP_MAX_STRING + 1];
    int hello_map, helloed;
    int restarted;         /* a reply said the daemon restarted since our hello */
    uint64_t new_instance; /* its instance (0: a daemon too old to say) */
    uint64_t id_floor;     /* ids below were sent before the last hello */
    size_t nstash;
    /* synchronous calls that ended without their reply (kvc_late). Grown as needed, never
     * forgetting one: a forgotten alloc's reply would keep its references for ever. Each
     * call reserves its slot before sending (kvc_late_reserve), so that adding it after a
     * failure cannot fail. One entry per call that waited a whole timeout, at most. */
    kvc_late_t *late;
    size_t nlate, late_cap;
    kvc_moved_t *moved; /* late seal dedupes (kvc_moved_t) */
    size_t nmoved, moved_cap;
    /* ids of peek lookups the caller sent itself (kvc_send, kvc_lookup_send) whose reply it
     * has not received yet: their pages grant nothing (kvc_granted). Cleared by a hello. */
    uint64_t *peeks;
    size_t npeeks, peeks_cap;
};

static kv_err_t kvc_fail(kvc_t *c, kv_err_t e, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    return e;
}

const char *kvc_errmsg(const kvc_t *c)
{
    return c ? c->err : "no client (NULL kvc_t: never connected, or closed by kvc_close)";
}

/* kvc_close sets the caller's pointer to NULL: a call through it afterwards (or one after a
 * failed kvc_connect) is the caller's mistake, answered with an error rather than a crash.
 * Every call that talks to the daemon passes through one of the functions that check. */
#define KVC_NULL_CHECK(c)                                                                          \
    do {                                                                                           \
        if (!(c))                                                                                  \
            return KV_ERR_INVALID_ARGUMENT;                                                        \
    } while (0)

void kvc_json_chars(FILE *out, const char *s, size_t max)
{
    const unsigned char *p = (const unsigned char *)(s ? s : "");
    for (size_t i = 0; i < max && p[i]; i++) {
        const unsigned char c = p[i];
        if (c == '"' || c == '\\') {
            fprintf(out, "\\%c", c);
        } else if (c < 0x20) {
            fprintf(out, "\\u%04x", c);
        } else if (c < 0x80) {
            fputc(c, out);
        } else if (c >= 0xc2 && c <= 0xf4) { /* a lead byte: its whole sequence or nothing */
            const size_t n = c < 0xe0 ? 1 : c < 0xf0 ? 2 : 3;
            size_t k = 1; /* a NUL is no continuation byte, so p[i + k] stays in the string */
            while (k <= n && i + k < max && (p[i + k] & 0xc0) == 0x80)
                k++;
            if (k > n) {
                fwrite(p + i, 1, n + 1, out);
                i += n;
            }
        }
    }
}

kv_err_t kvc_endpoint_probe(const char *endpoint, char *why, size_t cap)
{
    if (!endpoint || strncmp(endpoint, "ipc://", 6) != 0)
        return KV_ERR_OK;
    const char *path = endpoint + 6;
    struct stat sb;
    if (stat(path, &sb) != 0) {
        int e = errno;
        if (e == ENOENT || e == ENOTDIR) {
            snprintf(why, cap, "no socket file %s (is kvd running?)", path);
            return KV_ERR_UNAVAILABLE;
        }
        if (e == EACCES) {
            snprintf(why, cap,
                     "permission denied: a directory above %s is not accessible to uid %u (kvd "
                     "makes its socket directory 0700)",
                     path, (unsigned)getuid());
            return KV_ERR_PERMISSION_DENIED;
        }
        snprintf(why, cap, "stat(%s): %s", path, strerror(e));
        return KV_ERR_UNAVAILABLE;
    }
    if (!S_ISSOCK(sb.st_mode)) {
        snprintf(why, cap, "%s is not a socket (wrong endpoint?)", path);
        return KV_ERR_UNAVAILABLE;
    }
    /* connect(2) on a Unix socket needs write permission on the file */
    if (access(path, W_OK) != 0) {
        int e = errno;
        if (e == EACCES) {
            snprintf(why, cap,
                     "permission denied: the socket %s (owner uid %u, mode %03o) is not "
                     "writable by uid %u",
                     path, (unsigned)sb.st_uid, (unsigned)(sb.st_mode & 0777),
                     (unsigned)getuid());
            return KV_ERR_PERMISSION_DENIED;
        }
        snprintf(why, cap, "access(%s): %s", path, strerror(e));
        return KV_ERR_UNAVAILABLE;
    }
    /* non-blocking: a listener with a full backlog answers EAGAIN, not a wait; only
     * ECONNREFUSED (no listener) is a verdict, anything else is left to the call */
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int refused = 0;
    if (fd >= 0 && strlen(path) < sizeof sa.sun_path) {
        memcpy(sa.sun_path, path, strlen(path) + 1);
        refused = connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0 && errno == ECONNREFUSED;
    }
    if (fd >= 0)
        close(fd);
    if (!refused)
        return KV_ERR_OK;
    snprintf(why, cap,
             "nothing listens on %s, a socket file left by a kvd that did not stop cleanly "
             "(killed or crashed)",
             path);
    return KV_ERR_UNAVAILABLE;
}

kv_err_t kvc_connect(kvc_t **out, const char *endpoint, int timeout_ms)
{
    if (!out || !endpoint)
        return KV_ERR_INVALID_ARGUMENT;
    *out = NULL;
    kvc_t *c = calloc(1, sizeof *c);
    if (!c)
        return KV_ERR_NOMEM;
    c->timeout_ms = timeout_ms > 0 ? timeout_ms : 5000;
    c->next_id = 1;
    c->ctx = zmq_ctx_new();
    if (!c->ctx) {
        free(c);
        return KV_ERR_NOMEM;
    }
    c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
    int linger = 0, hwm = 0;
    if (!c->sock)
        goto fail;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(c->sock, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(c->sock, ZMQ_RCVHWM, &hwm, sizeof hwm);
    /* Reconnect to a restarted daemon (the same ipc path bound again) every 100 ms, without
     * exponential backoff: the libzmq defaults, set explicitly because kvc_rehello() relies on
     * them. A local ipc connect attempt costs microseconds; a longer interval would only delay
     * the engine's recovery. */
    int ivl = 100, ivl_max = 0;
    zmq_setsockopt(c->sock, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
    zmq_setsockopt(c->sock, ZMQ_RECONNECT_IVL_MAX, &ivl_max, sizeof ivl_max);
    char mon[64];
    snprintf(mon, sizeof mon, "inproc://kvc-mon-%p", (void *)c);
    if (zmq_socket_monitor(c->sock, mon, ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) == 0) {
        c->mon = zmq_socket(c->ctx, ZMQ_PAIR);
        if (c->mon && zmq_connect(c->mon, mon) != 0) {
            zmq_close(c->mon);
            c->mon = NULL;
        }
        if (c->mon)
            zmq_setsockopt(c->mon, ZMQ_LINGER, &linger, sizeof linger);
    }
    if (zmq_connect(c->sock, endpoint) != 0) {
        kv_err_t e = KV_ERR_INVALID_ARGUMENT;
        fprintf(stderr, "kvc: zmq_connect(%s) failed: %s\n", endpoint, zmq_strerror(errno));
        kvc_close(&c);
        return e;
    }
    *out = c;
    return KV_ERR_OK;
fail:
    kvc_close(&c);
    return KV_ERR_INTERNAL;
}

/* The sizes go with the mappings: after a failed map kvc_pools() must not pair a NULL base
 * with a page count, nor kvc_dir_entries() describe a directory that is gone. */
static void kvc_unmap(kvc_t *c)
{
    if (c->cuda) { /* device mappings: pool[] / dir are not host addresses */
        kvc__cuda_close(&c->cuda);
    } else {
        for (int f = 0; f < KV_FMT_COUNT; f++)
            if (c->pool[f])
                munmap(c->pool[f], c->pool_map_bytes[f]);
        if (c->dir)
            munmap(c->dir, c->dir_map_bytes);
    }
    memset(c->pool, 0, sizeof c->pool);
    memset(c->pool_map_bytes, 0, sizeof c->pool_map_bytes);
    memset(c->page_bytes, 0, sizeof c->page_bytes);
    memset(c->pool_pages, 0, sizeof c->pool_pages);
    c->dir = NULL;
    c->dir_map_bytes = 0;
    c->dir_entries = 0;
}

static void kvc_stash_clear(kvc_t *c)
{
    while (c->stash) {
        kvc_stash_t *s = c->stash;
        c->stash = s->next;
        kvd__reply__free_unpacked(s->rep, NULL);
        free(s);
    }
    c->nstash = 0;
}

void kvc_close(kvc_t **pc)
{
    if (!pc || !*pc)
        return;
    kvc_t *c = *pc;
    kvc_stash_clear(c);
    free(c->late);
    free(c->moved);
    free(c->peeks);
    kvc_unmap(c);
    if (c->mon) {
        zmq_socket_monitor(c->sock, NULL, 0);
        zmq_close(c->mon);
    }
    if (c->sock)
        zmq_close(c->sock);
    if (c->ctx)
        zmq_ctx_term(c->ctx);
    free(c);
    *pc = NULL;
}

/* ---- send / receive ---------------------------------------------------------------------- */
kv_err_t kvc_send_raw(kvc_t *c, const void *buf, size_t len)
{
    KVC_NULL_CHECK(c);
    if (zmq_send(c->sock, buf, len, 0) < 0)
        return kvc_fail(c, KV_ERR_UNAVAILABLE, "zmq_send failed: %s", zmq_strerror(errno));
    return KV_ERR_OK;
}

void kvc_set_safe_epoch(kvc_t *c, uint64_t safe_epoch)
{
    if (!c)
        return;
    c->manual_epoch = 1;
    if (safe_epoch > c->safe_epoch)
        c->safe_epoch = safe_epoch;
}

/* kvc_send without noting peek lookups: libkvc's own calls, which know what they sent. */
static kv_err_t kvc_send_req(kvc_t *c, Kvd__Request *req, uint64_t *id)
{
    KVC_NULL_CHECK(c);
    req->version = KVP_VERSION;
    req->id = c->next_id++;
    /* every call carries the safe epoch once a session exists (0 = not reported); only in the
     * packed bytes: left in the caller's struct, a request built once and sent again would
     * report the first call's epoch for ever and hold back this session's recycling */
    const uint64_t caller_epoch = req->completed_epoch;
    if (c->session && !req->completed_epoch)
        req->completed_epoch = c->manual_epoch ? c->safe_epoch : c->epoch;
    size_t n = kvd__request__get_packed_size(req);
    if (c->max_msg && n > c->max_msg) {
        req->completed_epoch = caller_epoch;
        return kvc_fail(c, KV_ERR_INVALID_ARGUMENT,
                        "a request of %zu bytes is over the daemon's max_msg_bytes (%llu): it "
                        "would be dropped unanswered with the connection; send fewer tokens or "
                        "pages per call",
                        n, (unsigned long long)c->max_msg);
    }
    uint8_t stackbuf[4096];
    uint8_t *buf = n <= sizeof stackbuf ? stackbuf : malloc(n);
    if (!buf) {
        req->completed_epoch = caller_epoch;
        return kvc_fail(c, KV_ERR_NOMEM, "out of memory packing %zu bytes", n);
    }
    kvd__request__pack(req, buf);
    req->completed_epoch = caller_epoch;
    kv_err_t e = kvc_send_raw(c, buf, n);
    if (buf != stackbuf)
        free(buf);
    if (id)
        *id = req->id;
    return e;
}

static int kvc_is_peek(const Kvd__Request *req)
{
    return req->body_case == KVD__REQUEST__BODY_LOOKUP && req->lookup && req->lookup->peek;
}

/* 1 when id is a peek lookup the caller sent (c->peeks), no longer noted after this. */
static int kvc_peek_take(kvc_t *c, uint64_t id)
{
    for (size_t i = 0; i < c->npeeks; i++)
        if (c->peeks[i] == id)
            return c->peeks[i] = c->peeks[--c->npeeks], 1;
    return 0;
}

/* Room for one more element after the n used of an array of *cap (elem bytes each), by
 * doubling (first 16): the array, moved or not, or NULL with it untouched when memory runs out.
 * The late, moved and peek lists grow this way. */
static void *kvc_grow(void *arr, size_t n, size_t *cap, size_t elem)
{
    if (n < *cap)
        return arr;
    const size_t c2 = *cap ? 2 * *cap : 16;
    void *p = realloc(arr, c2 * elem);
    if (p)
        *cap = c2;
    return p;
}

kv_err_t kvc_send(kvc_t *c, Kvd__Request *req, uint64_t *id)
{
    KVC_NULL_CHECK(c);
    if (kvc_is_peek(req)) { /* room first: noting cannot fail */
        uint64_t *p = kvc_grow(c->peeks, c->npeeks, &c->peeks_cap, sizeof *p);
        if (!p)
            return kvc_fail(c, KV_ERR_NOMEM, "out of memory noting %zu peek lookups",
                            c->npeeks + 1);
        c->peeks = p;
    }
    uint64_t sent;
    kv_err_t e = kvc_send_req(c, req, &sent);
    if (e == KV_ERR_OK && kvc_is_peek(req))
        c->peeks[c->npeeks++] = sent;
    if (id)
        *id = sent;
    return e;
}

static int64_t kvc_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void kvc_drain_monitor(kvc_t *c)
{
    zmq_msg_t m;
    while (c->mon) {
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return;
        }
        if (zmq_msg_size(&m) >= 6) {
            uint16_t ev;
            uint32_t val;
            memcpy(&ev, zmq_msg_data(&m), 2);
            memcpy(&val, (uint8_t *)zmq_msg_data(&m) + 2, 4);
            if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
                c->auth_failed = 1;
                snprintf(c->err, sizeof c->err,
                         "the daemon refused this peer (ZAP status %u): uid %u / gid %u is not in "
                         "its admit_uids / admit_gids",
                         val, (unsigned)getuid(), (unsigned)getgid());
            }
        }
        int more = zmq_msg_more(&m);
        zmq_msg_close(&m);
        if (more) { /* endpoint frame */
            zmq_msg_init(&m);
            zmq_msg_recv(&m, c->mon, ZMQ_DONTWAIT);
            zmq_msg_close(&m);
        }
    }
}

/* Receive one reply frame (any id) within the deadline. */
static kv_err_t kvc_recv_one(kvc_t *c, int64_t deadline, Kvd__Reply **rep)
{
    *rep = NULL;
    for (;;) {
        if (c->auth_failed)
            return KV_ERR_PERMISSION_DENIED;
        zmq_pollitem_t it[2] = {{c->sock, 0, ZMQ_POLLIN, 0}, {c->mon, 0, ZMQ_POLLIN, 0}};
        int64_t left = deadline - kvc_now_ms();
        if (left <= 0)
            return kvc_fail(c, KV_ERR_TIMEOUT, "no reply from the daemon within %d ms",
                            c->timeout_ms);
        int r = zmq_poll(it, c->mon ? 2 : 1, (long)left);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return kvc_fail(c, KV_ERR_UNAVAILABLE, "zmq_poll failed: %s", zmq_strerror(errno));
        }
        if (c->mon && (it[1].revents & ZMQ_POLLIN)) {
            kvc_drain_monitor(c);
            continue;
        }
        if (!(it[0].revents & ZMQ_POLLIN))
            continue;
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            continue;
        }
        int more = zmq_msg_more(&m);
        Kvd__Reply *r2 =
            kvd__reply__unpack(NULL, zmq_msg_size(&m), (const uint8_t *)zmq_msg_data(&m));
        zmq_msg_close(&m);
        while (more) { /* a well-behaved daemon sends one frame; drop any extra */
            zmq_msg_init(&m);
            zmq_msg_recv(&m, c->sock, 0);
            more = zmq_msg_more(&m);
            zmq_msg_close(&m);
        }
        if (!r2)
            return kvc_fail(c, KV_ERR_MALFORMED, "the daemon's reply did not decode");
        /* a body is read by the number of its field: under another protocol version the
         * same numbers may mean other things, so nothing of it is used (late references
         * included: a daemon we cannot speak to is not one we can return them to) */
        if (r2->version != KVP_VERSION) {
            const uint32_t v = r2->version;
            const unsigned long long id = (unsigned long long)r2->id;
            kvd__reply__free_unpacked(r2, NULL);
            return kvc_fail(c, KV_ERR_VERSION_MISMATCH,
                            "the daemon replied in protocol version %u (to request %llu); this "
                            "libkvc speaks version %u",
                            v, id, (unsigned)KVP_VERSION);
        }
        *rep = r2;
        return KV_ERR_OK;
    }
}

/* A reply from another daemon instance than the one our hello reached (see the top). */
static int kvc_is_restart(const kvc_t *c, const Kvd__Reply *r)
{
    if (!c->instance)
        return 0; /* no hello yet (or one in progress): nothing to compare with */
    if (r->instance)
        return r->instance != c->instance;
    /* a daemon without Reply.instance: NO_SESSION while we hold a session */
    return c->session && r->status == KVD__STATUS__NO_SESSION;
}

/* The caller was granted pages[n] (see kvc_moved_t for when): a remembered dedupe of a
 * retired page with one of those ids is stale from now on. */
static void kvc_moved_forget(kvc_t *c, const uint32_t *pages, size_t n)
{
    for (size_t i = 0; i < n && c->nmoved; i++)
        for (size_t j = 0; j < c->nmoved; j++)
            if (c->moved[j].from == pages[i]) {
                c->moved[j] = c->moved[--c->nmoved];
                break;
            }
}

/* A raw reply handed to the caller (kvc_recv, kvc_recv_any, kvc_call): what an OK one
 * grants the caller ends the moves of those ids (kvc_moved_t). peek: the reply is to a
 * lookup with peek, which grants nothing. The typed calls check their reply first and call
 * kvc_moved_forget for what they return. */
static void kvc_granted(kvc_t *c, const Kvd__Reply *r, int peek)
{
    if (r->status != KVD__STATUS__OK || !c->nmoved)
        return;
    if (r->body_case == KVD__REPLY__BODY_ALLOC && r->alloc)
        kvc_moved_forget(c, r->alloc->pages, r->alloc->n_pages);
    else if (r->body_case == KVD__REPLY__BODY_LOOKUP && r->lookup && !peek)
        kvc_moved_forget(c, r->lookup->pages, r->lookup->n_pages);
    else if (r->body_case == KVD__REPLY__BODY_SEAL && r->seal)
        kvc_moved_forget(c, &r->seal->page, 1);
}

static kv_err_t kvc_reply_status(kvc_t *c, Kvd__Reply *r)
{
    if (kvc_is_restart(c, r)) {
        c->restarted = 1;
        if (r->instance)
            c->new_instance = r->instance;
        char now[24] = "unknown";
        if (c->new_instance)
            snprintf(now, sizeof now, "%016llx", (unsigned long long)c->new_instance);
        return kvc_fail(c, KV_ERR_NO_SESSION,
                        "NO_SESSION: daemon restarted (instance %016llx → %s): call kvc_rehello; "
                        "page ids from before are invalid",
                        (unsigned long long)c->instance, now);
    }
    if (r->epoch > c->epoch)
        c->epoch = r->epoch;
    kv_err_t e = kv_err_valid((int)r->status) ? (kv_err_t)r->status : KV_ERR_INTERNAL;
    if (e != KV_ERR_OK)
        snprintf(c->err, sizeof c->err, "%s: %s", kv_err_name((int)e),
                 r->message && r->message[0] ? r->message : kv_err_msg((int)e));
    else
        c->err[0] = '\0';
    return e;
}

/* Room for one more late entry, taken before a request is sent so that recording it after a
 * failure cannot fail (kvc_late_add). NOMEM: send nothing. */
static kv_err_t kvc_late_reserve(kvc_t *c)
{
    kvc_late_t *l = kvc_grow(c->late, c->nlate, &c->late_cap, sizeof *l);
    if (!l)
        return kvc_fail(c, KV_ERR_NOMEM, "out of memory for %zu late-reply entries",
                        c->nlate + 1);
    c->late = l;
    return KV_ERR_OK;
}

/* 0 when there is no room (only kvc_give_back calls it unreserved: see there). */
static int kvc_late_add(kvc_t *c, uint64_t id, kvc_late_kind_t kind, uint32_t page)
{
    if (kvc_late_reserve(c) != KV_ERR_OK)
        return 0;
    c->late[c->nlate++] = (kvc_late_t){.id = id, .page = page, .kind = (uint8_t)kind};
    return 1;
}

/* The late entry a reply to a synchronous call `req` that failed without its reply needs. */
static void kvc_late_add_req(kvc_t *c, uint64_t id, const Kvd__Request *req)
{
    if (req->body_case == KVD__REQUEST__BODY_ALLOC ||
        (req->body_case == KVD__REQUEST__BODY_LOOKUP && !req->lookup->peek))
        kvc_late_add(c, id, KVC_LATE_REFS, 0);
    else if (req->body_case == KVD__REQUEST__BODY_SEAL)
        kvc_late_add(c, id, KVC_LATE_SEAL, req->seal->page);
    else
        kvc_late_add(c, id, KVC_LATE_DROP, 0);
}

static kv_err_t kvc_release_send_ids(kvc_t *c, const uint32_t *pages, size_t n, uint64_t *id);

/* Release references a reply gave us that the caller will never learn about (a late reply, or
 * one refused as malformed), without waiting: the release's own reply is dropped on arrival.
 * Sent even when no late entry can be recorded (out of memory): the references matter more
 * than the release's reply, which is then stashed like an unclaimed one. */
static void kvc_give_back(kvc_t *c, const uint32_t *pages, size_t n)
{
    uint64_t rid;
    if (n && kvc_release_send_ids(c, pages, n, &rid) == KV_ERR_OK)
        kvc_late_add(c, rid, KVC_LATE_DROP, 0);
}

/* A reply to a synchronous call that ended without it: consumed here (1) or not one (0). The
 * references an alloc or a lookup took for us are released (the release's own reply is
 * dropped the same way), so that a slow daemon cannot make a client leak pages it never
 * learned about. A seal that turned out a dedupe is remembered (kvc_moved_t). */
static int kvc_late(kvc_t *c, Kvd__Reply *r)
{
    size_t i = 0;
    while (i < c->nlate && c->late[i].id != r->id)
        i++;
    if (i == c->nlate)
        return 0;
    const kvc_late_t l = c->late[i];
    c->late[i] = c->late[--c->nlate];
    /* nothing here is the caller's: no move ends (kvc_moved_t) */
    if (l.kind == KVC_LATE_REFS && r->status == KVD__STATUS__OK) {
        if (r->body_case == KVD__REPLY__BODY_ALLOC && r->alloc)
            kvc_give_back(c, r->alloc->pages, r->alloc->n_pages);
        else if (r->body_case == KVD__REPLY__BODY_LOOKUP && r->lookup)
            kvc_give_back(c, r->lookup->pages, r->lookup->n_pages);
    }
    if (l.kind == KVC_LATE_SEAL && r->status == KVD__STATUS__OK &&
        r->body_case == KVD__REPLY__BODY_SEAL && r->seal && r->seal->page != l.page &&
        !kvc_is_restart(c, r)) {
        const uint32_t to = r->seal->page;
        kvc_moved_t *m = kvc_grow(c->moved, c->nmoved, &c->moved_cap, sizeof *m);
        if (m) {
            c->moved = m;
            c->moved[c->nmoved++] = (kvc_moved_t){.from = l.page, .to = to};
        } else { /* no memory to remember it: return the moved reference rather than leak it */
            kvc_give_back(c, &to, 1);
        }
    }
    kvd__reply__free_unpacked(r, NULL);
    return 1;
}

/* A reply that is not the one being waited for: dropped (sent before the last hello, never
 * sent at all, or late), or kept for a later kvc_recv. */
static kv_err_t kvc_route(kvc_t *c, Kvd__Reply *r)
{
    /* an id no kvc_send gave out yet: kept, it would be taken for the reply of the future
     * request that gets that id */
    if (r->id < c->id_floor || r->id >= c->next_id) {
        kvd__reply__free_unpacked(r, NULL);
        return KV_ERR_OK;
    }
    if (kvc_late(c, r))
        return KV_ERR_OK;
    if (c->nstash >= KVC_STASH_MAX) {
        /* an alloc's pages are referenced whoever asked: release them (a lookup's are
         * unless it was a peek, which the reply does not say: those stay) */
        const unsigned long long id = (unsigned long long)r->id;
        kvc_peek_take(c, r->id);
        if (r->status == KVD__STATUS__OK && r->body_case == KVD__REPLY__BODY_ALLOC)
            kvc_give_back(c, r->alloc->pages, r->alloc->n_pages);
        kvd__reply__free_unpacked(r, NULL);
        return kvc_fail(c, KV_ERR_RESOURCE_EXHAUSTED,
                        "%d replies are already waiting to be claimed (kvc_send without "
                        "kvc_recv, or a daemon answering a request more than once): the reply "
                        "to request %llu was dropped",
                        KVC_STASH_MAX, id);
    }
    kvc_stash_t *s = malloc(sizeof *s);
    if (!s) {
        kvd__reply__free_unpacked(r, NULL);
        return kvc_fail(c, KV_ERR_NOMEM, "out of memory stashing a reply");
    }
    s->rep = r;
    s->next = c->stash;
    c->stash = s;
    c->nstash++;
    return KV_ERR_OK;
}

/* kvc_recv for libkvc's own calls: nothing granted yet (they check the reply first). */
static kv_err_t kvc_recv_id(kvc_t *c, uint64_t id, Kvd__Reply **rep)
{
    *rep = NULL;
    KVC_NULL_CHECK(c);
    for (kvc_stash_t **pp = &c->stash; *pp; pp = &(*pp)->next) {
        if ((*pp)->rep->id == id) {
            kvc_stash_t *s = *pp;
            *pp = s->next;
            *rep = s->rep;
            free(s);
            c->nstash--;
            return kvc_reply_status(c, *rep);
        }
    }
    int64_t deadline = kvc_now_ms() + c->timeout_ms;
    for (;;) {
        Kvd__Reply *r;
        kv_err_t e = kvc_recv_one(c, deadline, &r);
        if (e != KV_ERR_OK)
            return e;
        if (r->id == id) {
            *rep = r;
            return kvc_reply_status(c, r);
        }
        if ((e = kvc_route(c, r)) != KV_ERR_OK)
            return e;
    }
}

kv_err_t kvc_recv(kvc_t *c, uint64_t id, Kvd__Reply **rep)
{
    const kv_err_t e = kvc_recv_id(c, id, rep);
    if (*rep)
        kvc_granted(c, *rep, kvc_peek_take(c, id));
    return e;
}

kv_err_t kvc_recv_any(kvc_t *c, Kvd__Reply **rep)
{
    *rep = NULL;
    KVC_NULL_CHECK(c);
    if (c->stash) {
        kvc_stash_t *s = c->stash;
        c->stash = s->next;
        *rep = s->rep;
        free(s);
        c->nstash--;
        const kv_err_t e = kvc_reply_status(c, *rep);
        kvc_granted(c, *rep, kvc_peek_take(c, (*rep)->id));
        return e;
    }
    const int64_t deadline = kvc_now_ms() + c->timeout_ms;
    for (;;) {
        kv_err_t e = kvc_recv_one(c, deadline, rep);
        if (e != KV_ERR_OK)
            return e;
        /* sent before the last hello (as in kvc_recv): from another daemon instance it would
         * also read as a restart of the one we just said hello to */
        if ((*rep)->id < c->id_floor) {
            kvd__reply__free_unpacked(*rep, NULL);
        } else if (!kvc_late(c, *rep)) {
            const kv_err_t e2 = kvc_reply_status(c, *rep);
            kvc_granted(c, *rep, kvc_peek_take(c, (*rep)->id));
            return e2;
        }
        *rep = NULL;
    }
}

void kvc_reply_free(Kvd__Reply **rep)
{
    if (rep && *rep) {
        kvd__reply__free_unpacked(*rep, NULL);
        *rep = NULL;
    }
}

/* kvc_call for libkvc's own calls (kvc_recv_id). */
static kv_err_t kvc_call_req(kvc_t *c, Kvd__Request *req, Kvd__Reply **rep)
{
    uint64_t id;
    *rep = NULL;
    KVC_NULL_CHECK(c);
    kv_err_t e = kvc_late_reserve(c);
    if (e != KV_ERR_OK || (e = kvc_send_req(c, req, &id)) != KV_ERR_OK)
        return e;
    e = kvc_recv_id(c, id, rep);
    /* failed without its reply (TIMEOUT, a frame that did not decode, another protocol
     * version, a full stash): nobody can ask for it again, and it may still come */
    if (e != KV_ERR_OK && !*rep)
        kvc_late_add_req(c, id, req);
    return e;
}

kv_err_t kvc_call(kvc_t *c, Kvd__Request *req, Kvd__Reply **rep)
{
    const kv_err_t e = kvc_call_req(c, req, rep);
    if (*rep)
        kvc_granted(c, *rep, kvc_is_peek(req));
    return e;
}

/* ---- hello and the fd handover ----------------------------------------------------------- */
/* 1 when process `pid` (the daemon, as SO_PEERCRED named it) has exited or exits within
 * KVC_EXIT_GRACE_MS; 0 when it lives on, or cannot be watched (pid 0: in a pid namespace we do
 * not see; no pidfd_open before Linux 5.3). */
static int kvc_daemon_exited(pid_t pid)
{
    if (pid <= 0)
        return 0;
    int fd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (fd < 0)
        return errno == ESRCH; /* already gone (and reaped) */
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int r;
    do
        r = poll(&p, 1, KVC_EXIT_GRACE_MS);
    while (r < 0 && errno == EINTR);
    close(fd);
    return r > 0;
}

static kv_err_t kvc_recv_fds(kvc_t *c, const char *path, int *fds, int *nfds)
{
    *nfds = 0;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path)
        return kvc_fail(c, KV_ERR_INVALID_ARGUMENT, "fd socket path too long: %s", path);
    strcpy(sa.sun_path, path);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return kvc_fail(c, KV_ERR_IO, "socket(AF_UNIX) failed: %s", strerror(errno));
    /* both timeouts: an AF_UNIX connect() to a listener whose backlog is full waits on the
     * send timeout, the fds on the receive one */
    struct timeval tv = {.tv_sec = c->timeout_ms / 1000, .tv_usec = (c->timeout_ms % 1000) * 1000};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (connect(s, (struct sockaddr *)&sa, sizeof sa) != 0) {
        int en = errno;
        close(s);
        return kvc_fail(c, en == EAGAIN || en == EINPROGRESS ? KV_ERR_TIMEOUT : KV_ERR_UNAVAILABLE,
                        "connect(%s) failed: %s", path, strerror(en));
    }
    /* the daemon's pid (credentials of its listen()), for kvc_daemon_exited below */
    struct ucred cr = {0};
    socklen_t crlen = sizeof cr;
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &crlen) != 0)
        cr.pid = 0;
    uint8_t hdr[16] = {0};
    union {
        char buf[CMSG_SPACE(sizeof(int) * KVC_MAX_FDS)];
        struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u);
    struct iovec iov = {.iov_base = hdr, .iov_len = sizeof hdr};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                        .msg_controllen = sizeof u.buf};
    ssize_t n;
    do
        n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    while (n < 0 && errno == EINTR);
    int en = errno;
    close(s);
    /* A failed recvmsg writes nothing back, msg_controllen included: the control buffer then
     * holds no fds of ours, and reading it would take stale bytes for fds and close them. */
    if (n < 0)
        mh.msg_controllen = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < k && *nfds < KVC_MAX_FDS; i++)
                memcpy(&fds[(*nfds)++], CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
        }
    }
    if (n != (ssize_t)sizeof hdr || memcmp(hdr, "KVDFDS01", 8) != 0 ||
        (mh.msg_flags & MSG_CTRUNC)) {
        for (int i = 0; i < *nfds; i++)
            close(fds[i]);
        *nfds = 0;
        if (n < 0 && (en == EAGAIN || en == EWOULDBLOCK))
            return kvc_fail(c, KV_ERR_TIMEOUT, "no fds from %s within %d ms", path,
                            c->timeout_ms);
        if (n < 0)
            return kvc_fail(c, KV_ERR_IO, "recvmsg(%s) failed: %s", path, strerror(en));
        if (mh.msg_flags & MSG_CTRUNC)
            return kvc_fail(c, KV_ERR_MALFORMED,
                            "the daemon sent more fds than the %d expected on %s", KVC_MAX_FDS,
                            path);
        /* the daemon closes with nothing sent when our pid owns no session it knows; anything
         * else it sent is not the handover, and saying "denied" would send the operator to
         * admit_uids for a protocol problem. A daemon that died between accept and send
         * closes the same way: its pidfd tells the two apart. */
        if (n == 0 && kvc_daemon_exited(cr.pid))
            return kvc_fail(c, KV_ERR_UNAVAILABLE,
                            "the daemon (pid %d) exited during the fd handover on %s: the socket "
                            "closed with nothing sent",
                            (int)cr.pid, path);
        if (n == 0)
            return kvc_fail(c, KV_ERR_PERMISSION_DENIED,
                            "the daemon closed the fd socket %s with nothing sent: it knows no "
                            "session of our pid %d%s",
                            path, (int)getpid(),
                            cr.pid ? "" : " (or it exited: its pid is not visible to us)");
        return kvc_fail(c, KV_ERR_MALFORMED,
                        "the fd handover on %s is not a KVDFDS01 header (%zd of 16 bytes, first "
                        "%02x %02x %02x %02x)",
                        path, n, hdr[0], hdr[1], hdr[2], hdr[3]);
    }
    /* The header names A session of this process, not necessarily ours: the daemon matches
     * the peer by pid, and a process may hold several sessions (one kvc_t per thread, or an
     * older kvc_t said hello again). The fds are the namespace's pools and directory, the
     * same for every session, so any of ours will do; only a zero id is malformed. */
    uint64_t sid = 0;
    for (int i = 0; i < 8; i++)
        sid |= (uint64_t)hdr[8 + i] << (8 * i);
    if (sid == 0) {
        for (int i = 0; i < *nfds; i++)
            close(fds[i]);
        *nfds = 0;
        return kvc_fail(c, KV_ERR_MALFORMED, "fd handover names session 0");
    }
    return KV_ERR_OK;
}

/* One descriptor of HelloRep.pools against the geometry and its fd (fd < 0: a cuda handle,
 * no size to check). */
static kv_err_t kvc_check_desc(kvc_t *c, const Kvd__PoolDesc *p, size_t i, int dir, int fd)
{
    if (dir) {
        if (c->dir)
            return kvc_fail(c, KV_ERR_MALFORMED, "pool descriptor %zu: a second directory", i);
        if (p->pages > p->bytes / sizeof(kv_dir_entry_t))
            return kvc_fail(c, KV_ERR_MALFORMED,
                            "pool descriptor %zu: a directory of %u entries in %llu bytes", i,
                            p->pages, (unsigned long long)p->bytes);
    } else {
        if ((unsigned)p->format >= KV_FMT_COUNT)
            return kvc_fail(c, KV_ERR_MALFORMED, "pool descriptor %zu: format %d", i,
                            (int)p->format);
        const uint64_t pb = kv_page_bytes(&c->geom, (kv_fmt_t)p->format);
        if (p->page_bytes != pb || p->pages > p->bytes / pb)
            return kvc_fail(c, KV_ERR_MALFORMED,
                            "pool descriptor %zu: %u pages of %llu bytes in %llu bytes (the "
                            "geometry says %llu-byte pages)",
                            i, p->pages, (unsigned long long)p->page_bytes,
                            (unsigned long long)p->bytes, (unsigned long long)pb);
    }
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && (uint64_t)st.st_size < p->bytes)
        return kvc_fail(c, KV_ERR_MALFORMED,
                        "pool descriptor %zu: %llu bytes, but its fd holds %lld", i,
                        (unsigned long long)p->bytes, (long long)st.st_size);
    return KV_ERR_OK;
}

static kv_err_t kvc_map(kvc_t *c, const Kvd__HelloRep *h)
{
    int fds[KVC_MAX_FDS];
    int nfds;
    kv_err_t e = kvc_recv_fds(c, h->fd_socket, fds, &nfds);
    if (e != KV_ERR_OK)
        return e;
    snprintf(c->backend, sizeof c->backend, "%s", h->backend && *h->backend ? h->backend : "host");
    int cuda = strncmp(c->backend, "cuda", 4) == 0;
    if (cuda)
        e = kvc__cuda_open(&c->cuda, strcmp(c->backend, "cuda-ipc") == 0, c->err, sizeof c->err);
    for (size_t i = 0; i < h->n_pools && e == KV_ERR_OK; i++) {
        const Kvd__PoolDesc *p = h->pools[i];
        if (p->fd_index >= (uint32_t)nfds || p->bytes == 0) {
            e = kvc_fail(c, KV_ERR_MALFORMED, "pool descriptor %zu names fd %u of %d", i,
                         p->fd_index, nfds);
            break;
        }
        int dir = p->kind == KVD__POOL_DESC__KIND__KIND_DIRECTORY;
        /* what the kernels and kvc_page_ptr will compute from the descriptor must lie inside
         * the mapping: a buggy or mismatched daemon gets MALFORMED here, not SIGBUS later */
        if ((e = kvc_check_desc(c, p, i, dir, cuda ? -1 : fds[p->fd_index])) != KV_ERR_OK)
            break;
        void *m;
        if (cuda) {
            uint8_t *d = NULL;
            e = kvc__cuda_map(c->cuda, fds[p->fd_index], p->bytes, dir, &d, c->err,
                              sizeof c->err);
            if (e != KV_ERR_OK)
                break;
            m = d;
        } else {
            m = mmap(NULL, p->bytes, dir ? PROT_READ : PROT_READ | PROT_WRITE, MAP_SHARED,
                     fds[p->fd_index], 0);
        }
        if (m == MAP_FAILED) {
            e = kvc_fail(c, KV_ERR_IO, "mmap(%s, %llu bytes) failed: %s",
                         dir ? "directory" : "pool", (unsigned long long)p->bytes,
                         strerror(errno));
            break;
        }
        if (dir) {
            c->dir = m;
            c->dir_map_bytes = p->bytes;
            c->dir_entries = p->pages;
        } else if ((unsigned)p->format < KV_FMT_COUNT && !c->pool[p->format]) {
            c->pool[p->format] = m;
            c->pool_map_bytes[p->format] = p->bytes;
            c->pool_pages[p->format] = p->pages;
            c->page_bytes[p->format] = p->page_bytes;
        } else if (!cuda) {
            munmap(m, p->bytes);
        }
    }
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    /* every daemon sends a directory and an FP8 pool (pages_fp8 >= 1; TQ3 may be absent):
     * without them kvc_page_ptr is always NULL and the kernels would get NULL bases */
    if (e == KV_ERR_OK && !c->dir)
        e = kvc_fail(c, KV_ERR_MALFORMED, "hello reply: no directory among its %zu pools",
                     h->n_pools);
    else if (e == KV_ERR_OK && !c->pool[KV_FMT_FP8])
        e = kvc_fail(c, KV_ERR_MALFORMED, "hello reply: no FP8 pool among its %zu pools",
                     h->n_pools);
    if (e != KV_ERR_OK)
        kvc_unmap(c);
    return e;
}

/* Forget everything the previous hello gave us: mappings, session, epochs, waiting replies.
 * The pools of a restarted daemon are new objects; the old mappings only keep dead memory
 * alive (host) or point at freed device memory (cuda). */
static void kvc_session_reset(kvc_t *c)
{
    kvc_unmap(c);
    kvc_stash_clear(c);
    c->session = c->epoch = c->instance = c->new_instance = c->max_msg = 0;
    c->max_alloc = c->max_tokens = 0;
    c->restarted = 0;
    c->nlate = 0;  /* their replies are below the next id_floor: dropped on arrival */
    c->nmoved = 0; /* page ids of the old session mean nothing now */
    c->npeeks = 0; /* their replies are below the next id_floor too */
    c->safe_epoch = 0; /* an engine in manual mode declares again (epochs restart too) */
    c->pid_seen = 0;
    c->backend[0] = '\0';
    c->events_endpoint[0] = '\0';
    c->id_floor = c->next_id;
}

kv_err_t kvc_hello(kvc_t *c, const char *namespace_, const char *client_name, int map)
{
    KVC_NULL_CHECK(c);
    const char *nsv = namespace_ ? namespace_ : "", *namev = client_name ? client_name : "";
    if (strlen(nsv) > KVP_MAX_STRING || strlen(namev) > KVP_MAX_STRING)
        return kvc_fail(c, KV_ERR_INVALID_ARGUMENT,
                        "hello: namespace and client name are at most %u bytes each",
                        KVP_MAX_STRING);
    /* copy first: kvc_rehello passes our own buffers */
    char ns[sizeof c->hello_ns], name[sizeof c->hello_name];
    snprintf(ns, sizeof ns, "%s", nsv);
    snprintf(name, sizeof name, "%s", namev);
    memcpy(c->hello_ns, ns, sizeof ns);
    memcpy(c->hello_name, name, sizeof name);
    c->hello_map = map;
    c->helloed = 1;
    if (c->session || c->instance || c->dir || c->cuda)
        kvc_session_reset(c);
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__HelloReq h = KVD__HELLO_REQ__INIT;
    req.body_case = KVD__REQUEST__BODY_HELLO;
    req.hello = &h;
    h.namespace_ = ns;
    h.client_name = name;
    h.pid = (uint32_t)getpid();
    Kvd__Reply *rep;
    kv_err_t e = kvc_call_req(c, &req, &rep);
    if (e != KV_ERR_OK) {
        kvc_reply_free(&rep);
        return e;
    }
    if (rep->body_case != KVD__REPLY__BODY_HELLO || !rep->hello->geometry) {
        kvc_reply_free(&rep);
        return kvc_fail(c, KV_ERR_MALFORMED, "hello reply without a body");
    }
    const Kvd__HelloRep *hr = rep->hello;
    if (hr->session_id == 0) { /* kvc_session_id() == 0 means "no session" to our callers */
        kvc_reply_free(&rep);
        return kvc_fail(c, KV_ERR_MALFORMED, "hello reply: session 0");
    }
    c->session = hr->session_id;
    c->epoch = hr->epoch;
    c->max_msg = hr->max_msg_bytes;
    c->max_alloc = hr->max_alloc;
    c->max_tokens = hr->max_tokens;
    c->instance = hr->instance;
    c->pid_seen = hr->pid;
    snprintf(c->events_endpoint, sizeof c->events_endpoint, "%s",
             hr->events_endpoint ? hr->events_endpoint : "");
    c->geom.layers = hr->geometry->layers;
    c->geom.kv_heads = hr->geometry->kv_heads;
    c->geom.head_dim = hr->geometry->head_dim;
    c->geom.page_tokens = hr->geometry->page_tokens;
    c->geom.seed = hr->geometry->seed;
    /* the backend the daemon serves, also without a mapping (kvctl, map = 0) */
    snprintf(c->backend, sizeof c->backend, "%s",
             hr->backend && *hr->backend ? hr->backend : "host");
    if (!kv_geom_valid(&c->geom))
        e = kvc_fail(c, KV_ERR_MALFORMED, "hello reply: invalid geometry (%u layers, %u heads, "
                                          "head_dim %u, %u tokens per page)",
                     c->geom.layers, c->geom.kv_heads, c->geom.head_dim, c->geom.page_tokens);
    else if (map)
        e = kvc_map(c, hr);
    if (e != KV_ERR_OK)
        c->session = 0; /* no usable session here; the daemon's is reused by the next hello */
    kvc_reply_free(&rep);
    return e;
}

kv_err_t kvc_rehello(kvc_t *c)
{
    KVC_NULL_CHECK(c);
    if (!c->helloed)
        return kvc_fail(c, KV_ERR_FAILED_PRECONDITION, "kvc_rehello before any kvc_hello");
    return kvc_hello(c, c->hello_ns, c->hello_name, c->hello_map);
}

int kvc_daemon_restarted(const kvc_t *c)
{
    return c ? c->restarted : 0;
}

uint64_t kvc_session_id(const kvc_t *c)
{
    return c ? c->session : 0;
}
uint32_t kvc_pid_seen(const kvc_t *c)
{
    return c ? c->pid_seen : 0;
}
uint64_t kvc_epoch(const kvc_t *c)
{
    return c ? c->epoch : 0;
}
const kv_geom_t *kvc_geom(const kvc_t *c)
{
    return c ? &c->geom : NULL;
}
uint32_t kvc_max_alloc(const kvc_t *c)
{
    return c ? c->max_alloc : 0;
}
uint32_t kvc_max_tokens(const kvc_t *c)
{
    return c ? c->max_tokens : 0;
}
uint32_t kvc_pool_pages(const kvc_t *c, kv_fmt_t f)
{
    return c && (unsigned)f < KV_FMT_COUNT ? c->pool_pages[f] : 0;
}
uint64_t kvc_page_bytes(const kvc_t *c, kv_fmt_t f)
{
    return c && (unsigned)f < KV_FMT_COUNT ? c->page_bytes[f] : 0;
}
uint8_t *kvc_pool_base(const kvc_t *c, kv_fmt_t f)
{
    return c && (unsigned)f < KV_FMT_COUNT ? c->pool[f] : NULL;
}
const volatile kv_dir_entry_t *kvc_directory(const kvc_t *c)
{
    return c ? c->dir : NULL;
}
const char *kvc_events_endpoint(const kvc_t *c)
{
    return c ? c->events_endpoint : "";
}
uint64_t kvc_instance(const kvc_t *c)
{
    return c ? c->instance : 0;
}
const char *kvc_backend(const kvc_t *c)
{
    return c && c->backend[0] ? c->backend : "host";
}
int kvc_on_device(const kvc_t *c)
{
    return c && c->cuda != NULL;
}
void kvc_pools(const kvc_t *c, kv_pools_t *out)
{
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        out->base[f] = c ? c->pool[f] : NULL;
        out->pages[f] = c ? c->pool_pages[f] : 0;
    }
}
uint32_t kvc_dir_entries(const kvc_t *c)
{
    return c ? c->dir_entries : 0;
}

uint8_t *kvc_page_ptr(const kvc_t *c, uint32_t page)
{
    if (!c || !c->dir || page >= c->dir_entries)
        return NULL;
    kv_dir_entry_t e;
    if (c->cuda) {
        if (kvc__cuda_read(c->cuda, &c->dir[page], &e, sizeof e) != KV_ERR_OK)
            return NULL;
    } else {
        e = __atomic_load_n(&c->dir[page], __ATOMIC_ACQUIRE);
    }
    if (!(kv_dir_flags(e) & KV_DIR_VALID))
        return NULL;
    kv_fmt_t f = kv_dir_fmt(e);
    uint32_t phys = kv_dir_phys(e);
    if ((unsigned)f >= KV_FMT_COUNT || !c->pool[f] || phys >= c->pool_pages[f])
        return NULL;
    return c->pool[f] + (uint64_t)phys * c->page_bytes[f];
}

/* ---- typed calls ------------------------------------------------------------------------- */
#define KVC_REQ(body_, field_, type_, init_)                                                       \
    Kvd__Request req = KVD__REQUEST__INIT;                                                         \
    type_ body = init_;                                                                            \
    req.body_case = KVD__REQUEST__BODY_##body_;                                                    \
    req.field_ = &body

static kv_err_t kvc_expect(kvc_t *c, Kvd__Reply *rep, int body_case)
{
    if ((int)rep->body_case != body_case)
        return kvc_fail(c, KV_ERR_MALFORMED, "reply %llu has body %d, expected %d",
                        (unsigned long long)rep->id, (int)rep->body_case, body_case);
    return KV_ERR_OK;
}

/* Page ids of a reply against the directory we mapped (kvctl maps none: nothing to check).
 * Engines index the directory with them in kernels, where an id past its end reads beyond
 * the mapping; returns the first bad index, or n. */
static size_t kvc_bad_page(const kvc_t *c, const uint32_t *pages, size_t n)
{
    size_t i = 0;
    while (c->dir && i < n && pages[i] < c->dir_entries)
        i++;
    return c->dir ? i : n;
}

static kv_err_t kvc_alloc_send_r(kvc_t *c, kv_fmt_t f, uint32_t n, uint32_t reserve,
                                 uint64_t *id)
{
    KVC_REQ(ALLOC, alloc, Kvd__AllocReq, KVD__ALLOC_REQ__INIT);
    body.count = n;
    body.format = (Kvd__Format)f;
    body.reserve = reserve; /* 0: not on the wire (proto3 default) */
    return kvc_send_req(c, &req, id);
}

kv_err_t kvc_alloc_send(kvc_t *c, kv_fmt_t f, uint32_t n, uint64_t *id)
{
    return kvc_alloc_send_r(c, f, n, 0, id);
}

/* The caller's part of an alloc reply (rep freed here; e: its status). */
static kv_err_t kvc_alloc_take(kvc_t *c, Kvd__Reply *rep, kv_err_t e, uint32_t n,
                               uint32_t *pages)
{
    if (e == KV_ERR_OK && (e = kvc_expect(c, rep, KVD__REPLY__BODY_ALLOC)) == KV_ERR_OK) {
        const size_t k = rep->alloc->n_pages, bad = kvc_bad_page(c, rep->alloc->pages, k);
        if (k != n)
            e = kvc_fail(c, KV_ERR_MALFORMED, "alloc of %u returned %zu pages", n, k);
        else if (bad < k)
            e = kvc_fail(c, KV_ERR_MALFORMED, "alloc returned page %u, past the %u-entry directory",
                         rep->alloc->pages[bad], c->dir_entries);
        else if (n)
            memcpy(pages, rep->alloc->pages, n * sizeof *pages);
        if (e == KV_ERR_OK) /* the caller's now: ids reused (kvc_moved_t) */
            kvc_moved_forget(c, pages, n);
        if (e != KV_ERR_OK) /* each page came with a reference the caller never sees */
            kvc_give_back(c, rep->alloc->pages, k);
    }
    kvc_reply_free(&rep);
    return e;
}

kv_err_t kvc_alloc_recv(kvc_t *c, uint64_t id, uint32_t n, uint32_t *pages)
{
    Kvd__Reply *rep;
    kv_err_t e = kvc_recv_id(c, id, &rep);
    return rep ? kvc_alloc_take(c, rep, e, n, pages) : e;
}

kv_err_t kvc_alloc(kvc_t *c, kv_fmt_t f, uint32_t n, uint32_t *pages)
{
    return kvc_alloc_reserve(c, f, n, 0, pages);
}

kv_err_t kvc_alloc_reserve(kvc_t *c, kv_fmt_t f, uint32_t n, uint32_t reserve, uint32_t *pages)
{
    KVC_NULL_CHECK(c);
    uint64_t id;
    Kvd__Reply *rep;
    kv_err_t e = kvc_late_reserve(c);
    if (e != KV_ERR_OK || (e = kvc_alloc_send_r(c, f, n, reserve, &id)) != KV_ERR_OK)
        return e;
    if ((e = kvc_recv_id(c, id, &rep)) != KV_ERR_OK && !rep) {
        kvc_late_add(c, id, KVC_LATE_REFS, 0); /* nobody can ask for it again: kvc_late */
        return e;
    }
    return kvc_alloc_take(c, rep, e, n, pages);
}

/* 1 when an earlier seal of `page` failed without its reply, which kvc_settle still awaits. */
static int kvc_seal_pending(const kvc_t *c, uint32_t page, size_t *at)
{
    for (size_t i = 0; i < c->nlate; i++)
        if (c->late[i].kind == KVC_LATE_SEAL && !c->late[i].gave_up && c->late[i].page == page)
            return *at = i, 1;
    return 0;
}

/* Before a request names pages[n] (and `also`; KVP_NO_PAGE: none): when an earlier seal of one
 * of them failed without its reply, wait for that reply first. The daemon handles our
 * requests in order, so it will have applied that seal when it reads this request: if it was
 * a dedupe, the page's reference is elsewhere by then, and only the reply says where. TIMEOUT
 * (nothing sent) when it does not come within the client's timeout; the next request naming
 * the page no longer waits for it (a reply that never comes must not block the page for good:
 * one that did not decode, say). */
static kv_err_t kvc_settle(kvc_t *c, const uint32_t *pages, size_t n, uint32_t also)
{
    int64_t deadline = 0;
    for (;;) {
        size_t at = 0;
        int pending = also != KVP_NO_PAGE && kvc_seal_pending(c, also, &at);
        for (size_t j = 0; j < n && !pending && c->nlate; j++)
            pending = kvc_seal_pending(c, pages[j], &at);
        if (!pending)
            return KV_ERR_OK;
        if (!deadline)
            deadline = kvc_now_ms() + c->timeout_ms;
        Kvd__Reply *r;
        kv_err_t e = kvc_recv_one(c, deadline, &r);
        if (e == KV_ERR_TIMEOUT) {
            const uint32_t page = c->late[at].page;
            c->late[at].gave_up = 1;
            return kvc_fail(c, KV_ERR_TIMEOUT,
                            "the reply to an earlier seal of page %u (it failed without one) has "
                            "not come within %d ms: until it does, libkvc cannot tell whether "
                            "the daemon moved that page's reference to a cached copy (nothing "
                            "sent; the next call naming the page no longer waits)",
                            page, c->timeout_ms);
        }
        if (e != KV_ERR_OK || (e = kvc_route(c, r)) != KV_ERR_OK)
            return e;
    }
}

/* Where a late dedupe moved the reference of `page` (kvc_moved_t); `page` if none did. */
static uint32_t kvc_moved_to(const kvc_t *c, uint32_t page)
{
    for (size_t j = 0; j < c->nmoved; j++)
        if (c->moved[j].from == page)
            return c->moved[j].to;
    return page;
}

/* pages[n] with each page that a late dedupe moved replaced by where its reference went.
 * Returns pages itself when none was moved, else a copy in *owned (free it); NULL: out of
 * memory. */
static const uint32_t *kvc_moved_map(kvc_t *c, const uint32_t *pages, size_t n,
                                     uint32_t **owned)
{
    *owned = NULL;
    for (size_t i = 0; i < n && c->nmoved; i++) {
        const uint32_t to = kvc_moved_to(c, pages[i]);
        if (to == pages[i])
            continue;
        if (!*owned) {
            if (!(*owned = malloc(n * sizeof **owned))) {
                kvc_fail(c, KV_ERR_NOMEM, "out of memory mapping %zu page ids", n);
                return NULL;
            }
            memcpy(*owned, pages, n * sizeof **owned);
        }
        (*owned)[i] = to;
    }
    return *owned ? *owned : pages;
}

kv_err_t kvc_seal(kvc_t *c, uint32_t page, uint32_t prev, const uint32_t *tokens, size_t n,
                  const void *extra, size_t extra_len, uint32_t *out_page)
{
    KVC_NULL_CHECK(c);
    KVC_REQ(SEAL, seal, Kvd__SealReq, KVD__SEAL_REQ__INIT);
    kv_err_t e = kvc_settle(c, NULL, 0, prev);
    if (e != KV_ERR_OK)
        return e;
    if (prev != KVP_NO_PAGE) /* a prev deduplicated late is held (and sealed) where it went */
        prev = kvc_moved_to(c, prev);
    body.page = page;
    body.has_prev = prev != KVP_NO_PAGE;
    body.prev = prev != KVP_NO_PAGE ? prev : 0;
    body.tokens = (uint32_t *)tokens;
    body.n_tokens = n;
    body.extra.data = (uint8_t *)extra;
    body.extra.len = extra ? extra_len : 0;
    Kvd__Reply *rep;
    e = kvc_call_req(c, &req, &rep);
    if (e == KV_ERR_OK && (e = kvc_expect(c, rep, KVD__REPLY__BODY_SEAL)) == KV_ERR_OK) {
        if (kvc_bad_page(c, &rep->seal->page, 1) == 0)
            e = kvc_fail(c, KV_ERR_MALFORMED, "seal returned page %u, past the %u-entry directory",
                         rep->seal->page, c->dir_entries);
        else if (out_page)
            *out_page = rep->seal->page;
        if (e == KV_ERR_OK) /* the caller holds it now: an id reused (kvc_moved_t) */
            kvc_moved_forget(c, &rep->seal->page, 1);
    }
    kvc_reply_free(&rep);
    return e;
}

kv_err_t kvc_lookup_send(kvc_t *c, const uint32_t *tokens, size_t n, int peek, uint64_t *id)
{
    KVC_REQ(LOOKUP, lookup, Kvd__LookupReq, KVD__LOOKUP_REQ__INIT);
    body.tokens.data = (uint8_t *)tokens; /* little-endian host: the array is the wire form */
    body.tokens.len = n * sizeof(uint32_t);
    body.peek = peek != 0;
    return kvc_send(c, &req, id);
}

/* Release pages[cap..k) of a lookup reply (k > cap). When that fails, the call fails and the
 * caller gets none of the pages: those it would have got, pages[0..cap), are given back too
 * (they leaked), and so are the others when the daemon surely did not release them (it said
 * so, or never got the request); after a TIMEOUT it may still, in order: not those. */
static kv_err_t kvc_lookup_trim(kvc_t *c, const uint32_t *pages, size_t k, size_t cap)
{
    uint64_t rid;
    Kvd__Reply *rr = NULL;
    int maybe_applied = 0;
    kv_err_t e = kvc_late_reserve(c);
    if (e == KV_ERR_OK && (e = kvc_release_send_ids(c, pages + cap, k - cap, &rid)) == KV_ERR_OK &&
        (e = kvc_recv_id(c, rid, &rr)) != KV_ERR_OK && !rr) {
        kvc_late_add(c, rid, KVC_LATE_DROP, 0);
        maybe_applied = 1;
    }
    kvc_reply_free(&rr);
    if (e == KV_ERR_OK)
        return e;
    char why[256];
    snprintf(why, sizeof why, "%s", kvc_errmsg(c));
    kvc_give_back(c, pages, maybe_applied ? cap : k);
    return kvc_fail(c, e, "lookup: returning the %zu pages beyond cap %zu failed (%s); %s",
                    k - cap, cap, why,
                    maybe_applied ? "the pages within cap were given back (*npages 0)"
                                  : "all the pages were given back (*npages 0)");
}

kv_err_t kvc_lookup(kvc_t *c, const uint32_t *tokens, size_t n, const void *extra,
                    size_t extra_len, int peek, uint32_t *pages, size_t cap, size_t *npages,
                    uint32_t *tokens_matched)
{
    KVC_REQ(LOOKUP, lookup, Kvd__LookupReq, KVD__LOOKUP_REQ__INIT);
    body.tokens.data = (uint8_t *)tokens;
    body.tokens.len = n * sizeof(uint32_t);
    body.peek = peek != 0;
    body.extra.data = (uint8_t *)extra;
    body.extra.len = extra ? extra_len : 0;
    Kvd__Reply *rep;
    *npages = 0;
    kv_err_t e = kvc_call_req(c, &req, &rep);
    if (e == KV_ERR_OK && (e = kvc_expect(c, rep, KVD__REPLY__BODY_LOOKUP)) == KV_ERR_OK) {
        size_t k = rep->lookup->n_pages;
        uint64_t matched = rep->lookup->tokens_matched;
        const uint32_t pt = c->geom.page_tokens;
        const size_t bad = kvc_bad_page(c, rep->lookup->pages, k);
        /* a match is whole pages of the tokens sent: more pages than that, or more tokens
         * than the pages hold, would make a caller skip prefill it has no KV for */
        if (bad < k || (pt && (k > n / pt || matched > (uint64_t)k * pt))) {
            if (!peek)
                kvc_give_back(c, rep->lookup->pages, k);
            if (bad < k)
                e = kvc_fail(c, KV_ERR_MALFORMED,
                             "lookup returned page %u, past the %u-entry directory",
                             rep->lookup->pages[bad], c->dir_entries);
            else
                e = kvc_fail(c, KV_ERR_MALFORMED,
                             "lookup of %zu tokens returned %zu pages of %u tokens and %llu "
                             "tokens matched",
                             n, k, pt, (unsigned long long)matched);
            kvc_reply_free(&rep);
            return e;
        }
        if (k > cap) {
            /* keep the reference accounting honest: hand back what we cannot return; the
             * tokens matched are then those of the pages returned, never more (a caller that
             * skips prefill by tokens_matched must hold a page for each of them) */
            const uint64_t covered = (uint64_t)cap * c->geom.page_tokens;
            matched = matched < covered ? matched : covered;
            if (!peek && (e = kvc_lookup_trim(c, rep->lookup->pages, k, cap)) != KV_ERR_OK) {
                kvc_reply_free(&rep);
                return e;
            }
            k = cap;
        }
        if (k)
            memcpy(pages, rep->lookup->pages, k * sizeof *pages);
        if (!peek) /* referenced, the caller's now: ids reused (kvc_moved_t) */
            kvc_moved_forget(c, pages, k);
        *npages = k;
        if (tokens_matched)
            *tokens_matched = (uint32_t)matched;
    }
    kvc_reply_free(&rep);
    return e;
}

/* The release request as given: pages from replies (kvc_give_back) are never mapped. */
static kv_err_t kvc_release_send_ids(kvc_t *c, const uint32_t *pages, size_t n, uint64_t *id)
{
    KVC_REQ(RELEASE, release, Kvd__ReleaseReq, KVD__RELEASE_REQ__INIT);
    body.pages = (uint32_t *)pages;
    body.n_pages = n;
    return kvc_send_req(c, &req, id);
}

kv_err_t kvc_release_send(kvc_t *c, const uint32_t *pages, size_t n, uint64_t *id)
{
    KVC_NULL_CHECK(c);
    uint32_t *owned;
    const uint32_t *ids;
    kv_err_t e = kvc_settle(c, pages, n, KVP_NO_PAGE);
    if (e != KV_ERR_OK)
        return e;
    if (!(ids = kvc_moved_map(c, pages, n, &owned)))
        return KV_ERR_NOMEM;
    e = kvc_release_send_ids(c, ids, n, id);
    free(owned);
    return e;
}

kv_err_t kvc_release(kvc_t *c, const uint32_t *pages, size_t n)
{
    KVC_NULL_CHECK(c);
    uint64_t id;
    kv_err_t e = kvc_late_reserve(c);
    if (e != KV_ERR_OK || (e = kvc_release_send(c, pages, n, &id)) != KV_ERR_OK)
        return e;
    Kvd__Reply *rep;
    if ((e = kvc_recv_id(c, id, &rep)) != KV_ERR_OK && !rep)
        kvc_late_add(c, id, KVC_LATE_DROP, 0);
    kvc_reply_free(&rep);
    return e;
}

kv_err_t kvc_seq_open(kvc_t *c, const char *tag, uint64_t *seq)
{
    KVC_REQ(SEQ_OPEN, seq_open, Kvd__SeqOpenReq, KVD__SEQ_OPEN_REQ__INIT);
    body.tag = (char *)(tag ? tag : "");
    Kvd__Reply *rep;
    kv_err_t e = kvc_call_req(c, &req, &rep);
    if (e == KV_ERR_OK && (e = kvc_expect(c, rep, KVD__REPLY__BODY_SEQ_OPEN)) == KV_ERR_OK)
        *seq = rep->seq_open->seq_id;
    kvc_reply_free(&rep);
    return e;
}

kv_err_t kvc_seq_append(kvc_t *c, uint64_t seq, const uint32_t *pages, size_t n)
{
    KVC_NULL_CHECK(c);
    KVC_REQ(SEQ_APPEND, seq_append, Kvd__SeqAppendReq, KVD__SEQ_APPEND_REQ__INIT);
    uint32_t *owned;
    const uint32_t *ids;
    kv_err_t e = kvc_settle(c, pages, n, KVP_NO_PAGE);
    if (e != KV_ERR_OK)
        return e;
    if (!(ids = kvc_moved_map(c, pages, n, &owned))) /* the loose reference is where it went */
        return KV_ERR_NOMEM;
    body.seq_id = seq;
    body.pages = (uint32_t *)ids;
    body.n_pages = n;
    Kvd__Reply *rep;
    e = kvc_call_req(c, &req, &rep);
    kvc_reply_free(&rep);
    free(owned);
    return e;
}

kv_err_t kvc_seq_close(kvc_t *c, uint64_t seq)
{
    KVC_REQ(SEQ_CLOSE, seq_close, Kvd__SeqCloseReq, KVD__SEQ_CLOSE_REQ__INIT);
    body.seq_id = seq;
    Kvd__Reply *rep;
    kv_err_t e = kvc_call_req(c, &req, &rep);
    kvc_reply_free(&rep);
    return e;
}

kv_err_t kvc_goodbye(kvc_t *c, uint64_t *released)
{
    KVC_REQ(GOODBYE, goodbye, Kvd__GoodbyeReq, KVD__GOODBYE_REQ__INIT);
    Kvd__Reply *rep;
    kv_err_t e = kvc_call_req(c, &req, &rep);
    if (e == KV_ERR_OK && (e = kvc_expect(c, rep, KVD__REPLY__BODY_GOODBYE)) == KV_ERR_OK) {
        c->session = 0;
        if (released)
            *released = rep->goodbye->released;
    }
    kvc_reply_free(&rep);
    return e;
}

kv_err_t kvc_heartbeat(kvc_t *c, uint64_t completed_epoch)
{
    KVC_REQ(HEARTBEAT, heartbeat, Kvd__HeartbeatReq, KVD__HEARTBEAT_REQ__INIT);
    body.completed_epoch = completed_epoch;
    Kvd__Reply *rep;
    kv_err_t e = kvc_call_req(c, &req, &rep);
    /* the epoch never goes back (kvc_reply_status): a lower one would make the next call
     * report a decreasing safe epoch, which the daemon refuses */
    if (e == KV_ERR_OK && (e = kvc_expect(c, rep, KVD__REPLY__BODY_HEARTBEAT)) == KV_ERR_OK &&
        rep->heartbeat->epoch > c->epoch)
        c->epoch = rep->heartbeat->epoch;
    kvc_reply_free(&rep);
    return e;
}
