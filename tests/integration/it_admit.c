/* it_admit.c — a peer whose uid/gid is not admitted is refused with a clear error
 * (issue 3, test 3). The daemon admits only uid 12345 (not ours): hello fails at once with
 * PERMISSION_DENIED and an explanation (no timeout), kvctl exits 1 naming the refusal, and the
 * fd socket hands nothing to our pid. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmocka.h>

#include "itest.h"

static void test_unadmitted_uid_is_refused(void **state)
{
    (void)state;
    if (getuid() == 12345)
        fail_msg("this test needs to run as a uid other than 12345");
    const char *extra[] = {"--admit_uids", "12345", NULL};
    itest_kvd_t k;
    itest_kvd_start(&k, extra);
    kvc_t *c = NULL;
    assert_int_equal(kvc_connect(&c, k.endpoint, 30000), KV_ERR_OK);
    int64_t t0 = itest_now_us();
    kv_err_t e = kvc_hello(c, NULL, "intruder", 1);
    int64_t ms = (itest_now_us() - t0) / 1000;
    assert_int_equal(e, KV_ERR_PERMISSION_DENIED);
    assert_non_null(strstr(kvc_errmsg(c), "refused"));
    assert_non_null(strstr(kvc_errmsg(c), "admit_uids"));
    assert_true(ms < 25000); /* detected from the handshake, not by running out the timeout */
    print_message("refused in %lld ms: %s\n", (long long)ms, kvc_errmsg(c));
    kvc_close(&c);

    char out[4096];
    const char *args[] = {"status", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, args), 1);

    /* the fd socket gives nothing to a peer that is not admitted */
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    char path[700];
    snprintf(path, sizeof path, "%s.fds", k.endpoint + 6);
    assert_true(strlen(path) < sizeof sa.sun_path);
    memcpy(sa.sun_path, path, strlen(path) + 1);
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(s >= 0);
    assert_int_equal(connect(s, (struct sockaddr *)&sa, sizeof sa), 0);
    char buf[64];
    struct timeval tv = {30, 0};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    assert_int_equal(read(s, buf, sizeof buf), 0); /* closed with nothing sent */
    close(s);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

static void test_own_uid_is_admitted_by_default(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvc_t *c = itest_connect(&k, "friend");
    assert_int_equal(kvc_pid_seen(c), (uint32_t)getpid()); /* pid from the kernel */
    assert_non_null(kvc_pool_base(c, KV_FMT_FP8));
    kvc_close(&c);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unadmitted_uid_is_refused),
        cmocka_unit_test(test_own_uid_is_admitted_by_default),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
