/* it_kvbench_engine.c — `kvbench engine` (engine-shim/kvbench.c) end to end, on the host backend.
 *
 * The benchmark's figures must be right, not only printed, so the smoke run uses a workload
 * whose prefix hits are known exactly: W = 2 workers, R = 3 requests each, P = 32 shared tokens
 * (2 pages of 16), U = 20 unique tokens, G = 2 decode steps. Every request after a worker's
 * first one finds the prefix its own first request committed, so it gets exactly P cached
 * tokens; a worker's first request gets 0, 16 or P depending on how much of the prefix the
 * other worker had committed (sealed page by page) before its begin — a race, so the test
 * accepts those but nothing else (16 was first seen under ASan timing):
 *     per worker: cached = first_cached + (R - 1)·P, first_cached ∈ {0, 16, P}
 *     total: (W·R − W)·P ≤ cached ≤ W·R·P, prefill = prompt − cached, decode steps = W·R·G.
 * Its built-in check (worker 0's first request against the float64 reference, rel L2 ≤ 1e-4)
 * must have run G times and passed.
 *
 * 1. smoke: the workload above on a daemon kvbench starts (--kvd the build's).
 * 2. a running daemon (--endpoint, itest's): the lifecycle retiers Stale pages to TQ3 while the
 *    workers decode (--attn-all, every layer checked); afterwards no reference is left and
 *    `kvctl check` is clean.
 * 3. bad arguments: exit 2 and usage; a missing daemon: exit 1 naming the socket; a --kvd that
 *    cannot be executed: exit 1 saying why; --help: 0.
 * 4. `kvbench rpc` on a running daemon of page_tokens 128 (a 4 x 64-token stack array
 *    overflowed there: SIGSEGV) reports that geometry (it printed 4/8/128/16 always); a prompt
 *    over the pool or under a page, and --iters abc, are refused before any figure; a socket
 *    file nothing listens on is said at once; none of these leaves a kvbench-* directory.
 * 5. The daemon killed under `kvbench engine --endpoint`: the run fails within seconds (the
 *    workers' calls waited out 60 s timeouts and the status polls 30 s ones: over 2 minutes),
 *    and each worker's "error" says why it stopped (it was "": kvbench had killed it). Workers
 *    killed from outside while the daemon stays: each "error" names the signal.
 *    Their "wall_s" is the time until they were killed (it was 0.000: set only on finishing).
 * 6. SIGTERM to `kvbench rpc` mid-run: its own kvd is stopped and its directory removed.
 * 7. A worker that dies before the start barrier without its ready byte (the test hook
 *    KVBENCH_TEST_DIE_BEFORE_READY: it kills itself, shim open): kvbench waited forever on the
 *    ready pipe, held open by the workers waiting for go. Now the run is called off within
 *    seconds: every other worker stops at its barrier naming the dead one, the JSON parses,
 *    "ok" is false, the wall times are null, and the daemon is left clean.
 * 8. Every worker ready, then dead before kvbench wrote go: that write raised SIGPIPE, which
 *    killed kvbench (no JSON, its TMPDIR left). Now it fails the run naming the signal.
 * 9. A pool that needs recycling (40 FP8 pages, 30 requests of 5 pages, W 1): worker 0's
 *    reference mapping, a session that made no call after its hello, held back the recycling of
 *    every page released after it, and the run failed with RESOURCE_EXHAUSTED at request 8
 *    ("min reported 1"). Now the reference reports after each check and ends after the first
 *    request, and the run completes.
 * 10. A worker hung before the start barrier (test hook KVBENCH_TEST_HANG_BEFORE_READY) held
 *    kvbench for ever; now --ready-timeout calls the run off and kills it. A worker killed at
 *    the barrier after its ready byte, while another was not ready, was reported "before it
 *    was ready"; now "at the start barrier, after it was ready".
 * 11. Batched decode (--batch 4, W 2, R 5, G 3): each worker runs its requests 0-3 as one
 *    batch, then request 4 alone, so attention calls = W·⌈R/4⌉·G = 12 (one per step, over the
 *    batch) for W·R·G = 30 sequence-steps; every figure of the smoke test holds, and the
 *    reference check of worker 0's first request passes on its rows of the batched calls.
 *    --batch 0 or over 1024: exit 2 naming the option.
 * Every `kvbench engine` JSON read here must parse (assert_json), failed runs' too: a consumer
 * reads it as a whole.
 */
#include <ctype.h>
#include <dirent.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "itest.h"

#define PAGE_TOKENS 16u /* kvbench engine's default --page-tokens */

#ifndef KVBENCH_BIN
#error "KVBENCH_BIN (the kvbench binary) is set by tests/integration/CMakeLists.txt"
#endif

#define OUT_CAP (1u << 20)

/* The number after `lead` "key": at or after `from` in the JSON; fails the test when missing. */
static double jfind(const char *from, const char *lead, const char *key)
{
    char pat[96];
    snprintf(pat, sizeof pat, "%s\"%s\": ", lead, key);
    const char *p = strstr(from, pat);
    if (!p)
        fail_msg("no %s\"%s\" in the output", *lead ? "top-level " : "", key);
    return strtod(p + strlen(pat), NULL);
}

static double jnum(const char *from, const char *key)
{
    return jfind(from, "", key);
}

/* A top-level figure (two-space indent: not the "params" or "workers" entries of that name). */
static double jtop(const char *j, const char *key)
{
    return jfind(j, "\n  ", key);
}

/* The JSON object of worker w (its "worker": w entry). */
static const char *jworker(const char *out, unsigned w)
{
    char pat[48];
    snprintf(pat, sizeof pat, "{\"worker\": %u,", w);
    const char *p = strstr(out, pat);
    if (!p)
        fail_msg("no entry for worker %u", w);
    return p;
}

/* JSON syntax (RFC 8259) of the value at s: the end of it, or NULL where it breaks. */
static const char *json_ws(const char *s)
{
    while (*s == ' ' || *s == '\n' || *s == '\t' || *s == '\r')
        s++;
    return s;
}

