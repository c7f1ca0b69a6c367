/* snapshot.c — durable prefix cache: the file format, the writer, the checking loader, the
 * salt file and CRC32C. snapshot.h has the contracts; docs/snapshot.md the format and why.
 *
 * File layout (all integers little-endian, written byte by byte: never a struct dump, so the
 * format does not depend on the compiler's padding or the host's byte order):
 *
 *   header, 160 bytes
 *     0  magic "KVDSNAP\0"          8  u32 format version       12  u32 header bytes (160)
 *    16  u32 hash version          20  u32 layout version      24  u32 layers
 *    28  u32 kv_heads              32  u32 head_dim            36  u32 page_tokens
 *    40  u64 rotation seed         48  u32 formats (2)         52  u32 flags (bit 0: salted)
 *    56  u64 page bytes FP8        64  u64 page bytes TQ3      72  u64 records FP8
 *    80  u64 records TQ3           88  u64 generation          96  u64 created (unix s)
 *   104  salt id[16]              120  namespace id[16]       136  20 zero bytes
 *   156  u32 CRC32C of bytes 0..155
 *   then per cached page, oldest LRU position first (restoring in file order rebuilds the LRU):
 *   record header, 64 bytes
 *     0  magic "KVDR"               4  u32 format               8  u32 flags (bit 0: pinned)
 *    12  u32 zero                  16  u64 payload bytes       24  chain hash[32]
 *    56  u32 record index          60  u32 CRC32C of bytes 0..59 and the payload
 *   payload: the page's bytes, exactly page bytes of its format
 *
 * The file size must equal 160 + Σ_f records_f × (64 + page_bytes_f): a truncated file or
 * trailing bytes are refused before any record is read, and the counts are bounded before the
 * multiplication (no 64-bit overflow whatever the header says).
 *
 * What is NOT stored: logical ids (clients re-look-up after a restart; ids are reassigned),
 * parent links (a lookup walks h_{i-1} → h_i by recomputing each hash from the tokens, so the
 * binding hash → page is all that must come back), refcounts, epochs.
 */
#include "snapshot.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

static const uint8_t snap_magic[8] = {'K', 'V', 'D', 'S', 'N', 'A', 'P', 0};
#define SNAP_REC_MAGIC   0x5244564Bu /* "KVDR" read as a little-endian u32 */
#define SNAP_HDR         KVD_SNAP_HEADER_BYTES
#define SNAP_FLAG_SALTED 0x1u

/* ---- CRC32C ------------------------------------------------------------------------------ */
/* Slicing by 8 (Intel's 2006 technique): eight 256-entry tables, one 8-byte step per loop.
 * ~1-2 GB/s on a plain core, against ~0.4 GB/s for the byte-wise table; the snapshot's cost is
 * disk bandwidth plus one pass of this over every page. Tables are built once on first use
 * (the daemon is single-threaded; a race would only build the same tables twice). */
static uint32_t crc_tab[8][256];
static int crc_ready;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        crc_tab[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_tab[t][i] = (crc_tab[t - 1][i] >> 8) ^ crc_tab[0][crc_tab[t - 1][i] & 0xFF];
    crc_ready = 1;
}

uint32_t kvd_crc32c(uint32_t crc, const void *buf, size_t len)
{
    if (!crc_ready)
        crc_init();
    const uint8_t *p = buf;
    uint32_t c = ~crc;
    while (len && ((uintptr_t)p & 7)) {
        c = (c >> 8) ^ crc_tab[0][(c ^ *p++) & 0xFF];
        len--;
    }
    while (len >= 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                           (uint32_t)p[3] << 24);
        c = crc_tab[7][lo & 0xFF] ^ crc_tab[6][(lo >> 8) & 0xFF] ^ crc_tab[5][(lo >> 16) & 0xFF] ^
            crc_tab[4][lo >> 24] ^ crc_tab[3][p[4]] ^ crc_tab[2][p[5]] ^ crc_tab[1][p[6]] ^
            crc_tab[0][p[7]];
        p += 8;
        len -= 8;
    }
    while (len--)
        c = (c >> 8) ^ crc_tab[0][(c ^ *p++) & 0xFF];
    return ~c;
}

