/* test_snapshot.c — kvd/snapshot.c and the core's persistence calls (kvd_core_page_read,
 * kvd_core_cache_restore): CRC32C against its check value and a bit-by-bit reference, a
 * round trip through a file (lookups hit with identical bytes, LRU order and pins kept), every
 * kind of corruption refused by the parser with its reason (magic, version, reserved bytes,
 * geometry, page bytes, namespace, salt, record CRC, record fields, truncation, trailing
 * bytes, oversized counts), the loader's fallback to the older generation and its rollback of
 * a half-restored file, the budget when the pool is smaller than the snapshot, generations
 * kept, stale .tmp files, a directory that cannot be listed, the salt file's checks,
 * allocation failure during a load, the end of a sliced write (rename, pruning) done by
 * the thread of its last flush, not by end's, and a write that runs out of room (short write,
 * then an error naming the file; the .tmp removed, the previous generation kept), and a FIFO
 * where a snapshot or the salt belongs (refused, not waited on). A generation refused as
 * corrupt is set aside as .refused (not one of another identity), so the next write keeps the
 * older one that loaded; a failed rename leaves it in place; the writer bounds the .refused.
 * Fixture: core_fixture.h (3 tokens per page, 7 FP8 and 5 TQ3 pages).
 */
#include "core_fixture.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "snapshot.h"
#include "util.h"

/* core_fixture.h's FX_OK names the core `c`; here several cores live side by side, so the
 * core calls report the code and the snapshot calls (SNAP_OK) the message in `err`. */
#undef FX_OK
#define FX_OK(expr)                                                                                \
    do {                                                                                           \
        int rc_ = (expr);                                                                          \
        if (rc_ != KV_ERR_OK)                                                                      \
            fail_msg("%s -> %s", #expr, kv_err_name(rc_));                                         \
    } while (0)
#define SNAP_OK(expr)                                                                              \
    do {                                                                                           \
        int rc_ = (expr);                                                                          \
        if (rc_ != KV_ERR_OK)                                                                      \
            fail_msg("%s -> %s: %s", #expr, kv_err_name(rc_), err);                                \
    } while (0)

/* Every test that touches files gets a fresh /tmp/kvd-snap-test-XXXXXX as cmocka setup and
 * loses it, with everything in it, as teardown — which cmocka runs after a failed test too,
 * so no run leaves one behind. */
static char tdir[64];

static void tdir_make(void)
{
    snprintf(tdir, sizeof(tdir), "/tmp/kvd-snap-test-XXXXXX");
    assert_non_null(mkdtemp(tdir));
}

static void tdir_remove(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tdir);
    assert_int_equal(system(cmd), 0);
}

static int tdir_setup(void **state)
{
    (void)state;
    tdir_make();
    return 0;
}

static int tdir_teardown(void **state)
{
    (void)state;
    tdir_remove();
    return 0;
}

static const uint8_t fx_salt[32] = {1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16,
                                    17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};

static kvd_core_t *snap_core(uint32_t fp8, uint32_t tq3)
{
    kvd_core_opts_t o;
    fx_opts(&o);
    o.pages[KV_FMT_FP8] = o.cache_quota_pages[KV_FMT_FP8] = fp8;
    o.pages[KV_FMT_TQ3] = o.cache_quota_pages[KV_FMT_TQ3] = tq3;
    memcpy(o.hash_key, fx_salt, 32);
    return fx_core_opts(&o);
}

/* Byte i of the page holding prompt `seed` page `k`: distinct per page and position. */
static uint8_t page_byte(uint32_t seed, uint32_t k, uint64_t i)
{
    return (uint8_t)(seed * 31u + k * 7u + i * 13u + (i >> 8));
}

static void fill_page(kvd_core_t *c, uint32_t lid, uint32_t seed, uint32_t k)
{
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, lid, &pi));
    uint8_t *p = kvd_backend_host_page(kvd_core_backend(c), pi.fmt, pi.phys);
    uint64_t pb = kvd_core_export(c)->page_bytes[pi.fmt];
    for (uint64_t i = 0; i < pb; i++)
        p[i] = page_byte(seed, k, i);
}

static void check_page(kvd_core_t *c, uint32_t lid, uint32_t seed, uint32_t k)
{
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, lid, &pi));
    const uint8_t *p = kvd_backend_host_page(kvd_core_backend(c), pi.fmt, pi.phys);
    uint64_t pb = kvd_core_export(c)->page_bytes[pi.fmt];
    for (uint64_t i = 0; i < pb; i++)
        if (p[i] != page_byte(seed, k, i))
            fail_msg("page %u (prompt %u page %u) byte %llu differs", lid, seed, k,
                     (unsigned long long)i);
}

/* A core of the standard test pools with one session open (*s): where every test starts. */
static kvd_core_t *session_core(uint64_t *s)
{
    kvd_core_t *a = snap_core(FX_FP8, FX_TQ3);
    FX_OK(kvd_core_session_open(a, 1, 0, s));
    return a;
}

/* Seal prompt `seed` of n pages with known bytes, then release it: cached, on the LRU. */
static void cache_prompt(kvd_core_t *c, uint64_t s, uint32_t seed, uint32_t n, uint32_t *ids)
{
    uint32_t tok[8 * FX_PT];
    fx_tokens(seed, n, tok);
    FX_OK(kvd_core_alloc(c, s, n, ids));
    uint32_t prev = KVD_NONE;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t h[32];
        uint32_t canon;
        fill_page(c, ids[i], seed, i);
        FX_OK(kvd_core_seal(c, s, ids[i], prev, tok + i * FX_PT, FX_PT, NULL, 0, h, &canon));
        prev = ids[i];
    }
    FX_OK(kvd_core_release(c, s, ids, n));
    fx_quiesce(c, s);
}

/* Lookup prompt seed (n pages) in a new session; returns hits; checks bytes of each hit. */
static uint32_t lookup_prompt(kvd_core_t *c, uint32_t seed, uint32_t n, uint32_t *out)
{
    uint64_t s;
    FX_OK(kvd_core_session_open(c, 99, 0, &s));
    uint32_t tok[8 * FX_PT], np, nt;
    fx_tokens(seed, n, tok);
    FX_OK(kvd_core_lookup(c, s, tok, n * FX_PT, NULL, 0, out, 8, &np, &nt));
    for (uint32_t i = 0; i < np; i++)
        check_page(c, out[i], seed, i);
    FX_OK(kvd_core_session_close(c, s));
    return np;
}

static void ident(kvd_snap_ident_t *id, const kvd_core_t *c)
{
    kvd_snap_ident(id, c, "default", fx_salt);
}

static uint8_t *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)n + 1);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

static void write_file(const char *path, const uint8_t *b, size_t len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b, 1, len, f), len);
    fclose(f);
}

/* ---- CRC32C ------------------------------------------------------------------------------ */
static uint32_t crc_bitwise(const uint8_t *p, size_t n)
{
    uint32_t c = ~0u;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    }
    return ~c;
}

