/* stats.h — every counter and gauge of the daemon core, defined ONCE (memcached's stats X-macro:
 * "no longer have to add new stats in 3+ places").
 *
 * KVD_STATS_MAP(XX)      scalar figures: XX(field, KIND, "help")
 * KVD_STATS_FMT_MAP(XX)  per-format figures, arrays [KV_FMT_COUNT]: XX(field, KIND, "help")
 *
 * KIND is COUNTER (monotone since start) or GAUGE (a current value). The struct below, the
 * Prometheus output of the daemon (metric kvd_<field>, per-format ones with label
 * format="fp8"|"tq3") and kvctl's listing all iterate these tables; nothing else lists stats.
 * The lifecycle_* figures belong to the lifecycle controller (lifecycle.h), not the core:
 * kvd_core_stats leaves them 0 and kvd_lc_stats fills them in. Likewise the snapshot* figures
 * belong to the daemon's persistence (server.c with kvd/snapshot.c); cache_restored is the
 * core's (kvd_core_cache_restore). replies_dropped is the server's (server.c, reply_hwm).
 */
#ifndef KVD_STATS_H
#define KVD_STATS_H

#include <stdint.h>

#include "kv_format.h"

#define KVD_STATS_MAP(XX)                                                                          \
    XX(epoch, GAUGE, "current epoch of the daemon (every reply carries it)")                       \
    XX(min_safe_epoch, GAUGE, "smallest epoch reported by a live session (retired pages "          \
                              "stamped at or below it are freed)")                                 \
    XX(sessions, GAUGE, "live sessions")                                                           \
    XX(sessions_opened, COUNTER, "sessions opened")                                                \
    XX(sessions_closed, COUNTER, "sessions closed (process exit or goodbye)")                      \
    XX(sequences, GAUGE, "live sequences")                                                         \
    XX(request_refs, GAUGE, "request references held by sessions (loose + in sequences)")         \
    XX(alloc_calls, COUNTER, "alloc requests")                                                     \
    XX(alloc_pages, COUNTER, "pages handed out by alloc")                                          \
    XX(alloc_exhausted, COUNTER, "alloc requests refused with RESOURCE_EXHAUSTED")                 \
    XX(release_refs, COUNTER, "request references released explicitly")                           \
    XX(reclaimed_refs, COUNTER, "request references dropped by session close")                     \
    XX(reclaimed_open_pages, COUNTER, "unsealed pages freed by session close")                     \
    XX(seals, COUNTER, "pages sealed and bound in the prefix index")                               \
    XX(seal_dedupes, COUNTER, "seals whose hash was already bound (caller switched to canonical)") \
    XX(seal_collisions, COUNTER, "seals not bound: 64-bit index key collided with another hash")   \
    XX(lookups, COUNTER, "prefix lookups")                                                         \
    XX(lookup_pages_asked, COUNTER, "full pages asked by lookups")                                 \
    XX(lookup_pages_hit, COUNTER, "pages returned by lookups")                                     \
    XX(lookup_pages_hashed, COUNTER,                                                               \
       "lookup hits found by recomputing the chain hash (not in the lookup memo)")                 \
    XX(lookup_tokens_asked, COUNTER, "tokens asked by lookups")                                    \
    XX(lookup_tokens_hit, COUNTER, "tokens covered by returned pages")                             \
    XX(cache_entries, GAUGE, "entries bound in the prefix index")                                  \
    XX(evictions_pressure, COUNTER, "cache entries evicted to satisfy an allocation")              \
    XX(evictions_quota, COUNTER, "cache entries evicted to stay under the cache quota")            \
    XX(evictions_admin, COUNTER, "cache entries evicted by the operator")                          \
    XX(pins, GAUGE, "pin references held")                                                         \
    XX(pin_changes, COUNTER, "pins and unpins (a moved pin changes the cache to be saved)")        \
    XX(retiers, COUNTER, "FP8 -> TQ3 conversions published")                                       \
    XX(promotes, COUNTER, "TQ3 -> FP8 conversions published")                                     \
    XX(conversion_failures, COUNTER, "conversions that failed (source kept)")                      \
    XX(retier_ns, COUNTER, "ns spent in published FP8 -> TQ3 conversions, wait included "        \
                           "(divide by retiers for the mean)")                                     \
    XX(promote_ns, COUNTER, "ns spent in published TQ3 -> FP8 conversions, wait included")        \
    XX(dir_syncs, COUNTER, "pushes of directory entries to the backend's shared copy (cuda: the "  \
                           "device directory; 0 on host, where the directory is shared memory)")   \
    XX(dir_sync_entries, COUNTER, "directory entries pushed by those")                             \
    XX(dir_sync_ns, COUNTER, "ns the daemon spent in those pushes (real clock, device wait "      \
                             "included)")                                                          \
    XX(retired_pages, COUNTER, "physical pages put on the retire list")                            \
    XX(collected_pages, COUNTER, "retired physical pages returned to a free list")                 \
    XX(logical_free, GAUGE, "free logical page ids")                                               \
    XX(logical_total, GAUGE, "logical page ids (directory entries)")                              \
    XX(events_published, COUNTER, "index event entries published (kvd/events.c; 0 while "       \
                                  "events_endpoint is empty)")                                     \
    XX(events_batches, COUNTER, "index event messages published (one per loop iteration with "   \
                                "changes, or per events_batch entries)")                           \
    XX(events_dropped, COUNTER, "index event entries lost before the socket (out of memory, "     \
                                "send error); their sequence numbers are skipped")                 \
    XX(events_seq, GAUGE, "sequence number of the last event message (subscribers compare)")      \
    XX(lifecycle_ticks, COUNTER, "lifecycle controller ticks run (0 while lifecycle_ms = 0)")     \
    XX(lifecycle_tick_ns, COUNTER, "ns spent in lifecycle ticks, conversions included")           \
    XX(lifecycle_tick_ns_max, GAUGE, "longest lifecycle tick since start, in ns")                 \
    XX(lifecycle_window, GAUGE, "effective Recent window in pages (recent_pages, less when the "  \
                                "FP8 pool is under pressure)")                                     \
    XX(lifecycle_window_shrinks, COUNTER, "times FP8 pressure halved the Recent window")          \
    XX(lifecycle_backlog, GAUGE, "conversions the last tick wanted but left for later ticks")     \
    XX(lifecycle_skipped_tq3_full, COUNTER, "ticks whose retiers stopped: TQ3 pool full and "     \
                                            "nothing evictable (pages stay FP8)")                  \
    XX(lifecycle_skipped_fp8_full, COUNTER, "ticks whose promotes stopped: no FP8 page free")    \
    XX(cache_restored, COUNTER, "cache entries restored from a snapshot at start")                \
    XX(snapshots_written, COUNTER, "snapshots written (docs/snapshot.md)")                        \
    XX(snapshot_failures, COUNTER, "snapshot writes that failed (previous generations kept)")     \
    XX(snapshot_pages, GAUGE, "pages in the last snapshot written")                               \
    XX(snapshot_bytes, GAUGE, "bytes of the last snapshot written")                               \
    XX(snapshot_ms, GAUGE, "duration of the last snapshot write in ms")                           \
    XX(snapshot_requests_during, COUNTER, "requests answered while a snapshot (periodic or "      \
       "kvctl) was being written off the loop")                                                   \
    XX(snapshot_in_flight, GAUGE, "1 while a snapshot (periodic or kvctl) is being written off "  \
                                  "the loop")                                                      \
    XX(snapshot_slices, COUNTER, "snapshot slices (<= 8 MiB each) written by the worker thread")  \
    XX(snapshot_ends_on_loop, COUNTER, "off-loop snapshots whose end (fsync, rename, unlink of "  \
       "the oldest generation) ran on the loop thread: no worker (0 normally)")                   \
    XX(snapshot_load_pages, GAUGE, "pages restored from a snapshot at start")                     \
    XX(snapshot_load_skipped, GAUGE, "valid snapshot pages not restored at start (no room)")      \
    XX(snapshot_load_refused, GAUGE, "snapshot generations refused at start (corrupt or "         \
                                     "mismatched; the log names file and reason)")                 \
    XX(snapshot_load_ms, GAUGE, "duration of the snapshot load at start in ms")                   \
    XX(replies_dropped, COUNTER, "replies not sent: the client connection already had reply_hwm " \
                                 "replies unread (its requests took effect; the log names it)")

