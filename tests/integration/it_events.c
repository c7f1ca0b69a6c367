/* it_events.c — index events from the real daemon (docs/protocol.md "Index events").
 *
 * kvd runs with --events_endpoint ipc://TMP/run/events.sock and a fast lifecycle controller
 * (--lifecycle_ms 10 --recent_pages 2 --anchor_pages 1). This process holds a real ZeroMQ SUB
 * socket on the topic "default" (the namespace) and is also the engine client. Then:
 *
 *   0. hello carries the events endpoint; the PUB/SUB slow joiner is beaten by sealing probe
 *      pages until one STORED arrives (and then every probe's), never by sleeping;
 *   1. a 4-page prompt sealed → exactly 4 STORED in order: page ids, format fp8, 16 tokens,
 *      the token ids, parent of page i = hash of page i-1, none for the first;
 *   2. the same prompt sealed by a second client dedupes and publishes nothing: the very next
 *      entry is the REMOVED of step 3;
 *   3. kvctl cache evict PAGE → exactly one REMOVED (admin) with that page's STORED hash;
 *   4. a 6-page prompt in a sequence: 6 STORED, then the lifecycle controller retiers the
 *      Stale pages [1, 4) → exactly 3 FORMAT_CHANGED to tq3 with their STORED hashes;
 *   4b. `kvctl events sync` → CLEARED (resync) then every bound entry once (the evicted one
 *      not, the Stale ones as tq3), the reply naming the CLEARED's message;
 *   5. `kvctl events --count 1 --json` in a child prints a STORED line;
 *   6. the daemon's counters agree (events_dropped 0, events_seq = the last seq seen) and
 *      stopping it publishes CLEARED (shutdown) as the next message.
 * Sequence numbers must be contiguous across every message received after the first.
 * Also: with events off, hello names no endpoint and kvctl events / events sync fail.
 *
 * Waits poll with generous timeouts (CI is a loaded 2-core machine).
 */
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "itest.h"
#include "kvproto.h"

#define PT 16
#define WAIT_MS 60000

typedef struct ent_s {
    uint64_t seq, time_ns;
    int kind, reason, format;
    uint32_t page, tokens, nids, tok0, tok_last;
    int has_hash, has_parent;
    uint8_t hash[32], parent[32];
} ent_t;

typedef struct subr_s {
    void *ctx, *sub;
    uint64_t last_seq, instance, messages;
    ent_t q[256]; /* received, not yet taken */
    int qh, qt;
} subr_t;

/* Receive one message within timeout_ms; append its entries. 1 received, 0 timeout. */
static int sub_recv(subr_t *s, int timeout_ms)
{
    zmq_pollitem_t it = {.socket = s->sub, .events = ZMQ_POLLIN};
    if (zmq_poll(&it, 1, timeout_ms) <= 0)
        return 0;
    zmq_msg_t topic, body;
    zmq_msg_init(&topic);
    zmq_msg_init(&body);
    assert_true(zmq_msg_recv(&topic, s->sub, 0) >= 0);
    assert_true(zmq_msg_more(&topic));
    assert_int_equal(zmq_msg_size(&topic), strlen("default"));
    assert_memory_equal(zmq_msg_data(&topic), "default", 7);
    assert_true(zmq_msg_recv(&body, s->sub, 0) >= 0);
    assert_false(zmq_msg_more(&body));
    Kvd__Event *ev = kvd__event__unpack(NULL, zmq_msg_size(&body), zmq_msg_data(&body));
    assert_non_null(ev);
    assert_int_equal(ev->version, KVP_VERSION);
    assert_string_equal(ev->namespace_, "default");
    assert_true(ev->time_ns > 1600000000ull * 1000000000ull); /* wall clock, not monotonic */
    if (s->messages) {
        if (ev->seq != s->last_seq + 1)
            fail_msg("sequence gap: %llu after %llu", (unsigned long long)ev->seq,
                     (unsigned long long)s->last_seq);
        assert_true(ev->instance == s->instance);
    }
    s->instance = ev->instance;
    s->last_seq = ev->seq;
    s->messages++;
    assert_true(ev->n_entries > 0);
    for (size_t i = 0; i < ev->n_entries; i++) {
        const Kvd__EventEntry *x = ev->entries[i];
        assert_true(s->qt < 256);
        ent_t *e = &s->q[s->qt++];
        memset(e, 0, sizeof *e);
        e->seq = ev->seq;
        e->time_ns = ev->time_ns;
        e->kind = x->kind;
        e->reason = x->reason;
        e->format = x->format;
        e->page = x->page;
        e->tokens = x->tokens;
        e->nids = (uint32_t)x->n_token_ids;
        if (x->n_token_ids) {
            e->tok0 = x->token_ids[0];
            e->tok_last = x->token_ids[x->n_token_ids - 1];
        }
        if (x->hash.len) {
            assert_int_equal(x->hash.len, 32);
            e->has_hash = 1;
            memcpy(e->hash, x->hash.data, 32);
        }
        if (x->parent_hash.len) {
            assert_int_equal(x->parent_hash.len, 32);
            e->has_parent = 1;
            memcpy(e->parent, x->parent_hash.data, 32);
        }
    }
    kvd__event__free_unpacked(ev, NULL);
    zmq_msg_close(&topic);
    zmq_msg_close(&body);
    return 1;
}