static void test_crc32c(void **state)
{
    assert_int_equal(kvd_crc32c(0, "123456789", 9), 0xE3069283u); /* the standard check */
    assert_int_equal(kvd_crc32c(0, "", 0), 0);
    uint8_t buf[1031];
    for (size_t i = 0; i < sizeof(buf); i++)
        buf[i] = (uint8_t)(i * 151u + 7u);
    /* misaligned starts and odd lengths through the 8-byte loop, against the bitwise one */
    const size_t offs[] = {0, 1, 3, 7}, lens[] = {0, 1, 7, 8, 9, 63, 1000};
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 7; b++)
            assert_int_equal(kvd_crc32c(0, buf + offs[a], lens[b]),
                             crc_bitwise(buf + offs[a], lens[b]));
    /* chaining: crc(a || b) from crc(a) */
    for (size_t cut = 0; cut <= 17; cut++)
        assert_int_equal(kvd_crc32c(kvd_crc32c(0, buf, cut), buf + cut, sizeof(buf) - cut),
                         crc_bitwise(buf, sizeof(buf)));
}

/* ---- core calls -------------------------------------------------------------------------- */
static void test_core_restore(void **state)
{
    kvd_core_t *c = snap_core(FX_FP8, FX_TQ3);
    uint64_t pb = kvd_core_export(c)->page_bytes[KV_FMT_FP8];
    uint8_t *bytes = malloc(pb), *back = malloc(pb);
    for (uint64_t i = 0; i < pb; i++)
        bytes[i] = page_byte(5, 0, i);
    uint8_t h[32];
    memset(h, 0xAB, sizeof(h));
    uint32_t lid;
    /* bad arguments change nothing */
    assert_int_equal(kvd_core_cache_restore(c, h, KV_FMT_FP8, bytes, pb - 1, &lid),
                     KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvd_core_cache_restore(c, h, (kv_fmt_t)2, bytes, pb, &lid),
                     KV_ERR_INVALID_ARGUMENT);
    FX_OK(kvd_core_cache_restore(c, h, KV_FMT_FP8, bytes, pb, &lid));
    assert_int_not_equal(lid, KVD_NONE);
    kvd_page_info_t pi;
    FX_OK(kvd_core_page_info(c, lid, &pi));
    assert_int_equal(pi.state, KVD_PAGE_SEALED);
    assert_int_equal(pi.cache, 1);
    assert_true(pi.on_lru);
    assert_memory_equal(pi.hash, h, 32);
    assert_int_equal(kv_dir_flags(kvd_core_backend(c)->dir[lid]), KV_DIR_VALID | KV_DIR_SEALED);
    uint32_t found;
    FX_OK(kvd_core_cache_find(c, h, &found));
    assert_int_equal(found, lid);
    FX_OK(kvd_core_page_read(c, lid, back, pb));
    assert_memory_equal(back, bytes, pb);
    assert_int_equal(kvd_core_page_read(c, lid, back, pb + 1), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvd_core_page_read(c, lid + 1, back, pb), KV_ERR_FAILED_PRECONDITION);
    /* the same hash twice is refused */
    assert_int_equal(kvd_core_cache_restore(c, h, KV_FMT_FP8, bytes, pb, &lid),
                     KV_ERR_FAILED_PRECONDITION);
    /* fill the pool: the 8th FP8 page has no room, and restore never evicts */
    for (int i = 1; i < (int)FX_FP8; i++) {
        h[0] = (uint8_t)i;
        FX_OK(kvd_core_cache_restore(c, h, KV_FMT_FP8, bytes, pb, NULL));
    }
    h[0] = 0x77;
    assert_int_equal(kvd_core_cache_restore(c, h, KV_FMT_FP8, bytes, pb, &lid),
                     KV_ERR_RESOURCE_EXHAUSTED);
    kvd_stats_t st = fx_stats(c);
    assert_int_equal(st.cache_entries, FX_FP8);
    assert_int_equal(st.cache_restored, FX_FP8);
    assert_int_equal(st.pages_lru[KV_FMT_FP8], FX_FP8);
    FX_CHECK(c);
    /* restored entries are evictable at once (stamp 0): an alloc takes the LRU head */
    uint64_t s;
    uint32_t got;
    FX_OK(kvd_core_session_open(c, 1, 0, &s));
    FX_OK(kvd_core_alloc(c, s, 1, &got));
    assert_int_equal(fx_stats(c).cache_entries, FX_FP8 - 1);
    FX_CHECK(c);
    free(bytes);
    free(back);
    kvd_core_free(&c);
}

/* ---- round trip -------------------------------------------------------------------------- */
/* A fresh snapshot directory and a core with one 3-page prompt cached, snapshotted once: the
 * starting point of the parser, rollback and allocation-failure tests. */
/* A core with one 3-page prompt cached (its logical ids in p1), and its identity. */
static kvd_core_t *prompt_core(kvd_snap_ident_t *id, uint32_t p1[3])
{
    uint64_t s;
    kvd_core_t *a = session_core(&s);
    cache_prompt(a, s, 1, 3, p1);
    ident(id, a);
    return a;
}

static kvd_core_t *snapped_core(kvd_snap_ident_t *id, kvd_snap_result_t *r)
{
    uint32_t p1[3];
    kvd_core_t *a = prompt_core(id, p1);
    char err[512] = "";
    SNAP_OK(kvd_snap_write(a, tdir, id, r, err, sizeof(err)));
    return a;
}

/* The sliced writer (the daemon's periodic snapshot): an entry evicted between the collection
 * and its slice copy is left out — the header, written last, counts what was written and the
 * file loads — and an entry converted meanwhile is written in its new format. */