#define KVD_STATS_FMT_MAP(XX)                                                                      \
    XX(pages_total, GAUGE, "physical pages in the pool")                                          \
    XX(pages_free, GAUGE, "physical pages on the free list")                                       \
    XX(pages_open, GAUGE, "live unsealed (request-owned, writable) pages")                         \
    XX(pages_sealed, GAUGE, "live sealed (immutable) pages")                                       \
    XX(pages_cached, GAUGE, "live pages bound in the prefix index")                                \
    XX(pages_lru, GAUGE, "cached pages with no other reference (evictable, on the LRU)")           \
    XX(pages_pinned, GAUGE, "pinned pages")                                                        \
    XX(pages_referenced, GAUGE, "live pages held by at least one request reference")               \
    XX(pages_retired, GAUGE, "pages on the retire list waiting for an epoch")                      \
    XX(page_bytes, GAUGE, "bytes of one page")                                                     \
    XX(bytes_total, GAUGE, "bytes of the pool")                                                    \
    XX(bytes_used, GAUGE, "bytes of pages not on the free list")                                  \
    XX(cache_quota_pages, GAUGE, "cache quota in pages")

typedef struct kvd_stats_s {
#define KVD_STATS_FIELD_(name, kind, help) uint64_t name;
    KVD_STATS_MAP(KVD_STATS_FIELD_)
#undef KVD_STATS_FIELD_
#define KVD_STATS_FMT_FIELD_(name, kind, help) uint64_t name[KV_FMT_COUNT];
    KVD_STATS_FMT_MAP(KVD_STATS_FMT_FIELD_)
#undef KVD_STATS_FMT_FIELD_
} kvd_stats_t;

/* "fp8" / "tq3": the label value used for per-format figures. */
static inline const char *kvd_fmt_name(int f)
{
    return f == KV_FMT_FP8 ? "fp8" : f == KV_FMT_TQ3 ? "tq3" : "unknown";
}

#endif /* KVD_STATS_H */
