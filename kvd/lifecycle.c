/* lifecycle.c — the lifecycle controller's plan and act steps (policy: lifecycle.h; the long
 * form and the choices: docs/lifecycle.md, docs/decisions.md).
 *
 * A plan is three passes over what the core already knows, through its public read-only API:
 *
 *   1. sequences (kvd_core_seq_foreach, block tables borrowed, not copied): every position
 *      raises tier[lid] to Anchor / Recent / Stale, the most protective holder winning, and
 *      since[lid] keeps the oldest append time (retiers go oldest first);
 *   2. every page touched in 1 (kvd_core_page_info): SEALED only; protected (Anchor, Recent,
 *      pinned) and TQ3 → promote; Stale, FP8, no loose holder → retier;
 *   3. cache entries no sequence holds (kvd_core_cache_foreach): pinned TQ3 → promote;
 *      on the FP8 LRU and idle ≥ cache_retier_ns → retier.
 *
 * Candidates are sorted (why, age, id) and cut to `batch`. The scratch arrays are sized by the
 * logical ids once at init (a page is a candidate at most once), so planning never allocates
 * and cannot fail half way; tier[] is cleared through the touched list, so a plan costs
 * O(sequence pages + logical ids), the second term from the pool figures (kvd_core_stats) and,
 * only when some entry is pinned or cache_retier_ns is set, the cache walk of pass 3
 * (docs/lifecycle.md has the measured figures).
 *
 * The window state (halved under FP8 pressure, doubled back when the pressure is gone) is the
 * controller's only policy state besides its counters; a plan proposes the next window and
 * kvd_lc_act commits it, so planning twice without acting changes nothing.
 */
#include "lifecycle.h"

#include <stdlib.h>
#include <string.h>

#include "util.h"

enum { TIER_NONE = 0, TIER_STALE = 1, TIER_RECENT = 2, TIER_ANCHOR = 3 };

typedef struct lc_cand_s {
    uint64_t key; /* retier: age key (oldest first); promote: 0 */
    uint32_t lid;
    uint8_t why;
    uint8_t dst;
} lc_cand_t;

struct kvd_lc_s {
    kvd_lc_params_t p;
    uint32_t nlogical;
    uint8_t *tier;     /* [nlogical] TIER_* of the plan in progress; all 0 between plans */
    uint64_t *since;   /* [nlogical] oldest append time over the page's holders */
    uint32_t *touched; /* [nlogical] ids whose tier is set */
    uint32_t ntouched;
    lc_cand_t *cand; /* [nlogical] */
    uint32_t ncand;
    kvd_lc_action_t *act; /* [nlogical] the plan handed out */
    uint32_t *blid;       /* [nlogical] kvd_lc_act's batch: logical ids, */
    kv_fmt_t *bdst;       /* targets */
    int *brc;             /* and results */
    uint32_t window;      /* effective Recent window, 1 .. recent_pages */
    uint32_t backlog;     /* conversions the last executed tick left behind */
    int tq3_full_last;    /* the last tick that tried a retier was refused for space */
    /* counters (stats.h lifecycle_*) */
    uint64_t ticks, tick_ns, tick_ns_max, shrinks, skipped_tq3, skipped_fp8;
};

const char *kvd_lc_why_name(kvd_lc_why_t w)
{
    switch (w) {
    case KVD_LC_WHY_PINNED:
        return "pinned";
    case KVD_LC_WHY_ANCHOR:
        return "anchor";
    case KVD_LC_WHY_RECENT:
        return "recent";
    case KVD_LC_WHY_STALE:
        return "stale";
    case KVD_LC_WHY_IDLE:
        return "idle";
    }
    return "unknown";
}

void kvd_lc_params_default(kvd_lc_params_t *p)
{
    p->recent_pages = KVD_LC_DEFAULT_RECENT_PAGES;
    p->anchor_pages = KVD_LC_DEFAULT_ANCHOR_PAGES;
    p->batch = KVD_LC_DEFAULT_BATCH;
    p->fp8_low_pct = KVD_LC_DEFAULT_FP8_LOW_PCT;
    p->cache_retier_ns = 0; /* cache_retier_ms "0": off */
}

static int params_valid(const kvd_lc_params_t *p)
{
    return p && p->recent_pages >= 1 && p->batch >= 1 && p->fp8_low_pct <= 100;
}