/* ---- little-endian fields ---------------------------------------------------------------- */
static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get64(const uint8_t *p)
{
    return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

/* ---- identity ---------------------------------------------------------------------------- */
void kvd_snap_ident(kvd_snap_ident_t *id, const kvd_core_t *c, const char *namespace_,
                    const uint8_t salt[KVD_HASH_KEY_BYTES])
{
    static const char ctx[] = "kvd snapshot salt id v1";
    const kvd_export_t *ex = kvd_core_export(c);
    memset(id, 0, sizeof(*id));
    id->geom = ex->geom;
    for (int f = 0; f < KV_FMT_COUNT; f++)
        id->page_bytes[f] = kv_page_bytes(&ex->geom, (kv_fmt_t)f);
    /* keyed: the fingerprint identifies the salt without revealing it */
    crypto_generichash(id->salt_id, KVD_SNAP_ID_BYTES, (const uint8_t *)ctx, sizeof(ctx) - 1, salt,
                       KVD_HASH_KEY_BYTES);
    const char *ns = namespace_ ? namespace_ : "";
    crypto_generichash(id->ns_id, KVD_SNAP_ID_BYTES, (const uint8_t *)ns, strlen(ns), NULL, 0);
}

static void snap_header_build(uint8_t h[SNAP_HDR], const kvd_snap_ident_t *id,
                              const uint64_t counts[KV_FMT_COUNT], uint64_t gen)
{
    memset(h, 0, SNAP_HDR);
    memcpy(h, snap_magic, 8);
    put32(h + 8, KVD_SNAP_FORMAT_VERSION);
    put32(h + 12, SNAP_HDR);
    put32(h + 16, KVD_SNAP_HASH_VERSION);
    put32(h + 20, KVD_SNAP_LAYOUT_VERSION);
    put32(h + 24, id->geom.layers);
    put32(h + 28, id->geom.kv_heads);
    put32(h + 32, id->geom.head_dim);
    put32(h + 36, id->geom.page_tokens);
    put64(h + 40, id->geom.seed);
    put32(h + 48, KV_FMT_COUNT);
    put32(h + 52, SNAP_FLAG_SALTED);
    put64(h + 56, id->page_bytes[KV_FMT_FP8]);
    put64(h + 64, id->page_bytes[KV_FMT_TQ3]);
    put64(h + 72, counts[KV_FMT_FP8]);
    put64(h + 80, counts[KV_FMT_TQ3]);
    put64(h + 88, gen);
    put64(h + 96, (uint64_t)time(NULL));
    memcpy(h + 104, id->salt_id, KVD_SNAP_ID_BYTES);
    memcpy(h + 120, id->ns_id, KVD_SNAP_ID_BYTES);
    put32(h + 156, kvd_crc32c(0, h, 156));
}

typedef struct snap_hdr_s {
    uint64_t count[KV_FMT_COUNT];
    uint64_t gen;
    uint64_t total; /* records */
} snap_hdr_t;

/* Check the 160 header bytes against `want` and the file size. Order: integrity first (magic,
 * CRC), then versions, then identity, then counts and size, so the reason names the first
 * thing that is actually wrong. */
static int snap_header_check(const uint8_t *h, uint64_t size, const kvd_snap_ident_t *want,
                             snap_hdr_t *out, char *err, size_t errlen)
{
    if (size < SNAP_HDR) {
        kvd_fmt(err, errlen, "%" PRIu64 " bytes: shorter than the %u-byte header (truncated)", size,
                SNAP_HDR);
        return KV_ERR_MALFORMED;
    }
    if (memcmp(h, snap_magic, 8) != 0) {
        kvd_fmt(err, errlen, "bad magic: not a kvd snapshot");
        return KV_ERR_MALFORMED;
    }
    uint32_t crc = kvd_crc32c(0, h, 156);
    if (crc != get32(h + 156)) {
        kvd_fmt(err, errlen, "header CRC32C mismatch (stored %08x, computed %08x)", get32(h + 156),
                crc);
        return KV_ERR_MALFORMED;
    }
    if (get32(h + 8) != KVD_SNAP_FORMAT_VERSION || get32(h + 12) != SNAP_HDR) {
        kvd_fmt(err, errlen, "format version %u (header %u bytes); this kvd reads version %u",
                get32(h + 8), get32(h + 12), KVD_SNAP_FORMAT_VERSION);
        return KV_ERR_MALFORMED;
    }
    for (int i = 136; i < 156; i++)
        if (h[i]) {
            kvd_fmt(err, errlen, "reserved header byte %d is not zero", i);
            return KV_ERR_MALFORMED;
        }
    if (get32(h + 16) != KVD_SNAP_HASH_VERSION) {
        kvd_fmt(err, errlen, "chain hash version %u, this kvd computes version %u", get32(h + 16),
                KVD_SNAP_HASH_VERSION);
        return KV_ERR_GEOMETRY_MISMATCH;
    }
    if (get32(h + 20) != KVD_SNAP_LAYOUT_VERSION) {
        /* Pages of another layout would decode to garbage (version 1 → 2 moved every TQ3 code),
         * and converting them is not worth the code: the cache refills. */
        kvd_fmt(err, errlen,
                "page layout version %u, this kvd uses version %u (docs/formats.md): its pages "
                "cannot be read; the cache starts without them",
                get32(h + 20), KVD_SNAP_LAYOUT_VERSION);
        return KV_ERR_GEOMETRY_MISMATCH;
    }
    const kv_geom_t *g = &want->geom;
    if (get32(h + 24) != g->layers || get32(h + 28) != g->kv_heads ||
        get32(h + 32) != g->head_dim || get32(h + 36) != g->page_tokens ||
        get64(h + 40) != g->seed) {
        kvd_fmt(err, errlen,
                "geometry mismatch: snapshot has %u layers x %u kv_heads x %u head_dim, %u "
                "tokens/page, seed %" PRIu64 "; the daemon has %u x %u x %u, %u, seed %" PRIu64,
                get32(h + 24), get32(h + 28), get32(h + 32), get32(h + 36), get64(h + 40),
                g->layers, g->kv_heads, g->head_dim, g->page_tokens, g->seed);
        return KV_ERR_GEOMETRY_MISMATCH;
    }
    if (get32(h + 48) != KV_FMT_COUNT || get32(h + 52) != SNAP_FLAG_SALTED) {
        kvd_fmt(err, errlen, "%u formats, flags %#x; expected %d formats, flags %#x", get32(h + 48),
                get32(h + 52), KV_FMT_COUNT, SNAP_FLAG_SALTED);
        return KV_ERR_MALFORMED;
    }
    for (int f = 0; f < KV_FMT_COUNT; f++)
        if (get64(h + 56 + 8 * f) != want->page_bytes[f]) {
            kvd_fmt(err, errlen, "%s pages of %" PRIu64 " bytes; the daemon's have %" PRIu64,
                    kvd_fmt_name(f), get64(h + 56 + 8 * f), want->page_bytes[f]);
            return KV_ERR_GEOMETRY_MISMATCH;
        }
    if (memcmp(h + 120, want->ns_id, KVD_SNAP_ID_BYTES) != 0) {
        kvd_fmt(err, errlen, "written for another namespace");
        return KV_ERR_GEOMETRY_MISMATCH;
    }
    if (memcmp(h + 104, want->salt_id, KVD_SNAP_ID_BYTES) != 0) {
        kvd_fmt(err, errlen,
                "written under another namespace salt (the salt file changed): "
                "its hashes can never match");
        return KV_ERR_GEOMETRY_MISMATCH;
    }
    /* Counts are bounded before any multiplication: the running total of records stays
     * ≤ 2^32 and page bytes (the daemon's own, checked equal above) ≤ 2^31, so the expected
     * size stays below 2^32 × (2^31 + 64) + 160 < 2^64 whatever the header says. */
    uint64_t expect = SNAP_HDR, total = 0;
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        uint64_t n = get64(h + 72 + 8 * f);
        if (n > KVD_SNAP_MAX_PAGES || (n && want->page_bytes[f] == 0) ||
            want->page_bytes[f] > (1ull << 31)) {
            kvd_fmt(err, errlen, "%" PRIu64 " %s records: more than a pool can hold", n,
                    kvd_fmt_name(f));
            return KV_ERR_MALFORMED;
        }
        total += n;
        if (total > KVD_SNAP_MAX_PAGES) {
            kvd_fmt(err, errlen, "%" PRIu64 " records: more than the index can hold", total);
            return KV_ERR_MALFORMED;
        }
        out->count[f] = n;
        expect += n * (KVD_SNAP_RECORD_BYTES + want->page_bytes[f]);
    }
    if (size != expect) {
        kvd_fmt(err, errlen, "%" PRIu64 " bytes but the header promises %" PRIu64 " (%s)", size,
                expect, size < expect ? "truncated" : "trailing bytes");
        return KV_ERR_MALFORMED;
    }
    out->gen = get64(h + 88);
    out->total = total;
    return KV_ERR_OK;
}

