/* config.h — the daemon's one configuration table.
 *
 * KVD_CONFIG_MAP is the single source of truth for every directive (Redis createIntConfig
 * habit): name, type, bounds (integers) or choices (strings), default, whether it may change at
 * runtime (kvctl config set), and the help line. From it come: the struct fields, the defaults,
 * the config file parser (`key = value` lines, `#` comments), the command-line flags
 * (`--key value`), `kvd --help`, `kvd --check-config FILE`, and the admin config get/set RPCs.
 * deploy/kvd.conf documents every row; tests/integration checks --help lists them all.
 *
 * Types: U64 (decimal, bounds inclusive), STR (choices "a|b" when non-empty), BOOL
 * (yes/no/true/false/on/off/1/0), IDS (comma separated uids/gids, may be empty; max is the
 * most ids it may hold).
 * Check: a value test beyond type and bounds (kvd_cfg_chk_<check> in config.c; `none`), for
 * what the daemon would otherwise refuse only at startup (an endpoint scheme, a group name):
 * kvd --check-config then names FILE:LINE, and startup names the line or the --flag too.
 * Thread: the daemon has one thread; nothing here locks.
 */
#ifndef KVD_CONFIG_H
#define KVD_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "lifecycle.h" /* KVD_LC_DEFAULT_*: the lifecycle rows' defaults */

#define KVD_CFG_STR_(x) #x
#define KVD_CFG_STR(x) KVD_CFG_STR_(x)

/*  XX(name, type, min, max, choices, default, runtime-mutable, check, help) */
#define KVD_CONFIG_MAP(XX)                                                                         \
    XX(endpoint, STR, 0, 0, "", "ipc:///run/kvd/kvd.sock", 0, ipc,                                 \
       "ZeroMQ endpoint (ipc:///ABSOLUTE/PATH; the directory is created 0700; fds go on "          \
       "PATH.fds)")                                                                                \
    XX(backend, STR, 0, 0, "host|cuda", "host", 0, none, "pool backend: host (memfd) or cuda")     \
    XX(namespace, STR, 0, 0, "", "default", 0, none, "model namespace served by this daemon")      \
    XX(layers, U64, 1, 1024, "", "4", 0, none, "model layers")                                     \
    XX(kv_heads, U64, 1, 256, "", "8", 0, none, "KV heads")                                        \
    XX(head_dim, U64, 64, 256, "64|128|256", "128", 0, none, "head dimension (64, 128 or 256)")    \
    XX(page_tokens, U64, 1, 4096, "", "16", 0, none, "tokens per page")                            \
    XX(seed, U64, 0, UINT64_MAX, "", "1", 0, none, "rotation seed of the namespace")               \
    XX(pages_fp8, U64, 1, 16777216, "", "1024", 0, none, "physical pages in the FP8 pool")         \
    XX(pages_tq3, U64, 0, 16777216, "", "1024", 0, none, "physical pages in the TQ3 pool")         \
    XX(cache_quota, U64, 0, 16777216, "", "0", 1, none,                                            \
       "max sealed cache pages kept unreferenced per format (0: bounded by the pool only)")        \
    XX(admit_uids, IDS, 0, 64, "", "", 0, none,                                                    \
       "uids admitted by the ZAP handler, comma separated (empty: the daemon's own uid)")          \
    XX(admit_gids, IDS, 0, 64, "", "", 0, none, "gids admitted in addition to admit_uids")         \
    XX(socket_group, STR, 0, 0, "", "", 0, group,                                                  \
       "group given access to the socket files (directory 0750, sockets 0660; empty: owner "       \
       "only, 0700/0600); admission is still admit_uids/admit_gids")                               \
    XX(lease_ms, U64, 100, 86400000, "", "10000", 1, none,                                         \
       "a session silent this long is reported lease-expired (its pages are kept)")                \
    XX(epoch_ms, U64, 1, 60000, "", "10", 1, none,                                                 \
       "period of the epoch / deferred-free collector")                                            \
    XX(max_msg_bytes, U64, 0, UINT64_MAX, "", "0", 0, none,                                        \
       "largest control message in bytes, ZMQ_MAXMSGSIZE (a bigger one drops its connection); "    \
       "0: the largest request max_tokens, page_tokens and the pools allow, plus 4 KiB, "          \
       "computed at startup (4198695 with the defaults); >= 2^63: unlimited")                     \
    XX(reply_hwm, U64, 0, 1048576, "", "256", 0, none,                                             \
       "replies queued per client connection that does not read them; beyond it a reply is "      \
       "dropped, logged and counted (replies_dropped); 0: unlimited")                             \
    XX(request_hwm, U64, 0, 1048576, "", "16", 0, none,                                            \
       "requests queued per client connection before kvd stops reading that connection (the "     \
       "client waits: nothing is lost); 0: unlimited")                                            \
    XX(max_alloc, U64, 1, 1048576, "", "4096", 1, none, "max pages in one alloc request")          \
    XX(max_tokens, U64, 1, 67108864, "", "1048576", 1, none, "max tokens in one lookup request")   \
    XX(max_sessions_per_pid, U64, 1, 65536, "", "64", 1, none,                                     \
       "sessions one process may hold (each has a pidfd; they end when it exits)")                 \
    XX(lifecycle_ms, U64, 0, 3600000, "", "100", 1, none,                                          \
       "period of the lifecycle controller (retier/promote) in ms (0: off)")                       \
    XX(recent_pages, U64, 1, 16777216, "", KVD_CFG_STR(KVD_LC_DEFAULT_RECENT_PAGES), 1, none,      \
       "Recent window: the last N pages of each sequence stay FP8")                                \
    XX(anchor_pages, U64, 0, 16777216, "", KVD_CFG_STR(KVD_LC_DEFAULT_ANCHOR_PAGES), 1, none,      \
       "Anchor sinks: the first N pages of each sequence stay FP8")                                \
    XX(retier_batch, U64, 1, 65536, "", KVD_CFG_STR(KVD_LC_DEFAULT_BATCH), 1, none,                \
       "max conversions per lifecycle tick (one batch; it blocks the loop)")                       \
    XX(fp8_low_watermark, U64, 0, 100, "", KVD_CFG_STR(KVD_LC_DEFAULT_FP8_LOW_PCT), 1, none,       \
       "FP8 free+evictable+retiring pages below this % of the pool halve the Recent window")       \
    XX(cache_retier_ms, U64, 0, 604800000, "", "0", 1, none,                                       \
       "sealed FP8 pages cached but unused this long go TQ3 (0: never, LRU eviction only)")        \
    XX(events_endpoint, STR, 0, 0, "", "", 0, pub,                                                 \
       "PUB endpoint of index events for KV-aware routers (ipc://PATH or tcp://HOST:PORT; "        \
       "empty: off)")                                                                              \
    XX(events_hwm, U64, 0, 1048576, "", "4096", 0, none,                                           \
       "event messages (each at most 16 KiB) queued per subscriber (4096: at most ~64 MiB); "      \
       "beyond it a slow subscriber loses messages and sees a sequence gap; 0: unlimited")         \
    XX(events_batch, U64, 1, 65536, "", "1024", 1, none,                                           \
       "max index event entries per published message, which also stops at 16 KiB (one "          \
       "message per loop iteration below)")                                                        \
    XX(events_tokens, BOOL, 0, 0, "", "yes", 1, none,                                              \
       "STORED events carry the page's token ids and extra (routers need them: chain hashes are "  \
       "keyed by the secret namespace salt)")                                                      \
    XX(metrics_port, U64, 0, 65535, "", "0", 0, none, "Prometheus HTTP port (0: off)")             \
    XX(metrics_addr, STR, 0, 0, "", "127.0.0.1", 0, ipaddr, "address the metrics port binds")      \
    XX(snapshot_dir, STR, 0, 0, "", "", 0, none,                                                   \
       "durable prefix cache directory (made 0700; holds the salt and two snapshot generations; "  \
       "empty: persistence off, the cache starts empty; docs/snapshot.md)")                        \
    XX(snapshot_ms, U64, 0, 604800000, "", "0", 1, none,                                           \
       "period of cache snapshots in ms when the cache changed (0: only on SIGTERM and kvctl "     \
       "snapshot)")                                                                                \
    XX(log_level, STR, 0, 0, "error|warn|info|debug", "info", 1, none, "log verbosity")