int kvd_lc_init(kvd_lc_t **out, const kvd_core_t *c, const kvd_lc_params_t *p)
{
    if (!out)
        return KV_ERR_INVALID_ARGUMENT;
    *out = NULL;
    if (!c || !params_valid(p))
        return KV_ERR_INVALID_ARGUMENT;
    kvd_stats_t st;
    kvd_core_stats(c, &st);
    uint32_t n = (uint32_t)st.logical_total;
    kvd_lc_t *lc = kvd_calloc(1, sizeof(*lc));
    if (!lc)
        return KV_ERR_NOMEM;
    lc->nlogical = n;
    lc->tier = kvd_calloc(n, sizeof(*lc->tier));
    lc->since = kvd_calloc(n, sizeof(*lc->since));
    lc->touched = kvd_calloc(n, sizeof(*lc->touched));
    lc->cand = kvd_calloc(n, sizeof(*lc->cand));
    lc->act = kvd_calloc(n, sizeof(*lc->act));
    lc->blid = kvd_calloc(n, sizeof(*lc->blid));
    lc->bdst = kvd_calloc(n, sizeof(*lc->bdst));
    lc->brc = kvd_calloc(n, sizeof(*lc->brc));
    if (!lc->tier || !lc->since || !lc->touched || !lc->cand || !lc->act || !lc->blid ||
        !lc->bdst || !lc->brc) {
        kvd_lc_free(&lc);
        return KV_ERR_NOMEM;
    }
    lc->p = *p;
    lc->window = p->recent_pages;
    *out = lc;
    return KV_ERR_OK;
}

void kvd_lc_free(kvd_lc_t **lcp)
{
    if (!lcp || !*lcp)
        return;
    kvd_lc_t *lc = *lcp;
    kvd_free(lc->tier);
    kvd_free(lc->since);
    kvd_free(lc->touched);
    kvd_free(lc->cand);
    kvd_free(lc->act);
    kvd_free(lc->blid);
    kvd_free(lc->bdst);
    kvd_free(lc->brc);
    kvd_free(lc);
    *lcp = NULL;
}

int kvd_lc_set_params(kvd_lc_t *lc, const kvd_lc_params_t *p)
{
    if (!lc || !params_valid(p))
        return KV_ERR_INVALID_ARGUMENT;
    /* An operator who sets a new window means that window now (pressure shrinks it again on
     * the next tick if it must); any other change keeps the pressure state. */
    if (p->recent_pages != lc->p.recent_pages)
        lc->window = p->recent_pages;
    lc->p = *p;
    return KV_ERR_OK;
}

void kvd_lc_get_params(const kvd_lc_t *lc, kvd_lc_params_t *p)
{
    *p = lc->p;
}

/* ---- plan -------------------------------------------------------------------------------- */
typedef struct plan_ctx_s {
    kvd_lc_t *lc;
    uint32_t window, anchor;
    uint64_t now;
} plan_ctx_t;

/* Pass 1: positions → tiers, most protective holder wins. */
static void visit_seq(uint64_t seq, uint64_t sid, const uint32_t *lids, const uint64_t *ts,
                      uint32_t n, void *ud)
{
    (void)seq, (void)sid;
    plan_ctx_t *x = ud;
    kvd_lc_t *lc = x->lc;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t lid = lids[i];
        KVD_ASSERT(lid < lc->nlogical); /* the core only keeps its own ids in sequences */
        uint8_t t = i < x->anchor                            ? TIER_ANCHOR
                    : (uint64_t)i + x->window >= (uint64_t)n ? TIER_RECENT
                                                             : TIER_STALE;
        if (lc->tier[lid] == TIER_NONE) {
            lc->touched[lc->ntouched++] = lid;
            lc->since[lid] = ts[i];
        } else if (ts[i] < lc->since[lid]) {
            lc->since[lid] = ts[i];
        }
        if (t > lc->tier[lid])
            lc->tier[lid] = t;
    }
}

static void add_cand(kvd_lc_t *lc, uint32_t lid, kv_fmt_t dst, kvd_lc_why_t why, uint64_t key)
{
    KVD_ASSERT(lc->ncand < lc->nlogical); /* each id at most once: pass 2 and 3 are disjoint */
    lc->cand[lc->ncand++] =
        (lc_cand_t){.key = key, .lid = lid, .why = (uint8_t)why, .dst = (uint8_t)dst};
}

/* Pass 3: cache entries no sequence holds. */
static void visit_cache(const kvd_page_info_t *p, void *ud)
{
    plan_ctx_t *x = ud;
    kvd_lc_t *lc = x->lc;
    if (p->logical >= lc->nlogical || lc->tier[p->logical] != TIER_NONE ||
        p->state != KVD_PAGE_SEALED)
        return;
    if (p->pins && p->fmt == KV_FMT_TQ3)
        add_cand(lc, p->logical, KV_FMT_FP8, KVD_LC_WHY_PINNED, 0);
    else if (lc->p.cache_retier_ns && p->on_lru && p->fmt == KV_FMT_FP8 &&
             x->now >= p->last_use_ns && x->now - p->last_use_ns >= lc->p.cache_retier_ns)
        add_cand(lc, p->logical, KV_FMT_TQ3, KVD_LC_WHY_IDLE, p->last_use_ns);
}

