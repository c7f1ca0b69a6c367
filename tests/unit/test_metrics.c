/* test_metrics.c — the metrics HTTP listener (kvd/metrics.c) under allocation failure.
 *
 * A connection whose memory cannot be allocated is accepted and closed, and the listener keeps
 * serving: the next scrape gets its 200. Regression: kvd_http_accept returned without
 * accepting when its calloc failed, and libuv stops watching a listening socket whose
 * connection callback leaves the connection unaccepted: the metrics endpoint was dead until
 * the daemon restarted. The allocation goes through kvd_calloc, so the fault hook
 * (kvd_alloc_fail_after, util.h) reaches it.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include <cmocka.h>

#include "metrics.h"
#include "util.h"

static int render(void *ud, char **out)
{
    (*(int *)ud)++;
    *out = strdup("kvd_test 1\n");
    return *out ? 0 : -1;
}

static int connect_to(int port)
{
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(s >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    /* the kernel completes the handshake from the backlog: no loop turn needed */
    assert_int_equal(connect(s, (struct sockaddr *)&a, sizeof a), 0);
    return s;
}

/* Run the loop until fd reaches EOF or ~3 s pass (well under KVD_HTTP_IDLE_MS, whose timer
 * would close an idle connection too); what was read goes into out (NUL-terminated). Returns
 * its length at EOF, -1 when the connection was still open at the end. */
static ssize_t loop_read(uv_loop_t *loop, int fd, char *out, size_t cap)
{
    _Static_assert(KVD_HTTP_IDLE_MS > 3000 * 2, "the idle timer must not decide the test");
    size_t len = 0;
    for (uint64_t t0 = kvd_mono_ns(); kvd_mono_ns() - t0 < 3000000000ull;) {
        uv_run(loop, UV_RUN_NOWAIT);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 1) == 1) {
            ssize_t r = read(fd, out + len, cap - 1 - len);
            if (r <= 0) { /* EOF (or reset): the server closed it */
                out[len] = '\0';
                return (ssize_t)len;
            }
            len += (size_t)r;
        }
    }
    out[len] = '\0';
    return -1;
}

static void test_accept_nomem_keeps_listening(void **state)
{
    (void)state;
    uv_loop_t loop;
    assert_int_equal(uv_loop_init(&loop), 0);
    kvd_http_t h;
    int renders = 0;
    char err[256] = "";
    if (kvd_http_start(&h, &loop, "127.0.0.1", 0, render, &renders, err, sizeof err) != 0)
        fail_msg("kvd_http_start: %s", err);
    struct sockaddr_storage sa;
    int sl = sizeof sa;
    assert_int_equal(uv_tcp_getsockname(&h.tcp, (struct sockaddr *)&sa, &sl), 0);
    const int port = ntohs(((struct sockaddr_in *)&sa)->sin_port);
    char buf[4096];
    /* two connections while every allocation fails: each is accepted and closed (the second
     * while the first's handle is still closing), nothing rendered */
    kvd_alloc_fail_after(1);
    int a = connect_to(port), b = connect_to(port);
    ssize_t n = loop_read(&loop, a, buf, sizeof buf);
    if (n != 0)
        fail_msg("a connection without memory was not closed (%zd bytes)", n);
    n = loop_read(&loop, b, buf, sizeof buf);
    if (n != 0)
        fail_msg("the second connection without memory was not closed (%zd bytes)", n);
    kvd_alloc_fail_after(0);
    close(a);
    close(b);
    assert_int_equal(renders, 0);
    /* memory is back: the listener still accepts and a scrape is answered */
    int c = connect_to(port);
    const char *get = "GET /metrics HTTP/1.1\r\n\r\n";
    assert_int_equal(write(c, get, strlen(get)), (ssize_t)strlen(get));
    n = loop_read(&loop, c, buf, sizeof buf);
    if (n <= 0 || !strstr(buf, "200 OK") || !strstr(buf, "kvd_test 1"))
        fail_msg("no scrape after the allocation failures: %zd bytes: %s", n, n > 0 ? buf : "");
    close(c);
    assert_int_equal(renders, 1);
    kvd_http_stop(&h);
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&loop), 0);
    assert_int_equal(kvd_alloc_live(), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_accept_nomem_keeps_listening),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
