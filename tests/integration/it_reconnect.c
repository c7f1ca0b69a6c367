/* it_reconnect.c — a client survives a restart of its daemon (DESIGN.md "Prefix cache",
 * docs/protocol.md "Daemon restarts").
 *
 * One kvc_t in this process lives across the restart: it seals NPAGES pages of known tokens
 * with known bytes written through its mapping (holding their references, as an engine in the
 * middle of a request does), `kvctl snapshot`, SIGTERM, a new kvd on the SAME endpoint and
 * snapshot directory. The same kvc_t: the next call fails with NO_SESSION and the message
 * "daemon restarted (instance X → Y): call kvc_rehello; ..." (an admin call too, which the new
 * daemon itself would answer OK: the instance in the reply gives it away); kvc_rehello()
 * succeeds; kvc_instance() changed; a lookup of the same tokens hits all NPAGES pages and the
 * bytes read through the NEW mapping are the ones written before; `kvctl check` is clean.
 * Without a snapshot the same sequence works and the lookup misses (0 pages). A request sent
 * while no daemon listens waits in the DEALER's queue and gets the new daemon's answer (the
 * restart error), within the call's timeout. A request the daemon took and never answered
 * (SIGSTOP, then SIGKILL: a crash) ends in TIMEOUT after the call's timeout, not a hang, and a
 * daemon started over the crashed one's stale socket files serves the same client after
 * kvc_rehello. kvc_rehello before any hello is FAILED_PRECONDITION (also after a hello refused
 * locally for a client name over 256 bytes: nothing is remembered from it).
 */
#include <inttypes.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "itest.h"

#define NPAGES 4u
#define PT     16u /* itest's page_tokens */

#define SEED 5000u /* the known prompt (itest_seal_known) */

static void must_contain(const char *s, const char *what)
{
    if (!strstr(s, what))
        fail_msg("\"%s\" lacks \"%s\"", s, what);
}

/* Seal the prompt through c's mapping; the references stay held (the engine is mid-request). */
static void seal_prompt(kvc_t *c, uint32_t *pages)
{
    itest_seal_known(c, SEED, NPAGES, pages);
}

/* The first calls after the restart: NO_SESSION naming both instances, for a session call and
 * for an admin call alike; nothing is retried behind the caller's back. */
static void expect_restart_error(kvc_t *c, uint64_t old_inst)
{
    uint32_t pg[1];
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, pg), KV_ERR_NO_SESSION);
    const char *m = kvc_errmsg(c);
    print_message("after the restart: %s\n", m);
    must_contain(m, "daemon restarted (instance ");
    must_contain(m, "call kvc_rehello; page ids from before are invalid");
    char hex[24];
    snprintf(hex, sizeof hex, "%016" PRIx64 " → ", old_inst);
    must_contain(m, hex);
    assert_int_equal(kvc_daemon_restarted(c), 1);

    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__StatusReq st = KVD__STATUS_REQ__INIT;
    req.body_case = KVD__REQUEST__BODY_STATUS;
    req.status = &st;
    Kvd__Reply *rep = NULL;
    assert_int_equal(kvc_call(c, &req, &rep), KV_ERR_NO_SESSION);
    kvc_reply_free(&rep);
    must_contain(kvc_errmsg(c), "daemon restarted");
    /* the old instance's session is still what kvc_instance() reports until kvc_rehello */
    assert_int_equal(kvc_instance(c), old_inst);
}

/* Lookup of the prompt through c; checks every hit's bytes through c's current mapping and
 * releases the hits. Returns the number of pages hit. */
static size_t lookup_prompt(kvc_t *c)
{
    uint32_t tok[NPAGES * PT], pages[NPAGES], matched = 0;
    itest_prompt_tokens(SEED, NPAGES, tok);
    size_t np = 0;
    assert_int_equal(kvc_lookup(c, tok, NPAGES * PT, NULL, 0, 0, pages, NPAGES, &np, &matched),
                     KV_ERR_OK);
    assert_int_equal(matched, np * PT);
    itest_check_known(c, SEED, pages, np);
    if (np)
        assert_int_equal(kvc_release(c, pages, np), KV_ERR_OK);
    return np;
}

