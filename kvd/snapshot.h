/* snapshot.h — the durable prefix cache: write the cached sealed pages to disk, reload them at
 * start (DESIGN.md "Prefix cache"; the byte format and the rules are in docs/snapshot.md).
 *
 * Files in the snapshot directory (made 0700 when missing):
 *
 *   salt                        the namespace salt (32 random bytes, 0600), created once. The
 *                               chain hashes in a snapshot are only findable with the salt
 *                               that made them, so the salt persists with the snapshots.
 *   cache.<gen>.snap            one generation: header + one record per cached page (0600).
 *                               <gen> is 20 decimal digits, so names sort like generations.
 *   cache.<gen>.snap.tmp        a write in progress (a crash leaves one; removed at load).
 *   cache.<gen>.snap.refused    a generation the loader refused as corrupt (MALFORMED: CRC,
 *                               a bad field, truncated), renamed out of the generations so the
 *                               next write does not keep it in place of the older one that
 *                               loaded; kept for inspection, the writer prunes all but the
 *                               KVD_SNAP_KEEP_REFUSED newest. Never loaded, never counted as a
 *                               generation; new generations are numbered above them. A file
 *                               of another identity (GEOMETRY_MISMATCH) is left as it is.
 *
 * Write: collect the cache (kvd_core_cache_foreach, LRU head first), then slice by slice copy
 * the pages and build their records (loop thread) and write them to the .tmp file (any thread:
 * no core access), the header last (pwrite at offset 0, with the counts of what was written),
 * fsync, rename it over its final name, fsync the directory, then delete every generation but
 * the two newest, and every .refused file but the two newest — all of that after the copy on
 * the thread that writes the last slice. A failure at any step removes the .tmp file and keeps
 * what was there: a crash leaves either the old generations or the new one, never a torn file
 * under a final name.
 *
 * Load: generations newest first. Each file is checked completely — header fields, identity
 * (geometry, page bytes per format, format/hash/layout versions, namespace, salt), its size
 * against the counts, every record's CRC32C — and refused with a reason naming the file when
 * anything is off; the next older generation is tried, then the cache starts empty. A file
 * refused as MALFORMED is renamed to .refused first (above; the log line says so, or why the
 * rename failed, in which case it stays where it was). Records go into fresh pages
 * (kvd_core_cache_restore); an error in the middle of a file releases every page that file
 * restored before the next generation is tried: never half a generation.
 *
 * Every field read from a file is untrusted. The parser (kvd_snap_parse_buf, also what the
 * fuzz target tests/fuzz/fuzz_snapshot.c drives) checks bounds before arithmetic, all in 64
 * bits, and never allocates more than one page of the expected size.
 *
 * Thread rule: the daemon's loop thread (it calls into the core), except
 * kvd_snap_writer_flush, which touches only the writer's file, names and buffer and may run on
 * a worker thread (one at a time, never concurrently with fill/end on the same writer).
 * kvd_snap_write blocks for the whole write (the daemon's SIGTERM snapshot); the periodic and
 * the kvctl snapshots use the writer so that the loop only blocks for one slice's copy at a
 * time (docs/snapshot.md gives measured figures; docs/decisions.md 41, 42).
 */
#ifndef KVD_SNAPSHOT_H
#define KVD_SNAPSHOT_H

#include <stddef.h>
#include <stdint.h>

#include "core.h"
#include "kv_format.h"

/* Versions in the header; each mismatch refuses a file with its own reason. FORMAT: this
 * file's layout (snapshot.c). HASH: the chain hash, BLAKE2b-256(salt || prev || tokens u32 LE
 * || extra) (docs/core.md). LAYOUT: the FP8/TQ3 page layouts of cuda/kv_format.h and the TQ3
 * codebook — kv_format.h owns that number (KV_LAYOUT_VERSION, bumped with the layouts), so a
 * layout change cannot forget the snapshot. Bump the one whose meaning changes. */