/* ---- sources: a byte buffer (fuzz, tests) or a file (read(), never mmap: a file shrunk
 * under a mapping would SIGBUS the daemon) ---------------------------------------------- */
typedef struct snap_src_s {
    const uint8_t *mem;
    uint64_t off, size;
    int fd;
    const char *path;
} snap_src_t;

static int src_read(snap_src_t *s, void *buf, uint64_t n, char *err, size_t errlen)
{
    if (n > s->size - s->off) { /* the size check makes this unreachable; keep it local */
        kvd_fmt(err, errlen, "read past the end at offset %" PRIu64, s->off);
        return KV_ERR_MALFORMED;
    }
    if (s->mem) {
        memcpy(buf, s->mem + s->off, (size_t)n);
        s->off += n;
        return KV_ERR_OK;
    }
    uint8_t *p = buf;
    while (n) {
        ssize_t r = read(s->fd, p, n > (1u << 30) ? (1u << 30) : (size_t)n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            kvd_fmt(err, errlen, "read at offset %" PRIu64 " failed: %s", s->off,
                    r == 0 ? "unexpected end of file (shrunk while reading?)" : strerror(errno));
            return KV_ERR_IO;
        }
        p += r;
        n -= (uint64_t)r;
        s->off += (uint64_t)r;
    }
    return KV_ERR_OK;
}

/* Read and check every record, calling fn for each. */
static int snap_records(snap_src_t *s, const snap_hdr_t *hd, const kvd_snap_ident_t *want,
                        kvd_snap_record_fn fn, void *ud, char *err, size_t errlen)
{
    uint64_t maxpb = 0;
    for (int f = 0; f < KV_FMT_COUNT; f++)
        if (hd->count[f] && want->page_bytes[f] > maxpb)
            maxpb = want->page_bytes[f];
    uint8_t *page = hd->total ? kvd_malloc((size_t)maxpb) : NULL;
    if (hd->total && !page) {
        kvd_fmt(err, errlen, "out of memory for a page buffer of %" PRIu64 " bytes", maxpb);
        return KV_ERR_NOMEM;
    }
    uint64_t seen[KV_FMT_COUNT] = {0};
    int rc = KV_ERR_OK;
    for (uint64_t i = 0; i < hd->total && rc == KV_ERR_OK; i++) {
        uint8_t r[KVD_SNAP_RECORD_BYTES];
        uint64_t at = s->off;
        rc = src_read(s, r, sizeof(r), err, errlen);
        if (rc != KV_ERR_OK)
            break;
        uint32_t f = get32(r + 4), flags = get32(r + 8);
        if (get32(r) != SNAP_REC_MAGIC || get32(r + 12) != 0 || get32(r + 56) != (uint32_t)i) {
            kvd_fmt(err, errlen,
                    "record %" PRIu64 " at offset %" PRIu64
                    ": bad record magic, reserved field or index",
                    i, at);
            rc = KV_ERR_MALFORMED;
            break;
        }
        if (f >= KV_FMT_COUNT || seen[f] >= hd->count[f] || get64(r + 16) != want->page_bytes[f] ||
            (flags & ~KVD_SNAP_REC_PINNED)) {
            kvd_fmt(err, errlen,
                    "record %" PRIu64 " at offset %" PRIu64 ": format %u / %" PRIu64
                    " bytes / flags %#x do not fit the header",
                    i, at, f, get64(r + 16), flags);
            rc = KV_ERR_MALFORMED;
            break;
        }
        uint64_t pb = want->page_bytes[f];
        rc = src_read(s, page, pb, err, errlen);
        if (rc != KV_ERR_OK)
            break;
        uint32_t crc = kvd_crc32c(kvd_crc32c(0, r, 60), page, (size_t)pb);
        if (crc != get32(r + 60)) {
            kvd_fmt(err, errlen,
                    "record %" PRIu64 " at offset %" PRIu64
                    ": CRC32C mismatch (stored %08x, computed %08x)",
                    i, at, get32(r + 60), crc);
            rc = KV_ERR_MALFORMED;
            break;
        }
        seen[f]++;
        if (fn)
            rc = fn(ud, r + 24, (kv_fmt_t)f, flags, page, pb);
    }
    kvd_free(page);
    return rc;
}

int kvd_snap_parse_buf(const uint8_t *buf, size_t len, const kvd_snap_ident_t *want,
                       kvd_snap_record_fn fn, void *ud, char *err, size_t errlen)
{
    if (!buf || !want) {
        kvd_fmt(err, errlen, "no buffer");
        return KV_ERR_INVALID_ARGUMENT;
    }
    snap_hdr_t hd;
    int rc = snap_header_check(buf, len, want, &hd, err, errlen);
    if (rc != KV_ERR_OK)
        return rc;
    snap_src_t s = {.mem = buf, .off = SNAP_HDR, .size = len, .fd = -1};
    return snap_records(&s, &hd, want, fn, ud, err, errlen);
}

/* ---- loading into the core --------------------------------------------------------------- */
typedef struct snap_load_s {
    kvd_core_t *c;
    uint64_t skip[KV_FMT_COUNT]; /* oldest records of each format left out (no room) */
    uint32_t *lids;              /* restored, for the rollback */
    uint64_t n, cap, skipped;
    int core_failed; /* the core refused a record: its message is kvd_core_errmsg */
} snap_load_t;

static int snap_restore_cb(void *ud, const uint8_t hash[KVD_HASH_BYTES], kv_fmt_t f, uint32_t flags,
                           const uint8_t *bytes, uint64_t len)
{
    snap_load_t *L = ud;
    if (L->skip[f]) {
        L->skip[f]--;
        L->skipped++;
        return KV_ERR_OK;
    }
    L->core_failed = 1;
    if (L->n >= L->cap) /* the budget said no more; cannot happen */
        KVD_PANIC("snapshot restore beyond its budget of %llu pages", (unsigned long long)L->cap);
    uint32_t lid = KVD_NONE;
    int rc = kvd_core_cache_restore(L->c, hash, f, bytes, (size_t)len, &lid);
    if (rc != KV_ERR_OK)
        return rc; /* e.g. the same hash twice in one file */
    /* the quota cannot take it back: the budget left room for it */
    KVD_ASSERT(lid != KVD_NONE);
    L->lids[L->n++] = lid;
    if (flags & KVD_SNAP_REC_PINNED && (rc = kvd_core_pin(L->c, lid)) != KV_ERR_OK)
        return rc;
    L->core_failed = 0;
    return KV_ERR_OK;
}