static void test_reconnect_with_snapshot(void **state)
{
    (void)state;
    char sdir[64];
    itest_tmpdir(sdir, sizeof sdir, "kvd-it-reco");
    const char *extra[] = {"--snapshot_dir", sdir, "--lifecycle_ms", "0", NULL};
    itest_kvd_t k;
    itest_kvd_start(&k, extra);

    kvc_t *c = itest_connect(&k, "engine");
    uint64_t inst0 = kvc_instance(c);
    assert_true(inst0 != 0);
    uint32_t pages[NPAGES];
    seal_prompt(c, pages);
    char out[4096];
    const char *snap[] = {"snapshot", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, snap), 0);
    must_contain(out, "4 pages");

    assert_int_equal(itest_kvd_restart(&k, extra), 0);
    expect_restart_error(c, inst0);

    assert_int_equal(kvc_rehello(c), KV_ERR_OK);
    assert_int_equal(kvc_daemon_restarted(c), 0);
    assert_true(kvc_instance(c) != 0);
    assert_true(kvc_instance(c) != inst0);
    assert_true(kvc_session_id(c) != 0);
    assert_int_equal(lookup_prompt(c), NPAGES);
    /* the new session works as any other: a fresh page through the new mapping */
    uint32_t pg[2];
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 2, pg), KV_ERR_OK);
    assert_non_null(kvc_page_ptr(c, pg[1]));
    assert_int_equal(kvc_release(c, pg, 2), KV_ERR_OK);
    itest_assert_check(&k);

    kvc_close(&c);
    assert_int_equal(itest_kvd_stop(&k), 0);
    itest_rmtree(sdir);
}

static void test_reconnect_without_snapshot(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvc_t *c = itest_connect(&k, "engine");
    uint64_t inst0 = kvc_instance(c);
    uint32_t pages[NPAGES];
    seal_prompt(c, pages);
    uint64_t seq = 0;
    assert_int_equal(kvc_seq_open(c, "before", &seq), KV_ERR_OK);

    assert_int_equal(itest_kvd_restart(&k, NULL), 0);
    expect_restart_error(c, inst0);
    /* still refused, still explained, until the caller acts */
    assert_int_equal(kvc_seq_close(c, seq), KV_ERR_NO_SESSION);
    must_contain(kvc_errmsg(c), "call kvc_rehello");

    assert_int_equal(kvc_rehello(c), KV_ERR_OK);
    assert_true(kvc_instance(c) != inst0);
    assert_int_equal(lookup_prompt(c), 0); /* the cache died with the old daemon */
    /* the old sequence id means nothing to the new daemon */
    assert_int_equal(kvc_seq_close(c, seq), KV_ERR_NOT_FOUND);
    uint32_t pg[3];
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 3, pg), KV_ERR_OK);
    uint8_t *p = kvc_page_ptr(c, pg[2]);
    assert_non_null(p);
    p[0] = 0x5a;
    assert_int_equal(kvc_release(c, pg, 3), KV_ERR_OK);
    itest_assert_check(&k);
    kvc_close(&c);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* Sent while the daemon is down: queued by the DEALER, answered by the next daemon. */
static void test_request_while_down(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvc_t *c = itest_connect(&k, "engine");
    uint64_t inst0 = kvc_instance(c);
    assert_int_equal(itest_kvd_down(&k), 0);
    uint64_t id = 0;
    assert_int_equal(kvc_alloc_send(c, KV_FMT_FP8, 1, &id), KV_ERR_OK);
    itest_kvd_up(&k, NULL);
    uint32_t pg[1];
    int64_t t0 = itest_now_us();
    assert_int_equal(kvc_alloc_recv(c, id, 1, pg), KV_ERR_NO_SESSION);
    must_contain(kvc_errmsg(c), "daemon restarted");
    /* far below the 30 s call timeout: the reconnect interval is 100 ms */
    int64_t ms = (itest_now_us() - t0) / 1000;
    print_message("queued request answered %lld ms after the new daemon was ready\n",
                  (long long)ms);
    assert_true(ms < 10000);
    assert_int_equal(kvc_rehello(c), KV_ERR_OK);
    assert_true(kvc_instance(c) != inst0);
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, pg), KV_ERR_OK);
    assert_int_equal(kvc_release(c, pg, 1), KV_ERR_OK);
    itest_assert_check(&k);
    kvc_close(&c);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* A crash with a request in flight: TIMEOUT, then the restart error, then kvc_rehello. */