static void test_writer_vanished(void **state)
{
    kvd_snap_ident_t id;
    uint32_t p1[3];
    kvd_core_t *a = prompt_core(&id, p1);
    char err[512] = "";
    kvd_snap_writer_t *w = NULL;
    SNAP_OK(kvd_snap_writer_begin(&w, a, tdir, &id, err, sizeof(err)));
    assert_int_equal(kvd_snap_writer_generation(w), 1);
    FX_OK(kvd_core_cache_evict(a, p1[2]));
    FX_OK(kvd_core_convert(a, p1[1], KV_FMT_TQ3));
    assert_int_equal(kvd_snap_writer_fill(w, a), KV_ERR_OK);
    assert_false(kvd_snap_writer_finished(w)); /* staged, not written */
    assert_int_equal(kvd_snap_writer_flush(w), KV_ERR_OK);
    assert_true(kvd_snap_writer_finished(w));
    kvd_snap_result_t r;
    SNAP_OK(kvd_snap_writer_end(&w, &r, err, sizeof(err)));
    assert_null(w);
    assert_int_equal(r.pages, 2);
    assert_int_equal(r.vanished, 1);
    assert_int_equal(r.bytes, 160 + (64 + id.page_bytes[0]) + (64 + id.page_bytes[1]));
    kvd_core_t *b = snap_core(FX_FP8, FX_TQ3);
    kvd_snap_result_t lr;
    SNAP_OK(kvd_snap_load(b, tdir, &id, NULL, NULL, &lr, err, sizeof(err)));
    assert_int_equal(lr.pages, 2);
    assert_int_equal(lr.refused, 0);
    assert_int_equal(fx_stats(b).pages_cached[KV_FMT_TQ3], 1);
    FX_CHECK(b);
    kvd_core_free(&b);
    /* a writer ended before its last slice was written: refused, no .tmp, generation 1 kept */
    SNAP_OK(kvd_snap_writer_begin(&w, a, tdir, &id, err, sizeof(err)));
    assert_int_equal(kvd_snap_writer_generation(w), 2);
    assert_int_equal(kvd_snap_writer_fill(w, a), KV_ERR_OK);
    assert_int_equal(kvd_snap_writer_end(&w, &r, err, sizeof(err)), KV_ERR_INTERNAL);
    assert_non_null(strstr(err, "before the last slice"));
    assert_int_equal(r.settled_here, 1); /* no flush finished it: end removed the .tmp */
    char tmp[512];
    snprintf(tmp, sizeof(tmp), "%s/cache.%020u.snap.tmp", tdir, 2u);
    assert_int_equal(access(tmp, F_OK), -1);
    snprintf(tmp, sizeof(tmp), "%s/cache.%020u.snap", tdir, 1u);
    assert_int_equal(access(tmp, F_OK), 0);
    kvd_core_free(&a);
}

/* The end of a write belongs to the thread of the last flush (the daemon's libuv worker), not
 * to end's (the loop): fsync, rename, directory fsync and the unlink of the generation that
 * falls out — ≈ 0.3 s for a 400 MB file on ext4, which once froze the loop — or, after an
 * error, the .tmp's unlink. Deterministic, no timing: the flushes run on a second thread; the
 * directory is checked between that thread's last flush and end; a generation planted after
 * that flush survives end (end prunes nothing); settled_here names the thread. */
typedef struct flush_arg_s {
    kvd_snap_writer_t *w;
    int rc;
} flush_arg_t;

static void *flush_main(void *ud)
{
    flush_arg_t *f = ud;
    f->rc = kvd_snap_writer_flush(f->w);
    return NULL;
}

static int flush_on_thread(kvd_snap_writer_t *w)
{
    flush_arg_t f = {w, -1};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, flush_main, &f), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    return f.rc;
}

static void gen_path(char *out, size_t cap, unsigned gen, const char *suffix)
{
    snprintf(out, cap, "%s/cache.%020u.snap%s", tdir, gen, suffix);
}

static int gen_exists(unsigned gen, const char *suffix)
{
    char p[512];
    gen_path(p, sizeof(p), gen, suffix);
    return access(p, F_OK) == 0;
}

static void test_writer_end_off_thread(void **state)
{
    kvd_snap_ident_t id;
    uint32_t p1[3];
    kvd_core_t *a = prompt_core(&id, p1);
    char err[512] = "";
    kvd_snap_result_t r;
    for (int i = 0; i < 2; i++) { /* generations 1 and 2: one thread does everything */
        SNAP_OK(kvd_snap_write(a, tdir, &id, &r, err, sizeof(err)));
        assert_int_equal(r.settled_here, 1);
    }
    kvd_snap_writer_t *w = NULL;
    SNAP_OK(kvd_snap_writer_begin(&w, a, tdir, &id, err, sizeof(err)));
    assert_int_equal(kvd_snap_writer_generation(w), 3);
    assert_int_equal(kvd_snap_writer_fill(w, a), KV_ERR_OK);
    assert_int_equal(flush_on_thread(w), KV_ERR_OK);
    assert_true(kvd_snap_writer_finished(w));
    /* before end: renamed, and generation 1 pruned, by the flushing thread */
    assert_true(gen_exists(3, ""));
    assert_false(gen_exists(3, ".tmp"));
    assert_true(gen_exists(2, ""));
    assert_false(gen_exists(1, ""));
    char g1[512], g2[512];
    gen_path(g1, sizeof(g1), 1, "");
    gen_path(g2, sizeof(g2), 2, "");
    size_t len;
    uint8_t *b = read_file(g2, &len);
    write_file(g1, b, len); /* a third generation again: end must leave it alone */
    free(b);
    SNAP_OK(kvd_snap_writer_end(&w, &r, err, sizeof(err)));
    assert_int_equal(r.settled_here, 0);
    assert_int_equal(r.generation, 3);
    assert_int_equal(r.pages, 3);
    assert_true(gen_exists(1, ""));
    /* a failed rename (onto a directory): the flushing thread removes the .tmp, every
     * generation stays, end reports the error and touches nothing */
    SNAP_OK(kvd_snap_writer_begin(&w, a, tdir, &id, err, sizeof(err)));
    assert_int_equal(kvd_snap_writer_generation(w), 4);
    char g4[512];
    gen_path(g4, sizeof(g4), 4, "");
    assert_int_equal(mkdir(g4, 0700), 0);
    assert_int_equal(kvd_snap_writer_fill(w, a), KV_ERR_OK);
    assert_true(gen_exists(4, ".tmp"));
    assert_int_equal(flush_on_thread(w), KV_ERR_IO);
    assert_true(kvd_snap_writer_finished(w));
    assert_false(gen_exists(4, ".tmp"));
    assert_int_equal(kvd_snap_writer_end(&w, &r, err, sizeof(err)), KV_ERR_IO);
    assert_non_null(strstr(err, "rename("));
    assert_int_equal(r.settled_here, 0);
    for (unsigned g = 1; g <= 3; g++)
        assert_true(gen_exists(g, ""));
    kvd_core_free(&a);
}

