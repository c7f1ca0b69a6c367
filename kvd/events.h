/* events.h — the index event publisher: a ZeroMQ PUB socket that tells an external KV-aware
 * router which chain hashes this daemon holds (DESIGN.md "Control protocol"; the Event message
 * of proto/kvd.proto; docs/protocol.md "Index events").
 *
 * The core knows nothing of ZeroMQ: it calls a hook (kvd_core_set_index_hook) on every index
 * change; kvd_events_hook copies the change into a pending batch. The batch is published as
 * ONE message [namespace][Event] before the loop next sleeps — a uv_check handle after the poll
 * phase (what the requests of one ROUTER drain changed goes out together) and a uv_prepare
 * handle before it (what timers, e.g. a lifecycle tick, changed) — or as soon as it holds
 * `batch_max` entries or KVD_EVENTS_MSG_BYTES. Each message carries the next sequence number; an
 * entry that cannot be
 * queued or sent (allocation failure, send error) burns a sequence number so that subscribers
 * see a gap, exactly as they do when PUB drops under its high-water mark.
 *
 * Memory: PUB queues up to `hwm` messages for each subscriber that does not read. A message is
 * at most KVD_EVENTS_MSG_BYTES (or one entry, when a single STORED entry is larger: token ids
 * of a page over ~3200 tokens), whatever events_batch, page_tokens and events_tokens are, so a
 * stuck subscriber costs the daemon at most hwm × KVD_EVENTS_MSG_BYTES (decision 55:
 * 4096 × 16 KiB = 64 MiB with the defaults, where 10000 messages of up to 1024 entries of
 * ~425 bytes were ~4.3 GB).
 *
 * Thread: the loop thread only (the hook runs inside core calls on that thread).
 */
#ifndef KVD_EVENTS_H
#define KVD_EVENTS_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "core.h"
#include "stats.h"

typedef struct kvd_events_s kvd_events_t;

/* Encoded Event message bound: header, namespace and entries (an upper-bound estimate of each
 * entry's bytes is what is counted, so the packed message never exceeds it). The topic frame
 * (the namespace) comes on top. Small enough that hwm × it is a sane worst case; large enough
 * that the per-message overhead (~40 bytes, one wake-up per subscriber) stays under 1%. */
#define KVD_EVENTS_MSG_BYTES 16384u

typedef struct kvd_events_opts_s {
    void *zctx;            /* the daemon's ZeroMQ context (borrowed) */
    const char *endpoint;  /* ipc://PATH or tcp://HOST:PORT; bound by init */
    uint64_t hwm;          /* ZMQ_SNDHWM in messages (0: ZeroMQ's unlimited) */
    const char *ns;        /* namespace: the topic frame and Event.namespace (copied) */
    uint64_t instance;     /* daemon instance id (HelloRep.instance) */
    int tokens;            /* include token ids and extra in STORED entries */
    uint32_t batch_max;    /* entries per message at most (≥ 1) */
    int zap;               /* ipc only: admit subscribers through the daemon's ZAP domain */
} kvd_events_opts_t;

/* Bind the PUB socket, start the end-of-iteration flush on loop, and queue CLEARED (start).
 * Returns 0, or -1 with err filled (nothing left allocated, *out NULL). */
int kvd_events_init(kvd_events_t **out, uv_loop_t *loop, const kvd_events_opts_t *o, char *err,
                    size_t errlen);
/* kvd_index_hook_fn: ud is the kvd_events_t. Never calls into the core. */
void kvd_events_hook(const kvd_index_ev_t *ev, void *ud);
/* Runtime-mutable settings (config set): entries per message, token ids on or off. */
void kvd_events_configure(kvd_events_t *e, uint32_t batch_max, int tokens);
/* Queue a STORED (reason RESTORED: no parent, no tokens) for every entry already in the
 * index: what a snapshot restored before the publisher existed. Call once, right after init
 * and kvd_core_set_index_hook, on the loop thread. */
void kvd_events_announce(kvd_events_t *e, const kvd_core_t *c);
/* Republish the whole index (events_sync): flush what is pending, then CLEARED (reason
 * RESYNC) and one STORED (reason RESYNC, no parent, no tokens) per bound entry, flushed before
 * returning. *seq_out = seq of the message holding the CLEARED; *entries_out = STOREDs. */
void kvd_events_resync(kvd_events_t *e, const kvd_core_t *c, uint64_t *seq_out,
                       uint32_t *entries_out);
/* Publish what is pending now (normally the check and prepare handles do). */
void kvd_events_flush(kvd_events_t *e);
/* Queue CLEARED (shutdown), flush, and close the loop handles (uv_close; run the loop after). */
void kvd_events_stop(kvd_events_t *e);
/* Close the socket (its linger lets the last message out) and free; *e = NULL. NULL-safe.
 * Call before zmq_ctx_term of the context. */
void kvd_events_free(kvd_events_t **e);
/* Fill the events_* rows of stats.h. NULL e: leaves them 0. */
void kvd_events_stats(const kvd_events_t *e, kvd_stats_t *st);

#endif /* KVD_EVENTS_H */