static const char *json_string(const char *s)
{
    if (*s++ != '"')
        return NULL;
    for (; *s != '"'; s++) {
        if ((unsigned char)*s < 0x20) /* a control character, or the end of the text */
            return NULL;
        if (*s != '\\')
            continue;
        if (*++s == 'u') {
            for (int i = 1; i <= 4; i++)
                if (!isxdigit((unsigned char)s[i]))
                    return NULL;
            s += 4;
        } else if (!*s || !strchr("\"\\/bfnrt", *s))
            return NULL;
    }
    return s + 1;
}

static const char *json_digits(const char *s)
{
    if (!isdigit((unsigned char)*s))
        return NULL;
    while (isdigit((unsigned char)*s))
        s++;
    return s;
}

static const char *json_value(const char *s, int depth)
{
    s = json_ws(s);
    if (depth > 32)
        return NULL;
    if (*s == '{' || *s == '[') {
        char close = *s == '{' ? '}' : ']';
        if (*(s = json_ws(s + 1)) == close)
            return s + 1;
        for (;;) {
            if (close == '}') {
                if (!(s = json_string(json_ws(s))) || *(s = json_ws(s)) != ':')
                    return NULL;
                s++;
            }
            if (!(s = json_value(s, depth + 1)))
                return NULL;
            if (*(s = json_ws(s)) == close)
                return s + 1;
            if (*s++ != ',')
                return NULL;
        }
    }
    if (*s == '"')
        return json_string(s);
    static const char *const words[] = {"true", "false", "null"};
    for (size_t i = 0; i < 3; i++)
        if (!strncmp(s, words[i], strlen(words[i])))
            return s + strlen(words[i]);
    /* a number: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? ("nan", "inf", "" are not) */
    s += *s == '-';
    if (!(s = *s == '0' ? s + 1 : json_digits(s)))
        return NULL;
    if (*s == '.' && !(s = json_digits(s + 1)))
        return NULL;
    if (*s == 'e' || *s == 'E') {
        s++;
        s += *s == '+' || *s == '-';
        s = json_digits(s);
    }
    return s;
}

/* The JSON object at j (kvbench's stdout; stderr lines may follow it) parses. */
static void assert_json(const char *j)
{
    assert_non_null(j);
    const char *e = json_value(j, 0);
    if (!e || (*e && *e != '\n'))
        fail_msg("kvbench's JSON does not parse%s:\n%s", e ? " (text after it)" : "", j);
}

static int run_bench(char *out, const char *const *args)
{
    const char *argv[64] = {KVBENCH_BIN, "engine"};
    int n = 2;
    for (; *args && n < 63; args++)
        argv[n++] = *args;
    argv[n] = NULL;
    int rc = itest_run(argv, out, OUT_CAP);
    if (rc != 0)
        fprintf(stderr, "%s\n", out);
    return rc;
}


/* The run's "check": the float64 reference ran on every decode step (g) of worker 0's first
 * request, within its tolerance, and no output was non-finite. Returns the object. */
static const char *reference_checked(const char *j, unsigned g)
{
    const char *ck = strstr(j, "\"check\":");
    assert_non_null(ck);
    assert_non_null(strstr(ck, "float64 kv_attn_reference"));
    assert_int_equal((int)jnum(ck, "checks"), g);
    assert_true(jnum(ck, "rel_err_max") <= 1e-4);
    assert_int_equal((int)jnum(ck, "nonfinite"), 0);
    return ck;
}
static void test_smoke_prefix_hits_are_exact(void **state)
{
    (void)state;
    const unsigned W = 2, R = 3, P = 32, U = 20, G = 2;
    static char out[OUT_CAP]; /* static: a failed assertion leaves without a free */
    const char *args[] = {"--kvd",    KVD_BIN,    "--workers", "2",        "--requests",
                          "3",        "--prefix", "32",        "--suffix", "20",
                          "--decode", "2",        NULL};
    assert_int_equal(run_bench(out, args), 0);
    const char *j = strchr(out, '{');
    assert_json(j);
    assert_non_null(strstr(j, "\"ok\": true,\n  \"error\": \"\","));
    assert_non_null(strstr(j, "\"backend\": \"host\""));
    double cached = jtop(j, "cached_tokens"), prompt = jtop(j, "prompt_tokens");
    fprintf(stderr, "[ kvbench ] cached %.0f of %.0f prompt tokens (allowed %u..%u)\n", cached,
            prompt, (W * R - W) * P, W * R * P);
    assert_int_equal((int)jtop(j, "requests"), W * R);
    assert_int_equal((int)prompt, W * R * (P + U));
    assert_true(cached >= (W * R - W) * P && cached <= W * R * P);
    assert_int_equal((int)jtop(j, "cached_expected_min"), (W * R - W) * P);
    assert_int_equal((int)jtop(j, "cached_expected_max"), W * R * P);
    assert_int_equal((int)jtop(j, "prefill_tokens"), (int)(prompt - cached));
    assert_int_equal((int)jtop(j, "decode_steps"), W * R * G);
    double sum = 0;
    for (unsigned w = 0; w < W; w++) {
        const char *o = jworker(j, w);
        double first = jnum(o, "first_cached"), wc = jnum(o, "cached_tokens");
        /* a worker's first request races the other's commit, which seals the prefix page by
         * page: it hits 0, one page or the whole prefix; its later requests hit all of it */
        assert_true(first >= 0 && first <= P && (unsigned)first % PAGE_TOKENS == 0);
        assert_int_equal((int)wc, (int)first + (R - 1) * P);
        assert_int_equal((int)jnum(o, "cached_max"), P);
        assert_int_equal((int)jnum(o, "requests"), R);
        assert_int_equal((int)jnum(o, "decode_steps"), R * G);
        sum += wc;
    }
    assert_true(sum == cached);
    /* the daemon saw the same hits (the shim's lookups are the only ones) */
    assert_int_equal((int)jnum(j, "lookup_tokens_hit"), (int)cached);
    assert_int_equal((int)jnum(j, "request_refs_end"), 0);
    const char *ck = reference_checked(j, G);
    assert_int_equal((int)jnum(ck, "attention_calls"), W * R * G);
    /* --batch 1: kvs_append per sequence and layer, as before kvs_append_batch */
    const int L = (int)jnum(strstr(j, "\"geometry\":"), "layers");
    assert_true(L >= 1);
    assert_int_equal((int)jnum(ck, "append_calls"), W * R * G * L);
    assert_int_equal((int)jnum(ck, "append_seqs"), W * R * G * L);
    assert_true(jtop(j, "wall_s") > 0 && jtop(j, "decode_tokens_per_s") > 0);
}