static int cand_cmp(const void *a, const void *b)
{
    const lc_cand_t *x = a, *y = b;
    if (x->why != y->why)
        return x->why < y->why ? -1 : 1;
    if (x->key != y->key)
        return x->key < y->key ? -1 : 1;
    return x->lid < y->lid ? -1 : x->lid > y->lid;
}

/* Passes 1-3 for window w: fills lc->cand; returns how many are Stale retiers. pins: pin
 * references held in the core (pass 3 only looks for pinned or idle entries, and walking every
 * cached page is the biggest cost of a plan, so it is skipped when it cannot find any). */
static uint32_t collect(kvd_lc_t *lc, const kvd_core_t *c, uint32_t w, uint64_t now,
                        uint64_t pins)
{
    plan_ctx_t x = {.lc = lc, .window = w, .anchor = lc->p.anchor_pages, .now = now};
    uint32_t stale = 0;
    lc->ntouched = 0;
    lc->ncand = 0;
    kvd_core_seq_foreach(c, visit_seq, &x);
    /* Pass 2: decide each page held by a sequence. */
    for (uint32_t i = 0; i < lc->ntouched; i++) {
        uint32_t lid = lc->touched[i];
        kvd_page_info_t pi;
        KVD_ASSERT(kvd_core_page_info(c, lid, &pi) == KV_ERR_OK);
        if (pi.state != KVD_PAGE_SEALED) /* OPEN: its client is still writing it */
            continue;
        uint8_t t = lc->tier[lid];
        if ((t >= TIER_RECENT || pi.pins) && pi.fmt == KV_FMT_TQ3) {
            add_cand(lc, lid, KV_FMT_FP8,
                     pi.pins            ? KVD_LC_WHY_PINNED
                     : t == TIER_ANCHOR ? KVD_LC_WHY_ANCHOR
                                        : KVD_LC_WHY_RECENT,
                     0);
        } else if (t == TIER_STALE && !pi.pins && pi.fmt == KV_FMT_FP8 && pi.req_loose == 0) {
            add_cand(lc, lid, KV_FMT_TQ3, KVD_LC_WHY_STALE, lc->since[lid]);
            stale++;
        }
    }
    if (pins || lc->p.cache_retier_ns)
        kvd_core_cache_foreach(c, visit_cache, &x);
    for (uint32_t i = 0; i < lc->ntouched; i++)
        lc->tier[lc->touched[i]] = TIER_NONE;
    lc->ntouched = 0;
    return stale;
}

int kvd_lc_plan(kvd_lc_t *lc, const kvd_core_t *c, uint64_t now_ns, kvd_lc_plan_t *plan)
{
    if (!lc || !c || !plan)
        return KV_ERR_INVALID_ARGUMENT;
    memset(plan, 0, sizeof(*plan));
    /* Pressure. Retiring FP8 pages count as available: they are free as soon as clients report
     * their epochs, and shrinking the window cannot free them any sooner. */
    kvd_stats_t st;
    kvd_core_stats(c, &st);
    uint64_t total = st.pages_total[KV_FMT_FP8];
    uint64_t avail =
        st.pages_free[KV_FMT_FP8] + st.pages_lru[KV_FMT_FP8] + st.pages_retired[KV_FMT_FP8];
    uint64_t low = (total * lc->p.fp8_low_pct + 99) / 100;
    uint64_t high = 2 * low < total ? 2 * low : total;
    uint32_t w = lc->window, W = lc->p.recent_pages;
    if (w > W)
        w = W;
    plan->window_before = lc->window;
    plan->pressure = avail < low;
    plan->fp8_avail = avail;
    plan->fp8_low = low;
    if (st.pages_total[KV_FMT_TQ3] == 0) { /* pages_tq3 = 0: nothing can go Stale, nor back */
        plan->window = w;
        plan->act = lc->act;
        return KV_ERR_OK;
    }
    if (!plan->pressure && avail >= high && w < W)
        w = w > W / 2 ? W : 2 * w;
    uint32_t stale = collect(lc, c, w, now_ns, st.pins);
    /* Under pressure the window halves (once per tick, never below 1) only when the current
     * window has no Stale work left and the halved one has some: shrinking while retiers are
     * queued, or when no sequence is long enough for it to matter, frees nothing sooner. The
     * halved plan has the same non-Stale candidates except Recent promotes, and there are
     * none under pressure, so keeping it when it finds no Stale page is keeping the first. */
    if (plan->pressure && w > 1 && stale == 0 && collect(lc, c, w / 2, now_ns, st.pins) > 0)
        w /= 2;
    plan->window = w;

    qsort(lc->cand, lc->ncand, sizeof(*lc->cand), cand_cmp);
    /* Promotes only out of the headroom above the high mark (none under pressure). */
    uint64_t budget = !plan->pressure && avail > high ? avail - high : 0;
    uint32_t n = 0;
    for (uint32_t i = 0; i < lc->ncand; i++) {
        const lc_cand_t *k = &lc->cand[i];
        if (k->dst == KV_FMT_FP8) {
            if (budget == 0)
                continue; /* waits for space, not for time: not backlog */
            budget--;
        }
        if (n < lc->p.batch)
            lc->act[n++] = (kvd_lc_action_t){
                .logical = k->lid, .dst = (kv_fmt_t)k->dst, .why = (kvd_lc_why_t)k->why};
        else
            plan->backlog++;
    }
    plan->act = lc->act;
    plan->n = n;
    return KV_ERR_OK;
}

