/* it_sessions.c — one process, several sessions: every hello maps the pools.
 *
 * The fd socket knows only the peer's pid (SO_PEERCRED), so the session id it sends with the
 * fds is one of that process's sessions, not necessarily the one that just said hello. libkvc
 * accepts any (the fds are the namespace's, the same for every session). Before session 10 it
 * demanded its own id and refused the handover: a second kvc_t's hello, a rehello of an older
 * kvc_t, and most of a burst of concurrent hellos from worker threads (one kvc_t per thread,
 * the documented thread rule) failed with INTERNAL "fd handover for session N, expected M".
 * Each check below failed then. Also: pages written through one session's mapping are read
 * back through the other's (the same pools). And a session answers only to the process that
 * opened it: another process that takes its routing id gets NO_SESSION. A capped lookup
 * reports only the tokens of the pages it returns. A process holds at most
 * max_sessions_per_pid sessions. The late reply of a call that timed out gives its pages back.
 * The operator can fence a silent session that holds back page recycling. The hello tells the
 * request bounds (max_alloc, max_tokens) in force when it was answered.
 */
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "itest.h"

#define THREADS 4
#define ROUNDS 10

static const itest_kvd_t *g_k;

static void *hello_thread(void *arg)
{
    kvc_t *c = NULL;
    if (kvc_connect(&c, g_k->endpoint, 30000) != KV_ERR_OK)
        return NULL;
    if (kvc_hello(c, NULL, (const char *)arg, 1) != KV_ERR_OK) {
        fprintf(stderr, "thread hello: %s\n", kvc_errmsg(c));
        kvc_close(&c);
        return NULL;
    }
    return c; /* mapped: checked and closed by the main thread */
}