static void test_engine_batched_decode(void **state)
{
    (void)state;
    const unsigned W = 2, R = 5, P = 32, U = 20, G = 3, N = 4;
    static char out[OUT_CAP];
    const char *args[] = {"--kvd",    KVD_BIN, "--workers", "2",  "--requests", "5",
                          "--prefix", "32",    "--suffix",  "20", "--decode",   "3",
                          "--batch",  "4",     "--seed",    "3",  NULL};
    assert_int_equal(run_bench(out, args), 0);
    const char *j = strchr(out, '{');
    assert_json(j);
    assert_non_null(strstr(j, "\"ok\": true,\n  \"error\": \"\","));
    const char *pa = strstr(j, "\"params\":");
    assert_non_null(pa);
    assert_int_equal((int)jnum(pa, "batch"), N);
    assert_int_equal((int)jtop(j, "requests"), W * R);
    assert_int_equal((int)jtop(j, "decode_steps"), W * R * G);
    /* a worker's later requests begin after its first one committed the prefix, batch or not */
    double cached = jtop(j, "cached_tokens");
    assert_true(cached >= (W * R - W) * P && cached <= W * R * P);
    assert_int_equal((int)jtop(j, "prefill_tokens"), (int)(W * R * (P + U) - cached));
    for (unsigned w = 0; w < W; w++) {
        const char *o = jworker(j, w);
        assert_int_equal((int)jnum(o, "requests"), R);
        assert_int_equal((int)jnum(o, "decode_steps"), R * G);
        assert_int_equal((int)jnum(o, "cached_tokens"), (int)jnum(o, "first_cached") + (R - 1) * P);
    }
    assert_int_equal((int)jnum(j, "request_refs_end"), 0);
    const char *ck = reference_checked(j, G);
    /* one call per step over the batch: requests 0-3 together, then request 4 alone */
    assert_int_equal((int)jnum(ck, "attention_calls"), W * ((R + N - 1) / N) * G);
    assert_int_equal((int)jnum(ck, "attention_seqs"), W * R * G);
    /* and one kvs_append_batch per layer of each step over the same batch (24 calls for the
     * 60 sequence-layer appends; 60 calls without batching) */
    const int L = (int)jnum(strstr(j, "\"geometry\":"), "layers");
    assert_true(L >= 1);
    assert_int_equal((int)jnum(ck, "append_calls"), W * ((R + N - 1) / N) * G * L);
    assert_int_equal((int)jnum(ck, "append_seqs"), W * R * G * L);
    assert_true(jtop(j, "decode_tokens_per_s") > 0 && jtop(j, "decode_step_tokens_per_s") > 0);

    static const char *bad[] = {"0", "1025"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(itest_run((const char *[]){KVBENCH_BIN, "engine", "--batch", bad[i], NULL},
                                   out, OUT_CAP),
                         2);
        assert_non_null(strstr(out, "--batch needs 1 <= N <= 1024"));
    }
}

static void test_running_daemon_with_lifecycle(void **state)
{
    (void)state;
    const char *extra[] = {"--lifecycle_ms",
                           "5",
                           "--recent_pages",
                           "1",
                           "--anchor_pages",
                           "0",
                           "--retier_batch",
                           "64",
                           NULL};
    itest_kvd_t k;
    itest_kvd_start(&k, extra);
    char *out = malloc(OUT_CAP);
    assert_non_null(out);
    /* 160 + 7 + 40 tokens: 13 pages per sequence, all but the last Stale to the lifecycle */
    const char *args[] = {"--endpoint", k.endpoint,  "--workers", "3",      "--requests", "2",
                          "--prefix",   "160",       "--suffix",  "7",      "--decode",   "40",
                          "--attn-all", "--q-heads", "6",         "--seed", "9",          NULL};
    assert_int_equal(run_bench(out, args), 0);
    const char *j = strchr(out, '{');
    assert_json(j);
    assert_non_null(strstr(j, "\"ok\": true"));
    assert_non_null(strstr(j, "\"own_daemon\": false"));
    assert_int_equal((int)jnum(j, "attn_layers"), 2);
    double cached = jtop(j, "cached_tokens");
    assert_true(cached >= (6 - 3) * 160 && cached <= 6 * 160);
    const char *ck = strstr(j, "\"check\":");
    assert_non_null(ck);
    assert_int_equal((int)jnum(ck, "checks"), 40 * 2); /* every step, both layers */
    assert_true(jnum(ck, "rel_err_max") <= 1e-4);
    fprintf(stderr,
            "[ kvbench ] lifecycle: %.0f retiers, %.0f TQ3 pages at most in the checked "
            "table, %.0f reference retries\n",
            jnum(j, "retiers"), jnum(ck, "tq3_pages_in_checked_table_max"), jnum(ck, "retries"));
    /* the daemon's conversion and tick figures: conversions ran (the run is sized for it),
     * each took real time, and no tick is shorter than the mean */
    assert_true(jnum(j, "retiers") > 0);
    assert_true(jnum(j, "conversion_us_per_page") > 0);
    assert_true(jnum(j, "lifecycle_tick_us_max") >= jnum(j, "lifecycle_tick_us_mean"));
    assert_int_equal(itest_wait_stat(&k, "request_refs", 0, 20000) >= 0, 1);
    itest_assert_check(&k);
    free(out);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    char *out = malloc(OUT_CAP);
    assert_non_null(out);
    assert_int_equal(
        itest_run((const char *[]){KVBENCH_BIN, "engine", "--frobnicate", NULL}, out, OUT_CAP), 2);
    assert_non_null(strstr(out, "'--frobnicate'"));
    assert_non_null(strstr(out, "usage: kvbench engine"));
    assert_int_equal(
        itest_run((const char *[]){KVBENCH_BIN, "engine", "--workers", "x", NULL}, out, OUT_CAP),
        2);
    assert_non_null(strstr(out, "--workers needs a non-negative integer"));
    assert_int_equal(
        itest_run((const char *[]){KVBENCH_BIN, "engine", "--suffix", "0", NULL}, out, OUT_CAP), 2);
    assert_int_equal(
        itest_run((const char *[]){KVBENCH_BIN, "engine", "--seed", "abc", NULL}, out, OUT_CAP), 2);
    assert_int_equal(
        itest_run((const char *[]){KVBENCH_BIN, "engine", "--backend", "tpu", NULL}, out, OUT_CAP),
        2);
    assert_int_equal(itest_run((const char *[]){KVBENCH_BIN, "engine", "--endpoint",
                                                "ipc:///nonexistent/kvd.sock", NULL},
                               out, OUT_CAP),
                     1);
    assert_non_null(strstr(out, "no socket file /nonexistent/kvd.sock"));
    /* a --kvd that cannot be executed (a directory: EACCES) says why; its log was empty */
    assert_int_equal(
        itest_run((const char *[]){KVBENCH_BIN, "rpc", "--kvd", "/tmp", NULL}, out, OUT_CAP), 1);
    assert_non_null(strstr(out, "cannot execute /tmp: Permission denied"));
    const char *see = strstr(out, "(see "); /* kept for the user: remove it here */
    assert_non_null(see);
    char logp[256];
    assert_int_equal(sscanf(see, "(see %255[^)])", logp), 1);
    assert_int_equal(unlink(logp), 0);
    *strrchr(logp, '/') = '\0';
    assert_int_equal(rmdir(logp), 0);
    assert_int_equal(
        itest_run((const char *[]){KVBENCH_BIN, "engine", "--help", NULL}, out, OUT_CAP), 0);
    assert_non_null(strstr(out, "--workers W"));
    free(out);
}