#define KVD_SNAP_FORMAT_VERSION 1u
#define KVD_SNAP_HASH_VERSION   1u
#define KVD_SNAP_LAYOUT_VERSION KV_LAYOUT_VERSION
#define KVD_SNAP_HEADER_BYTES   160u
#define KVD_SNAP_RECORD_BYTES   64u /* record header; the page's bytes follow */
#define KVD_SNAP_ID_BYTES       16u
#define KVD_SNAP_KEEP           2            /* generations kept */
#define KVD_SNAP_KEEP_REFUSED   2            /* set-aside (.refused) files kept */
#define KVD_SNAP_MAX_PAGES      (1ull << 32) /* a count above this is refused before any I/O */

/* What a snapshot must match to be loaded (and what a written one records). */
typedef struct kvd_snap_ident_s {
    kv_geom_t geom;
    uint64_t page_bytes[KV_FMT_COUNT];
    uint8_t salt_id[KVD_SNAP_ID_BYTES]; /* keyed fingerprint of the salt (not the salt) */
    uint8_t ns_id[KVD_SNAP_ID_BYTES];   /* BLAKE2b of the namespace name */
} kvd_snap_ident_t;

/* Identity of the daemon's namespace: geometry and page bytes from the core's export, the
 * fingerprints from the namespace name and the salt. */
void kvd_snap_ident(kvd_snap_ident_t *id, const kvd_core_t *c, const char *namespace_,
                    const uint8_t salt[KVD_HASH_KEY_BYTES]);

/* Create dir (0700) if missing; read dir/salt, or create it (32 random bytes, mode 0600,
 * O_EXCL, fsync'd with the directory) when absent. Refused (KV_ERR_IO /
 * KV_ERR_PERMISSION_DENIED) when the file is not a regular file of exactly 32 bytes owned by
 * this uid or when group/other may read it — a leaked salt lets anyone compute this
 * namespace's hashes. *created = 1 when it was made now. */
int kvd_snap_salt_load(const char *dir, uint8_t salt[KVD_HASH_KEY_BYTES], int *created, char *err,
                       size_t errlen);

typedef struct kvd_snap_result_s {
    uint64_t generation;
    uint64_t pages;    /* written, or restored */
    uint64_t vanished; /* write: collected entries evicted before their slice was copied */
    uint64_t skipped;  /* load: valid records not restored (no free page or quota room) */
    uint64_t bytes;    /* file bytes */
    uint64_t ns;       /* wall time of the whole call */
    uint32_t refused;  /* load: generations refused before one loaded (or none was left) */
    int settled_here;  /* write: the end's file work (fsync, rename, directory fsync, pruning,
                        * or the .tmp's unlink) ran on the thread that called end (always 1
                        * for kvd_snap_write; 0 when a worker's flush did it) */
    char path[1024];   /* the file written or loaded ("" when none) */
} kvd_snap_result_t;

/* Write a new generation of every cached page. KV_ERR_OK, or IO / NOMEM / DEVICE with a
 * message naming the call and the file; on failure the previous generations are untouched. */
int kvd_snap_write(kvd_core_t *c, const char *dir, const kvd_snap_ident_t *id, kvd_snap_result_t *r,
                   char *err, size_t errlen);