static void snap_rollback(snap_load_t *L)
{
    for (uint64_t i = 0; i < L->n; i++) {
        kvd_page_info_t pi;
        if (kvd_core_page_info(L->c, L->lids[i], &pi) != KV_ERR_OK || !pi.cache)
            continue;
        for (uint32_t p = 0; p < pi.pins; p++)
            kvd_core_unpin(L->c, L->lids[i]);
        kvd_core_cache_evict(L->c, L->lids[i]);
    }
    kvd_core_collect(L->c);
    L->n = 0;
}

int kvd_snap_load_file(kvd_core_t *c, const char *path, const kvd_snap_ident_t *id,
                       kvd_snap_result_t *r, char *err, size_t errlen)
{
    uint64_t t0 = kvd_mono_ns();
    memset(r, 0, sizeof(*r));
    snprintf(r->path, sizeof(r->path), "%s", path);
    /* O_NONBLOCK: a FIFO under a generation's name would otherwise block the open (and the
     * daemon's start) until a writer came; it is refused below instead */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        kvd_fmt(err, errlen, "open failed: %s", strerror(errno));
        return KV_ERR_IO;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || fcntl(fd, F_SETFL, 0) != 0) {
        kvd_fmt(err, errlen, "not a regular file");
        close(fd);
        return KV_ERR_IO;
    }
    snap_src_t s = {.fd = fd, .size = (uint64_t)st.st_size, .path = path};
    uint8_t h[SNAP_HDR];
    snap_hdr_t hd;
    int rc = KV_ERR_MALFORMED;
    if (s.size < SNAP_HDR)
        rc = snap_header_check(h, s.size, id, &hd, err, errlen); /* reports "truncated" */
    else if ((rc = src_read(&s, h, SNAP_HDR, err, errlen)) == KV_ERR_OK)
        rc = snap_header_check(h, s.size, id, &hd, err, errlen);
    if (rc != KV_ERR_OK) {
        close(fd);
        return rc;
    }
    /* Budget: what fits without evicting anything (free pages, quota room, logical ids).
     * When the snapshot holds more, the OLDEST records of that format are left out, so the
     * most recently used entries come back. */
    kvd_stats_t cs;
    kvd_core_stats(c, &cs);
    snap_load_t L = {.c = c};
    uint64_t budget[KV_FMT_COUNT], ids = cs.logical_free;
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        uint64_t room = cs.cache_quota_pages[f] > cs.pages_cached[f]
                            ? cs.cache_quota_pages[f] - cs.pages_cached[f]
                            : 0;
        budget[f] = cs.pages_free[f] < room ? cs.pages_free[f] : room;
        if (budget[f] > hd.count[f])
            budget[f] = hd.count[f];
    }
    if (budget[KV_FMT_FP8] > ids)
        budget[KV_FMT_FP8] = ids;
    if (budget[KV_FMT_TQ3] > ids - budget[KV_FMT_FP8])
        budget[KV_FMT_TQ3] = ids - budget[KV_FMT_FP8];
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        L.skip[f] = hd.count[f] - budget[f];
        L.cap += budget[f];
    }
    L.lids = L.cap ? kvd_malloc(sizeof(uint32_t) * (size_t)L.cap) : NULL;
    if (L.cap && !L.lids) {
        close(fd);
        kvd_fmt(err, errlen, "out of memory for %" PRIu64 " page ids", L.cap);
        return KV_ERR_NOMEM;
    }
    rc = snap_records(&s, &hd, id, snap_restore_cb, &L, err, errlen);
    if (rc != KV_ERR_OK && L.core_failed)
        kvd_fmt(err, errlen, "record %" PRIu64 ": restoring it failed: %s", L.n + L.skipped,
                kvd_core_errmsg(c));
    close(fd);
    if (rc != KV_ERR_OK) {
        snap_rollback(&L);
    } else {
        r->generation = hd.gen;
        r->pages = L.n;
        r->skipped = L.skipped;
        r->bytes = s.size;
    }
    kvd_free(L.lids);
    r->ns = kvd_mono_ns() - t0;
    return rc;
}

/* ---- the directory ----------------------------------------------------------------------- */
/* Name suffixes after "cache.<gen>.snap": a generation, a write in progress, a generation the
 * loader set aside as corrupt. Only SNAP_GEN names are ever loaded or counted as generations. */
#define SNAP_GEN     ""
#define SNAP_TMP     ".tmp"
#define SNAP_REFUSED ".refused"

/* "cache." + 20 digits + ".snap" + suffix → 1 and *gen. */
static int snap_name_gen(const char *name, const char *suffix, uint64_t *gen)
{
    size_t n = strlen(name), want = 6 + 20 + 5 + strlen(suffix);
    if (n != want || strncmp(name, "cache.", 6) != 0 || strncmp(name + 26, ".snap", 5) != 0 ||
        strcmp(name + 31, suffix) != 0)
        return 0;
    uint64_t g = 0;
    for (int i = 6; i < 26; i++) {
        if (name[i] < '0' || name[i] > '9' || g > (UINT64_MAX - 9) / 10)
            return 0;
        g = g * 10 + (uint64_t)(name[i] - '0');
    }
    *gen = g;
    return 1;
}