static void test_round_trip(void **state)
{
    uint64_t s;
    kvd_core_t *a = session_core(&s);
    uint32_t p1[3], p2[2];
    cache_prompt(a, s, 1, 3, p1);
    cache_prompt(a, s, 2, 2, p2);
    FX_OK(kvd_core_convert(a, p2[1], KV_FMT_TQ3)); /* one TQ3 entry: its bytes come back too */
    fill_page(a, p2[1], 2, 1);                     /* known bytes in the TQ3 page */
    FX_OK(kvd_core_pin(a, p1[0]));
    kvd_snap_ident_t id;
    ident(&id, a);
    kvd_snap_result_t r;
    char err[512] = "";
    SNAP_OK(kvd_snap_write(a, tdir, &id, &r, err, sizeof(err)));
    assert_int_equal(r.pages, 5);
    assert_int_equal(r.generation, 1);
    uint64_t pb8 = id.page_bytes[0], pb3 = id.page_bytes[1];
    assert_int_equal(r.bytes, 160 + 4 * (64 + pb8) + (64 + pb3));
    struct stat st;
    assert_int_equal(stat(r.path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    /* LRU order of a, FP8 head first, to compare after the reload */
    uint32_t before[8] = {0}, after[8] = {0};
    kvd_core_t *b = snap_core(FX_FP8, FX_TQ3);
    kvd_snap_result_t lr;
    SNAP_OK(kvd_snap_load(b, tdir, &id, NULL, NULL, &lr, err, sizeof(err)));
    assert_int_equal(lr.pages, 5);
    assert_int_equal(lr.refused, 0);
    assert_int_equal(lr.generation, 1);
    assert_string_equal(lr.path, r.path);
    FX_CHECK(b);
    kvd_stats_t sb = fx_stats(b);
    assert_int_equal(sb.cache_entries, 5);
    assert_int_equal(sb.pages_cached[KV_FMT_TQ3], 1);
    assert_int_equal(sb.pins, 1);
    /* the LRU order of the unpinned FP8 entries is a's: compare by hash */
    kvd_page_info_t pa, pbi;
    uint32_t na = 0, nb = 0;
    for (uint32_t l = a->pool[0].lru_head; l != KVD_NONE; l = a->lp[l].lru_next)
        before[na++] = l;
    for (uint32_t l = b->pool[0].lru_head; l != KVD_NONE; l = b->lp[l].lru_next)
        after[nb++] = l;
    assert_int_equal(na, nb);
    for (uint32_t i = 0; i < na; i++) {
        FX_OK(kvd_core_page_info(a, before[i], &pa));
        FX_OK(kvd_core_page_info(b, after[i], &pbi));
        assert_memory_equal(pa.hash, pbi.hash, 32);
    }
    /* lookups hit every page, bytes identical (checked inside lookup_prompt) */
    uint32_t out[8];
    assert_int_equal(lookup_prompt(b, 1, 3, out), 3);
    assert_int_equal(lookup_prompt(b, 2, 2, out), 2);
    assert_int_equal(kv_dir_fmt(kvd_core_backend(b)->dir[out[1]]), KV_FMT_TQ3);
    FX_OK(kvd_core_page_info(b, out[0], &pbi));
    FX_CHECK(b);
    kvd_core_free(&b);
    kvd_core_free(&a);
}

/* ---- the parser: every corruption refused ------------------------------------------------ */
static void fix_hdr_crc(uint8_t *b)
{
    uint32_t c = kvd_crc32c(0, b, 156);
    for (int i = 0; i < 4; i++)
        b[156 + i] = (uint8_t)(c >> (8 * i));
}

static void fix_rec_crc(uint8_t *r, uint64_t pb)
{
    uint32_t c = kvd_crc32c(kvd_crc32c(0, r, 60), r + 64, pb);
    for (int i = 0; i < 4; i++)
        r[60 + i] = (uint8_t)(c >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Expect parse of (buf, len) to fail with code and a message containing `why`. */
static void expect_bad(const uint8_t *buf, size_t len, const kvd_snap_ident_t *id, int code,
                       const char *why)
{
    char err[512] = "";
    int rc = kvd_snap_parse_buf(buf, len, id, NULL, NULL, err, sizeof(err));
    if (rc != code || !strstr(err, why))
        fail_msg("expected %s '%s', got %s '%s'", kv_err_name(code), why, kv_err_name(rc), err);
}

static int count_cb(void *ud, const uint8_t hash[32], kv_fmt_t f, uint32_t flags,
                    const uint8_t *bytes, uint64_t len)
{
    (*(int *)ud)++;
    return KV_ERR_OK;
}

static void test_parser_refuses(void **state)
{
    kvd_snap_ident_t id;
    kvd_snap_result_t r;
    char err[512] = "";
    kvd_core_t *a = snapped_core(&id, &r);
    size_t len;
    uint8_t *good = read_file(r.path, &len);
    uint8_t *b = malloc(len + 1);
    uint64_t pb = id.page_bytes[0];
    int n = 0;
    SNAP_OK(kvd_snap_parse_buf(good, len, &id, count_cb, &n, err, sizeof(err)));
    assert_int_equal(n, 3);
#define RESET() memcpy(b, good, len)
    RESET();
    b[0] ^= 1;
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "bad magic");
    RESET();
    b[8] = 2; /* version without fixing the CRC: the CRC catches it */
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "header CRC32C");
    fix_hdr_crc(b);
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "format version 2");
    RESET();
    b[140] = 1;
    fix_hdr_crc(b);
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "reserved header byte 140");
    RESET();
    b[16] = 9;
    fix_hdr_crc(b);
    expect_bad(b, len, &id, KV_ERR_GEOMETRY_MISMATCH, "chain hash version 9");
    RESET();
    b[20] = 9;
    fix_hdr_crc(b);
    expect_bad(b, len, &id, KV_ERR_GEOMETRY_MISMATCH, "page layout version 9");
    /* a snapshot of the previous layout (1: TQ3 bit planes, Lloyd–Max keys) is refused too */
    RESET();
    b[20] = (uint8_t)(KV_LAYOUT_VERSION - 1);
    fix_hdr_crc(b);
    char why[96];
    snprintf(why, sizeof why, "page layout version %u, this kvd uses version %u",
             KV_LAYOUT_VERSION - 1, KV_LAYOUT_VERSION);
    expect_bad(b, len, &id, KV_ERR_GEOMETRY_MISMATCH, why);
    /* identity: geometry, seed, page bytes, namespace, salt of the loading daemon differ */
    kvd_snap_ident_t other = id;
    other.geom.head_dim = 128;
    expect_bad(good, len, &other, KV_ERR_GEOMETRY_MISMATCH, "geometry mismatch");
    other = id;
    other.geom.seed = 8;
    expect_bad(good, len, &other, KV_ERR_GEOMETRY_MISMATCH, "seed 7");
    other = id;
    other.page_bytes[1]++;
    expect_bad(good, len, &other, KV_ERR_GEOMETRY_MISMATCH, "tq3 pages of");
    kvd_snap_ident(&other, a, "another", fx_salt);
    expect_bad(good, len, &other, KV_ERR_GEOMETRY_MISMATCH, "another namespace");
    uint8_t salt2[32];
    memcpy(salt2, fx_salt, 32);
    salt2[5] ^= 0x40;
    kvd_snap_ident(&other, a, "default", salt2);
    expect_bad(good, len, &other, KV_ERR_GEOMETRY_MISMATCH, "another namespace salt");
    /* sizes: truncation anywhere, a trailing byte, a short header */
    expect_bad(good, len - 1, &id, KV_ERR_MALFORMED, "truncated");
    expect_bad(good, 160 + 64 + 5, &id, KV_ERR_MALFORMED, "truncated");
    expect_bad(good, 100, &id, KV_ERR_MALFORMED, "shorter than the 160-byte header");
    RESET();
    b[len] = 0;
    expect_bad(b, len + 1, &id, KV_ERR_MALFORMED, "trailing bytes");
    /* counts: huge (overflow bait) and merely wrong */
    RESET();
    put_u64(b + 72, 1ull << 62);
    fix_hdr_crc(b);
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "more than a pool can hold");
    RESET();
    put_u64(b + 72, UINT64_MAX);
    put_u64(b + 80, UINT64_MAX);
    fix_hdr_crc(b);
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "more than a pool can hold");
    RESET();
    put_u64(b + 72, 1ull << 32); /* each count at the bound, the sum above it */
    put_u64(b + 80, 1ull << 32);
    fix_hdr_crc(b);
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "more than the index can hold");
    RESET();
    put_u64(b + 72, 2);
    put_u64(b + 80, 1); /* same total size only if page bytes were equal: they are not */
    fix_hdr_crc(b);
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "bytes but the header promises");
    /* records: a payload bit, the stored hash, the index, the format, the flags */
    uint8_t *r1 = b + 160 + (64 + pb); /* record 1 */
    RESET();
    r1[64 + pb / 2] ^= 0x10;
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "record 1 at offset");
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "CRC32C mismatch");
    RESET();
    r1[30] ^= 1;
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "CRC32C mismatch");
    RESET();
    r1[56] = 2; /* index 2 where 1 belongs (records swapped or duplicated) */
    fix_rec_crc(r1, pb);
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "bad record magic, reserved field or index");
    RESET();
    r1[4] = 1; /* says TQ3, but the header has no TQ3 records */
    fix_rec_crc(r1, pb);
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "do not fit the header");
    RESET();
    r1[8] = 4; /* unknown flag */
    fix_rec_crc(r1, pb);
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "do not fit the header");
    RESET();
    r1[0] ^= 1;
    fix_rec_crc(r1, pb);
    expect_bad(b, len, &id, KV_ERR_MALFORMED, "bad record magic");
    /* an empty snapshot is valid */
    kvd_core_t *e = snap_core(FX_FP8, FX_TQ3);
    tdir_remove();
    tdir_make();
    SNAP_OK(kvd_snap_write(e, tdir, &id, &r, err, sizeof(err)));
    free(good);
    good = read_file(r.path, &len);
    assert_int_equal(len, 160);
    n = 0;
    SNAP_OK(kvd_snap_parse_buf(good, len, &id, count_cb, &n, err, sizeof(err)));
    assert_int_equal(n, 0);
    kvd_core_free(&e);
    free(good);
    free(b);
    kvd_core_free(&a);
}

