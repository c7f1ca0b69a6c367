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
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
    assert_non_null(j);
    assert_non_null(strstr(j, "\"ok\": true"));
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
    /* the reference check ran on every decode step of worker 0's first request */
    const char *ck = strstr(j, "\"check\":");
    assert_non_null(ck);
    assert_non_null(strstr(ck, "float64 kv_attn_reference"));
    assert_int_equal((int)jnum(ck, "checks"), G);
    assert_true(jnum(ck, "rel_err_max") <= 1e-4);
    assert_int_equal((int)jnum(ck, "nonfinite"), 0);
    assert_int_equal((int)jnum(ck, "attention_calls"), W * R * G);
    assert_true(jtop(j, "wall_s") > 0 && jtop(j, "decode_tokens_per_s") > 0);
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
    assert_non_null(j);
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
    const char *see = strstr(out, "(see /tmp/kvbench-"); /* kept for the user: remove it here */
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_smoke_prefix_hits_are_exact),
        cmocka_unit_test(test_running_daemon_with_lifecycle),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