static int u64_desc(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

typedef struct snap_gens_s {
    uint64_t *g; /* newest first once listed; kvd_malloc'd */
    size_t n, cap;
} snap_gens_t;

static int gens_push(snap_gens_t *l, uint64_t g)
{
    if (l->n == l->cap) {
        size_t nc = l->cap ? 2 * l->cap : 8;
        uint64_t *nb = kvd_realloc(l->g, nc * sizeof(uint64_t));
        if (!nb)
            return KV_ERR_NOMEM;
        l->g = nb;
        l->cap = nc;
    }
    l->g[l->n++] = g;
    return KV_ERR_OK;
}

/* Generations present, newest first, into a kvd_malloc'd array; refused (may be NULL): the
 * set-aside generations likewise. rm_tmp: unlink *.tmp. */
static int snap_list(const char *dir, uint64_t **out, size_t *n, snap_gens_t *refused, int rm_tmp,
                     char *err, size_t errlen)
{
    *out = NULL;
    *n = 0;
    snap_gens_t gens = {0}, ref = {0};
    DIR *d = opendir(dir);
    if (!d) {
        kvd_fmt(err, errlen, "opendir(%s) failed: %s", dir, strerror(errno));
        return KV_ERR_IO;
    }
    struct dirent *e;
    int rc = KV_ERR_OK;
    while (rc == KV_ERR_OK && (e = readdir(d)) != NULL) {
        uint64_t g;
        if (rm_tmp && snap_name_gen(e->d_name, SNAP_TMP, &g)) {
            char p[1024];
            snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
            unlink(p); /* a write that did not finish (crash): never a generation */
        } else if (snap_name_gen(e->d_name, SNAP_GEN, &g)) {
            rc = gens_push(&gens, g);
        } else if (refused && snap_name_gen(e->d_name, SNAP_REFUSED, &g)) {
            rc = gens_push(&ref, g);
        }
    }
    closedir(d);
    if (rc != KV_ERR_OK) {
        kvd_fmt(err, errlen, "out of memory listing %s", dir);
        kvd_free(gens.g);
        kvd_free(ref.g);
        return rc;
    }
    if (gens.n)
        qsort(gens.g, gens.n, sizeof(uint64_t), u64_desc);
    if (ref.n)
        qsort(ref.g, ref.n, sizeof(uint64_t), u64_desc);
    *out = gens.g;
    *n = gens.n;
    if (refused)
        *refused = ref;
    return KV_ERR_OK;
}

/* The file of generation gen in dir (suffix: SNAP_GEN, SNAP_TMP, SNAP_REFUSED); 0 when the
 * name does not fit buf (a snapshot_dir that long is refused where a file is written; a load
 * or a prune skips the name). */
static int snap_path(char *buf, size_t len, const char *dir, uint64_t gen, const char *suffix)
{
    int n = snprintf(buf, len, "%s/cache.%020" PRIu64 ".snap%s", dir, gen, suffix);
    return n >= 0 && (size_t)n < len;
}

static int snap_fsync_dir(const char *dir, char *err, size_t errlen)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fsync(fd) != 0) {
        kvd_fmt(err, errlen, "fsync of directory %s failed: %s", dir, strerror(errno));
        if (fd >= 0)
            close(fd);
        return KV_ERR_IO;
    }
    close(fd);
    return KV_ERR_OK;
}

/* A generation refused as corrupt (rc MALFORMED: its own bytes are wrong — CRC, a bad field,
 * truncated, trailing bytes) is renamed cache.<gen>.snap.refused, out of the generations. Left
 * under its name it stayed one of the two newest, so the next write kept it and pruned the
 * older generation that had just loaded: one more fault and nothing was loadable. The file is
 * kept for an operator to inspect (the writer prunes all but the KVD_SNAP_KEEP_REFUSED newest).
 * Not for an identity mismatch (GEOMETRY_MISMATCH: another configuration's cache, intact), nor
 * for I/O errors, out of memory or a record the core refused: those keep today's handling.
 * Appends what happened to line[len] (the log line). A failed rename (read-only directory)
 * leaves the file where it was, as before this existed. */
static void snap_set_aside(const char *dir, uint64_t gen, const char *path, char *line, size_t len)
{
    char to[1040];
    size_t at = strlen(line);
    if (!snap_path(to, sizeof(to), dir, gen, SNAP_REFUSED)) {
        snprintf(line + at, len - at, "; could not set it aside, left in place: name too long");
        return;
    }
    if (rename(path, to) != 0) {
        snprintf(line + at, len - at,
                 "; could not set it aside, left in place: rename(%s, %s) failed: %s", path, to,
                 strerror(errno));
        return;
    }
    char why[512];
    if (snap_fsync_dir(dir, why, sizeof(why)) != KV_ERR_OK)
        snprintf(line + at, len - at, "; set aside as %s (not durable: %s)", to, why);
    else
        snprintf(line + at, len - at, "; set aside as %s", to);
}

int kvd_snap_load(kvd_core_t *c, const char *dir, const kvd_snap_ident_t *id, kvd_snap_log_fn log,
                  void *log_ud, kvd_snap_result_t *r, char *err, size_t errlen)
{
    uint64_t t0 = kvd_mono_ns();
    memset(r, 0, sizeof(*r));
    uint64_t *gens;
    size_t n;
    int rc = snap_list(dir, &gens, &n, NULL, 1, err, errlen);
    if (rc != KV_ERR_OK)
        return rc;
    uint32_t refused = 0;
    for (size_t i = 0; i < n; i++) {
        char path[1024], why[512] = "";
        if (!snap_path(path, sizeof(path), dir, gens[i], SNAP_GEN))
            continue;
        kvd_snap_result_t one;
        int lrc = kvd_snap_load_file(c, path, id, &one, why, sizeof(why));
        if (lrc == KV_ERR_OK) {
            *r = one;
            break;
        }
        refused++;
        char line[2800];
        snprintf(line, sizeof(line), "%s: %s", path, why);
        if (lrc == KV_ERR_MALFORMED)
            snap_set_aside(dir, gens[i], path, line, sizeof(line));
        if (log)
            log(log_ud, line);
    }
    kvd_free(gens);
    r->refused = refused;
    r->ns = kvd_mono_ns() - t0;
    return KV_ERR_OK;
}

/* path: the file behind fd, for the message (the log line must say which file ran out of
 * room: the snapshot's .tmp or the salt's) */
static int write_all(int fd, const char *path, const struct iovec *iov, int iovcnt, char *err,
                     size_t errlen)
{
    struct iovec v[2];
    memcpy(v, iov, sizeof(struct iovec) * (size_t)iovcnt);
    int i = 0;
    while (i < iovcnt) {
        ssize_t w = writev(fd, v + i, iovcnt - i);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            kvd_fmt(err, errlen, "write to %s failed: %s", path,
                    w < 0 ? strerror(errno) : "no progress");
            return KV_ERR_IO;
        }
        size_t left = (size_t)w;
        while (i < iovcnt && left >= v[i].iov_len)
            left -= v[i++].iov_len;
        if (i < iovcnt) {
            v[i].iov_base = (uint8_t *)v[i].iov_base + left;
            v[i].iov_len -= left;
        }
    }
    return KV_ERR_OK;
}

/* ---- writing ----------------------------------------------------------------------------- */
/* The writer works in slices so that the daemon's loop is never blocked for the whole write
 * (docs/decisions.md 32, 41): kvd_snap_writer_fill (loop thread, core access) copies the next
 * slice of pages into the staging buffer and builds their record headers and CRCs;
 * kvd_snap_writer_flush (any ONE thread at a time, NO core access: only write()/pwrite()/
 * fsync()/close() on the writer's own fd and buffer) writes that slice. The header is written
 * last, with pwrite at offset 0, because only then are the record counts known (a page
 * evicted between the collection and its slice copy is left out, see fill). */