/* ---- the loader: generations, fallback, rollback, budget --------------------------------- */
typedef struct log_s {
    int n;
    char last[1600];
} log_t;

static void log_cb(void *ud, const char *line)
{
    log_t *l = ud;
    l->n++;
    snprintf(l->last, sizeof(l->last), "%s", line);
}

static void test_generations_fallback(void **state)
{
    uint64_t s;
    kvd_core_t *a = session_core(&s);
    uint32_t p1[2], p2[2];
    kvd_snap_ident_t id;
    ident(&id, a);
    kvd_snap_result_t r1, r2, r3, lr;
    char err[512] = "";
    cache_prompt(a, s, 1, 2, p1);
    SNAP_OK(kvd_snap_write(a, tdir, &id, &r1, err, sizeof(err)));
    cache_prompt(a, s, 2, 2, p2);
    SNAP_OK(kvd_snap_write(a, tdir, &id, &r2, err, sizeof(err)));
    SNAP_OK(kvd_snap_write(a, tdir, &id, &r3, err, sizeof(err)));
    assert_int_equal(r3.generation, 3);
    /* two generations kept: the first is gone */
    struct stat st;
    assert_int_not_equal(stat(r1.path, &st), 0);
    assert_int_equal(stat(r2.path, &st), 0);
    /* rewrite generation 2 as the old state (prompt 1 only) to tell them apart: reload a
     * core holding prompt 1 only and write generation 4, then drop 3 so 2 (both prompts)
     * and 4 (prompt 1) remain */
    kvd_core_t *only1 = snap_core(FX_FP8, FX_TQ3);
    uint64_t s1;
    FX_OK(kvd_core_session_open(only1, 1, 0, &s1));
    cache_prompt(only1, s1, 1, 2, p1);
    kvd_snap_result_t r4;
    SNAP_OK(kvd_snap_write(only1, tdir, &id, &r4, err, sizeof(err)));
    assert_int_equal(r4.generation, 4);
    assert_int_not_equal(stat(r2.path, &st), 0); /* 3 and 4 kept */
    /* a stale .tmp of a crashed write is removed by the load */
    char tmp[1100];
    snprintf(tmp, sizeof(tmp), "%s/cache.%020d.snap.tmp", tdir, 9);
    write_file(tmp, (const uint8_t *)"junk", 4);
    /* newest (4) intact: loaded, nothing refused */
    kvd_core_t *b = snap_core(FX_FP8, FX_TQ3);
    log_t lg = {0};
    SNAP_OK(kvd_snap_load(b, tdir, &id, log_cb, &lg, &lr, err, sizeof(err)));
    assert_int_equal(lr.generation, 4);
    assert_int_equal(lr.pages, 2);
    assert_int_equal(lg.n, 0);
    assert_int_not_equal(stat(tmp, &st), 0);
    kvd_core_free(&b);
    /* flip one payload byte of generation 4: refused with file and reason, 3 loads (4 pages) */
    size_t len;
    uint8_t *buf = read_file(r4.path, &len);
    buf[len - 10] ^= 0x01;
    write_file(r4.path, buf, len);
    free(buf);
    b = snap_core(FX_FP8, FX_TQ3);
    SNAP_OK(kvd_snap_load(b, tdir, &id, log_cb, &lg, &lr, err, sizeof(err)));
    assert_int_equal(lr.generation, 3);
    assert_int_equal(lr.pages, 4);
    assert_int_equal(lr.refused, 1);
    assert_int_equal(lg.n, 1);
    assert_non_null(strstr(lg.last, r4.path));
    assert_non_null(strstr(lg.last, "CRC32C mismatch"));
    uint32_t out[8];
    assert_int_equal(lookup_prompt(b, 2, 2, out), 2);
    FX_CHECK(b);
    /* regression (refused newest kept, good older pruned): the corrupt 4 is set aside, so the
     * next write (5, numbered above it) keeps 5 and the 3 that loaded, not 5 and the broken 4 */
    assert_non_null(strstr(lg.last, "set aside as"));
    assert_false(gen_exists(4, ""));
    assert_true(gen_exists(4, ".refused"));
    kvd_snap_result_t r5;
    SNAP_OK(kvd_snap_write(b, tdir, &id, &r5, err, sizeof(err)));
    assert_int_equal(r5.generation, 5);
    assert_true(gen_exists(5, ""));
    assert_true(gen_exists(3, ""));
    assert_true(gen_exists(4, ".refused"));
    kvd_core_free(&b);
    /* ... and with 5 gone, 3 still loads */
    assert_int_equal(unlink(r5.path), 0);
    b = snap_core(FX_FP8, FX_TQ3);
    lg.n = 0;
    SNAP_OK(kvd_snap_load(b, tdir, &id, log_cb, &lg, &lr, err, sizeof(err)));
    assert_int_equal(lr.generation, 3);
    assert_int_equal(lr.pages, 4);
    assert_int_equal(lg.n, 0);
    kvd_core_free(&b);
    /* generation 3 truncated too: refused and set aside (4 already is), the cache starts empty */
    buf = read_file(r3.path, &len);
    write_file(r3.path, buf, len - 1);
    free(buf);
    b = snap_core(FX_FP8, FX_TQ3);
    lg.n = 0;
    SNAP_OK(kvd_snap_load(b, tdir, &id, log_cb, &lg, &lr, err, sizeof(err)));
    assert_int_equal(lr.pages, 0);
    assert_int_equal(lr.refused, 1);
    assert_int_equal(lg.n, 1);
    assert_non_null(strstr(lg.last, "truncated"));
    assert_non_null(strstr(lg.last, "set aside as"));
    assert_true(gen_exists(3, ".refused"));
    assert_int_equal(fx_stats(b).cache_entries, 0);
    FX_CHECK(b);
    kvd_core_free(&b);
    kvd_core_free(&only1);
    kvd_core_free(&a);
}