static void test_one_process_many_sessions(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    g_k = &k;
    kvc_t *a = itest_connect(&k, "A");
    kvc_t *b = itest_connect(&k, "B"); /* the second session of this pid maps too */
    assert_non_null(kvc_pool_base(b, KV_FMT_FP8));
    assert_true(kvc_session_id(a) != kvc_session_id(b));

    /* one pool behind both: bytes written through A's mapping are B's */
    uint32_t page;
    assert_int_equal(kvc_alloc(a, KV_FMT_FP8, 1, &page), KV_ERR_OK);
    uint8_t *pa = kvc_page_ptr(a, page), *pb = kvc_page_ptr(b, page);
    assert_non_null(pa);
    assert_non_null(pb);
    memset(pa, 0x5a, 64);
    assert_int_equal(memcmp(pa, pb, 64), 0);
    assert_int_equal(kvc_release(a, &page, 1), KV_ERR_OK);

    /* the older kvc_t says hello again (its session is reused, a newer one exists) */
    assert_int_equal(kvc_rehello(a), KV_ERR_OK);
    assert_non_null(kvc_pool_base(a, KV_FMT_FP8));

    /* bursts of concurrent hellos, one kvc_t per thread */
    int failed = 0;
    for (int r = 0; r < ROUNDS; r++) {
        pthread_t t[THREADS];
        char names[THREADS][16];
        for (int i = 0; i < THREADS; i++) {
            snprintf(names[i], sizeof names[i], "t%d.%d", r, i);
            assert_int_equal(pthread_create(&t[i], NULL, hello_thread, names[i]), 0);
        }
        for (int i = 0; i < THREADS; i++) {
            void *ret = NULL;
            assert_int_equal(pthread_join(t[i], &ret), 0);
            kvc_t *c = ret;
            if (!c || !kvc_pool_base(c, KV_FMT_FP8))
                failed++;
            kvc_close(&c);
        }
    }
    assert_int_equal(failed, 0);
    kvc_close(&a);
    kvc_close(&b);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* One request through a raw DEALER; returns the reply (the caller frees it). */
static Kvd__Reply *raw_request(void *d, Kvd__Request *req)
{
    uint8_t buf[512];
    req->version = KVP_VERSION;
    size_t n = kvd__request__get_packed_size(req);
    assert_true(n <= sizeof buf);
    kvd__request__pack(req, buf);
    assert_int_equal(zmq_send(d, buf, n, 0), (int)n);
    uint8_t rb[4096];
    int r = zmq_recv(d, rb, sizeof rb, 0);
    assert_true(r > 0);
    Kvd__Reply *rep = kvd__reply__unpack(NULL, (size_t)r, rb);
    assert_non_null(rep);
    return rep;
}

static void *raw_dealer(void *ctx, const itest_kvd_t *k, const char *rid)
{
    void *d = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0, tmo = 30000;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(d, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    zmq_setsockopt(d, ZMQ_ROUTING_ID, rid, strlen(rid));
    assert_int_equal(zmq_connect(d, k->endpoint), 0);
    return d;
}

/* A session answers to the process that opened it, not to its routing id alone: process A
 * opens a session through a DEALER with a chosen ZMQ_ROUTING_ID, allocates a page, closes the
 * socket and stays alive; this process connects with the same routing id. Its release of A's
 * page gets NO_SESSION (before session 10 it released A's reference), and A's reference
 * stays. */
static void test_routing_id_is_not_a_session(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    const char *rid = "kvd-it-rid";
    int up[2], down[2];
    assert_int_equal(pipe(up), 0);
    assert_int_equal(pipe(down), 0);
    pid_t a = fork();
    if (a == 0) {
        close(up[0]); /* so that the read below sees EOF when the test process is gone */
        close(down[1]);
        void *ctx = zmq_ctx_new();
        void *d = raw_dealer(ctx, &k, rid);
        Kvd__Request req = KVD__REQUEST__INIT;
        Kvd__HelloReq h = KVD__HELLO_REQ__INIT;
        req.id = 1;
        req.body_case = KVD__REQUEST__BODY_HELLO;
        req.hello = &h;
        h.client_name = "A";
        Kvd__Reply *rep = raw_request(d, &req);
        if (rep->status != KVD__STATUS__OK)
            _exit(10);
        kvd__reply__free_unpacked(rep, NULL);
        Kvd__AllocReq al = KVD__ALLOC_REQ__INIT;
        al.count = 1;
        req = (Kvd__Request)KVD__REQUEST__INIT;
        req.id = 2;
        req.body_case = KVD__REQUEST__BODY_ALLOC;
        req.alloc = &al;
        rep = raw_request(d, &req);
        if (rep->status != KVD__STATUS__OK || rep->body_case != KVD__REPLY__BODY_ALLOC ||
            rep->alloc->n_pages != 1)
            _exit(11);
        uint32_t page = rep->alloc->pages[0];
        kvd__reply__free_unpacked(rep, NULL);
        zmq_close(d); /* the socket goes, the process (and so the session) stays */
        zmq_ctx_term(ctx);
        if (write(up[1], &page, sizeof page) != (ssize_t)sizeof page)
            _exit(12);
        char go;
        _exit(read(down[0], &go, 1) == 1 ? 0 : 13);
    }
    close(up[1]);
    close(down[0]);
    uint32_t page = 0;
    assert_int_equal(read(up[0], &page, sizeof page), (ssize_t)sizeof page);
    assert_int_equal(itest_stat(&k, "request_refs"), 1);
    void *ctx = zmq_ctx_new();
    void *d = raw_dealer(ctx, &k, rid);
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__ReleaseReq rl = KVD__RELEASE_REQ__INIT;
    rl.n_pages = 1;
    rl.pages = &page;
    req.id = 3;
    req.body_case = KVD__REQUEST__BODY_RELEASE;
    req.release = &rl;
    Kvd__Reply *rep = raw_request(d, &req);
    assert_int_equal(rep->status, KVD__STATUS__NO_SESSION);
    kvd__reply__free_unpacked(rep, NULL);
    assert_int_equal(itest_stat(&k, "request_refs"), 1); /* A's reference stands */
    zmq_close(d);
    zmq_ctx_term(ctx);
    assert_int_equal(write(down[1], "g", 1), 1);
    int st;
    assert_int_equal(waitpid(a, &st, 0), a);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_true(itest_wait_stat(&k, "request_refs", 0, 30000) >= 0); /* A exited: reclaimed */
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
    close(up[0]);
    close(down[1]);
}

/* kvc_lookup with a cap below the hits: the pages beyond it are released, and tokens_matched
 * counts only the tokens of the pages returned (before session 10 it kept the daemon's full
 * count, so a caller skipping prefill by it skipped tokens it held no page for). */
static void test_lookup_cap(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvc_t *c = itest_connect(&k, "capped");
    uint32_t pages[3], tok[3 * ITEST_PT], got[1], matched = 0;
    itest_seal_known(c, 77, 3, pages);
    assert_int_equal(kvc_release(c, pages, 3), KV_ERR_OK);
    itest_prompt_tokens(77, 3, tok);
    size_t np = 0;
    assert_int_equal(kvc_lookup(c, tok, 3 * ITEST_PT, NULL, 0, 0, got, 1, &np, &matched),
                     KV_ERR_OK);
    assert_int_equal(np, 1);
    assert_int_equal(got[0], pages[0]);
    assert_int_equal(matched, ITEST_PT);
    assert_int_equal(itest_stat(&k, "request_refs"), 1); /* the two beyond the cap released */
    assert_int_equal(kvc_release(c, got, 1), KV_ERR_OK);
    kvc_close(&c);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* max_sessions_per_pid: a hello beyond it is RESOURCE_EXHAUSTED with the reason, and raising
 * it at runtime lets the next one in (before session 10 a process could open sessions until
 * the daemon ran out of file descriptors: each keeps a pidfd). */
static void test_sessions_per_pid(void **state)
{
    (void)state;
    const char *extra[] = {"--max_sessions_per_pid", "3", NULL};
    itest_kvd_t k;
    itest_kvd_start(&k, extra);
    kvc_t *c[4];
    for (int i = 0; i < 3; i++)
        c[i] = itest_connect(&k, "one of three");
    assert_int_equal(kvc_connect(&c[3], k.endpoint, 30000), KV_ERR_OK);
    assert_int_equal(kvc_hello(c[3], NULL, "fourth", 1), KV_ERR_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(kvc_errmsg(c[3]), "max_sessions_per_pid"));
    assert_int_equal(itest_stat(&k, "sessions"), 3);
    char out[256];
    const char *set[] = {"config", "set", "max_sessions_per_pid", "4", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, set), 0);
    assert_int_equal(kvc_hello(c[3], NULL, "fourth", 1), KV_ERR_OK);
    assert_non_null(kvc_pool_base(c[3], KV_FMT_FP8));
    for (int i = 0; i < 4; i++)
        kvc_close(&c[i]);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* A call that timed out must not leak what its late reply grants: the daemon is stopped
 * (SIGSTOP) past the client's 300 ms timeout during an alloc of 32 pages, which returns
 * TIMEOUT; after SIGCONT the next call receives the late reply, and libkvc releases its 32
 * pages. Before session 10 the reply was stashed forever and the pages stayed referenced
 * until the process exited (request_refs 33 here instead of 1). */
static void test_late_reply_released(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvc_t *c = NULL;
    assert_int_equal(kvc_connect(&c, k.endpoint, 300), KV_ERR_OK);
    assert_int_equal(kvc_hello(c, NULL, "slow daemon", 1), KV_ERR_OK);
    uint32_t pages[32], one;
    assert_int_equal(kill(k.pid, SIGSTOP), 0);
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 32, pages), KV_ERR_TIMEOUT);
    assert_int_equal(kill(k.pid, SIGCONT), 0);
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, &one), KV_ERR_OK);
    if (itest_wait_stat(&k, "request_refs", 1, 30000) < 0)
        fail_msg("request_refs stays %" PRIu64 ": the late alloc's pages were not released",
                 itest_stat(&k, "request_refs"));
    assert_int_equal(kvc_release(c, &one, 1), KV_ERR_OK);
    kvc_close(&c);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* A live but silent session holds back the recycling of every page others release (their
 * retire stamps wait for its epoch report): B, allocating and releasing, runs the 256-page FP8
 * pool dry. `kvctl sessions fence A` lets B go on at once; A's next request is refused with a
 * message naming the fence, and kvctl shows it FENCED. (Before session 10 there was no fence:
 * only A's exit helped.) */
static void test_fence_silent_session(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvc_t *a = itest_connect(&k, "silent A");
    kvc_t *b = itest_connect(&k, "busy B");
    uint32_t pages[32];
    kv_err_t e = KV_ERR_OK;
    int rounds = 0;
    for (; rounds < 100 && e == KV_ERR_OK; rounds++) {
        e = kvc_alloc(b, KV_FMT_FP8, 32, pages);
        if (e == KV_ERR_OK)
            assert_int_equal(kvc_release(b, pages, 32), KV_ERR_OK);
    }
    assert_int_equal(e, KV_ERR_RESOURCE_EXHAUSTED); /* 256 pages, all waiting on A's report */
    char sid[24], out[4096];
    snprintf(sid, sizeof sid, "%" PRIu64, kvc_session_id(a));
    const char *fence[] = {"sessions", "fence", sid, NULL}, *list[] = {"sessions", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, fence), 0);
    assert_non_null(strstr(out, "fenced"));
    assert_int_equal(kvc_alloc(b, KV_FMT_FP8, 32, pages), KV_ERR_OK);
    assert_int_equal(kvc_release(b, pages, 32), KV_ERR_OK);
    assert_int_equal(kvc_alloc(a, KV_FMT_FP8, 1, pages), KV_ERR_FAILED_PRECONDITION);
    assert_non_null(strstr(kvc_errmsg(a), "fenced by the operator"));
    assert_int_equal(itest_kvctl(&k, out, sizeof out, list), 0);
    assert_non_null(strstr(out, "FENCED"));
    const char *bad[] = {"sessions", "fence", "999999", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, bad), 1); /* no such session */
    kvc_close(&a);
    kvc_close(&b);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* kvc_goodbye ends a session at once, as its process's exit would: its pages are released
 * and it stops holding back recycling (the fence test's silent A, without an operator), and a
 * process may open and close more clients than max_sessions_per_pid over its life. */
static void test_goodbye(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvc_t *a = itest_connect(&k, "closing A");
    kvc_t *b = itest_connect(&k, "busy B");
    uint32_t pages[32];
    assert_int_equal(kvc_alloc(a, KV_FMT_FP8, 5, pages), KV_ERR_OK);
    uint64_t seq;
    assert_int_equal(kvc_seq_open(a, "s", &seq), KV_ERR_OK);
    assert_int_equal(kvc_seq_append(a, seq, pages, 2), KV_ERR_OK);
    uint64_t released = 0;
    assert_int_equal(kvc_goodbye(a, &released), KV_ERR_OK);
    assert_int_equal(released, 5); /* 3 loose + 2 moved into the sequence */
    assert_int_equal(kvc_session_id(a), 0);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    assert_int_equal(kvc_alloc(a, KV_FMT_FP8, 1, pages), KV_ERR_NO_SESSION);
    /* A never reported an epoch, yet B recycles the whole 256-page pool many times over */
    for (int r = 0; r < 40; r++) {
        assert_int_equal(kvc_alloc(b, KV_FMT_FP8, 32, pages), KV_ERR_OK);
        assert_int_equal(kvc_release(b, pages, 32), KV_ERR_OK);
    }
    /* more open/close cycles than max_sessions_per_pid (64) */
    for (int i = 0; i < 70; i++) {
        assert_int_equal(kvc_hello(a, NULL, "A again", 1), KV_ERR_OK);
        assert_int_equal(kvc_goodbye(a, NULL), KV_ERR_OK);
    }
    char out[4096];
    const char *list[] = {"sessions", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, list), 0);
    assert_null(strstr(out, "A again"));
    assert_non_null(strstr(out, "busy B"));
    kvc_close(&a);
    kvc_close(&b);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* A heartbeat's own completed_epoch is its report. libkvc also puts the latest epoch it has
 * seen in every request's envelope; the daemon applied that first, so a heartbeat declaring an
 * older (valid, not decreasing) safe epoch failed with INVALID_ARGUMENT "must be >= the
 * previous report", and the envelope's claim stood instead of the heartbeat's. */
static void test_heartbeat_epoch_is_the_body(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvc_t *c = itest_connect(&k, "heartbeat");
    uint64_t first = kvc_epoch(c);
    uint32_t page;
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, &page), KV_ERR_OK);
    assert_int_equal(kvc_release(c, &page, 1), KV_ERR_OK); /* stamps: the epoch moves */
    assert_true(kvc_epoch(c) > first);
    kv_err_t e = kvc_heartbeat(c, first);
    if (e != KV_ERR_OK)
        fail_msg("heartbeat(%llu) at epoch %llu: %s", (unsigned long long)first,
                 (unsigned long long)kvc_epoch(c), kvc_errmsg(c));
    char out[4096], want[64];
    const char *list[] = {"--json", "sessions", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, list), 0);
    snprintf(want, sizeof want, "\"completed_epoch\":%llu,", (unsigned long long)first);
    if (!strstr(out, want))
        fail_msg("the heartbeat's epoch %llu is not the session's: %s",
                 (unsigned long long)first, out);
    /* a bad report in the heartbeat itself is still an error */
    assert_int_equal(kvc_heartbeat(c, kvc_epoch(c) + 100), KV_ERR_INVALID_ARGUMENT);
    kvc_close(&c);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* Drain refuses new sessions, not a second hello of a connection that has one (it returns the
 * same session): kvc_rehello of a live client during a drain failed with DRAINING. */