static void test_crash_in_flight(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvc_t *c = NULL;
    const int timeout_ms = 2000; /* short enough for the test, long for a 100 ms reconnect */
    assert_int_equal(kvc_connect(&c, k.endpoint, timeout_ms), KV_ERR_OK);
    assert_int_equal(kvc_hello(c, NULL, "engine", 1), KV_ERR_OK);
    uint64_t inst0 = kvc_instance(c);
    assert_int_equal(kill(k.pid, SIGSTOP), 0);
    uint64_t id = 0;
    assert_int_equal(kvc_alloc_send(c, KV_FMT_FP8, 1, &id), KV_ERR_OK);
    struct timespec ts = {0, 50 * 1000000L}; /* let libzmq hand the frame to the kernel */
    nanosleep(&ts, NULL);
    assert_int_equal(kill(k.pid, SIGKILL), 0);
    int st = 0;
    assert_int_equal(waitpid(k.pid, &st, 0), k.pid);
    k.pid = 0;
    uint32_t pg[1];
    int64_t t0 = itest_now_us();
    assert_int_equal(kvc_alloc_recv(c, id, 1, pg), KV_ERR_TIMEOUT);
    int64_t ms = (itest_now_us() - t0) / 1000;
    assert_true(ms >= timeout_ms - 50 && ms < timeout_ms + 3000);
    must_contain(kvc_errmsg(c), "no reply from the daemon within 2000 ms");

    itest_kvd_up(&k, NULL); /* over the stale socket files of the killed daemon */
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, pg), KV_ERR_NO_SESSION);
    must_contain(kvc_errmsg(c), "daemon restarted");
    assert_int_equal(kvc_rehello(c), KV_ERR_OK);
    assert_true(kvc_instance(c) != inst0);
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, pg), KV_ERR_OK);
    assert_non_null(kvc_page_ptr(c, pg[0]));
    assert_int_equal(kvc_release(c, pg, 1), KV_ERR_OK);
    itest_assert_check(&k);
    kvc_close(&c);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

static void test_rehello_needs_hello(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvc_t *c = NULL;
    assert_int_equal(kvc_connect(&c, k.endpoint, 30000), KV_ERR_OK);
    assert_int_equal(kvc_rehello(c), KV_ERR_FAILED_PRECONDITION);
    must_contain(kvc_errmsg(c), "before any kvc_hello");
    /* a name the daemon would refuse is refused before anything is sent or remembered */
    char longname[300];
    memset(longname, 'n', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    assert_int_equal(kvc_hello(c, NULL, longname, 0), KV_ERR_INVALID_ARGUMENT);
    must_contain(kvc_errmsg(c), "at most 256 bytes");
    assert_int_equal(kvc_rehello(c), KV_ERR_FAILED_PRECONDITION);
    assert_int_equal(kvc_daemon_restarted(c), 0);
    kvc_close(&c);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* "Ready" (the fd socket exists) means a SIGTERM takes the clean path: exit 0. kvd used to
 * install its signal handlers just after creating the socket, and a SIGTERM in between killed
 * it (status 128 + 15; seen once in CI under ASan). itest_kvd_start polls every 5 ms, which
 * almost never hits that window, so this test spawns kvd itself, spins on the socket file and
 * sends SIGTERM the moment it appears, twenty times. */
static void test_sigterm_at_ready(void **state)
{
    (void)state;
    char dir[256], ep[320], fds[400], log[320];
    itest_tmpdir(dir, sizeof dir, "kvd-ready");
    snprintf(ep, sizeof ep, "ipc://%s/kvd.sock", dir);
    snprintf(fds, sizeof fds, "%s/kvd.sock.fds", dir);
    snprintf(log, sizeof log, "%s/kvd.log", dir);
    const char *argv[] = {
        KVD_BIN, "--endpoint",    ep,   "--layers",    "2",  "--kv_heads",  "2",  "--head_dim",
        "64",    "--page_tokens", "16", "--pages_fp8", "64", "--pages_tq3", "16", NULL};
    for (int i = 0; i < 20; i++) {
        unlink(fds);
        const pid_t pid = itest_kvd_exec(argv, log, 1);
        struct stat st;
        int64_t t0 = itest_now_us();
        while (stat(fds, &st) != 0 && itest_now_us() - t0 < 30000000) {
        }
        assert_int_equal(kill(pid, SIGTERM), 0);
        int status = 0;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            itest_print_log(log);
            fail_msg("stop %d at the ready point: status %d (exited %d, signal %d)", i, status,
                     WIFEXITED(status) ? WEXITSTATUS(status) : -1,
                     WIFSIGNALED(status) ? WTERMSIG(status) : 0);
        }
    }
    itest_rmtree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sigterm_at_ready),
        cmocka_unit_test(test_reconnect_with_snapshot),
        cmocka_unit_test(test_reconnect_without_snapshot),
        cmocka_unit_test(test_request_while_down),
        cmocka_unit_test(test_crash_in_flight),
        cmocka_unit_test(test_rehello_needs_hello),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
