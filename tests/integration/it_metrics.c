/* it_metrics.c — the Prometheus endpoint serves the core's stats table, per-format pool
 * figures, RPC latency histograms per operation and errors by code, on loopback; an idle
 * connection does not hold the daemon's shutdown. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "itest.h"

static void test_metrics_families(void **state)
{
    (void)state;
    char port[16];
    int p = itest_free_port();
    snprintf(port, sizeof port, "%d", p);
    const char *extra[] = {"--metrics_port", port, NULL};
    itest_kvd_t k;
    itest_kvd_start(&k, extra);
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
    int idle = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(idle >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)p)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(idle, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_true(itest_scrape(p, out, sizeof out) > 1000); /* accepted: the loop saw it */
    assert_int_equal(itest_kvd_stop(&k), 0);
    close(idle);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_metrics_families),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
