/* it_metrics.c — the Prometheus endpoint serves the core's stats table, per-format pool
 * figures, RPC latency histograms per operation and errors by code, on loopback; an idle
 * connection does not hold the daemon's shutdown, and 64 of them do not lock a scraper out. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "itest.h"

static int connect_port(int p)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)p)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    return fd;
}

/* kvd on the itest endpoint with a metrics listener on a free port; returns the port */
static int start_with_metrics(itest_kvd_t *k)
{
    char port[16];
    const int p = itest_free_port();
    snprintf(port, sizeof port, "%d", p);
    const char *extra[] = {"--metrics_port", port, NULL};
    itest_kvd_start(k, extra);
    return p;
}

static void test_metrics_families(void **state)
{
    (void)state;
    itest_kvd_t k;
    const int p = start_with_metrics(&k);
    kvc_t *c = itest_connect(&k, "metrics");
    uint32_t pages[3];
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 3, pages), KV_ERR_OK);
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 0, pages), KV_ERR_INVALID_ARGUMENT);
    static char out[1 << 20];
    assert_true(itest_scrape(p, out, sizeof out) > 1000);
    assert_non_null(strstr(out, "HTTP/1.1 200 OK"));
    assert_non_null(strstr(out, "\nkvd_alloc_pages 3\n"));
    assert_non_null(strstr(out, "# TYPE kvd_alloc_pages counter"));
    assert_non_null(strstr(out, "kvd_pages_open{format=\"fp8\"} 3\n"));
    assert_non_null(strstr(out, "kvd_sessions_connected 1\n"));
    assert_non_null(strstr(out, "kvd_rpc_errors_total{code=\"INVALID_ARGUMENT\"} 1\n"));
    assert_non_null(strstr(out, "kvd_rpc_latency_seconds_count{op=\"alloc\"} 2\n"));
    assert_non_null(strstr(out, "kvd_rpc_latency_seconds_bucket{op=\"hello\",le=\"+Inf\"} 1\n"));
    assert_non_null(strstr(out, "kvd_bytes_per_live_token "));
    kvc_close(&c);
    /* an idle scraper connection (connected, nothing sent) must not hold the shutdown: before
     * session 10 the daemon kept running until the peer closed, and itest_kvd_stop's SIGKILL
     * after 30 s made the exit status 137 */
    int idle = connect_port(p);
    assert_true(itest_scrape(p, out, sizeof out) > 1000); /* accepted: the loop saw it */
    assert_int_equal(itest_kvd_stop(&k), 0);
    close(idle);
}

/* 64 connections that never send a request (one local process can hold them, no privilege
 * needed) must not lock the scraper out. Regression: the 65th connection was the one closed,
 * so every scrape was reset for as long as the 64 stayed (10 s each, renewed by reconnecting).
 * Now the oldest connection without a request makes room. */
static void test_metrics_idle_connections_do_not_lock_out(void **state)
{
    (void)state;
    itest_kvd_t k;
    const int p = start_with_metrics(&k);
    enum { N = 64 }; /* KVD_HTTP_MAX_CONNS */
    int idle[N];
    for (int i = 0; i < N; i++)
        idle[i] = connect_port(p);
    static char out[1 << 20];
    size_t n = itest_scrape(p, out, sizeof out);
    if (n < 1000 || !strstr(out, "HTTP/1.1 200 OK"))
        fail_msg("scrape with %d idle connections open got %zu bytes: '%.60s'", N, n, out);
    /* the bound still holds: the oldest idle connection was closed for it */
    struct pollfd pf = {.fd = idle[0], .events = POLLIN};
    assert_int_equal(poll(&pf, 1, 30000), 1);
    char b;
    assert_true(read(idle[0], &b, 1) <= 0);
    /* and the others still wait (closed only by their own 10 s or the shutdown) */
    pf.fd = idle[N - 1];
    assert_int_equal(poll(&pf, 1, 0), 0);
    assert_int_equal(itest_kvd_stop(&k), 0);
    for (int i = 0; i < N; i++)
        close(idle[i]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_metrics_families),
        cmocka_unit_test(test_metrics_idle_connections_do_not_lock_out),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
