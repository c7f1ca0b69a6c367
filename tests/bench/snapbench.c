/* snapbench.c — snapshot write and load rates of kvd/snapshot.c (docs/snapshot.md).
 *
 *   snapbench [PAGES [DIR]]      default 3000 pages in a fresh /tmp directory (removed after)
 *
 * Fills a host-backend core of the daemon's default geometry (4 layers, 8 KV heads, head_dim
 * 128, 16 tokens per page: 135 KB FP8 pages) with PAGES cached FP8 pages of pseudo-random
 * bytes (kvd_core_cache_restore), writes a snapshot (collect, copy, CRC32C, write, fsync,
 * rename, directory fsync: what `kvctl snapshot` does), loads it into a fresh core (read, every
 * check, CRC32C, restore), and prints one JSON line. The load reads a file that was just
 * written, so it comes from the page cache: it measures the loader, not the disk. Also the
 * CRC32C rate alone over one page.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "snapshot.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static kvd_core_t *core(uint32_t pages, const uint8_t salt[32])
{
    kv_geom_t g = {.layers = 4, .kv_heads = 8, .head_dim = 128, .page_tokens = 16, .seed = 1};
    kvd_core_opts_t o;
    kvd_core_opts_default(&o, &g, pages, 16);
    memcpy(o.hash_key, salt, 32);
    char err[256];
    kvd_core_t *c = NULL;
    if (kvd_core_init(&c, &o, err, sizeof(err)) != KV_ERR_OK) {
        fprintf(stderr, "snapbench: %s\n", err);
        exit(1);
    }
    return c;
}

int main(int argc, char **argv)
{
    if (argc > 1 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        printf("usage: snapbench [PAGES [DIR]]\n"
               "Snapshot write and load rates of kvd/snapshot.c on a host-backend core of the\n"
               "default geometry; one JSON line on stdout. PAGES default 3000 (135 KB each);\n"
               "DIR default a fresh /tmp directory, removed after.\n");
        return 0;
    }
    char *end = NULL;
    unsigned long pages = argc > 1 ? strtoul(argv[1], &end, 10) : 3000;
    if (argc > 1 && (*end != '\0' || pages == 0 || pages > 1000000)) {
        fprintf(stderr, "snapbench: PAGES must be a number in 1..1000000, not '%s'\n", argv[1]);
        return 2;
    }
    uint32_t n = (uint32_t)pages;
    char dir[512] = "/tmp/kvd-snapbench-XXXXXX";
    int own = argc <= 2;
    if (own && !mkdtemp(dir))
        return 1;
    if (!own)
        snprintf(dir, sizeof(dir), "%s", argv[2]);
    uint8_t salt[32] = {7};
    kvd_core_t *a = core(n, salt);
    uint64_t pb = kvd_core_export(a)->page_bytes[KV_FMT_FP8];
    uint8_t *page = malloc(pb);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (uint32_t i = 0; i < n; i++) {
        for (uint64_t b = 0; b < pb; b += 8) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            memcpy(page + b, &x, pb - b < 8 ? pb - b : 8);
        }
        uint8_t h[32];
        for (int k = 0; k < 32; k++)
            h[k] = (uint8_t)(x >> (k % 8 * 8)) ^ (uint8_t)(i >> (k % 4 * 8));
        if (kvd_core_cache_restore(a, h, KV_FMT_FP8, page, pb, NULL) != KV_ERR_OK) {
            fprintf(stderr, "snapbench: restore %u: %s\n", i, kvd_core_errmsg(a));
            return 1;
        }
    }
    kvd_snap_ident_t id;
    kvd_snap_ident(&id, a, "bench", salt);
    kvd_snap_result_t w, l;
    char err[1024];
    if (kvd_snap_write(a, dir, &id, &w, err, sizeof(err)) != KV_ERR_OK) {
        fprintf(stderr, "snapbench: write: %s\n", err);
        return 1;
    }
    kvd_core_t *b = core(n, salt);
    if (kvd_snap_load(b, dir, &id, NULL, NULL, &l, err, sizeof(err)) != KV_ERR_OK || l.pages != n) {
        fprintf(stderr, "snapbench: load: %s (%" PRIu64 " pages)\n", err, l.pages);
        return 1;
    }
    double t0 = now_s();
    uint32_t crc = 0;
    int reps = 200;
    for (int i = 0; i < reps; i++)
        crc = kvd_crc32c(crc, page, pb);
    double crc_s = now_s() - t0;
    printf("{\"pages\":%u,\"page_bytes\":%" PRIu64 ",\"file_bytes\":%" PRIu64
           ",\"write_ms\":%.1f,\"write_MBps\":%.0f,\"load_ms\":%.1f,\"load_MBps\":%.0f,"
           "\"crc32c_MBps\":%.0f,\"crc\":\"%08x\"}\n",
           n, pb, w.bytes, (double)w.ns / 1e6, (double)w.bytes / 1e6 / ((double)w.ns / 1e9),
           (double)l.ns / 1e6, (double)l.bytes / 1e6 / ((double)l.ns / 1e9),
           (double)pb * reps / 1e6 / crc_s, crc);
    kvd_core_free(&a);
    kvd_core_free(&b);
    free(page);
    if (own) {
        char cmd[600];
        snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
        if (system(cmd) != 0)
            return 1;
    }
    return 0;
}