/* Entries of dir (a TMPDIR given to kvbench) other than . and .. */
static int dir_entries(const char *dir)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

/* kvbench rpc with args (NULL-terminated) and TMPDIR=tmp; output into out */
static int run_rpc(const char *tmp, char *out, const char *const *args)
{
    const char *argv[32] = {KVBENCH_BIN, "rpc"};
    int n = 2;
    for (; *args && n < 31; args++)
        argv[n++] = *args;
    argv[n] = NULL;
    setenv("TMPDIR", tmp, 1);
    int rc = itest_run(argv, out, OUT_CAP);
    unsetenv("TMPDIR");
    return rc;
}

static void test_rpc_checks_on_a_running_daemon(void **state)
{
    (void)state;
    const char *extra[] = {"--page_tokens", "128", NULL}; /* 256 FP8 pages of 128 tokens */
    itest_kvd_t k;
    itest_kvd_start(&k, extra);
    char tmp[256];
    itest_tmpdir(tmp, sizeof tmp, "kvbench-it-tmp");
    static char out[OUT_CAP];
    const char *ok[] = {"--endpoint",      k.endpoint, "--iters", "100",
                        "--prompt-tokens", "4096",     NULL};
    int rc = run_rpc(tmp, out, ok);
    if (rc != 0 ||
        !strstr(out, "\"geometry\": {\"layers\": 2, \"kv_heads\": 2, \"head_dim\": 64, "
                     "\"page_tokens\": 128}") ||
        !strstr(out, "\"lookup_long\": {\"tokens\": 4096, \"pages\": 32,"))
        fail_msg("kvbench rpc on page_tokens 128: rc %d:\n%s", rc, out);
    const struct {
        const char *a, *v;
        int rc;
        const char *says;
    } bad[] = {
        {"--prompt-tokens", "65536", 1, "needs 512 FP8 pages, more than the daemon's pool of 256"},
        {"--prompt-tokens", "100", 1, "less than one page of the daemon's geometry"},
        {"--iters", "abc", 2, "--iters needs a positive integer"},
        {"--prompt-tokens", "-1", 2, "--prompt-tokens needs a positive integer"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *args[] = {"--endpoint", k.endpoint, "--iters", "100", bad[i].a, bad[i].v, NULL};
        rc = run_rpc(tmp, out, args);
        if (rc != bad[i].rc || !strstr(out, bad[i].says) || strchr(out, '{'))
            fail_msg("kvbench rpc %s %s: rc %d, wanted %d and '%s':\n%s", bad[i].a, bad[i].v, rc,
                     bad[i].rc, bad[i].says, out);
    }
    /* a socket file nothing listens on (a kvd killed with SIGKILL leaves one) */
    char path[320], ep[340];
    snprintf(path, sizeof path, "%s/stale.sock", tmp);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    memcpy(sa.sun_path, path, strlen(path) + 1);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    close(fd);
    snprintf(ep, sizeof ep, "ipc://%s", path);
    const char *stale[] = {"--endpoint", ep, NULL};
    int64_t t0 = itest_now_us();
    rc = run_rpc(tmp, out, stale);
    if (rc != 1 || !strstr(out, "nothing listens on") || itest_now_us() - t0 > 10000000)
        fail_msg("kvbench rpc on a stale socket: rc %d:\n%s", rc, out);
    assert_int_equal(unlink(path), 0);
    if (dir_entries(tmp) != 0)
        fail_msg("kvbench rpc left %d entries in its TMPDIR %s", dir_entries(tmp), tmp);
    itest_rmtree(tmp);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
}

/* A run's TMPDIR for kvbench (tmp) and the file its stdout and stderr go to (log, beside it) */
static void run_dirs(char *tmp, size_t tmp_cap, char *log, size_t log_cap)
{
    itest_tmpdir(tmp, tmp_cap, "kvbench-it-tmp");
    snprintf(log, log_cap, "%s.log", tmp);
}

/* A daemon of the test's own (k), then run_dirs */
static void kvd_and_run_dirs(itest_kvd_t *k, char *tmp, size_t tmp_cap, char *log,
                             size_t log_cap)
{
    itest_kvd_start(k, NULL);
    run_dirs(tmp, tmp_cap, log, log_cap);
}

/* kvbench left nothing in its TMPDIR, whatever ended the run; then both go */
static void run_dirs_clean(const char *tmp, const char *log)
{
    assert_int_equal(dir_entries(tmp), 0);
    assert_int_equal(unlink(log), 0);
    itest_rmtree(tmp);
}

/* The end of a run against the test's own daemon: every request reference reclaimed, the
 * daemon consistent and stopped cleanly, kvbench's TMPDIR empty; then both run dirs go */
static void kvd_drained_stop(itest_kvd_t *k, const char *tmp, const char *log)
{
    if (itest_wait_stat(k, "request_refs", 0, 20000) < 0)
        fail_msg("request references still held 20 s after the run: %llu",
                 (unsigned long long)itest_stat(k, "request_refs"));
    itest_assert_check(k);
    assert_int_equal(itest_kvd_stop(k), 0);
    run_dirs_clean(tmp, log);
}

/* fork + exec argv with stdout and stderr into the file `log`, TMPDIR=tmp; its pid */
static pid_t spawn_logged(const char *const *argv, const char *log, const char *tmp)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0)
            _exit(126);
        setenv("TMPDIR", tmp, 1);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return pid;
}

