/* it_admit.c — a peer whose uid/gid is not admitted is refused with a clear error
 * (issue 3, test 3). The daemon admits only uid 12345 (not ours): hello fails at once with
 * PERMISSION_DENIED and an explanation (no timeout), kvctl exits 1 naming the refusal, and the
 * fd socket hands nothing to our pid. Also socket_group: the socket files shared with one group
 * (directory 0750, sockets 0660), an unknown group a startup error. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
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

/* socket_group: the directory 0750 and both socket files 0660, owned by the group, and an
 * admitted peer still gets in; an unknown group is a startup error naming it. The group is our
 * own primary group (the only one a test can count on being a member of). */
static void test_socket_group(void **state)
{
    (void)state;
    struct group *g = getgrgid(getgid());
    if (!g)
        fail_msg("no group entry for our gid %u", (unsigned)getgid());
    char name[256];
    snprintf(name, sizeof name, "%s", g->gr_name);
    const char *extra[] = {"--socket_group", name, NULL};
    itest_kvd_t k;
    itest_kvd_start(&k, extra);
    const char *sock = k.endpoint + 6;
    char dir[640], fds[650];
    snprintf(dir, sizeof dir, "%s", sock);
    *strrchr(dir, '/') = '\0';
    snprintf(fds, sizeof fds, "%s.fds", sock);
    struct {
        const char *path;
        unsigned mode;
    } want[] = {{dir, 0750}, {sock, 0660}, {fds, 0660}};
    for (int i = 0; i < 3; i++) {
        struct stat st;
        assert_int_equal(stat(want[i].path, &st), 0);
        if ((st.st_mode & 0777) != want[i].mode || st.st_gid != getgid())
            fail_msg("%s: mode %03o gid %u, want %03o gid %u", want[i].path,
                     (unsigned)(st.st_mode & 0777), (unsigned)st.st_gid, want[i].mode,
                     (unsigned)getgid());
    }
    kvc_t *c = itest_connect(&k, "group-member");
    uint32_t pages[2];
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 2, pages), KV_ERR_OK);
    kvc_close(&c);
    assert_int_equal(itest_kvd_stop(&k), 0);

    char out[65536];
    const char *bad[] = {KVD_BIN, "--endpoint", "ipc:///tmp/kvd-it-admit-nogroup/kvd.sock",
                         "--socket_group", "no-such-group-kvd", NULL};
    assert_int_not_equal(itest_run(bad, out, sizeof out), 0);
    if (!strstr(out, "no-such-group-kvd"))
        fail_msg("the error does not name the group: %s", out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unadmitted_uid_is_refused),
        cmocka_unit_test(test_own_uid_is_admitted_by_default),
        cmocka_unit_test(test_socket_group),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