static int count_refused(void)
{
    DIR *d = opendir(tdir);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strstr(e->d_name, ".snap.refused"))
            n++;
    closedir(d);
    return n;
}

static void flip_byte(const char *path)
{
    size_t len;
    uint8_t *buf = read_file(path, &len);
    buf[len - 10] ^= 0x01;
    write_file(path, buf, len);
    free(buf);
}

/* Which refusals set a file aside, what happens when the rename fails, and the bound on the
 * set-aside files. */
static void test_refused_set_aside(void **state)
{
    kvd_snap_ident_t id;
    kvd_snap_result_t r1, r, lr;
    char err[512] = "";
    kvd_core_t *a = snapped_core(&id, &r1); /* generation 1 */
    SNAP_OK(kvd_snap_write(a, tdir, &id, &r, err, sizeof(err)));
    assert_int_equal(r.generation, 2);
    /* another identity (here the namespace): refused, but intact: left under its name */
    kvd_snap_ident_t other = id;
    other.ns_id[0] ^= 1;
    kvd_core_t *b = snap_core(FX_FP8, FX_TQ3);
    log_t lg = {0};
    SNAP_OK(kvd_snap_load(b, tdir, &other, log_cb, &lg, &lr, err, sizeof(err)));
    assert_int_equal(lr.refused, 2);
    assert_non_null(strstr(lg.last, "another namespace"));
    assert_null(strstr(lg.last, "set aside"));
    assert_true(gen_exists(1, "") && gen_exists(2, ""));
    assert_int_equal(count_refused(), 0);
    kvd_core_free(&b);
    /* the rename fails (a directory holds the name; root ignores a read-only directory's
     * mode): logged with the reason, the file stays, the older generation loads as before */
    flip_byte(r.path);
    char blocker[512], inside[600];
    gen_path(blocker, sizeof(blocker), 2, ".refused");
    assert_int_equal(mkdir(blocker, 0700), 0);
    snprintf(inside, sizeof(inside), "%s/x", blocker);
    write_file(inside, (const uint8_t *)"x", 1);
    b = snap_core(FX_FP8, FX_TQ3);
    lg.n = 0;
    SNAP_OK(kvd_snap_load(b, tdir, &id, log_cb, &lg, &lr, err, sizeof(err)));
    assert_int_equal(lr.generation, 1);
    assert_int_equal(lg.n, 1);
    assert_non_null(strstr(lg.last, "CRC32C mismatch"));
    assert_non_null(strstr(lg.last, "could not set it aside"));
    assert_non_null(strstr(lg.last, "rename("));
    assert_true(gen_exists(2, ""));
    kvd_core_free(&b);
    assert_int_equal(unlink(inside), 0);
    assert_int_equal(rmdir(blocker), 0);
    /* bound: four corrupt generations in a row (2, 3, 4, 5), each refused and set aside, each
     * followed by a write; generation 1, which loads every time, is never pruned, and at most
     * KVD_SNAP_KEEP_REFUSED set-aside files are left after a write, the newest ones */
    for (unsigned g = 2; g <= 5; g++) {
        if (g > 2) {
            SNAP_OK(kvd_snap_write(a, tdir, &id, &r, err, sizeof(err)));
            assert_int_equal(r.generation, g);
            flip_byte(r.path);
        }
        b = snap_core(FX_FP8, FX_TQ3);
        SNAP_OK(kvd_snap_load(b, tdir, &id, NULL, NULL, &lr, err, sizeof(err)));
        assert_int_equal(lr.generation, 1);
        assert_int_equal(lr.refused, 1);
        assert_true(gen_exists(g, ".refused"));
        kvd_core_free(&b);
    }
    /* the write of 5 pruned 2 (it had 2, 3, 4); the loader adds without pruning, so 3 now */
    assert_int_equal(count_refused(), 3);
    assert_false(gen_exists(2, ".refused"));
    SNAP_OK(kvd_snap_write(a, tdir, &id, &r, err, sizeof(err)));
    assert_int_equal(r.generation, 6);
    assert_int_equal(count_refused(), KVD_SNAP_KEEP_REFUSED);
    assert_true(gen_exists(5, ".refused") && gen_exists(4, ".refused"));
    assert_true(gen_exists(6, "") && gen_exists(1, ""));
    kvd_core_free(&a);
}

static void test_rollback_half_load(void **state)
{
    kvd_snap_ident_t id;
    kvd_snap_result_t r, lr;
    char err[512] = "";
    kvd_core_t *a = snapped_core(&id, &r);
    /* record 2 carries record 0's hash, with a valid CRC: only the restore can see it, after
     * two pages went in. They must come out again. */
    size_t len;
    uint8_t *b = read_file(r.path, &len);
    uint64_t pb = id.page_bytes[0];
    uint8_t *r0 = b + 160, *r2 = b + 160 + 2 * (64 + pb);
    memcpy(r2 + 24, r0 + 24, 32);
    fix_rec_crc(r2, pb);
    write_file(r.path, b, len);
    free(b);
    int64_t live0 = kvd_alloc_live(); /* the index may keep its grown capacity: compare after
                                         the core is freed */
    kvd_core_t *c = snap_core(FX_FP8, FX_TQ3);
    assert_int_equal(kvd_snap_load_file(c, r.path, &id, &lr, err, sizeof(err)),
                     KV_ERR_FAILED_PRECONDITION);
    assert_non_null(strstr(err, "record 2"));
    assert_non_null(strstr(err, "already bound"));
    kvd_stats_t st = fx_stats(c);
    assert_int_equal(st.cache_entries, 0);
    assert_int_equal(st.pages_free[KV_FMT_FP8], FX_FP8);
    assert_int_equal(st.logical_free, FX_FP8 + FX_TQ3);
    FX_CHECK(c);
    kvd_core_free(&c);
    assert_int_equal(kvd_alloc_live(), live0);
    kvd_core_free(&a);
}