/* waitpid with a deadline (SIGKILL and a failed test past it); the status */
static int wait_within(pid_t pid, int64_t us, const char *what)
{
    int st;
    for (int64_t t0 = itest_now_us(); itest_now_us() - t0 < us;) {
        if (waitpid(pid, &st, WNOHANG) == pid)
            return st;
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    fail_msg("%s: still running after %lld s", what, (long long)(us / 1000000));
    return -1;
}

static void read_file(const char *path, char *out, size_t cap)
{
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = '\0';
    fclose(f);
}

/* Worker w's "error" string (its JSON entry in j) into err[cap]; its "ok" into *ok. */
static void jworker_error(const char *j, unsigned w, int *ok, char *err, size_t cap)
{
    const char *o = jworker(j, w), *end = strchr(o, '}');
    const char *e = strstr(o, "\"error\": \"");
    if (!e)
        fail_msg("no \"error\" in the entry of worker %u", w);
    e += strlen("\"error\": \"");
    const char *q = strchr(e, '"');
    while (q && q[-1] == '\\')
        q = strchr(q + 1, '"');
    assert_non_null(q);
    snprintf(err, cap, "%.*s", (int)(q - e), e);
    const char *okp = strstr(o, "\"ok\": ");
    assert_true(okp && (!end || okp < end));
    *ok = !strncmp(okp + strlen("\"ok\": "), "true", 4);
}

/* Direct children of pid (from /proc/PID/stat's ppid) into kids[cap]; their count. */
static int children_of(pid_t pid, pid_t *kids, int cap)
{
    DIR *d = opendir("/proc");
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) && n < cap;) {
        char p[300], buf[512];
        if (e->d_name[0] < '0' || e->d_name[0] > '9')
            continue;
        snprintf(p, sizeof p, "/proc/%s/stat", e->d_name);
        FILE *f = fopen(p, "r");
        if (!f)
            continue; /* gone meanwhile */
        size_t len = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[len] = '\0';
        const char *rp = strrchr(buf, ')'); /* after "pid (comm)": " state ppid" */
        int ppid = 0;
        char st;
        if (rp && sscanf(rp + 1, " %c %d", &st, &ppid) == 2 && ppid == pid)
            kids[n++] = (pid_t)atoi(e->d_name);
    }
    closedir(d);
    return n;
}

/* A daemon of its own (k) and a `kvbench engine` on it with far more requests than the test
 * waits for, logged to log, TMPDIR tmp (run_dirs); the engine's pid */
static pid_t spawn_long_engine(itest_kvd_t *k, char *tmp, size_t tmp_cap, char *log,
                               size_t log_cap)
{
    kvd_and_run_dirs(k, tmp, tmp_cap, log, log_cap);
    const char *argv[] = {KVBENCH_BIN,  "engine", "--endpoint", k->endpoint,
                          "--requests", "100000", NULL};
    return spawn_logged(argv, log, tmp);
}

static void test_engine_daemon_killed_fails_fast(void **state)
{
    (void)state;
    itest_kvd_t k;
    char tmp[256], log[300];
    pid_t pid = spawn_long_engine(&k, tmp, sizeof tmp, log, sizeof log);
    /* both workers attached (and the reference session): then the daemon dies */
    assert_true(itest_wait_stat(&k, "sessions_opened", 3, 30000) >= 0);
    kill(k.pid, SIGKILL);
    waitpid(k.pid, NULL, 0);
    int64_t t0 = itest_now_us();
    int st = wait_within(pid, 30000000, "kvbench engine after its daemon was killed");
    static char out[OUT_CAP];
    read_file(log, out, sizeof out);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 1 || !strstr(out, "went away during the run") ||
        !strstr(out, "\"ok\": false,\n  \"error\": \"the daemon at "))
        fail_msg("kvbench engine, daemon killed: status %d after %.1f s:\n%s", st,
                 (double)(itest_now_us() - t0) / 1e6, out);
    fprintf(stderr, "[ kvbench ] the daemon's death ended the run in %.1f s\n",
            (double)(itest_now_us() - t0) / 1e6);
    /* every worker stopped, and says why: killed by kvbench naming the daemon's going away,
     * or its own error when a call failed first */
    const char *j = strchr(out, '{');
    assert_json(j);
    for (unsigned w = 0; w < 2; w++) {
        char err[600];
        int ok;
        jworker_error(j, w, &ok, err, sizeof err);
        if (ok || !err[0] ||
            (!strncmp(err, "killed by kvbench", 17) && !strstr(err, "went away during the run")))
            fail_msg("worker %u after the daemon was killed: ok %d, error '%s':\n%s", w, ok, err,
                     out);
        fprintf(stderr, "[ kvbench ] worker %u: %s\n", w, err);
    }
    run_dirs_clean(tmp, log);
    k.pid = 0; /* reaped above */
    itest_rmtree(k.dir);
}

/* Workers killed from outside (an operator, the OOM killer) while the daemon stays: the run
 * fails and each worker's "error" names the signal (it was ""). */
