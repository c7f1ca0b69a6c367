/* fuzz_snapshot.c — libFuzzer target over the snapshot loader's parsing (kvd/snapshot.c,
 * kvd_snap_parse_buf): header checks, identity, size against counts, per-record fields and
 * CRC32C — every byte of a snapshot file is untrusted. Each record that passes is restored
 * into a small real core (kvd_core_cache_restore), as the loader does, so hostile hashes
 * (duplicates, 64-bit key collisions) and a full pool reach the core too. Built only with
 * clang and -DKVD_FUZZ=ON; .ci/fuzz seeds it with gen_snapshot_corpus's valid files.
 *
 * Properties checked beyond "no crash, no sanitizer report":
 *   - the verdict is a code of the error vocabulary, and a failure comes with a message;
 *   - an accepted buffer delivered exactly the records its header counts;
 *   - after the input's restores are evicted again the core is empty and kvd_core_check finds
 *     nothing (the rollback the loader relies on).
 * Every input runs twice: as given, and with every CRC32C recomputed where the layout puts it
 * (header, then each record as the record's own format field sizes it). A mutation almost
 * never keeps a CRC valid, so without the second pass the fuzzer would stop at the header
 * CRC; with it, mutated versions, identities, counts and record fields reach their checks.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "snap_fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct fz_s {
    kvd_core_t *c;
    uint32_t lids[16];
    uint32_t n;
    uint64_t records;
} fz_t;

static int fz_record(void *ud, const uint8_t hash[KVD_HASH_BYTES], kv_fmt_t f, uint32_t flags,
                     const uint8_t *bytes, uint64_t len)
{
    fz_t *z = ud;
    z->records++;
    if (z->n == 16)
        return KV_ERR_RESOURCE_EXHAUSTED;
    uint32_t lid;
    int rc = kvd_core_cache_restore(z->c, hash, f, bytes, (size_t)len, &lid);
    if (rc == KV_ERR_OK && lid != KVD_NONE) {
        z->lids[z->n++] = lid;
        if (flags & KVD_SNAP_REC_PINNED)
            kvd_core_pin(z->c, lid);
    }
    return rc;
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Recompute the header CRC and each record's CRC in place, as far as the bytes go. */
static void fix_crcs(uint8_t *b, size_t size, const kvd_snap_ident_t *id)
{
    if (size < 160)
        return;
    put32(b + 156, kvd_crc32c(0, b, 156));
    for (size_t off = 160; size - off >= 64;) {
        uint32_t f = (uint32_t)b[off + 4] | (uint32_t)b[off + 5] << 8 | (uint32_t)b[off + 6] << 16 |
                     (uint32_t)b[off + 7] << 24;
        if (f >= KV_FMT_COUNT || size - off - 64 < id->page_bytes[f])
            return;
        size_t pb = (size_t)id->page_bytes[f];
        put32(b + off + 60, kvd_crc32c(kvd_crc32c(0, b + off, 60), b + off + 64, pb));
        off += 64 + pb;
    }
}

static void one(kvd_core_t *c, const kvd_snap_ident_t *id, const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static kvd_core_t *c;
    static kvd_snap_ident_t id;
    if (!c)
        c = snap_fuzz_core(&id);
    one(c, &id, data, size);
    uint8_t *fixed = malloc(size ? size : 1);
    if (!fixed)
        return 0;
    memcpy(fixed, data, size);
    fix_crcs(fixed, size, &id);
    one(c, &id, fixed, size);
    free(fixed);
    return 0;
}

static void one(kvd_core_t *c, const kvd_snap_ident_t *idp, const uint8_t *data, size_t size)
{
    const kvd_snap_ident_t id = *idp;
    fz_t z = {.c = c};
    char err[512] = "";
    int rc = kvd_snap_parse_buf(data, size, &id, fz_record, &z, err, sizeof(err));
    if (rc < 0 || rc > KV_ERR_DEVICE || (rc != KV_ERR_OK && !err[0] && z.records == 0))
        abort();
    if (rc == KV_ERR_OK && size >= 88) {
        uint64_t want = 0;
        for (int f = 0; f < 2; f++)
            for (int i = 0; i < 8; i++)
                want += (uint64_t)data[72 + 8 * f + i] << (8 * i);
        if (want != z.records)
            abort();
    }
    for (uint32_t i = 0; i < z.n; i++) {
        kvd_page_info_t pi;
        if (kvd_core_page_info(c, z.lids[i], &pi) != KV_ERR_OK || !pi.cache)
            continue;
        while (pi.pins--)
            kvd_core_unpin(c, z.lids[i]);
        kvd_core_cache_evict(c, z.lids[i]);
    }
    kvd_core_collect(c);
    kvd_stats_t st;
    kvd_core_stats(c, &st);
    char rep[1024];
    if (st.cache_entries != 0 || kvd_core_check(c, rep, sizeof(rep)) != 0)
        abort();
}