static void test_budget_keeps_newest(void **state)
{
    uint64_t s;
    kvd_core_t *a = session_core(&s);
    uint32_t p1[2], p2[3];
    cache_prompt(a, s, 1, 2, p1); /* older */
    cache_prompt(a, s, 2, 3, p2); /* newer: the LRU tail */
    kvd_snap_ident_t id;
    ident(&id, a);
    kvd_snap_result_t r, lr;
    char err[512] = "";
    SNAP_OK(kvd_snap_write(a, tdir, &id, &r, err, sizeof(err)));
    /* a daemon restarted with a 3-page FP8 pool: the 3 most recent pages come back */
    kvd_core_t *c = snap_core(3, FX_TQ3);
    SNAP_OK(kvd_snap_load(c, tdir, &id, NULL, NULL, &lr, err, sizeof(err)));
    assert_int_equal(lr.pages, 3);
    assert_int_equal(lr.skipped, 2);
    uint32_t out[8];
    assert_int_equal(lookup_prompt(c, 2, 3, out), 3);
    assert_int_equal(lookup_prompt(c, 1, 2, out), 0);
    FX_CHECK(c);
    kvd_core_free(&c);
    /* a quota of 1 leaves room for one */
    c = snap_core(FX_FP8, FX_TQ3);
    FX_OK(kvd_core_set_cache_quota(c, KV_FMT_FP8, 1));
    SNAP_OK(kvd_snap_load(c, tdir, &id, NULL, NULL, &lr, err, sizeof(err)));
    assert_int_equal(lr.pages, 1);
    assert_int_equal(lr.skipped, 4);
    FX_CHECK(c);
    kvd_core_free(&c);
    kvd_core_free(&a);
}

/* Allocation failure at every point of a load: either it loaded, or it failed with nothing
 * restored and nothing leaked (SQLite's OOM loop). */
static void test_load_oom(void **state)
{
    kvd_snap_ident_t id;
    kvd_snap_result_t r, lr;
    char err[512] = "";
    kvd_core_t *a = snapped_core(&id, &r);
    int loaded = 0;
    for (uint64_t n = 1; n < 40 && !loaded; n++) {
        int64_t live0 = kvd_alloc_live();
        kvd_core_t *c = snap_core(FX_FP8, FX_TQ3);
        kvd_alloc_fail_after(n);
        int rc = kvd_snap_load_file(c, r.path, &id, &lr, err, sizeof(err));
        kvd_alloc_fail_after(0);
        if (rc == KV_ERR_OK) {
            loaded = 1;
            assert_int_equal(fx_stats(c).cache_entries, 3);
        } else {
            assert_int_equal(rc, KV_ERR_NOMEM);
            assert_int_equal(fx_stats(c).cache_entries, 0);
        }
        FX_CHECK(c);
        kvd_core_free(&c);
        assert_int_equal(kvd_alloc_live(), live0);
    }
    assert_true(loaded);
    kvd_core_free(&a);
}

/* A directory that cannot be listed: write and load fail with IO naming it, nothing changes. */
static void test_bad_directory(void **state)
{
    uint64_t s;
    kvd_core_t *a = session_core(&s);
    uint32_t p1[2];
    cache_prompt(a, s, 1, 2, p1);
    kvd_snap_ident_t id;
    ident(&id, a);
    kvd_snap_result_t r;
    char err[512] = "";
    const char *nodir = "/nonexistent-kvd-snapshot-dir/x";
    assert_int_equal(kvd_snap_write(a, nodir, &id, &r, err, sizeof(err)), KV_ERR_IO);
    assert_non_null(strstr(err, nodir));
    assert_int_equal(kvd_snap_load(a, nodir, &id, NULL, NULL, &r, err, sizeof(err)), KV_ERR_IO);
    assert_int_equal(r.pages, 0);
    assert_int_equal(fx_stats(a).cache_entries, 2);
    FX_CHECK(a);
    kvd_core_free(&a);
}

/* A write that runs out of room (disk full, a file size limit): RLIMIT_FSIZE makes write()
 * stop short in the middle of a record, then fail (EFBIG, as ENOSPC would). The .tmp is
 * removed, generation 1 stays and loads, and the error names the file that could not be
 * written ("write failed: File too large" alone did not say which, nor that it was the
 * snapshot's or the salt's). The limit is lifted before any assertion. */
static int write_limited(rlim_t bytes, int (*fn)(void *), void *ud)
{
    struct rlimit old, lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
    lim = old;
    lim.rlim_cur = bytes;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN); /* else the kernel kills the test */
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    int rc = fn(ud);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    return rc;
}

typedef struct limited_s {
    kvd_core_t *c;
    const kvd_snap_ident_t *id;
    const char *dir;
    char err[512];
} limited_t;

static int limited_write(void *ud)
{
    limited_t *l = ud;
    kvd_snap_result_t r;
    return kvd_snap_write(l->c, l->dir, l->id, &r, l->err, sizeof(l->err));
}

static int limited_salt(void *ud)
{
    limited_t *l = ud;
    uint8_t salt[32];
    int created;
    return kvd_snap_salt_load(l->dir, salt, &created, l->err, sizeof(l->err));
}

static void test_write_disk_full(void **state)
{
    kvd_snap_ident_t id;
    kvd_snap_result_t r, lr;
    char err[512] = "";
    kvd_core_t *a = snapped_core(&id, &r); /* generation 1, 3 FP8 pages */
    limited_t l = {.c = a, .id = &id, .dir = tdir};
    /* room for the header and half of record 0: one short write, then EFBIG */
    int rc = write_limited(160 + 64 + id.page_bytes[KV_FMT_FP8] / 2, limited_write, &l);
    if (rc != KV_ERR_IO)
        fail_msg("write under a file size limit -> %s: %s", kv_err_name(rc), l.err);
    char tmp[512];
    gen_path(tmp, sizeof(tmp), 2, ".tmp");
    if (!strstr(l.err, tmp) || !strstr(l.err, strerror(EFBIG)))
        fail_msg("the error does not name %s and the cause: '%s'", tmp, l.err);
    assert_false(gen_exists(2, ".tmp"));
    assert_false(gen_exists(2, ""));
    assert_true(gen_exists(1, ""));
    kvd_core_t *b = snap_core(FX_FP8, FX_TQ3);
    SNAP_OK(kvd_snap_load(b, tdir, &id, NULL, NULL, &lr, err, sizeof(err)));
    assert_int_equal(lr.generation, 1);
    assert_int_equal(lr.pages, 3);
    kvd_core_free(&b);
    /* the salt's write: no salt, no salt.tmp, the message names salt.tmp */
    char dir[128], path[160];
    snprintf(dir, sizeof(dir), "%s/salted", tdir);
    l.dir = dir;
    assert_int_equal(write_limited(16, limited_salt, &l), KV_ERR_IO);
    snprintf(path, sizeof(path), "%s/salt.tmp", dir);
    if (!strstr(l.err, path) || !strstr(l.err, strerror(EFBIG)))
        fail_msg("the error does not name %s and the cause: '%s'", path, l.err);
    assert_int_equal(access(path, F_OK), -1);
    snprintf(path, sizeof(path), "%s/salt", dir);
    assert_int_equal(access(path, F_OK), -1);
    kvd_core_free(&a);
}