/* Bytes of one slice: what the loop copies and CRCs in one go. 8 MiB keeps the loop's stall
 * per slice at a few ms (memcpy ~5 GB/s + CRC32C ~2 GB/s here: ≈ 5 ms, docs/snapshot.md) while
 * each write() stays big enough for the disk (~25 ms at 300 MB/s). A slice always holds at
 * least one record, whatever the page size. */
#define SNAP_SLICE_BYTES (8u << 20)

typedef struct snap_entry_s {
    uint32_t lid;
    uint8_t fmt;
    uint8_t hash[KVD_HASH_BYTES]; /* the binding at collection: a reused id is told apart */
} snap_entry_t;

typedef struct snap_collect_s {
    snap_entry_t *e;
    size_t n, cap;
} snap_collect_t;

static void snap_collect_cb(const kvd_page_info_t *p, void *ud)
{
    snap_collect_t *w = ud;
    if (w->n < w->cap && p->state == KVD_PAGE_SEALED && p->cache) {
        snap_entry_t *e = &w->e[w->n++];
        e->lid = p->logical;
        e->fmt = (uint8_t)p->fmt;
        memcpy(e->hash, p->hash, KVD_HASH_BYTES);
    }
}

struct kvd_snap_writer_s {
    char dir[1024], tmp[1024], fin[1024];
    kvd_snap_ident_t id;
    uint64_t gen, t0;
    int fd;
    snap_collect_t col;
    size_t next;                   /* next entry to copy */
    uint64_t counts[KV_FMT_COUNT]; /* records staged so far, per format */
    uint64_t records, vanished;    /* staged records; entries gone before their copy */
    uint8_t *buf;                  /* the staging buffer: one slice */
    size_t cap, staged;            /* its size; bytes staged and not yet written */
    uint64_t bytes;                /* file bytes (header included) */
    uint8_t hdr[SNAP_HDR];         /* the real header, built when the last slice is staged */
    int last, rc;                  /* everything staged; first error (sticky) */
    int settled;                   /* the end's file work is done (snap_writer_settle) */
    pthread_t settler;             /* the thread that did it (kvd_snap_result_t.settled_here) */
    uint64_t ns;                   /* collection to the end of the settle */
    char err[512];
};

static int snap_writer_fail(kvd_snap_writer_t *w, int rc)
{
    if (w->rc == KV_ERR_OK)
        w->rc = rc;
    return w->rc;
}

int kvd_snap_writer_begin(kvd_snap_writer_t **out, kvd_core_t *c, const char *dir,
                          const kvd_snap_ident_t *id, char *err, size_t errlen)
{
    *out = NULL;
    uint64_t t0 = kvd_mono_ns();
    uint64_t *gens;
    size_t ngen;
    snap_gens_t ref;
    int rc = snap_list(dir, &gens, &ngen, &ref, 0, err, errlen);
    if (rc != KV_ERR_OK)
        return rc;
    /* above the set-aside ones too: reusing a refused generation's number would put a good
     * file and a corrupt one under the same <gen> (and a later refusal would replace it) */
    uint64_t top = ngen ? gens[0] : 0;
    if (ref.n && ref.g[0] > top)
        top = ref.g[0];
    uint64_t gen = top + 1;
    kvd_free(gens);
    kvd_free(ref.g);
    kvd_stats_t st;
    kvd_core_stats(c, &st);
    uint64_t maxpb = id->page_bytes[0] > id->page_bytes[1] ? id->page_bytes[0] : id->page_bytes[1];
    size_t cap = SNAP_SLICE_BYTES;
    if (SNAP_HDR + KVD_SNAP_RECORD_BYTES + maxpb > cap)
        cap = (size_t)(SNAP_HDR + KVD_SNAP_RECORD_BYTES + maxpb);
    kvd_snap_writer_t *w = kvd_calloc(1, sizeof(*w));
    if (w) {
        w->col.cap = (size_t)st.cache_entries;
        w->col.e = w->col.cap ? kvd_calloc(w->col.cap, sizeof(snap_entry_t)) : NULL;
        w->buf = kvd_malloc(cap);
    }
    if (!w || (w->col.cap && !w->col.e) || !w->buf) {
        if (w) {
            kvd_free(w->col.e);
            kvd_free(w->buf);
        }
        kvd_free(w);
        kvd_fmt(err, errlen, "out of memory for the snapshot of %" PRIu64 " pages",
                (uint64_t)st.cache_entries);
        return KV_ERR_NOMEM;
    }
    w->cap = cap;
    w->id = *id;
    w->gen = gen;
    w->t0 = t0;
    if (snprintf(w->dir, sizeof(w->dir), "%s", dir) >= (int)sizeof(w->dir) ||
        !snap_path(w->tmp, sizeof(w->tmp), dir, gen, SNAP_TMP) ||
        !snap_path(w->fin, sizeof(w->fin), dir, gen, SNAP_GEN)) {
        kvd_fmt(err, errlen, "snapshot_dir %.64s... is too long for a file name here", dir);
        kvd_free(w->col.e);
        kvd_free(w->buf);
        kvd_free(w);
        return KV_ERR_INVALID_ARGUMENT;
    }
    kvd_core_cache_foreach(c, snap_collect_cb, &w->col);
    unlink(w->tmp);
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (w->fd < 0) {
        kvd_fmt(err, errlen, "open(%s) failed: %s", w->tmp, strerror(errno));
        kvd_free(w->col.e);
        kvd_free(w->buf);
        kvd_free(w);
        return KV_ERR_IO;
    }
    /* the header's place: zeros until the counts are known (a crash leaves a .tmp, which the
     * next load removes; a zero header is never under a final name) */
    memset(w->buf, 0, SNAP_HDR);
    w->staged = SNAP_HDR;
    w->bytes = SNAP_HDR;
    *out = w;
    return KV_ERR_OK;
}

