/* metrics.h — RPC figures of the server and the Prometheus text exposition.
 *
 * The core's counters come from its stats X-macro (stats.h) and are rendered by iterating it;
 * this module adds what only the server sees: per-operation request counts and latency
 * histograms (decode → reply sent), errors by status code, sessions by state. The HTTP side is
 * deliberately tiny: one libuv TCP listener on metrics_addr:metrics_port (loopback by default),
 * each connection gets the full text exposition for any GET and is closed (Prometheus opens a
 * fresh connection per scrape anyway).
 */
#ifndef KVD_METRICS_H
#define KVD_METRICS_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "kv_err.h"
#include "kvproto.h"
#include "stats.h"

/* Upper bounds of the latency buckets in microseconds (+Inf implicit). */
#define KVD_LAT_BUCKETS_US {5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000, 100000}
#define KVD_LAT_NB 11

typedef struct kvd_metrics_s {
    uint64_t requests[KVP_OP_COUNT + 1];
    uint64_t lat_bucket[KVP_OP_COUNT + 1][KVD_LAT_NB];
    uint64_t lat_sum_ns[KVP_OP_COUNT + 1];
    uint64_t errors[KV_ERR_COUNT_];
} kvd_metrics_t;

/* Gauges the server adds beside the core's stats. */
typedef struct kvd_metrics_extra_s {
    uint64_t sessions_connected, sessions_lease_expired, zap_admitted, zap_refused;
    uint64_t fd_handovers, fd_refused, uptime_s, draining;
    double bytes_per_live_token;
} kvd_metrics_extra_t;

void kvd_metrics_observe(kvd_metrics_t *m, kvp_op_t op, uint64_t ns, kv_err_t status);
/* Render the whole exposition into a malloc'd NUL-terminated string (*out; free()). */
int kvd_metrics_render(const kvd_metrics_t *m, const kvd_stats_t *st,
                       const kvd_metrics_extra_t *x, char **out);

/* HTTP listener. render(ud, &text) must return a malloc'd string. */
/* Connections are tracked so that kvd_http_stop can close them (an idle scraper must not keep
 * the loop, and so the daemon's shutdown, alive); each also closes after KVD_HTTP_IDLE_MS
 * without a complete request, and at most KVD_HTTP_MAX_CONNS are open at once: one more
 * closes the oldest that has sent no complete request yet (refused only when all are being
 * answered), so idle connections cannot lock a scraper out. */
#define KVD_HTTP_IDLE_MS 10000
#define KVD_HTTP_MAX_CONNS 64
typedef struct kvd_http_conn_s kvd_http_conn_t;
typedef struct kvd_http_s {
    uv_tcp_t tcp;
    int active;
    int (*render)(void *ud, char **out);
    void *ud;
    kvd_http_conn_t *conns; /* open connections, a doubly linked list */
    unsigned nconns;
} kvd_http_t;
int kvd_http_start(kvd_http_t *h, uv_loop_t *loop, const char *addr, int port,
                   int (*render)(void *ud, char **out), void *ud, char *err, size_t errlen);
void kvd_http_stop(kvd_http_t *h);

#endif /* KVD_METRICS_H */