/* The incremental writer (kvd_snap_write is begin + run + end). A writer holds the open .tmp
 * file, the entries collected at begin and one staging buffer of at most max(8 MiB, one
 * record) bytes.
 *   begin   (loop) list generations, collect the cache, open cache.<gen>.snap.tmp (O_EXCL).
 *   fill    (loop) copy the next slice of pages into the buffer with records and CRCs; an
 *           entry no longer cached under the collected hash is left out (counted in
 *           vanished). Call only when the previous slice was flushed. When every entry is
 *           staged, the header (with the final counts) is built too.
 *   flush   (ANY thread, no core access) write the staged slice; after the last one pwrite
 *           the header at offset 0, fsync, close, rename, fsync the directory, then delete
 *           all but the two newest generations (the slow part on a big file: it belongs off
 *           the loop). After an error (fill's included) it closes and removes the .tmp
 *           instead and keeps the previous generations. Either way the writer is finished.
 *   finished  1 once a flush did that end work (or end did it for a writer ended early).
 *   run     (loop) flush and fill until finished: the rest of the write, synchronously.
 *   end     (loop) fill *r, free the writer; no filesystem call unless the writer was not
 *           finished (ended early: the .tmp is removed, KV_ERR_INTERNAL).
 * fill and flush return KV_ERR_OK or the writer's first error (sticky; end reports it). */
typedef struct kvd_snap_writer_s kvd_snap_writer_t;
int kvd_snap_writer_begin(kvd_snap_writer_t **out, kvd_core_t *c, const char *dir,
                          const kvd_snap_ident_t *id, char *err, size_t errlen);
int kvd_snap_writer_fill(kvd_snap_writer_t *w, kvd_core_t *c);
int kvd_snap_writer_flush(kvd_snap_writer_t *w);
int kvd_snap_writer_finished(const kvd_snap_writer_t *w);
int kvd_snap_writer_run(kvd_snap_writer_t *w, kvd_core_t *c);
uint64_t kvd_snap_writer_generation(const kvd_snap_writer_t *w);
int kvd_snap_writer_end(kvd_snap_writer_t **pw, kvd_snap_result_t *r, char *err, size_t errlen);

/* Called once per refused generation with a line "FILE: reason" (for the log), plus
 * "; set aside as FILE.refused" or "; could not set it aside, left in place: …" when the
 * file was refused as corrupt. */
typedef void (*kvd_snap_log_fn)(void *ud, const char *line);

/* Load the newest generation that passes every check (see the top). Returns KV_ERR_OK also
 * when nothing was loaded (empty directory, or every generation refused: r->pages == 0,
 * r->refused says how many); an error only for the directory itself (IO). */
int kvd_snap_load(kvd_core_t *c, const char *dir, const kvd_snap_ident_t *id, kvd_snap_log_fn log,
                  void *log_ud, kvd_snap_result_t *r, char *err, size_t errlen);

/* Load one file into the core, all or nothing. On any failure every page it restored is
 * evicted again and the message says why. Errors: IO (open, read, short file), MALFORMED
 * (a check failed), GEOMETRY_MISMATCH (identity differs), and the core's restore errors. */
int kvd_snap_load_file(kvd_core_t *c, const char *path, const kvd_snap_ident_t *id,
                       kvd_snap_result_t *r, char *err, size_t errlen);

/* The parser alone, over bytes in memory: header checks against `want`, size against counts,
 * then fn once per record whose CRC checked (fn returns KV_ERR_OK to go on). Returns KV_ERR_OK
 * when the whole buffer is a valid snapshot, else the first failure with a message. */
typedef int (*kvd_snap_record_fn)(void *ud, const uint8_t hash[KVD_HASH_BYTES], kv_fmt_t f,
                                  uint32_t flags, const uint8_t *bytes, uint64_t len);
int kvd_snap_parse_buf(const uint8_t *buf, size_t len, const kvd_snap_ident_t *want,
                       kvd_snap_record_fn fn, void *ud, char *err, size_t errlen);

/* Record flags. */
#define KVD_SNAP_REC_PINNED 0x1u /* the entry was pinned: restored with one pin */

/* CRC32C (Castagnoli, reflected 0x82F63B78), table-driven (slicing by 8): start with crc = 0;
 * kvd_crc32c(0, "123456789", 9) == 0xE3069283. Chains: crc32c(crc32c(0, a), b) == crc of a||b. */
uint32_t kvd_crc32c(uint32_t crc, const void *buf, size_t len);

#endif /* KVD_SNAPSHOT_H */
