/* lifecycle.h — the lifecycle controller: which page is Recent, Anchor or Stale, and the
 * conversions that follow (DESIGN.md "Lifecycle controller"; Minima-KV §3.1, Eq. 5).
 *
 * Policy, per namespace (one core = one namespace):
 *
 *   position i of a live sequence of n pages is
 *     Anchor  i < anchor_pages                      (attention sinks)            → FP8
 *     Recent  i ≥ n − window                        (window = recent_pages, less
 *                                                    under FP8 pressure, ≥ 1)    → FP8
 *     Stale   otherwise                                                          → TQ3
 *   a pinned cache entry is Anchor wherever it is;
 *   a page held by several sequences takes the most protective tier of its holders;
 *   a page held loose by some session (looked up or allocated, not yet appended: its position
 *   is unknown) is never retiered, only promoted when a sequence wants it FP8;
 *   a page held by nobody (cache only, on the LRU) is retiered when it has not been acquired
 *   for cache_retier_ns (0 = never: it stays FP8 until evicted).
 *   Only SEALED pages are converted: OPEN pages are still being written by their client.
 *   A namespace without a TQ3 pool (pages_tq3 = 0) gets empty plans.
 *
 * Pressure: avail = FP8 free + evictable (cache-only) + retiring pages. avail < low
 * (fp8_low_pct of the pool) halves the Recent window, so more pages go Stale: at most once per
 * tick, never below 1, and only when the current window has no Stale work left and the halved
 * one has some (otherwise shrinking frees nothing sooner). avail ≥ high = min(2·low, pool)
 * doubles it back up to recent_pages. Promotions need an FP8 page each, so they are planned
 * only out of the headroom above high (none under pressure): a grown window cannot promote
 * the pool straight back into pressure, which is what would make the two thrash. A retier
 * whose TQ3 pool is full makes the core evict unreferenced TQ3 cache entries first
 * (kvd_core_convert → eviction); when nothing can go, the page stays FP8, the tick stops
 * retiering and counts it (lifecycle_skipped_tq3_full).
 *
 * Two steps, so the policy can be tested without converting anything:
 *   kvd_lc_plan  pure: reads the core (const), writes only the plan and lc's scratch arrays.
 *                O(live sequence pages + logical ids) per call.
 *   kvd_lc_act   runs at most `batch` conversions of a plan, re-checking each page first, as
 *                ONE kvd_core_convert_batch: one backend call per direction and one wait
 *                (cuda: one kernel launch and one stream sync for the whole tick instead of
 *                one per page). Conversions are BLOCKING (the CPU twins on host, the kernel on
 *                cuda), so `batch` still bounds how long one tick holds the daemon's loop.
 * kvd_lc_tick = plan + act + timing; the daemon calls it from a libuv timer.
 *
 * Thread rule: the loop thread only, like the core. No logging here (kvdcore has no logger):
 * results say what happened and the server logs.
 */
#ifndef KVD_LIFECYCLE_H
#define KVD_LIFECYCLE_H

#include <stdint.h>

#include "core.h"

typedef struct kvd_lc_s kvd_lc_t;

typedef struct kvd_lc_params_s {
    uint32_t recent_pages;    /* W ≥ 1: last W pages of each sequence stay FP8 */
    uint32_t anchor_pages;    /* A ≥ 0: first A pages of each sequence stay FP8 */
    uint32_t batch;           /* ≥ 1: conversions per tick at most */
    uint32_t fp8_low_pct;     /* 0..100: low watermark of FP8 free + evictable, % of the pool
                                 (0: never under pressure) */
    uint64_t cache_retier_ns; /* cache-only FP8 pages idle this long go TQ3; 0 = never */
} kvd_lc_params_t;

/* Why a page is in the plan (also the order in which a plan is executed). */
typedef enum kvd_lc_why_e {
    KVD_LC_WHY_PINNED = 0, /* promote: pinned cache entry */
    KVD_LC_WHY_ANCHOR = 1, /* promote: position < anchor_pages in some sequence */
    KVD_LC_WHY_RECENT = 2, /* promote: inside some sequence's Recent window */
    KVD_LC_WHY_STALE = 3,  /* retier: Stale in every sequence that holds it */
    KVD_LC_WHY_IDLE = 4,   /* retier: cache only, idle ≥ cache_retier_ns */
} kvd_lc_why_t;
const char *kvd_lc_why_name(kvd_lc_why_t w); /* "pinned", "anchor", "recent", "stale", "idle" */