static void test_engine_workers_killed_say_how(void **state)
{
    (void)state;
    itest_kvd_t k;
    char tmp[256], log[300];
    pid_t pid = spawn_long_engine(&k, tmp, sizeof tmp, log, sizeof log);
    /* a lookup means a worker is past the start barrier: every worker has checked in */
    for (int64_t t0 = itest_now_us(); itest_stat(&k, "lookups") == 0;) {
        if (itest_now_us() - t0 > 30000000) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            fail_msg("kvbench engine's workers never looked anything up");
        }
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    pid_t kids[8];
    int n = children_of(pid, kids, 8);
    if (n != 2) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        fail_msg("kvbench engine has %d children, want its 2 workers", n);
    }
    for (int i = 0; i < n; i++)
        assert_int_equal(kill(kids[i], SIGKILL), 0);
    int st = wait_within(pid, 30000000, "kvbench engine after its workers were killed");
    static char out[OUT_CAP];
    read_file(log, out, sizeof out);
    const char *j = strchr(out, '{');
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 1 || !j || !strstr(j, "\"ok\": false"))
        fail_msg("kvbench engine, workers killed: status %d:\n%s", st, out);
    assert_json(j);
    for (unsigned w = 0; w < 2; w++) {
        char err[600];
        int ok;
        jworker_error(j, w, &ok, err, sizeof err);
        if (ok || strcmp(err, "killed by signal 9 (Killed) before it finished"))
            fail_msg("worker %u killed by SIGKILL: ok %d, error '%s':\n%s", w, ok, err, out);
        /* past a lookup, so it ran: its wall time is until it was killed, not 0.000 */
        if (!(jnum(jworker(j, w), "wall_s") > 0))
            fail_msg("worker %u killed after it started reports no wall time:\n%s", w, out);
    }
    /* the daemon reclaims what the workers held */
    kvd_drained_stop(&k, tmp, log);
}

/* A worker that dies before the start barrier without writing its ready byte (as the OOM
 * killer would end it, its shim open): kvbench read the ready pipe forever, since the other
 * workers, waiting for go, held the pipe's write end open. Now the run is called off. */
static void test_engine_worker_dead_before_start_does_not_hang(void **state)
{
    (void)state;
    itest_kvd_t k;
    char tmp[256], log[300];
    kvd_and_run_dirs(&k, tmp, sizeof tmp, log, sizeof log);
    const char *argv[] = {KVBENCH_BIN,  "engine", "--endpoint", k.endpoint, "--workers", "3",
                          "--requests", "2",      "--decode",   "2",        NULL};
    setenv("KVBENCH_TEST_DIE_BEFORE_READY", "1", 1); /* worker 1 */
    pid_t pid = spawn_logged(argv, log, tmp);
    unsetenv("KVBENCH_TEST_DIE_BEFORE_READY");
    int64_t t0 = itest_now_us();
    int st = wait_within(pid, 30000000, "kvbench engine with a worker dead before the start");
    fprintf(stderr, "[ kvbench ] a worker dead before the start ended the run in %.2f s\n",
            (double)(itest_now_us() - t0) / 1e6);
    static char out[OUT_CAP];
    read_file(log, out, sizeof out);
    const char *j = strchr(out, '{');
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 1 || !j)
        fail_msg("kvbench engine, worker 1 dead before the start: status %d:\n%s", st, out);
    assert_json(j);
    const char *how = "worker 1 killed by signal 9 (Killed) before it was ready";
    char want[256];
    snprintf(want, sizeof want,
             "\"ok\": false,\n  \"error\": \"the run was called off at the start barrier: %s\"",
             how);
    if (!strstr(j, want) || !strstr(j, "\"wall_s\": null,\n  \"decode_tokens_per_s\": null"))
        fail_msg("want %s and a null wall time:\n%s", want, out);
    assert_int_equal((int)jtop(j, "requests"), 0);
    for (unsigned w = 0; w < 3; w++) {
        char err[600], other[300];
        int ok;
        jworker_error(j, w, &ok, err, sizeof err);
        snprintf(other, sizeof other, "stopped by kvbench before the start: %s", how);
        if (ok || strcmp(err, w == 1 ? "killed by signal 9 (Killed) before it was ready" : other))
            fail_msg("worker %u: ok %d, error '%s':\n%s", w, ok, err, out);
        /* it never started: no wall time (it was 0.000, as if measured) */
        if (!strstr(jworker(j, w), "\"wall_s\": null, \"decode_tokens_per_s\": null"))
            fail_msg("worker %u of a run called off has a wall time:\n%s", w, out);
    }
    /* every session ended: the stopped workers' and the reference mapping's by goodbye, the
     * dead worker's at its exit; nothing is held and the daemon is consistent */
    if (itest_wait_stat(&k, "sessions_closed", itest_stat(&k, "sessions_opened"), 20000) < 0 ||
        itest_stat(&k, "sessions_opened") != 4)
        fail_msg("sessions: %llu opened (want 3 workers + worker 0's reference), %llu closed",
                 (unsigned long long)itest_stat(&k, "sessions_opened"),
                 (unsigned long long)itest_stat(&k, "sessions_closed"));
    kvd_drained_stop(&k, tmp, log);
}

/* 1 when pid's main thread is in system call nr with first argument a0 (any when a0 is
 * ~0ul), 0 when not, -1 when /proc/PID/syscall cannot say (no such file or not readable
 * here: the caller skips) */
static int in_syscall_on(pid_t pid, long want, unsigned long a0_want)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/syscall", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    long nr = -1;
    unsigned long a0 = 0;
    int got = fscanf(f, "%ld 0x%lx", &nr, &a0); /* "running" while it runs */
    fclose(f);
    return got >= 1 && nr == want && (a0_want == ~0ul || (got == 2 && a0 == a0_want));
}

/* 1 when pid is blocked in write(fd, ...), 0 when not, -1 when that cannot be read */
static int blocked_writing(pid_t pid, int fd)
{
    return in_syscall_on(pid, SYS_write, (unsigned long)fd);
}

/* pid's state letter in /proc/PID/stat ('Z': dead, not reaped), or 0 when it is gone */
static char proc_state(pid_t pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *rp = strrchr(buf, ')');
    return rp && rp[1] == ' ' ? rp[2] : 0;
}

/* Every worker was ready, then all died before kvbench wrote the go bytes: the write to a pipe
 * nobody reads raised SIGPIPE, which kvbench did not handle, so it died by it (status 141)
 * with no JSON, its TMPDIR left behind (and its own kvd, when it had one, killed without a
 * clean stop). Made deterministic: kvbench's stderr is a full pipe, so it blocks printing
 * "workers ready; go" (after the barrier, before the go bytes); the worker is killed and dead
 * meanwhile, then the pipe is drained. kvbench must fail the run as for any killed worker. */