int kvd_snap_writer_fill(kvd_snap_writer_t *w, kvd_core_t *c)
{
    if (w->rc != KV_ERR_OK || w->last)
        return w->rc;
    /* at most one slice in the buffer: flush must have written the previous one */
    KVD_ASSERT(w->staged == 0 || (w->records == 0 && w->staged == SNAP_HDR));
    while (w->next < w->col.n) {
        const snap_entry_t *e = &w->col.e[w->next];
        kvd_page_info_t pi;
        /* Read by logical id, as the whole-file writer did, but the entry must still be the
         * one collected: sealed, cached, same hash. One evicted meanwhile (its id maybe reused)
         * is left out — the header is written last, with the counts of what was staged. A
         * retiered entry keeps id and hash and is written in its current format. */
        if (kvd_core_page_info(c, e->lid, &pi) != KV_ERR_OK || pi.state != KVD_PAGE_SEALED ||
            !pi.cache || memcmp(pi.hash, e->hash, KVD_HASH_BYTES) != 0) {
            w->vanished++;
            w->next++;
            continue;
        }
        uint64_t pb = w->id.page_bytes[pi.fmt];
        if (w->staged && w->staged + KVD_SNAP_RECORD_BYTES + pb > w->cap)
            break; /* the slice is full */
        uint8_t *rh = w->buf + w->staged, *page = rh + KVD_SNAP_RECORD_BYTES;
        /* a copy, then the CRC over the copy: the file is self-consistent even if a client
         * scribbles over a sealed page in the shared pool meanwhile */
        if (kvd_core_page_read(c, e->lid, page, (size_t)pb) != KV_ERR_OK) {
            kvd_fmt(w->err, sizeof(w->err), "reading page %u failed: %s", e->lid,
                    kvd_core_errmsg(c));
            return snap_writer_fail(w, KV_ERR_IO);
        }
        memset(rh, 0, KVD_SNAP_RECORD_BYTES);
        put32(rh, SNAP_REC_MAGIC);
        put32(rh + 4, (uint32_t)pi.fmt);
        put32(rh + 8, pi.pins > 0 ? KVD_SNAP_REC_PINNED : 0);
        put64(rh + 16, pb);
        memcpy(rh + 24, pi.hash, KVD_HASH_BYTES);
        put32(rh + 56, (uint32_t)w->records);
        put32(rh + 60, kvd_crc32c(kvd_crc32c(0, rh, 60), page, (size_t)pb));
        w->staged += KVD_SNAP_RECORD_BYTES + (size_t)pb;
        w->bytes += KVD_SNAP_RECORD_BYTES + pb;
        w->counts[pi.fmt]++;
        w->records++;
        w->next++;
    }
    if (w->next == w->col.n) {
        w->last = 1;
        snap_header_build(w->hdr, &w->id, w->counts, w->gen);
    }
    return KV_ERR_OK;
}

/* The end of a write: every filesystem call of it that may take long on a big file, done by
 * whoever writes the last slice — the daemon's libuv worker, so none of it stalls the loop
 * (decisions 41, 42). In this order, which is what makes a crash at any point leave the newest or
 * the previous generation loadable:
 *   1. (flush, before this) the header at offset 0, fsync of the .tmp, close: the data is on
 *      disk before any name points at it;
 *   2. rename .tmp -> final name: atomic, so a crash shows the old name or the complete new
 *      file, never a torn one under a final name;
 *   3. fsync of the directory: the rename is durable;
 *   4. only then unlink the generations beyond the two newest (the slow one: unlinking a
 *      400 MB file frees its extents, ~0.3 s on ext4 here). Never before 3: a crash between
 *      a prune and a not-yet-durable rename could otherwise leave one generation only.
 * On an error (any earlier step included) the .tmp is closed and unlinked instead (its
 * unlink may be as slow) and the previous generations are untouched; after a failed
 * directory fsync nothing is pruned (the new file may or may not survive a crash).
 * No core access: only the writer's fd, names and buffers. */
static void snap_writer_settle(kvd_snap_writer_t *w)
{
    if (w->fd >= 0) { /* an error before the last slice's close */
        close(w->fd);
        w->fd = -1;
    }
    if (w->rc == KV_ERR_OK && rename(w->tmp, w->fin) != 0) {
        kvd_fmt(w->err, sizeof(w->err), "rename(%s, %s) failed: %s", w->tmp, w->fin,
                strerror(errno));
        snap_writer_fail(w, KV_ERR_IO);
    }
    if (w->rc != KV_ERR_OK) {
        unlink(w->tmp);
    } else if (snap_writer_fail(w, snap_fsync_dir(w->dir, w->err, sizeof(w->err))) ==
               KV_ERR_OK) {
        uint64_t *gens;
        size_t ngen;
        snap_gens_t ref;
        char ignore[256];
        if (snap_list(w->dir, &gens, &ngen, &ref, 0, ignore, sizeof(ignore)) == KV_ERR_OK) {
            char old[1040];
            for (size_t i = KVD_SNAP_KEEP; i < ngen; i++)
                if (snap_path(old, sizeof(old), w->dir, gens[i], SNAP_GEN))
                    unlink(old);
            /* set-aside files are bounded too, so that repeated refusals cannot fill the disk */
            for (size_t i = KVD_SNAP_KEEP_REFUSED; i < ref.n; i++)
                if (snap_path(old, sizeof(old), w->dir, ref.g[i], SNAP_REFUSED))
                    unlink(old);
            kvd_free(gens);
            kvd_free(ref.g);
        }
    }
    w->ns = kvd_mono_ns() - w->t0;
    w->settler = pthread_self();
    w->settled = 1;
}

int kvd_snap_writer_flush(kvd_snap_writer_t *w)
{
    if (w->settled)
        return w->rc;
    if (w->rc == KV_ERR_OK && w->staged) {
        struct iovec v = {w->buf, w->staged};
        if (write_all(w->fd, w->tmp, &v, 1, w->err, sizeof(w->err)) != KV_ERR_OK)
            snap_writer_fail(w, KV_ERR_IO);
        w->staged = 0;
    }
    if (w->rc == KV_ERR_OK && !w->last)
        return KV_ERR_OK;
    size_t done = 0;
    while (w->rc == KV_ERR_OK && done < SNAP_HDR) {
        ssize_t n = pwrite(w->fd, w->hdr + done, SNAP_HDR - done, (off_t)done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            kvd_fmt(w->err, sizeof(w->err), "pwrite of the header to %s failed: %s", w->tmp,
                    n < 0 ? strerror(errno) : "no progress");
            snap_writer_fail(w, KV_ERR_IO);
        }
        done += n > 0 ? (size_t)n : 0;
    }
    if (w->rc == KV_ERR_OK && fsync(w->fd) != 0) {
        kvd_fmt(w->err, sizeof(w->err), "fsync(%s) failed: %s", w->tmp, strerror(errno));
        snap_writer_fail(w, KV_ERR_IO);
    }
    if (w->rc == KV_ERR_OK) {
        int fd = w->fd;
        w->fd = -1;
        if (close(fd) != 0) {
            kvd_fmt(w->err, sizeof(w->err), "close(%s) failed: %s", w->tmp, strerror(errno));
            snap_writer_fail(w, KV_ERR_IO);
        }
    }
    snap_writer_settle(w);
    return w->rc;
}