static void test_rehello_while_draining(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvc_t *a = itest_connect(&k, "drained");
    uint64_t sid = kvc_session_id(a);
    char out[4096];
    const char *drain[] = {"drain", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, drain), 0);
    kv_err_t e = kvc_rehello(a);
    if (e != KV_ERR_OK)
        fail_msg("rehello of a live session while draining: %s", kvc_errmsg(a));
    assert_int_equal(kvc_session_id(a), sid);
    assert_non_null(kvc_pool_base(a, KV_FMT_FP8));
    kvc_t *b = NULL; /* a new session is still refused */
    assert_int_equal(kvc_connect(&b, k.endpoint, 30000), KV_ERR_OK);
    assert_int_equal(kvc_hello(b, NULL, "new", 1), KV_ERR_DRAINING);
    assert_int_equal(itest_stat(&k, "sessions"), 1);
    kvc_close(&b);
    kvc_close(&a);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* A request over the daemon's max_msg_bytes is not answered: libzmq drops it with the
 * connection, and the session was lost to the client (TIMEOUT, then NO_SESSION on every call
 * with no restart to react to, while the old session pinned the safe epoch; the review of the
 * session-12 diff showed it with a lookup 5% over max_tokens). libkvc now learns the bound at
 * hello (HelloRep.max_msg_bytes) and refuses such a request itself, at once; the session
 * works on. */