typedef struct kvd_lc_action_s {
    uint32_t logical;
    kv_fmt_t dst; /* KV_FMT_TQ3 = retier, KV_FMT_FP8 = promote */
    kvd_lc_why_t why;
} kvd_lc_action_t;

typedef struct kvd_lc_plan_s {
    const kvd_lc_action_t *act; /* [n]: promotes first, then retiers oldest first; borrowed
                                   from lc, valid until its next plan */
    uint32_t n;                 /* ≤ batch */
    uint32_t backlog;           /* conversions wanted beyond these n (promotes over the
                                   headroom are not counted: they wait for space, not time) */
    uint32_t window;            /* Recent window this plan used */
    uint32_t window_before;     /* the controller's window when planning started */
    int pressure;               /* FP8 free + evictable < low watermark */
    uint64_t fp8_avail;         /* FP8 free + evictable + retiring pages */
    uint64_t fp8_low;           /* low watermark in pages */
} kvd_lc_plan_t;

typedef struct kvd_lc_result_s {
    uint32_t retiered, promoted;
    uint32_t skipped_changed; /* planned pages whose state changed before their turn */
    int tq3_full;             /* a retier found the TQ3 pool full; the rest were skipped */
    int tq3_full_new;         /* … and the previous tick had no such refusal: log it */
    int fp8_full;             /* a promote found no FP8 page */
    uint32_t failures;        /* other conversion errors (e.g. DEVICE; source kept) */
    int first_error;          /* kv_err_t of the first failure, KV_ERR_OK when none */
    char msg[256];            /* the core's message for it */
    uint64_t tick_ns;         /* kvd_lc_tick only: time of plan + act */
} kvd_lc_result_t;

/* Defaults: kvd_lc_params_default and the daemon's config table (kvd/config.h, which
 * stringifies these) take them from here; docs/lifecycle.md explains each. Plain decimal
 * literals: config.h turns them into its default strings. */
#define KVD_LC_DEFAULT_RECENT_PAGES 32
#define KVD_LC_DEFAULT_ANCHOR_PAGES 1
#define KVD_LC_DEFAULT_BATCH 8
#define KVD_LC_DEFAULT_FP8_LOW_PCT 10
void kvd_lc_params_default(kvd_lc_params_t *p);

/* Create a controller for core c (sized by its logical ids) with params p.
 * Errors: INVALID_ARGUMENT (NULL, bad params), NOMEM. *out is NULL on failure. */
int kvd_lc_init(kvd_lc_t **out, const kvd_core_t *c, const kvd_lc_params_t *p);
/* Free; *lc = NULL. NULL-safe. */
void kvd_lc_free(kvd_lc_t **lc);
/* Change params at run time (kvctl config set). A new recent_pages restarts the effective
 * window from it; other changes keep the current (maybe shrunk) window. Errors: INVALID_ARGUMENT
 * (recent_pages or batch 0, fp8_low_pct > 100; params unchanged). */
int kvd_lc_set_params(kvd_lc_t *lc, const kvd_lc_params_t *p);
void kvd_lc_get_params(const kvd_lc_t *lc, kvd_lc_params_t *p);

/* Plan one tick at time now_ns (the core's clock: the daemon's CLOCK_MONOTONIC, a test's
 * injected clock; it only ages cache-only pages). Pure (see above). Errors: NOMEM (scratch
 * could not grow; nothing changed). */
int kvd_lc_plan(kvd_lc_t *lc, const kvd_core_t *c, uint64_t now_ns, kvd_lc_plan_t *plan);
/* Execute plan (from kvd_lc_plan on this lc and core, nothing else called on the core in
 * between) and commit its window. Never fails as a whole: res says what was done. */
void kvd_lc_act(kvd_lc_t *lc, kvd_core_t *c, const kvd_lc_plan_t *plan, kvd_lc_result_t *res);
/* Plan + act, timed on the real clock. Errors: as kvd_lc_plan (then nothing was done). */
int kvd_lc_tick(kvd_lc_t *lc, kvd_core_t *c, uint64_t now_ns, kvd_lc_result_t *res);

/* Fill the lifecycle_* fields of st (stats.h); leaves every other field alone. */
void kvd_lc_stats(const kvd_lc_t *lc, kvd_stats_t *st);

#endif /* KVD_LIFECYCLE_H */