int kvd_snap_writer_finished(const kvd_snap_writer_t *w)
{
    return w->settled;
}

uint64_t kvd_snap_writer_generation(const kvd_snap_writer_t *w)
{
    return w->gen;
}

int kvd_snap_writer_run(kvd_snap_writer_t *w, kvd_core_t *c)
{
    for (;;) {
        kvd_snap_writer_flush(w); /* settles after the last slice or at the first error */
        if (w->settled)
            return w->rc;
        kvd_snap_writer_fill(w, c);
    }
}

int kvd_snap_writer_end(kvd_snap_writer_t **pw, kvd_snap_result_t *r, char *err, size_t errlen)
{
    kvd_snap_writer_t *w = *pw;
    *pw = NULL;
    memset(r, 0, sizeof(*r));
    if (!w->settled) { /* ended early: give up the .tmp here (the caller's thread) */
        if (w->rc == KV_ERR_OK) {
            kvd_fmt(w->err, sizeof(w->err), "ended before the last slice was written");
            snap_writer_fail(w, KV_ERR_INTERNAL);
        }
        snap_writer_settle(w);
    }
    int rc = w->rc;
    if (rc != KV_ERR_OK) {
        kvd_fmt(err, errlen, "%s", w->err);
    } else {
        r->generation = w->gen;
        r->pages = w->records;
        r->vanished = w->vanished;
        r->bytes = w->bytes;
        snprintf(r->path, sizeof(r->path), "%s", w->fin);
    }
    r->ns = w->ns;
    r->settled_here = pthread_equal(w->settler, pthread_self()) != 0;
    kvd_free(w->col.e);
    kvd_free(w->buf);
    kvd_free(w);
    return rc;
}

int kvd_snap_write(kvd_core_t *c, const char *dir, const kvd_snap_ident_t *id, kvd_snap_result_t *r,
                   char *err, size_t errlen)
{
    kvd_snap_writer_t *w;
    memset(r, 0, sizeof(*r));
    int rc = kvd_snap_writer_begin(&w, c, dir, id, err, errlen);
    if (rc != KV_ERR_OK)
        return rc;
    kvd_snap_writer_run(w, c);
    return kvd_snap_writer_end(&w, r, err, errlen);
}

/* ---- salt -------------------------------------------------------------------------------- */
int kvd_snap_salt_load(const char *dir, uint8_t salt[KVD_HASH_KEY_BYTES], int *created, char *err,
                       size_t errlen)
{
    *created = 0;
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        kvd_fmt(err, errlen, "mkdir(%s, 0700) failed: %s", dir, strerror(errno));
        return KV_ERR_IO;
    }
    char path[1024];
    snprintf(path, sizeof(path), "%s/salt", dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK); /* a FIFO: refused */
    if (fd < 0 && errno == ENOENT) {
        /* first start on this directory: make the salt, durably, before any snapshot uses it */
        if (sodium_init() < 0) {
            kvd_fmt(err, errlen, "sodium_init() failed");
            return KV_ERR_INTERNAL;
        }
        randombytes_buf(salt, KVD_HASH_KEY_BYTES);
        /* written as salt.tmp and renamed: created in place, a crash between the open and the
         * fsync left a short salt that every later start refused (a crash loop until an
         * operator deleted it). A leftover salt.tmp was never used by any snapshot; it is
         * removed and the file made anew (O_EXCL): opened with O_TRUNC it kept its own mode
         * and owner, so a 0644 leftover put this run's salt in a file others could read, and
         * every later start refused it. */
        char tmp[1040];
        snprintf(tmp, sizeof(tmp), "%s.tmp", path);
        unlink(tmp);
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd < 0) {
            kvd_fmt(err, errlen, "creating %s failed: %s", tmp, strerror(errno));
            return KV_ERR_IO;
        }
        struct iovec v = {salt, KVD_HASH_KEY_BYTES};
        int rc = write_all(fd, tmp, &v, 1, err, errlen);
        if (rc == KV_ERR_OK && fsync(fd) != 0) {
            kvd_fmt(err, errlen, "fsync(%s) failed: %s", tmp, strerror(errno));
            rc = KV_ERR_IO;
        }
        close(fd);
        if (rc == KV_ERR_OK && rename(tmp, path) != 0) {
            kvd_fmt(err, errlen, "rename(%s, %s) failed: %s", tmp, path, strerror(errno));
            rc = KV_ERR_IO;
        }
        if (rc == KV_ERR_OK)
            rc = snap_fsync_dir(dir, err, errlen);
        if (rc != KV_ERR_OK) {
            unlink(tmp);
            unlink(path);
            sodium_memzero(salt, KVD_HASH_KEY_BYTES);
            return rc;
        }
        *created = 1;
        return KV_ERR_OK;
    }
    if (fd < 0) {
        kvd_fmt(err, errlen, "open(%s) failed: %s", path, strerror(errno));
        return KV_ERR_IO;
    }
    struct stat st;
    int rc = KV_ERR_OK;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != KVD_HASH_KEY_BYTES ||
        fcntl(fd, F_SETFL, 0) != 0) {
        kvd_fmt(err, errlen, "%s must be a regular file of exactly %d bytes", path,
                KVD_HASH_KEY_BYTES);
        rc = KV_ERR_IO;
    } else if (st.st_uid != geteuid() || (st.st_mode & 077)) {
        kvd_fmt(err, errlen,
                "%s is mode %03o owned by uid %u: the namespace salt must be readable by the "
                "daemon's user only (chown it to uid %u and chmod 600)",
                path, (unsigned)(st.st_mode & 0777), (unsigned)st.st_uid, (unsigned)geteuid());
        rc = KV_ERR_PERMISSION_DENIED;
    } else {
        snap_src_t s = {.fd = fd, .size = KVD_HASH_KEY_BYTES};
        rc = src_read(&s, salt, KVD_HASH_KEY_BYTES, err, errlen);
    }
    close(fd);
    if (rc != KV_ERR_OK)
        sodium_memzero(salt, KVD_HASH_KEY_BYTES);
    return rc;
}