static void test_request_over_max_msg_bytes(void **state)
{
    (void)state;
    const char *extra[] = {"--max_tokens", "4096", NULL};
    itest_kvd_t k;
    itest_kvd_start(&k, extra);
    kvc_t *c = NULL;
    assert_int_equal(kvc_connect(&c, k.endpoint, 3000), KV_ERR_OK);
    assert_int_equal(kvc_hello(c, NULL, "oversize", 1), KV_ERR_OK);
    const uint64_t sid = kvc_session_id(c);
    const size_t n = 1u << 20; /* ~5 MB packed, far over the bound max_tokens 4096 derives */
    uint32_t *tok = calloc(n, sizeof *tok), got[4], matched = 0;
    assert_non_null(tok);
    size_t np = 0;
    const kv_err_t e = kvc_lookup(c, tok, n, NULL, 0, 0, got, 4, &np, &matched);
    free(tok);
    if (e != KV_ERR_INVALID_ARGUMENT)
        fail_msg("an oversized lookup: %s (%s), want INVALID_ARGUMENT from libkvc",
                 kv_err_name(e), kvc_errmsg(c));
    assert_non_null(strstr(kvc_errmsg(c), "max_msg_bytes"));
    uint32_t page;
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, &page), KV_ERR_OK); /* the session lives on */
    assert_int_equal(kvc_session_id(c), sid);
    assert_int_equal(kvc_release(c, &page, 1), KV_ERR_OK);
    assert_int_equal(itest_stat(&k, "sessions"), 1);
    kvc_close(&c);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* HelloRep.max_alloc and max_tokens are the directives' values when the hello was answered:
 * a client (libkvshim) sizes its first allocs and lookups from them instead of learning them
 * from refusals. A later `kvctl config set` is seen by the next hello, not by the session's
 * copy; kvctl's hello (no mapping) is told too. */
