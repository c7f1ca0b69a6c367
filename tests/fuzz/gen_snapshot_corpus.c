/* gen_snapshot_corpus.c — writes valid snapshot files of the fuzz namespace (snap_fuzz.h)
 * into the directory argv[1]: empty, one FP8 page, and FP8 + TQ3 pages with a pinned entry.
 * .ci/fuzz builds and runs it to seed fuzz_snapshot (no binary seeds in the repository). */
#include "snap_fuzz.h"

static void put(kvd_core_t *c, uint8_t tag, kv_fmt_t f, int pin)
{
    uint8_t h[KVD_HASH_BYTES], page[65536];
    memset(h, tag, sizeof(h));
    uint64_t pb = kvd_core_export(c)->page_bytes[f];
    for (uint64_t i = 0; i < pb; i++)
        page[i] = (uint8_t)(tag + i);
    uint32_t lid;
    if (pb > sizeof(page) || kvd_core_cache_restore(c, h, f, page, (size_t)pb, &lid) != KV_ERR_OK ||
        (pin && kvd_core_pin(c, lid) != KV_ERR_OK))
        abort();
}

static void emit(kvd_core_t *c, const kvd_snap_ident_t *id, const char *out, const char *name)
{
    char dir[512] = "/tmp/kvd-gen-snap-XXXXXX", err[512], cmd[2048];
    if (!mkdtemp(dir))
        abort();
    kvd_snap_result_t r;
    if (kvd_snap_write(c, dir, id, &r, err, sizeof(err)) != KV_ERR_OK) {
        fprintf(stderr, "gen_snapshot_corpus: %s\n", err);
        abort();
    }
    snprintf(cmd, sizeof(cmd), "cp %s %s/%s && rm -rf %s", r.path, out, name, dir);
    if (system(cmd) != 0)
        abort();
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: gen_snapshot_corpus DIR\n");
        return 2;
    }
    kvd_snap_ident_t id;
    kvd_core_t *c = snap_fuzz_core(&id);
    emit(c, &id, argv[1], "snap-empty");
    put(c, 1, KV_FMT_FP8, 0);
    emit(c, &id, argv[1], "snap-one");
    put(c, 2, KV_FMT_FP8, 1);
    put(c, 3, KV_FMT_TQ3, 0);
    emit(c, &id, argv[1], "snap-mixed");
    kvd_core_free(&c);
    return 0;
}