static void test_engine_workers_dead_before_go_no_sigpipe(void **state)
{
    (void)state;
    itest_kvd_t k;
    char tmp[256], log[300];
    kvd_and_run_dirs(&k, tmp, sizeof tmp, log, sizeof log);
    int ep[2];
    assert_int_equal(pipe(ep), 0);
    /* fill it, then make it blocking again (the flag is shared with kvbench's stderr) */
    assert_int_equal(fcntl(ep[1], F_SETFL, O_NONBLOCK), 0);
    char junk[4096];
    memset(junk, '.', sizeof junk);
    while (write(ep[1], junk, sizeof junk) > 0 || write(ep[1], junk, 1) > 0)
        continue;
    assert_int_equal(fcntl(ep[1], F_SETFL, 0), 0);
    const char *argv[] = {KVBENCH_BIN,  "engine", "--endpoint", k.endpoint, "--workers", "1",
                          "--requests", "1",      "--decode",   "1",        NULL};
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || dup2(fd, 1) < 0 || dup2(ep[1], 2) < 0)
            _exit(126);
        close(ep[0]);
        setenv("TMPDIR", tmp, 1);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(ep[1]);
    const char *fail = NULL;
    pid_t kids[8];
    int n = 0;
    int64_t t0 = itest_now_us();
    for (int b; !fail && (b = blocked_writing(pid, 2)) != 1;) {
        if (b < 0) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            close(ep[0]);
            itest_kvd_stop(&k);
            unlink(log);
            itest_rmtree(tmp);
            skip(); /* no /proc/PID/syscall: where kvbench blocks cannot be seen */
        }
        if (itest_now_us() - t0 > 30000000)
            fail = "kvbench never blocked on its full stderr after the start barrier";
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    if (!fail && (n = children_of(pid, kids, 8)) != 1)
        fail = "kvbench engine --workers 1 does not have one child";
    for (int i = 0; i < n && !fail; i++) {
        assert_int_equal(kill(kids[i], SIGKILL), 0);
        for (t0 = itest_now_us(); proc_state(kids[i]) != 'Z' && !fail;) {
            if (itest_now_us() - t0 > 30000000)
                fail = "the killed worker did not die";
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
    }
    /* drain kvbench's stderr (it goes on) until it exits */
    fcntl(ep[0], F_SETFL, O_NONBLOCK);
    int st = 0;
    for (t0 = itest_now_us();;) {
        while (read(ep[0], junk, sizeof junk) > 0)
            continue;
        if (waitpid(pid, &st, WNOHANG) == pid)
            break;
        if (itest_now_us() - t0 > 30000000) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            fail = fail ? fail : "kvbench still running 30 s after its worker died";
            break;
        }
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    close(ep[0]);
    static char out[OUT_CAP];
    read_file(log, out, sizeof out);
    const char *j = strchr(out, '{');
    if (fail || !WIFEXITED(st) || WEXITSTATUS(st) != 1 || !j) {
        itest_kvd_stop(&k); /* what the test made goes, kvbench's leftovers with it */
        unlink(log);
        itest_rmtree(tmp);
    }
    if (fail)
        fail_msg("%s (status %d):\n%s", fail, st, out);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 1 || !j)
        fail_msg("kvbench engine, its worker dead before go: %s %d, wanted exit 1 and JSON:\n%s",
                 WIFSIGNALED(st) ? "killed by signal" : "exit status",
                 WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st), out);
    assert_json(j);
    char err[600];
    int ok;
    jworker_error(j, 0, &ok, err, sizeof err);
    if (ok || strncmp(err, "killed by signal 9 (Killed)", 27))
        fail_msg("worker 0 killed before go: ok %d, error '%s':\n%s", ok, err, out);
    kvd_drained_stop(&k, tmp, log);
}

static void test_engine_reference_does_not_hold_back_recycling(void **state)
{
    (void)state;
    static char out[OUT_CAP];
    /* 32 + 40 + 2 tokens: 4 sealed pages per request (2 of them the shared prefix) and a
     * partial one; 30 requests cache 62 pages in a pool of 40, so entries must be evicted and
     * released pages recycled, which waits for every session's epoch report */
    const char *args[] = {"--kvd",    KVD_BIN,    "--workers",   "1",        "--requests",
                          "30",       "--prefix", "32",          "--suffix", "40",
                          "--decode", "2",        "--pages-fp8", "40",       NULL};
    int rc = run_bench(out, args);
    const char *j = strchr(out, '{');
    assert_json(j);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(j, "\"ok\": true,\n  \"error\": \"\","));
    assert_int_equal((int)jtop(j, "requests"), 30);
    assert_int_equal((int)jnum(j, "alloc_exhausted"), 0);
    assert_true(jnum(j, "evictions_pressure") > 0); /* the run did need the recycling */
    const char *ck = strstr(j, "\"check\":");
    assert_non_null(ck);
    assert_int_equal((int)jnum(ck, "checks"), 2);
}

/* kvbench engine --endpoint on k, W 2, worker 1 hung before its ready byte, --ready-timeout
 * `timeout`: its pid, its output going to log */
static pid_t spawn_with_hung_worker(const itest_kvd_t *k, const char *timeout, const char *log,
                                    const char *tmp)
{
    const char *argv[] = {
        KVBENCH_BIN, "engine",   "--endpoint", k->endpoint,       "--workers", "2", "--requests",
        "1",         "--decode", "1",          "--ready-timeout", timeout,     NULL};
    setenv("KVBENCH_TEST_HANG_BEFORE_READY", "1", 1);
    pid_t pid = spawn_logged(argv, log, tmp);
    unsetenv("KVBENCH_TEST_HANG_BEFORE_READY");
    return pid;
}

/* The run's JSON in out (from log) after kvbench exited 1; its "error" must be `why`, worker
 * 0's error `err0` and worker 1's `err1`; no wall time; the daemon left clean. */
static void check_called_off(itest_kvd_t *k, int st, const char *log, const char *tmp,
                             const char *why, const char *err0, const char *err1)
{
    static char out[OUT_CAP];
    read_file(log, out, sizeof out);
    const char *j = strchr(out, '{');
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 1 || !j)
        fail_msg("kvbench engine with a hung worker: status %d:\n%s", st, out);
    assert_json(j);
    char want[512];
    snprintf(want, sizeof want,
             "\"ok\": false,\n  \"error\": \"the run was called off at the start barrier: %s\"",
             why);
    if (!strstr(j, want) || !strstr(j, "\"wall_s\": null,"))
        fail_msg("want %s and a null wall time:\n%s", want, out);
    for (unsigned w = 0; w < 2; w++) {
        char err[600];
        int ok;
        jworker_error(j, w, &ok, err, sizeof err);
        if (ok || strcmp(err, w ? err1 : err0))
            fail_msg("worker %u: ok %d, error '%s', want '%s':\n%s", w, ok, err, w ? err1 : err0,
                     out);
    }
    assert_true(itest_wait_stat(k, "sessions_closed", itest_stat(k, "sessions_opened"), 20000) >=
                0);
    kvd_drained_stop(k, tmp, log);
}