static void test_hello_tells_the_request_bounds(void **state)
{
    (void)state;
    const char *extra[] = {"--max_alloc", "77", "--max_tokens", "999", NULL};
    itest_kvd_t k;
    itest_kvd_start(&k, extra);
    kvc_t *c = NULL, *admin = NULL;
    assert_int_equal(kvc_max_alloc(c), 0); /* no kvc_t: not told */
    assert_int_equal(kvc_connect(&c, k.endpoint, 3000), KV_ERR_OK);
    assert_int_equal(kvc_max_alloc(c), 0); /* no hello yet */
    assert_int_equal(kvc_max_tokens(c), 0);
    assert_int_equal(kvc_hello(c, NULL, "bounds", 1), KV_ERR_OK);
    assert_int_equal(kvc_max_alloc(c), 77);
    assert_int_equal(kvc_max_tokens(c), 999);
    /* they are the bounds the request gate enforces */
    uint32_t pages[78];
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 78, pages), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 77, pages), KV_ERR_OK);
    assert_int_equal(kvc_release(c, pages, 77), KV_ERR_OK);
    char out[4096];
    const char *sa[] = {"config", "set", "max_alloc", "50", NULL};
    const char *st[] = {"config", "set", "max_tokens", "500", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, sa), 0);
    assert_int_equal(itest_kvctl(&k, out, sizeof out, st), 0);
    assert_int_equal(kvc_max_alloc(c), 77); /* the values at the time of the hello */
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 77, pages), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvc_rehello(c), KV_ERR_OK);
    assert_int_equal(kvc_max_alloc(c), 50);
    assert_int_equal(kvc_max_tokens(c), 500);
    assert_int_equal(kvc_connect(&admin, k.endpoint, 3000), KV_ERR_OK);
    assert_int_equal(kvc_hello(admin, NULL, "bounds admin", 0), KV_ERR_OK);
    assert_int_equal(kvc_max_alloc(admin), 50);
    assert_int_equal(kvc_max_tokens(admin), 500);
    kvc_close(&admin);
    kvc_close(&c);
    assert_int_equal(kvc_max_tokens(c), 0);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello_tells_the_request_bounds),
        cmocka_unit_test(test_request_over_max_msg_bytes),
        cmocka_unit_test(test_one_process_many_sessions),
        cmocka_unit_test(test_routing_id_is_not_a_session),
        cmocka_unit_test(test_lookup_cap),
        cmocka_unit_test(test_sessions_per_pid),
        cmocka_unit_test(test_late_reply_released),
        cmocka_unit_test(test_fence_silent_session),
        cmocka_unit_test(test_goodbye),
        cmocka_unit_test(test_heartbeat_epoch_is_the_body),
        cmocka_unit_test(test_rehello_while_draining),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
