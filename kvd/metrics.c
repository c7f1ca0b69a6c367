/* metrics.c — see metrics.h. Names: kvd_<stat> for the core's table (per-format ones with
 * label format="fp8"|"tq3"), kvd_rpc_* for the server's own figures. */
#include "metrics.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "util.h"

static const uint64_t kvd_lat_us[KVD_LAT_NB] = KVD_LAT_BUCKETS_US;

void kvd_metrics_observe(kvd_metrics_t *m, kvp_op_t op, uint64_t ns, kv_err_t status)
{
    unsigned i = (unsigned)op <= KVP_OP_COUNT ? (unsigned)op : KVP_OP_COUNT;
    m->requests[i]++;
    m->lat_sum_ns[i] += ns;
    for (int b = 0; b < KVD_LAT_NB; b++)
        if (ns <= kvd_lat_us[b] * 1000u) {
            m->lat_bucket[i][b]++;
            break;
        }
    if (kv_err_valid((int)status))
        m->errors[status]++;
}

typedef struct kvd_buf_s {
    char *p;
    size_t len, cap;
    int oom;
} kvd_buf_t;

static void kvd_bprintf(kvd_buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void kvd_bprintf(kvd_buf_t *b, const char *fmt, ...)
{
    if (b->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t nc = b->cap * 2 + (size_t)n;
        char *np = realloc(b->p, nc);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = nc;
    }
}

int kvd_metrics_render(const kvd_metrics_t *m, const kvd_stats_t *st,
                       const kvd_metrics_extra_t *x, char **out)
{
    kvd_buf_t b = {.cap = 16384};
    b.p = malloc(b.cap);
    if (!b.p)
        return -1;
    b.p[0] = '\0';
#define KVD_M_SCALAR_(name, kind, help)                                                            \
    kvd_bprintf(&b, "# HELP kvd_%s %s\n# TYPE kvd_%s %s\nkvd_%s %llu\n", #name, help, #name,       \
                strcmp(#kind, "COUNTER") ? "gauge" : "counter", #name,                             \
                (unsigned long long)st->name);
    KVD_STATS_MAP(KVD_M_SCALAR_)
#undef KVD_M_SCALAR_
#define KVD_M_FMT_(name, kind, help)                                                               \
    kvd_bprintf(&b, "# HELP kvd_%s %s\n# TYPE kvd_%s %s\n", #name, help, #name,                    \
                strcmp(#kind, "COUNTER") ? "gauge" : "counter");                                   \
    for (int f = 0; f < KV_FMT_COUNT; f++)                                                         \
        kvd_bprintf(&b, "kvd_%s{format=\"%s\"} %llu\n", #name, kvd_fmt_name(f),                    \
                    (unsigned long long)st->name[f]);
    KVD_STATS_FMT_MAP(KVD_M_FMT_)
#undef KVD_M_FMT_
    kvd_bprintf(&b,
                "# HELP kvd_bytes_per_live_token pool bytes of referenced pages per token they "
                "hold\n# TYPE kvd_bytes_per_live_token gauge\nkvd_bytes_per_live_token %.3f\n",
                x->bytes_per_live_token);
    struct {
        const char *name, *help, *type; /* running totals are counters (rate() needs that) */
        uint64_t v;
    } g[] = {
        {"sessions_connected", "sessions whose process is alive", "gauge", x->sessions_connected},
        {"sessions_lease_expired", "live sessions silent for longer than lease_ms", "gauge",
         x->sessions_lease_expired},
        {"zap_admitted", "connections admitted by the ZAP handler", "counter", x->zap_admitted},
        {"zap_refused", "connections refused by the ZAP handler", "counter", x->zap_refused},
        {"fd_handovers", "pool fd sets handed over SCM_RIGHTS", "counter", x->fd_handovers},
        {"fd_refused", "fd socket connections refused", "counter", x->fd_refused},
        {"uptime_seconds", "seconds since start", "gauge", x->uptime_s},
        {"draining", "1 while draining", "gauge", x->draining},
    };
    for (size_t i = 0; i < sizeof g / sizeof g[0]; i++)
        kvd_bprintf(&b, "# HELP kvd_%s %s\n# TYPE kvd_%s %s\nkvd_%s %llu\n", g[i].name,
                    g[i].help, g[i].name, g[i].type, g[i].name, (unsigned long long)g[i].v);
    kvd_bprintf(&b, "# HELP kvd_rpc_errors_total replies by status code\n"
                    "# TYPE kvd_rpc_errors_total counter\n");
    for (int e = 0; e < KV_ERR_COUNT_; e++)
        kvd_bprintf(&b, "kvd_rpc_errors_total{code=\"%s\"} %llu\n", kv_err_name(e),
                    (unsigned long long)m->errors[e]);
    kvd_bprintf(&b, "# HELP kvd_rpc_latency_seconds request decode to reply sent\n"
                    "# TYPE kvd_rpc_latency_seconds histogram\n");
    for (int op = 0; op <= KVP_OP_COUNT; op++) {
        const char *on = kvp_op_name((kvp_op_t)op);
        uint64_t cum = 0;
        for (int bk = 0; bk < KVD_LAT_NB; bk++) {
            cum += m->lat_bucket[op][bk];
            kvd_bprintf(&b, "kvd_rpc_latency_seconds_bucket{op=\"%s\",le=\"%g\"} %llu\n", on,
                        (double)kvd_lat_us[bk] * 1e-6, (unsigned long long)cum);
        }
        kvd_bprintf(&b, "kvd_rpc_latency_seconds_bucket{op=\"%s\",le=\"+Inf\"} %llu\n", on,
                    (unsigned long long)m->requests[op]);
        kvd_bprintf(&b, "kvd_rpc_latency_seconds_sum{op=\"%s\"} %.9f\n", on,
                    (double)m->lat_sum_ns[op] * 1e-9);
        kvd_bprintf(&b, "kvd_rpc_latency_seconds_count{op=\"%s\"} %llu\n", on,
                    (unsigned long long)m->requests[op]);
    }
    if (b.oom) {
        free(b.p);
        return -1;
    }
    *out = b.p;
    return 0;
}

/* ---- HTTP -------------------------------------------------------------------------------- */
struct kvd_http_conn_s {
    uv_tcp_t tcp;
    uv_timer_t idle; /* closes a connection that sends no complete request in time */
    kvd_http_t *srv;
    kvd_http_conn_t *prev, *next;
    char req[2048];
    size_t len;
    uv_write_t wr;
    char *resp;
    int responded;
    int closing;
    int handles; /* of tcp and idle, still open: the connection is freed at 0 */
};

static void kvd_http_handle_closed(uv_handle_t *h)
{
    kvd_http_conn_t *c = h->data;
    if (--c->handles == 0) {
        kvd_free(c->resp);
        kvd_free(c);
    }
}

/* Unlink and close both handles; idempotent (a write cancelled by the close calls back). */
static void kvd_http_conn_close(kvd_http_conn_t *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    if (c->prev)
        c->prev->next = c->next;
    else
        c->srv->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->srv->nconns--;
    uv_timer_stop(&c->idle);
    uv_close((uv_handle_t *)&c->idle, kvd_http_handle_closed);
    uv_close((uv_handle_t *)&c->tcp, kvd_http_handle_closed);
}

static void kvd_http_idle(uv_timer_t *t)
{
    kvd_http_conn_close(t->data);
}

static void kvd_http_written(uv_write_t *w, int status)
{
    kvd_http_conn_close(w->data);
}

static void kvd_http_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    kvd_http_conn_t *c = h->data;
    size_t room = sizeof c->req - 1 - c->len;
    *buf = uv_buf_init(c->req + c->len, (unsigned)room);
}

static void kvd_http_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    kvd_http_conn_t *c = s->data;
    if (c->responded || c->closing)
        return;
    if (n < 0) {
        kvd_http_conn_close(c);
        return;
    }
    c->len += (size_t)n;
    c->req[c->len] = '\0';
    int full = c->len >= sizeof c->req - 1;
    if (!strstr(c->req, "\r\n\r\n") && !strstr(c->req, "\n\n") && !full)
        return;
    c->responded = 1;
    uv_read_stop(s);
    char *body = NULL;
    const char *status = "200 OK";
    if (strncmp(c->req, "GET ", 4) != 0) {
        status = "405 Method Not Allowed";
    } else if (c->srv->render(c->srv->ud, &body) != 0) {
        status = "500 Internal Server Error";
        body = NULL;
    }
    size_t bl = body ? strlen(body) : 0;
    size_t cap = bl + 256;
    c->resp = kvd_malloc(cap);
    if (!c->resp) {
        free(body);
        kvd_http_conn_close(c);
        return;
    }
    int hl = snprintf(c->resp, cap,
                      "HTTP/1.1 %s\r\nContent-Type: text/plain; version=0.0.4\r\n"
                      "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                      status, bl);
    if (body)
        memcpy(c->resp + hl, body, bl);
    free(body);
    uv_buf_t ub = uv_buf_init(c->resp, (unsigned)((size_t)hl + bl));
    c->wr.data = c;
    if (uv_write(&c->wr, s, &ub, 1, kvd_http_written) != 0)
        kvd_http_conn_close(c);
}

/* The connection of last resort. A connection callback that leaves its connection unaccepted
 * makes libuv stop watching the listening socket until uv_accept is called: returning on an
 * allocation failure ended the metrics endpoint for the daemon's life. So a connection whose
 * memory cannot be had is still accepted, into this handle, and closed at once (the scraper
 * sees the connection close and retries at its next interval). Static because this path must
 * need no memory; a daemon has one listener. While the handle closes (until the next loop
 * iteration) a second such connection waits, the listener paused, and is taken from the close
 * callback: nothing is left unaccepted for good. */
static uv_tcp_t kvd_http_spare;
static int kvd_http_spare_busy;
static uv_stream_t *kvd_http_spare_next; /* a listener whose connection waits for the spare */
static uint64_t kvd_http_nomem;          /* connections closed for want of memory */

static void kvd_http_accept(uv_stream_t *srv, int status);

static void kvd_http_spare_closed(uv_handle_t *hd)
{
    kvd_http_spare_busy = 0;
    uv_stream_t *next = kvd_http_spare_next;
    kvd_http_spare_next = NULL;
    if (next)
        kvd_http_accept(next, 0);
}

static void kvd_http_refuse(uv_stream_t *srv)
{
    if (kvd_http_spare_busy) {
        kvd_http_spare_next = srv;
        return;
    }
    kvd_http_nomem++;
    if (uv_tcp_init(srv->loop, &kvd_http_spare) != 0)
        return; /* cannot fail on Linux (no allocation, no socket until accept) */
    kvd_http_spare_busy = 1;
    if (uv_accept(srv, (uv_stream_t *)&kvd_http_spare) != 0)
        KVD_LOGD("metrics: uv_accept of a refused connection failed");
    uv_close((uv_handle_t *)&kvd_http_spare, kvd_http_spare_closed);
    KVD_LOGW("metrics: out of memory for a connection: closed it (%" PRIu64 " so far)",
             kvd_http_nomem);
}

static void kvd_http_accept(uv_stream_t *srv, int status)
{
    kvd_http_t *h = srv->data;
    if (status < 0)
        return;
    kvd_http_conn_t *c = kvd_calloc(1, sizeof *c);
    if (!c) {
        kvd_http_refuse(srv);
        return;
    }
    c->srv = h;
    uv_tcp_init(srv->loop, &c->tcp);
    uv_timer_init(srv->loop, &c->idle);
    c->tcp.data = c->idle.data = c;
    c->handles = 2;
    c->next = h->conns; /* linked first, so that every path out closes through the list */
    if (h->conns)
        h->conns->prev = c;
    h->conns = c;
    h->nconns++;
    if (uv_accept(srv, (uv_stream_t *)&c->tcp) != 0) {
        kvd_http_conn_close(c);
        return;
    }
    if (h->nconns > KVD_HTTP_MAX_CONNS) {
        /* Full. Refusing the newcomer let anyone who holds 64 idle connections lock the scraper
         * out (and keep it out by reconnecting every 10 s). A scraper sends its GET as soon as
         * it connects, so the oldest connection still without a request is the one to drop;
         * the newcomer is refused only when all the others are being answered. */
        kvd_http_conn_t *old = NULL;
        for (kvd_http_conn_t *p = h->conns; p; p = p->next)
            if (p != c && !p->responded)
                old = p; /* the list is newest first: the last one is the oldest */
        if (!old) {
            kvd_http_conn_close(c);
            return;
        }
        kvd_http_conn_close(old);
    }
    if (uv_read_start((uv_stream_t *)&c->tcp, kvd_http_alloc, kvd_http_read) != 0 ||
        uv_timer_start(&c->idle, kvd_http_idle, KVD_HTTP_IDLE_MS, 0) != 0)
        kvd_http_conn_close(c);
}

int kvd_http_start(kvd_http_t *h, uv_loop_t *loop, const char *addr, int port,
                   int (*render)(void *ud, char **out), void *ud, char *err, size_t errlen)
{
    memset(h, 0, sizeof *h);
    h->render = render;
    h->ud = ud;
    struct sockaddr_storage sa;
    if (uv_ip4_addr(addr, port, (struct sockaddr_in *)&sa) != 0 &&
        uv_ip6_addr(addr, port, (struct sockaddr_in6 *)&sa) != 0) {
        snprintf(err, errlen, "metrics_addr '%s' is not an IP address", addr);
        return -1;
    }
    uv_tcp_init(loop, &h->tcp);
    h->tcp.data = h;
    h->active = 1;
    int r = uv_tcp_bind(&h->tcp, (struct sockaddr *)&sa, 0);
    if (r == 0)
        r = uv_listen((uv_stream_t *)&h->tcp, 16, kvd_http_accept);
    if (r != 0) {
        snprintf(err, errlen, "metrics listen on %s:%d failed: %s", addr, port, uv_strerror(r));
        kvd_http_stop(h);
        return -1;
    }
    return 0;
}

void kvd_http_stop(kvd_http_t *h)
{
    if (kvd_http_spare_next == (uv_stream_t *)&h->tcp) /* closing: nothing to accept for it */
        kvd_http_spare_next = NULL;
    if (h->active && !uv_is_closing((uv_handle_t *)&h->tcp))
        uv_close((uv_handle_t *)&h->tcp, NULL);
    h->active = 0;
    while (h->conns) /* an idle scraper's connection would keep the loop alive */
        kvd_http_conn_close(h->conns);
}