/* The next entry, waiting up to WAIT_MS. */
static ent_t next(subr_t *s)
{
    int64_t t0 = itest_now_us();
    while (s->qh == s->qt) {
        if (itest_now_us() - t0 > (int64_t)WAIT_MS * 1000)
            fail_msg("no event within %d ms", WAIT_MS);
        sub_recv(s, 200);
    }
    ent_t e = s->q[s->qh++];
    if (s->qh == s->qt)
        s->qh = s->qt = 0;
    return e;
}

static uint32_t probe_seed = 900000;

/* Seal one fresh single-page prompt (unique tokens) and release it; returns its page. */
static uint32_t probe(kvc_t *c)
{
    uint32_t p, canon, tok[PT];
    for (uint32_t i = 0; i < PT; i++)
        tok[i] = probe_seed++;
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, &p), KV_ERR_OK);
    if (kvc_seal(c, p, KVP_NO_PAGE, tok, PT, NULL, 0, &canon) != KV_ERR_OK)
        fail_msg("probe seal: %s", kvc_errmsg(c));
    assert_int_equal(kvc_release(c, &canon, 1), KV_ERR_OK);
    return canon;
}

/* Beat the slow joiner: probe until a message arrives, then consume entries up to the STORED
 * of the last probe sent (everything after the subscription went live arrives, in order). */
static void sub_sync(subr_t *s, kvc_t *c)
{
    uint32_t last = 0;
    int64_t t0 = itest_now_us();
    while (s->qt == 0) {
        if (itest_now_us() - t0 > (int64_t)WAIT_MS * 1000)
            fail_msg("no event reached the subscriber within %d ms", WAIT_MS);
        last = probe(c);
        sub_recv(s, 100);
    }
    for (;;) {
        ent_t e = next(s);
        assert_int_equal(e.kind, KVD__EVENT_ENTRY__KIND__KIND_STORED);
        if (e.page == last)
            break;
    }
}