/* ---- act --------------------------------------------------------------------------------- */
void kvd_lc_act(kvd_lc_t *lc, kvd_core_t *c, const kvd_lc_plan_t *plan, kvd_lc_result_t *res)
{
    memset(res, 0, sizeof(*res));
    uint32_t not_run = 0, n = 0;
    /* The plan's pages that are still what it saw (SEALED, other format), converted as ONE
     * batch: one backend call per direction and one wait (kvd_core_convert_batch). */
    for (uint32_t i = 0; i < plan->n; i++) {
        const kvd_lc_action_t *a = &plan->act[i];
        kvd_page_info_t pi;
        if (kvd_core_page_info(c, a->logical, &pi) != KV_ERR_OK || pi.state != KVD_PAGE_SEALED ||
            pi.fmt == a->dst) {
            res->skipped_changed++;
            continue;
        }
        lc->blid[n] = a->logical;
        lc->bdst[n] = a->dst;
        n++;
    }
    kvd_core_convert_batch(c, n, lc->blid, lc->bdst, lc->brc); /* results per page: below */
    for (uint32_t i = 0; i < n; i++) {
        const int rc = lc->brc[i];
        if (rc == KV_ERR_OK) {
            if (lc->bdst[i] == KV_FMT_TQ3)
                res->retiered++;
            else
                res->promoted++;
            continue;
        }
        if (rc == KV_ERR_RESOURCE_EXHAUSTED) {
            int *full = lc->bdst[i] == KV_FMT_TQ3 ? &res->tq3_full : &res->fp8_full;
            if (!*full) /* counted once per tick, as when the pages ran one by one */
                lc->bdst[i] == KV_FMT_TQ3 ? lc->skipped_tq3++ : lc->skipped_fp8++;
            *full = 1; /* the core already evicted what it could: not run */
            not_run++;
        } else if (rc == KV_ERR_FAILED_PRECONDITION) {
            res->skipped_changed++; /* an earlier page of the batch evicted it */
            continue;
        } else {
            res->failures++;
        }
        if (res->first_error == KV_ERR_OK) {
            res->first_error = rc;
            kvd_fmt(res->msg, sizeof(res->msg), "%s", kvd_core_errmsg(c));
        }
    }
    if (res->tq3_full) {
        res->tq3_full_new = !lc->tq3_full_last;
        lc->tq3_full_last = 1;
    } else if (res->retiered) {
        lc->tq3_full_last = 0;
    }
    if (plan->window < lc->window)
        lc->shrinks++;
    lc->window = plan->window;
    lc->backlog = plan->backlog + not_run;
}

int kvd_lc_tick(kvd_lc_t *lc, kvd_core_t *c, uint64_t now_ns, kvd_lc_result_t *res)
{
    uint64_t t0 = kvd_mono_ns();
    kvd_lc_plan_t plan;
    int rc = kvd_lc_plan(lc, c, now_ns, &plan);
    if (rc != KV_ERR_OK) {
        if (res)
            memset(res, 0, sizeof(*res));
        return rc;
    }
    kvd_lc_result_t local;
    if (!res)
        res = &local;
    kvd_lc_act(lc, c, &plan, res);
    uint64_t dt = kvd_mono_ns() - t0;
    res->tick_ns = dt;
    lc->ticks++;
    lc->tick_ns += dt;
    if (dt > lc->tick_ns_max)
        lc->tick_ns_max = dt;
    return KV_ERR_OK;
}

void kvd_lc_stats(const kvd_lc_t *lc, kvd_stats_t *st)
{
    if (!lc)
        return;
    st->lifecycle_ticks = lc->ticks;
    st->lifecycle_tick_ns = lc->tick_ns;
    st->lifecycle_tick_ns_max = lc->tick_ns_max;
    st->lifecycle_window = lc->window;
    st->lifecycle_window_shrinks = lc->shrinks;
    st->lifecycle_backlog = lc->backlog;
    st->lifecycle_skipped_tq3_full = lc->skipped_tq3;
    st->lifecycle_skipped_fp8_full = lc->skipped_fp8;
}