/* A FIFO under a generation's name, or as the salt: refused as not a regular file. open()
 * without O_NONBLOCK waited for a writer that never comes — the daemon hung at start, before
 * its sockets, without a log line. alarm() turns such a hang into a failure of this test. */
static void test_fifo_refused(void **state)
{
    kvd_snap_ident_t id;
    kvd_snap_result_t r, lr;
    char err[512] = "";
    kvd_core_t *a = snapped_core(&id, &r); /* generation 1 */
    char fifo[512];
    gen_path(fifo, sizeof(fifo), 2, "");
    assert_int_equal(mkfifo(fifo, 0600), 0);
    kvd_core_t *b = snap_core(FX_FP8, FX_TQ3);
    log_t lg = {0};
    alarm(10);
    int rc = kvd_snap_load(b, tdir, &id, log_cb, &lg, &lr, err, sizeof(err));
    alarm(0);
    SNAP_OK(rc);
    assert_int_equal(lr.refused, 1);
    assert_int_equal(lr.generation, 1);
    assert_int_equal(lr.pages, 3);
    assert_non_null(strstr(lg.last, fifo));
    assert_non_null(strstr(lg.last, "not a regular file"));
    kvd_core_free(&b);
    char dir[128], salt[160];
    snprintf(dir, sizeof(dir), "%s/fifo", tdir);
    assert_int_equal(mkdir(dir, 0700), 0);
    snprintf(salt, sizeof(salt), "%s/salt", dir);
    assert_int_equal(mkfifo(salt, 0600), 0);
    uint8_t s[32];
    int created;
    alarm(10);
    rc = kvd_snap_salt_load(dir, s, &created, err, sizeof(err));
    alarm(0);
    assert_int_equal(rc, KV_ERR_IO);
    assert_non_null(strstr(err, "must be a regular file"));
    kvd_core_free(&a);
}

/* ---- salt file --------------------------------------------------------------------------- */
static void test_salt_file(void **state)
{
    char dir[128], path[160];
    snprintf(dir, sizeof(dir), "%s/snaps", tdir); /* made by the call, 0700 */
    uint8_t s1[32], s2[32];
    int created;
    char err[512] = "";
    SNAP_OK(kvd_snap_salt_load(dir, s1, &created, err, sizeof(err)));
    assert_int_equal(created, 1);
    struct stat st;
    assert_int_equal(stat(dir, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0700);
    snprintf(path, sizeof(path), "%s/salt", dir);
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    assert_int_equal(st.st_size, 32);
    SNAP_OK(kvd_snap_salt_load(dir, s2, &created, err, sizeof(err)));
    assert_int_equal(created, 0);
    assert_memory_equal(s1, s2, 32);
    /* readable by others: refused, salt wiped */
    chmod(path, 0644);
    assert_int_equal(kvd_snap_salt_load(dir, s2, &created, err, sizeof(err)),
                     KV_ERR_PERMISSION_DENIED);
    assert_non_null(strstr(err, "chmod 600"));
    chmod(path, 0600);
    /* wrong size */
    write_file(path, s1, 31);
    chmod(path, 0600);
    assert_int_equal(kvd_snap_salt_load(dir, s2, &created, err, sizeof(err)), KV_ERR_IO);
    assert_non_null(strstr(err, "exactly 32 bytes"));
    /* what a crash while creating it leaves now: salt.tmp, no salt; the next start makes one */
    char dir2[120], tmp[140];
    snprintf(dir2, sizeof(dir2), "%s/snaps2", tdir);
    assert_int_equal(mkdir(dir2, 0700), 0);
    snprintf(tmp, sizeof(tmp), "%s/salt.tmp", dir2);
    write_file(tmp, s1, 5);
    /* a leftover of another mode (an operator's copy, a restore): the new salt must not
     * inherit it — opened with O_TRUNC, the salt was written 0644, used for this run, and
     * every later start refused it ("chmod 600") */
    assert_int_equal(chmod(tmp, 0644), 0);
    SNAP_OK(kvd_snap_salt_load(dir2, s2, &created, err, sizeof(err)));
    assert_int_equal(created, 1);
    assert_int_not_equal(stat(tmp, &st), 0); /* renamed over, not left behind */
    snprintf(path, sizeof(path), "%s/salt", dir2);
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_size, 32);
    assert_int_equal(st.st_mode & 0777, 0600);
    SNAP_OK(kvd_snap_salt_load(dir2, s1, &created, err, sizeof(err))); /* the next start */
    assert_int_equal(created, 0);
    assert_memory_equal(s1, s2, 32);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crc32c),
        cmocka_unit_test(test_core_restore),
        cmocka_unit_test_setup_teardown(test_round_trip, tdir_setup, tdir_teardown),
        cmocka_unit_test_setup_teardown(test_parser_refuses, tdir_setup, tdir_teardown),
        cmocka_unit_test_setup_teardown(test_generations_fallback, tdir_setup, tdir_teardown),
        cmocka_unit_test_setup_teardown(test_refused_set_aside, tdir_setup, tdir_teardown),
        cmocka_unit_test_setup_teardown(test_rollback_half_load, tdir_setup, tdir_teardown),
        cmocka_unit_test_setup_teardown(test_budget_keeps_newest, tdir_setup, tdir_teardown),
        cmocka_unit_test_setup_teardown(test_load_oom, tdir_setup, tdir_teardown),
        cmocka_unit_test(test_bad_directory),
        cmocka_unit_test_setup_teardown(test_salt_file, tdir_setup, tdir_teardown),
        cmocka_unit_test_setup_teardown(test_writer_vanished, tdir_setup, tdir_teardown),
        cmocka_unit_test_setup_teardown(test_writer_end_off_thread, tdir_setup, tdir_teardown),
        cmocka_unit_test_setup_teardown(test_write_disk_full, tdir_setup, tdir_teardown),
        cmocka_unit_test_setup_teardown(test_fifo_refused, tdir_setup, tdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