static void test_events(void **state)
{
    (void)state;
    char evdir[64];
    itest_tmpdir(evdir, sizeof evdir, "kvd-ev");
    char evep[128];
    snprintf(evep, sizeof evep, "ipc://%s/run/events.sock", evdir);
    itest_kvd_t k;
    // clang-format off
    const char *extra[] = {
        "--events_endpoint", evep,
        "--lifecycle_ms", "10",
        "--recent_pages", "2",
        "--anchor_pages", "1",
        NULL};
    // clang-format on
    itest_kvd_start(&k, extra);
    {   /* one daemon per events socket: a second one on it is refused, naming the first */
        static char out[8192];
        char ep2[128], pid[32];
        snprintf(ep2, sizeof ep2, "ipc://%s/second.sock", evdir);
        snprintf(pid, sizeof pid, "pid %d", (int)k.pid);
        const char *two[] = {KVD_BIN, "--endpoint", ep2, "--events_endpoint", evep, NULL};
        assert_int_equal(itest_run(two, out, sizeof out), 1);
        if (!strstr(out, "in use by another kvd") || !strstr(out, pid) ||
            !strstr(out, "give this one another events_endpoint"))
            fail_msg("second kvd on one events socket: %s", out);
    }
    kvc_t *c = itest_connect(&k, "events-client");
    /* 0. the hello names the endpoint; subscribe to our namespace */
    assert_string_equal(kvc_events_endpoint(c), evep);
    subr_t *s = calloc(1, sizeof *s);
    assert_non_null(s);
    s->ctx = zmq_ctx_new();
    s->sub = zmq_socket(s->ctx, ZMQ_SUB);
    assert_int_equal(zmq_setsockopt(s->sub, ZMQ_SUBSCRIBE, "default", 7), 0);
    assert_int_equal(zmq_connect(s->sub, evep), 0);
    sub_sync(s, c);
    assert_true(s->instance != 0);

    /* 1. a 4-page prompt */
    uint32_t pages[6], canon[6], tok[6 * PT];
    for (uint32_t i = 0; i < 6 * PT; i++)
        tok[i] = 7000u + i * 5u;
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 4, pages), KV_ERR_OK);
    for (uint32_t i = 0; i < 4; i++)
        if (kvc_seal(c, pages[i], i ? canon[i - 1] : KVP_NO_PAGE, tok + i * PT, PT, NULL, 0,
                     &canon[i]) != KV_ERR_OK)
            fail_msg("seal %u: %s", i, kvc_errmsg(c));
    ent_t st[4];
    for (uint32_t i = 0; i < 4; i++) {
        st[i] = next(s);
        assert_int_equal(st[i].kind, KVD__EVENT_ENTRY__KIND__KIND_STORED);
        assert_int_equal(st[i].page, canon[i]);
        assert_int_equal(st[i].format, KVD__FORMAT__FORMAT_FP8);
        assert_int_equal(st[i].tokens, PT);
        assert_int_equal(st[i].nids, PT);
        assert_int_equal(st[i].tok0, tok[i * PT]);
        assert_int_equal(st[i].tok_last, tok[i * PT + PT - 1]);
        assert_true(st[i].has_hash);
        assert_int_equal(st[i].has_parent, i > 0);
        if (i > 0)
            assert_memory_equal(st[i].parent, st[i - 1].hash, 32);
    }

    /* 2. dedupe by a second client: nothing published (checked by what comes next) */
    kvc_t *c2 = itest_connect(&k, "events-client-2");
    uint32_t p2[4], canon2[4];
    assert_int_equal(kvc_alloc(c2, KV_FMT_FP8, 4, p2), KV_ERR_OK);
    for (uint32_t i = 0; i < 4; i++) {
        if (kvc_seal(c2, p2[i], i ? canon2[i - 1] : KVP_NO_PAGE, tok + i * PT, PT, NULL, 0,
                     &canon2[i]) != KV_ERR_OK)
            fail_msg("dedupe seal %u: %s", i, kvc_errmsg(c2));
        assert_int_equal(canon2[i], canon[i]);
    }
    kvc_close(&c2);

    /* 3. admin evict of page 3 */
    char out[4096], pg[16];
    snprintf(pg, sizeof pg, "%u", canon[3]);
    const char *ev_args[] = {"cache", "evict", pg, NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, ev_args), 0);
    ent_t r = next(s);
    assert_int_equal(r.kind, KVD__EVENT_ENTRY__KIND__KIND_REMOVED);
    assert_int_equal(r.page, canon[3]);
    assert_int_equal(r.reason, KVD__EVENT_ENTRY__REASON__REASON_ADMIN);
    assert_memory_equal(r.hash, st[3].hash, 32);

    /* 4. a 6-page prompt in a sequence: Stale pages [1, 4) go TQ3 */
    uint32_t tok6[6 * PT];
    for (uint32_t i = 0; i < 6 * PT; i++)
        tok6[i] = 50000u + i;
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 6, pages), KV_ERR_OK);
    for (uint32_t i = 0; i < 6; i++)
        if (kvc_seal(c, pages[i], i ? canon[i - 1] : KVP_NO_PAGE, tok6 + i * PT, PT, NULL, 0,
                     &canon[i]) != KV_ERR_OK)
            fail_msg("seal %u: %s", i, kvc_errmsg(c));
    uint64_t seq;
    assert_int_equal(kvc_seq_open(c, "events", &seq), KV_ERR_OK);
    assert_int_equal(kvc_seq_append(c, seq, canon, 6), KV_ERR_OK);
    ent_t st6[6];
    for (uint32_t i = 0; i < 6; i++) {
        st6[i] = next(s);
        assert_int_equal(st6[i].kind, KVD__EVENT_ENTRY__KIND__KIND_STORED);
        assert_int_equal(st6[i].page, canon[i]);
        assert_int_equal(st6[i].has_parent, i > 0);
        if (i > 0)
            assert_memory_equal(st6[i].parent, st6[i - 1].hash, 32);
    }
    int seen[6] = {0};
    for (int n = 0; n < 3; n++) {
        ent_t f = next(s);
        assert_int_equal(f.kind, KVD__EVENT_ENTRY__KIND__KIND_FORMAT_CHANGED);
        assert_int_equal(f.format, KVD__FORMAT__FORMAT_TQ3);
        int idx = -1;
        for (int i = 0; i < 6; i++)
            if (canon[i] == f.page)
                idx = i;
        if (idx < 1 || idx > 3 || seen[idx]++)
            fail_msg("FORMAT_CHANGED for page %u (index %d): expected each of [1, 4) once",
                     f.page, idx);
        assert_memory_equal(f.hash, st6[idx].hash, 32);
    }
    assert_true(itest_wait_stat(&k, "lifecycle_backlog", 0, WAIT_MS) >= 0);
    assert_int_equal(itest_stat(&k, "retiers"), 3);

    /* 4b. kvctl events sync: CLEARED (resync), then every bound entry once, the Stale ones
     * as tq3; the reply names the message that starts it */
    uint64_t bound = itest_stat(&k, "cache_entries");
    const char *sync_args[] = {"--json", "events", "sync", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, sync_args), 0);
    ent_t cr = next(s);
    assert_int_equal(cr.kind, KVD__EVENT_ENTRY__KIND__KIND_CLEARED);
    assert_int_equal(cr.reason, KVD__EVENT_ENTRY__REASON__REASON_RESYNC);
    char sync_want[96];
    snprintf(sync_want, sizeof sync_want, "{\"seq\":%llu,\"entries\":%llu}",
             (unsigned long long)cr.seq, (unsigned long long)bound);
    if (!strstr(out, sync_want))
        fail_msg("kvctl events sync printed '%s', expected '%s'", out, sync_want);
    int found6[6] = {0};
    for (uint64_t n = 0; n < bound; n++) {
        ent_t x = next(s);
        assert_int_equal(x.kind, KVD__EVENT_ENTRY__KIND__KIND_STORED);
        assert_int_equal(x.reason, KVD__EVENT_ENTRY__REASON__REASON_RESYNC);
        assert_int_equal(x.nids, 0);
        assert_false(x.has_parent);
        assert_false(x.page == st[3].page && !memcmp(x.hash, st[3].hash, 32)); /* evicted */
        for (int i = 0; i < 6; i++)
            if (x.page == canon[i]) {
                assert_memory_equal(x.hash, st6[i].hash, 32);
                assert_int_equal(x.format, i >= 1 && i <= 3 ? KVD__FORMAT__FORMAT_TQ3
                                                            : KVD__FORMAT__FORMAT_FP8);
                found6[i]++;
            }
    }
    for (int i = 0; i < 6; i++)
        assert_int_equal(found6[i], 1);

    /* 5. kvctl events in a child: probe until it prints a line */
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    pid_t kid = fork();
    assert_true(kid >= 0);
    if (kid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        dup2(pfd[1], 1);
        close(pfd[0]);
        close(pfd[1]);
        execl(KVCTL_BIN, KVCTL_BIN, "--endpoint", k.endpoint, "events", "--count", "1",
              "--json", (char *)NULL);
        _exit(127);
    }
    close(pfd[1]);
    char line[8192];
    size_t got = 0;
    int64_t t0 = itest_now_us();
    while (!memchr(line, '\n', got)) {
        if (itest_now_us() - t0 > (int64_t)WAIT_MS * 1000)
            fail_msg("kvctl events printed nothing within %d ms", WAIT_MS);
        probe(c);
        /* our own subscriber sees the probes too: check their seqs, then drop them (a slow
         * kvctl start must not overflow the queue) */
        while (sub_recv(s, 0))
            s->qh = s->qt = 0;
        struct pollfd pf = {.fd = pfd[0], .events = POLLIN};
        if (poll(&pf, 1, 100) > 0) {
            ssize_t rd = read(pfd[0], line + got, sizeof line - 1 - got);
            if (rd <= 0)
                break;
            got += (size_t)rd;
        }
    }
    line[got] = '\0';
    close(pfd[0]);
    int status = 0;
    assert_int_equal(waitpid(kid, &status, 0), kid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    assert_non_null(strstr(line, "\"kind\":\"stored\""));
    assert_non_null(strstr(line, "\"namespace\":\"default\""));
    assert_non_null(strstr(line, "\"tokens\":16"));
    assert_non_null(strstr(line, "\"parent\":null"));

    /* 6. counters; drain the probes' messages first so events_seq is comparable */
    for (;;) {
        uint64_t want = itest_stat(&k, "events_seq");
        while (s->last_seq < want)
            if (!sub_recv(s, WAIT_MS))
                fail_msg("message %llu never arrived", (unsigned long long)want);
        if (itest_stat(&k, "events_seq") == want)
            break;
    }
    assert_int_equal(itest_stat(&k, "events_dropped"), 0);
    assert_true(itest_stat(&k, "events_batches") >= s->messages);
    assert_true(itest_stat(&k, "events_published") >= 4 + 1 + 6 + 3);
    s->qh = s->qt = 0;
    kvc_close(&c);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
    ent_t cl = next(s);
    assert_int_equal(cl.kind, KVD__EVENT_ENTRY__KIND__KIND_CLEARED);
    assert_int_equal(cl.reason, KVD__EVENT_ENTRY__REASON__REASON_SHUTDOWN);
    assert_false(cl.has_hash);
    struct stat sst; /* a clean exit removes the socket file (the lock file stays) */
    if (stat(evep + 6, &sst) == 0)
        fail_msg("%s is still there after a clean exit", evep + 6);

    int zero = 0;
    zmq_setsockopt(s->sub, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(s->sub);
    zmq_ctx_term(s->ctx);
    free(s);
    itest_rmtree(evdir);
}

static uint64_t realtime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* Event.time_ns's clock */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A lifecycle tick's FORMAT_CHANGED leaves when the tick made it, not when something next wakes
 * an idle daemon. Regression: the publisher flushed from a uv_check handle only, which runs
 * after the poll phase, and timers run outside it: the entries of a tick waited while poll
 * slept until the next timer (here the next tick, 2.5 s later; epoch_ms and lease_ms are set
 * long so that nothing else wakes the loop). */
static void test_events_tick_not_held(void **state)
{
    (void)state;
    char evdir[64];
    itest_tmpdir(evdir, sizeof evdir, "kvd-ev");
    char evep[128];
    snprintf(evep, sizeof evep, "ipc://%s/run/events.sock", evdir);
    itest_kvd_t k;
    // clang-format off
    const char *extra[] = {
        "--events_endpoint", evep,
        "--lifecycle_ms", "2500",
        "--epoch_ms", "60000",
        "--lease_ms", "86400000",
        "--recent_pages", "1",
        "--anchor_pages", "0",
        NULL};
    // clang-format on
    itest_kvd_start(&k, extra);
    kvc_t *c = itest_connect(&k, "events-tick");
    subr_t *s = calloc(1, sizeof *s);
    assert_non_null(s);
    s->ctx = zmq_ctx_new();
    s->sub = zmq_socket(s->ctx, ZMQ_SUB);
    assert_int_equal(zmq_setsockopt(s->sub, ZMQ_SUBSCRIBE, "default", 7), 0);
    assert_int_equal(zmq_connect(s->sub, evep), 0);
    sub_sync(s, c);
    /* 3 sealed pages in a sequence: with a window of 1, the next tick retiers 0 and 1 */
    uint32_t pages[3], canon[3], tok[3 * PT];
    for (uint32_t i = 0; i < 3 * PT; i++)
        tok[i] = 70000u + i;
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 3, pages), KV_ERR_OK);
    for (uint32_t i = 0; i < 3; i++)
        if (kvc_seal(c, pages[i], i ? canon[i - 1] : KVP_NO_PAGE, tok + i * PT, PT, NULL, 0,
                     &canon[i]) != KV_ERR_OK)
            fail_msg("seal %u: %s", i, kvc_errmsg(c));
    uint64_t seq;
    assert_int_equal(kvc_seq_open(c, "tick", &seq), KV_ERR_OK);
    assert_int_equal(kvc_seq_append(c, seq, canon, 3), KV_ERR_OK);
    for (uint32_t i = 0; i < 3; i++)
        assert_int_equal(next(s).kind, KVD__EVENT_ENTRY__KIND__KIND_STORED);
    /* the tick is seen in the client's own directory mapping: no request wakes the daemon */
    int64_t t0 = itest_now_us();
    while (kv_dir_fmt(kvc_directory(c)[canon[0]]) != KV_FMT_TQ3 ||
           kv_dir_fmt(kvc_directory(c)[canon[1]]) != KV_FMT_TQ3) {
        if (itest_now_us() - t0 > (int64_t)WAIT_MS * 1000)
            fail_msg("pages 0 and 1 not retiered within %d ms", WAIT_MS);
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    uint64_t seen_ns = realtime_ns();
    for (int n = 0; n < 2; n++) {
        ent_t f = next(s);
        assert_int_equal(f.kind, KVD__EVENT_ENTRY__KIND__KIND_FORMAT_CHANGED);
        assert_true(f.page == canon[0] || f.page == canon[1]);
        if (f.time_ns > seen_ns && f.time_ns - seen_ns > 1000000000ull)
            fail_msg("FORMAT_CHANGED of page %u published %llu ms after the directory showed "
                     "it", f.page, (unsigned long long)((f.time_ns - seen_ns) / 1000000u));
    }
    kvc_close(&c);
    assert_int_equal(itest_kvd_stop(&k), 0);
    int zero = 0;
    zmq_setsockopt(s->sub, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(s->sub);
    zmq_ctx_term(s->ctx);
    free(s);
    itest_rmtree(evdir);
}

/* Events off (the default): kvctl says so, events sync is refused, hello names no endpoint. */
static void test_events_off(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    kvc_t *c = itest_connect(&k, "events-off");
    assert_string_equal(kvc_events_endpoint(c), "");
    kvc_close(&c);
    char out[4096];
    const char *sync_args[] = {"events", "sync", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, sync_args), 1);
    const char *ev_args[] = {"events", "--count", "1", NULL};
    assert_int_equal(itest_kvctl(&k, out, sizeof out, ev_args), 1);
    assert_int_equal(itest_stat(&k, "events_batches"), 0);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_events_off),
        cmocka_unit_test(test_events),
        cmocka_unit_test(test_events_tick_not_held),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
