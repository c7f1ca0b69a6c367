/* it_share.c — two processes share pages through the daemon (issue 3, test 1).
 *
 * A allocates, writes a byte pattern into its own mapping of the FP8 pool, seals the pages as
 * a 3-page prompt. B (another process) looks up the same tokens, must get the same logical
 * pages, the same physical pages through its own read-only directory mapping, and read
 * identical bytes through its own pool mapping. A stays alive until B is done, so nothing
 * but the cache keeps the pages.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "itest.h"

#define NPAGES 3
#define PT 16

static void prompt_tokens(uint32_t *t, size_t n)
{
    for (size_t i = 0; i < n; i++)
        t[i] = (uint32_t)(1000 + i * 7);
}

static uint8_t pattern(uint32_t page_idx, uint64_t off)
{
    return (uint8_t)((page_idx * 131u + off * 17u + 5u) & 0xff);
}

/* child A: returns via pipe the canonical logical ids */
static int child_a(const itest_kvd_t *k, int wfd, int rfd)
{
    kvc_t *c = itest_connect(k, "writer-A");
    uint32_t pages[NPAGES], canon[NPAGES], tok[NPAGES * PT];
    prompt_tokens(tok, NPAGES * PT);
    if (kvc_alloc(c, KV_FMT_FP8, NPAGES, pages) != KV_ERR_OK)
        return 10;
    uint64_t pb = kvc_page_bytes(c, KV_FMT_FP8);
    for (uint32_t i = 0; i < NPAGES; i++) {
        uint8_t *p = kvc_page_ptr(c, pages[i]);
        if (!p)
            return 11;
        for (uint64_t o = 0; o < pb; o++)
            p[o] = pattern(i, o);
    }
    for (uint32_t i = 0; i < NPAGES; i++)
        if (kvc_seal(c, pages[i], i ? canon[i - 1] : KVP_NO_PAGE, tok + i * PT, PT, NULL, 0,
                     &canon[i]) != KV_ERR_OK) {
            fprintf(stderr, "seal: %s\n", kvc_errmsg(c));
            return 12;
        }
    if (write(wfd, canon, sizeof canon) != (ssize_t)sizeof canon)
        return 13;
    char go;
    if (read(rfd, &go, 1) != 1) /* stay alive (and mapped) until B is done */
        return 14;
    kvc_close(&c);
    return 0;
}

static int child_b(const itest_kvd_t *k, const uint32_t *want)
{
    kvc_t *c = itest_connect(k, "reader-B");
    uint32_t tok[NPAGES * PT + 5], got[NPAGES + 1];
    prompt_tokens(tok, NPAGES * PT + 5); /* a longer prompt: 5 tokens past the cached pages */
    size_t n = 0;
    uint32_t matched = 0;
    if (kvc_lookup(c, tok, NPAGES * PT + 5, NULL, 0, 0, got, NPAGES + 1, &n, &matched) !=
        KV_ERR_OK)
        return 20;
    if (n != NPAGES || matched != NPAGES * PT)
        return 21;
    uint64_t pb = kvc_page_bytes(c, KV_FMT_FP8);
    for (uint32_t i = 0; i < NPAGES; i++) {
        if (got[i] != want[i])
            return 22;
        const uint8_t *p = kvc_page_ptr(c, got[i]);
        if (!p)
            return 23;
        for (uint64_t o = 0; o < pb; o++)
            if (p[o] != pattern(i, o))
                return 24;
        kv_dir_entry_t e = kvc_directory(c)[got[i]];
        if (!(kv_dir_flags(e) & KV_DIR_SEALED))
            return 25;
    }
    if (kvc_release(c, got, n) != KV_ERR_OK)
        return 26;
    kvc_close(&c);
    return 0;
}

static void test_two_processes_share_sealed_pages(void **state)
{
    (void)state;
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    int a2p[2], p2a[2];
    assert_int_equal(pipe(a2p), 0);
    assert_int_equal(pipe(p2a), 0);
    pid_t a = fork();
    if (a == 0)
        _exit(child_a(&k, a2p[1], p2a[0]));
    uint32_t canon[NPAGES];
    assert_int_equal(read(a2p[0], canon, sizeof canon), (ssize_t)sizeof canon);
    assert_int_equal(itest_stat(&k, "cache_entries"), NPAGES);
    pid_t b = fork();
    if (b == 0)
        _exit(child_b(&k, canon));
    int st;
    assert_int_equal(waitpid(b, &st, 0), b);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_int_equal(write(p2a[1], "g", 1), 1);
    assert_int_equal(waitpid(a, &st, 0), a);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    /* both sessions gone: every reference released, the cache keeps the prompt */
    assert_true(itest_wait_stat(&k, "sessions", 0, 30000) >= 0);
    assert_int_equal(itest_stat(&k, "request_refs"), 0);
    assert_int_equal(itest_stat(&k, "cache_entries"), NPAGES);
    itest_assert_check(&k);
    assert_int_equal(itest_kvd_stop(&k), 0);
    close(a2p[0]);
    close(a2p[1]);
    close(p2a[0]);
    close(p2a[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_processes_share_sealed_pages),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