static void test_engine_worker_hung_before_start_times_out(void **state)
{
    (void)state;
    itest_kvd_t k;
    char tmp[256], log[300];
    kvd_and_run_dirs(&k, tmp, sizeof tmp, log, sizeof log);
    pid_t pid = spawn_with_hung_worker(&k, "2", log, tmp);
    int st = wait_within(pid, 30000000, "kvbench engine with a worker hung before the start");
    const char *why = "worker 1 not ready after 2 s (--ready-timeout): killed";
    char other[300];
    snprintf(other, sizeof other, "stopped by kvbench before the start: %s", why);
    check_called_off(&k, st, log, tmp, why, other,
                     "killed by kvbench (SIGKILL): not ready after 2 s (--ready-timeout)");
}

/* 1 when pid's main thread is in system call nr, 0 when not, -1 when that cannot be read */
static int in_syscall(pid_t pid, long want)
{
    return in_syscall_on(pid, want, ~0ul);
}

static void test_engine_worker_dead_after_ready_says_so(void **state)
{
    (void)state;
    itest_kvd_t k;
    char tmp[256], log[300];
    kvd_and_run_dirs(&k, tmp, sizeof tmp, log, sizeof log);
    pid_t pid = spawn_with_hung_worker(&k, "8", log, tmp);
    /* worker 1 waits in pause() for ever; worker 0, ready, in read() on the go pipe: kill it */
    pid_t kids[4], ready = 0;
    for (int64_t t0 = itest_now_us(); !ready && itest_now_us() - t0 < 6000000;) {
        int n = children_of(pid, kids, 4), hung = 0;
        for (int i = 0; i < n; i++) {
            int r = in_syscall(kids[i], SYS_read), p = in_syscall(kids[i], SYS_pause);
            if (r < 0 || p < 0) {
                kill(pid, SIGKILL);
                waitpid(pid, NULL, 0);
                itest_kvd_stop(&k);
                unlink(log);
                itest_rmtree(tmp);
                skip(); /* no /proc/PID/syscall: where the workers wait cannot be seen */
            }
            hung += p;
            ready = r ? kids[i] : ready;
        }
        if (!(n == 2 && hung == 1))
            ready = 0;
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    if (!ready) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        fail_msg("worker 0 was not seen waiting for go beside the hung worker 1");
    }
    assert_int_equal(kill(ready, SIGKILL), 0);
    int st = wait_within(pid, 30000000, "kvbench engine, worker 0 killed at the barrier");
    const char *how = "killed by signal 9 (Killed) at the start barrier, after it was ready";
    char why[200];
    snprintf(why, sizeof why, "worker 0 %s", how);
    /* the hung worker cannot stop at the barrier: it is killed at --ready-timeout */
    check_called_off(&k, st, log, tmp, why, how,
                     "killed by kvbench (SIGKILL): not ready after 8 s (--ready-timeout)");
}

static void test_rpc_sigterm_cleans_up(void **state)
{
    (void)state;
    char tmp[256], log[300];
    run_dirs(tmp, sizeof tmp, log, sizeof log);
    const char *argv[] = {KVBENCH_BIN, "rpc", "--kvd", KVD_BIN, "--iters", "10000000", NULL};
    pid_t pid = spawn_logged(argv, log, tmp);
    /* its kvd is ready when TMPDIR/kvbench-XXXXXX/run/kvd.sock.fds exists */
    char fds[1024] = "";
    for (int64_t t0 = itest_now_us(); !fds[0] && itest_now_us() - t0 < 30000000;) {
        DIR *d = opendir(tmp);
        assert_non_null(d);
        for (struct dirent *e; (e = readdir(d));) {
            char p[1024];
            struct stat sb;
            snprintf(p, sizeof p, "%s/%s/run/kvd.sock.fds", tmp, e->d_name);
            if (e->d_name[0] != '.' && stat(p, &sb) == 0)
                snprintf(fds, sizeof fds, "%s", p);
        }
        closedir(d);
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    if (!fds[0]) {
        kill(pid, SIGKILL); /* its kvd dies with it (PR_SET_PDEATHSIG) */
        waitpid(pid, NULL, 0);
        fail_msg("kvbench rpc's kvd never became ready in %s", tmp);
    }
    struct timespec ts = {0, 300000000}; /* into the figures */
    nanosleep(&ts, NULL);
    kill(pid, SIGTERM);
    int st = wait_within(pid, 30000000, "kvbench rpc after SIGTERM");
    static char out[OUT_CAP];
    read_file(log, out, sizeof out);
    if (!WIFSIGNALED(st) || WTERMSIG(st) != SIGTERM || dir_entries(tmp) != 0)
        fail_msg("kvbench rpc, SIGTERM: status %d, %d entries left in %s:\n%s", st,
                 dir_entries(tmp), tmp, out);
    assert_int_equal(unlink(log), 0);
    itest_rmtree(tmp);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_smoke_prefix_hits_are_exact),
        cmocka_unit_test(test_engine_batched_decode),
        cmocka_unit_test(test_running_daemon_with_lifecycle),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_rpc_checks_on_a_running_daemon),
        cmocka_unit_test(test_engine_daemon_killed_fails_fast),
        cmocka_unit_test(test_engine_workers_killed_say_how),
        cmocka_unit_test(test_engine_worker_dead_before_start_does_not_hang),
        cmocka_unit_test(test_engine_workers_dead_before_go_no_sigpipe),
        cmocka_unit_test(test_engine_reference_does_not_hold_back_recycling),
        cmocka_unit_test(test_engine_worker_hung_before_start_times_out),
        cmocka_unit_test(test_engine_worker_dead_after_ready_says_so),
        cmocka_unit_test(test_rpc_sigterm_cleans_up),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