typedef enum kvd_ctype_e { KVD_CT_U64, KVD_CT_STR, KVD_CT_BOOL, KVD_CT_IDS } kvd_ctype_t;

typedef struct kvd_config_s {
#define KVD_CFG_FIELD_U64(n) uint64_t n;
#define KVD_CFG_FIELD_STR(n) char *n;
#define KVD_CFG_FIELD_BOOL(n) int n;
#define KVD_CFG_FIELD_IDS(n) char *n;
#define KVD_CFG_FIELD_(n, t, lo, hi, ch, def, mut, chk, help) KVD_CFG_FIELD_##t(n)
    KVD_CONFIG_MAP(KVD_CFG_FIELD_)
#undef KVD_CFG_FIELD_
} kvd_config_t;

typedef struct kvd_config_desc_s {
    const char *name;
    kvd_ctype_t type;
    uint64_t min, max;
    const char *choices; /* "" or "a|b|c" */
    const char *def;
    int mutable_;
    const char *help;
    size_t offset;
    /* NULL, or (STR and IDS rows): 0 when value is acceptable, else non-zero with err naming
     * the key and what is wrong */
    int (*check)(const char *key, const char *value, char *err, size_t cap);
} kvd_config_desc_t;

size_t kvd_config_count(void);
const kvd_config_desc_t *kvd_config_desc(size_t i);
const kvd_config_desc_t *kvd_config_find(const char *key);
const char *kvd_config_type_name(kvd_ctype_t t);

/* Fill every field with its default. 0, or -1 on allocation failure. */
int kvd_config_init(kvd_config_t *c);
void kvd_config_free(kvd_config_t *c);

enum { KVD_CFG_OK = 0, KVD_CFG_UNKNOWN = -1, KVD_CFG_BAD_VALUE = -2, KVD_CFG_IMMUTABLE = -3 };
/* Parse and store one value. runtime=1 refuses keys that are not runtime-mutable. On error
 * err gets a message naming the key and what is accepted. */
int kvd_config_set(kvd_config_t *c, const char *key, const char *value, int runtime, char *err,
                   size_t cap);
/* Current value as text (what the file would contain). */
int kvd_config_get(const kvd_config_t *c, const char *key, char *buf, size_t cap);
/* Parse a config file. Returns the number of errors; each goes to `report` (when non-NULL) as
 * "FILE:LINE: key 'k': message". Parsing continues after an error so one run shows them all.
 * A path that is not a regular file (a directory, a FIFO) is one error; a directive set twice
 * is an error on the second line ("FILE:LINE: 'k' already set at line N"), which is ignored. */
int kvd_config_load_file(kvd_config_t *c, const char *path, FILE *report);
/* Write `--key VALUE  help [default]` lines for every directive; VALUE is the choices, the
 * bounds MIN..MAX of an integer, or the type. */
void kvd_config_help(FILE *f);
/* Parse an IDS value into out[] (at most cap entries); returns the count or -1. */
int kvd_config_ids(const char *s, uint32_t *out, int cap);

#endif /* KVD_CONFIG_H */
