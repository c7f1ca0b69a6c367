/* it_reclaim.c — references are reclaimed when the process exits, not when its socket closes
 * (issue 3, test 2; DESIGN.md "Ownership").
 *
 * test_kill9_reclaims_everything: a client holding many references (open and sealed pages,
 *   a sequence) is killed with SIGKILL; once it has exited every request reference is gone,
 *   its unsealed pages are free, its sealed pages are still cached, kvctl check is clean.
 * test_regression_socket_close_frees_nothing: the client closes its socket and stays alive;
 *   for the whole time it lives nothing is released, and only its exit reclaims.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "itest.h"

#define PT 16

static int holder(const itest_kvd_t *k, int wfd, int rfd, int close_socket, uint32_t npages,
                  uint32_t nsealed)
{
    kvc_t *c = itest_connect(k, "holder");
    uint32_t pages[128], prev = KVP_NO_PAGE;
    if (kvc_alloc(c, KV_FMT_FP8, npages, pages) != KV_ERR_OK)
        return 10;
    for (uint32_t i = 0; i < nsealed; i++) {
        uint32_t tok[PT];
        for (int j = 0; j < PT; j++)
            tok[j] = 77 + i * PT + (uint32_t)j;
        if (kvc_seal(c, pages[i], prev, tok, PT, NULL, 0, &prev) != KV_ERR_OK)
            return 11;
    }
    uint64_t seq;
    if (kvc_seq_open(c, "held", &seq) != KV_ERR_OK ||
        kvc_seq_append(c, seq, pages + nsealed, 8) != KV_ERR_OK)
        return 12;
    if (close_socket)
        kvc_close(&c); /* the socket is gone; the process (and its "kernels") live on */
    char b = 'r';
    if (write(wfd, &b, 1) != 1)
        return 13;
    if (read(rfd, &b, 1) != 1) /* wait for the parent (or for SIGKILL) */
        return 14;
    return 0;
}

/* A holder process (see holder) that has reported ready: its pid, and to_child, the pipe end
 * that lets it exit normally when written. */
typedef struct held_s {
    pid_t pid;
    int to_child;
} held_t;

static held_t spawn_holder(const itest_kvd_t *k, int close_socket, uint32_t npages,
                           uint32_t nsealed)
{
    int c2p[2], p2c[2];
    assert_int_equal(pipe(c2p), 0);
    assert_int_equal(pipe(p2c), 0);
    pid_t pid = fork();
    if (pid == 0)
        _exit(holder(k, c2p[1], p2c[0], close_socket, npages, nsealed));
    char b;
    assert_int_equal(read(c2p[0], &b, 1), 1);
    close(c2p[0]);
    close(c2p[1]);
    close(p2c[0]);
    return (held_t){.pid = pid, .to_child = p2c[1]};
}

static void test_kill9_reclaims_everything(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    held_t h = spawn_holder(&k, 0, 100, 10);
    pid_t pid = h.pid;
    assert_int_equal(itest_stat(&k, "request_refs"), 100);
    assert_int_equal(itest_stat(&k, "pages_open.fp8"), 90);
    assert_int_equal(itest_stat(&k, "cache_entries"), 10);
    assert_int_equal(kill(pid, SIGKILL), 0);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    close(h.to_child);
    int64_t t0 = itest_now_us();
    int64_t ms = itest_wait_stat(&k, "request_refs", 0, 30000);
    assert_true(ms >= 0);
    print_message("reclaim observed %.1f ms after waitpid (poll included)\n",
                  (double)(itest_now_us() - t0) / 1000.0);
    assert_int_equal(itest_stat(&k, "sessions"), 0);
    assert_int_equal(itest_stat(&k, "pages_open.fp8"), 0);
    assert_int_equal(itest_stat(&k, "cache_entries"), 10);
    assert_int_equal(itest_stat(&k, "reclaimed_refs"), 100);
    assert_int_equal(itest_stat(&k, "reclaimed_open_pages"), 90);
    assert_true(itest_wait_stat(&k, "pages_free.fp8", 256 - 10, 30000) >= 0);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

static void test_regression_socket_close_frees_nothing(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    held_t h = spawn_holder(&k, 1, 20, 4);
    pid_t pid = h.pid;
    /* The socket is closed; a buggy daemon would reclaim now. Watch for a while: this wait is
     * the test (the daemon gets every chance to do the wrong thing), not a synchronisation. */
    int64_t t0 = itest_now_us();
    while (itest_now_us() - t0 < 500000) {
        assert_int_equal(itest_stat(&k, "request_refs"), 20);
        assert_int_equal(itest_stat(&k, "sessions"), 1);
        struct timespec ts = {0, 20000000};
        nanosleep(&ts, NULL);
    }
    assert_int_equal(itest_stat(&k, "pages_open.fp8"), 16);
    assert_int_equal(write(h.to_child, "x", 1), 1); /* now let it exit normally */
    close(h.to_child);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_true(itest_wait_stat(&k, "request_refs", 0, 30000) >= 0);
    assert_int_equal(itest_stat(&k, "pages_open.fp8"), 0);
    assert_int_equal(itest_stat(&k, "cache_entries"), 4);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kill9_reclaims_everything),
        cmocka_unit_test(test_regression_socket_close_frees_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
