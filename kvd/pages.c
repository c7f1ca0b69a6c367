/* pages.c — logical and physical page tables, free lists, retire lists, refcount transitions
 * and directory publication.
 *
 * A physical page is in exactly one place: a free list (FREE), mapped by one logical page
 * (LIVE), being filled by a conversion (FILLING, inside one call only), or a retire list
 * (RETIRED, with an epoch stamp). A logical page is FREE (on the logical free list), OPEN or
 * SEALED (mapped), or RETIRED (its physical page is on a retire list and carries lid back, so
 * both are freed together). The directory entry of a RETIRED logical page keeps pointing at the
 * old physical page until collection: a kernel still in flight that resolves it reads the data
 * it expects, never another tenant's page.
 *
 * Free lists are LIFO (the most recently freed page is warm in cache/TLB); retire lists are
 * unordered because stamps are not monotone (an evicted cache entry carries the stamp of its
 * last client drop, which can be old), so collection scans the whole list: O(retired).
 */
#include <string.h>

#include "core_int.h"

uint32_t kvd__lp_client_refs(const kvd_lpage_t *p)
{
    return p->req_loose + p->req_seq;
}

/* 64-bit: request refs and pins are each bounded by KVD_PAGE_REFS_MAX, so with the cache
 * and conversion refs their 32-bit sum could wrap to 0 and retire a page still in use. */
uint64_t kvd__lp_total(const kvd_lpage_t *p)
{
    return (uint64_t)p->req_loose + p->req_seq + p->cached + p->pins + p->conv;
}

int kvd__pages_init(kvd_core_t *c, const uint32_t pages[KV_FMT_COUNT],
                    const uint32_t quota[KV_FMT_COUNT])
{
    c->lp = kvd_calloc(c->nlogical, sizeof(kvd_lpage_t));
    c->sync_lids = kvd_calloc(c->nlogical, sizeof(uint32_t));
    if (!c->lp || !c->sync_lids)
        return KV_ERR_NOMEM;
    /* Free list in ascending id order so the first allocations get ids 0, 1, 2, … */
    for (uint32_t i = 0; i < c->nlogical; i++) {
        c->lp[i].state = KVD_PAGE_FREE;
        c->lp[i].next_free = i + 1 < c->nlogical ? i + 1 : KVD_NONE;
        c->lp[i].lru_prev = c->lp[i].lru_next = KVD_NONE;
        c->lp[i].phys = KVD_NONE;
    }
    c->lfree_head = 0;
    c->nlfree = c->nlogical;
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        kvd_pool_t *pl = &c->pool[f];
        pl->n = pages[f];
        pl->quota = quota[f];
        pl->free_head = pl->retire_head = KVD_NONE;
        pl->lru_head = pl->lru_tail = KVD_NONE;
        if (pages[f] == 0)
            continue;
        pl->pg = kvd_calloc(pages[f], sizeof(kvd_ppage_t));
        if (!pl->pg)
            return KV_ERR_NOMEM;
        for (uint32_t i = 0; i < pages[f]; i++) {
            pl->pg[i].state = KVD_PHYS_FREE;
            pl->pg[i].lid = KVD_NONE;
            pl->pg[i].next = i + 1 < pages[f] ? i + 1 : KVD_NONE;
        }
        pl->free_head = 0;
        pl->nfree = pages[f];
    }
    for (uint32_t i = 0; i < c->nlogical; i++)
        __atomic_store_n(&c->dir[i], kv_dir_make(0, KV_FMT_FP8, 0, 0), __ATOMIC_RELEASE);
    return KV_ERR_OK;
}

void kvd__pages_fini(kvd_core_t *c)
{
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        kvd_free(c->pool[f].pg);
        c->pool[f].pg = NULL;
    }
    kvd_free(c->lp);
    c->lp = NULL;
    kvd_free(c->sync_lids);
    c->sync_lids = NULL;
}

/* Push entry lid to the backend's shared copy of the directory (cuda: device memory; host:
 * nothing, dir[] is the shared memfd). A failure here means the device copy no longer matches
 * the core's view; serving on would hand out wrong pages, so it is fatal. */
void kvd__dir_sync(kvd_core_t *c, const uint32_t *lids, uint32_t n)
{
    if (!c->be->ops->dir_sync || n == 0)
        return;
    char err[256] = "";
    const uint64_t t0 = kvd_mono_ns(); /* real time: what the daemon's loop stood still */
    if (c->be->ops->dir_sync(c->be, lids, n, err, sizeof(err)) != KV_ERR_OK)
        KVD_PANIC("%u directory entries (first %u) could not be published to the device: %s", n,
                  lids[0], err);
    c->st.dir_syncs++;
    c->st.dir_sync_entries += n;
    c->st.dir_sync_ns += kvd_mono_ns() - t0;
}

static void dir_sync(kvd_core_t *c, uint32_t lid)
{
    kvd__dir_sync(c, &lid, 1);
}

uint32_t kvd__phys_alloc(kvd_core_t *c, kv_fmt_t f, uint32_t lid)
{
    kvd_pool_t *pl = &c->pool[f];
    uint32_t p = pl->free_head;
    if (p == KVD_NONE)
        return KVD_NONE;
    kvd_ppage_t *pp = &pl->pg[p];
    if (pp->state != KVD_PHYS_FREE)
        KVD_PANIC("physical page %s:%u on the free list in state %d", kvd_fmt_name(f), p,
                  pp->state);
    pl->free_head = pp->next;
    pl->nfree--;
    pp->state = KVD_PHYS_FILLING;
    pp->lid = lid;
    pp->next = KVD_NONE;
    pp->stamp = 0;
    return p;
}

static void phys_push_free(kvd_pool_t *pl, uint32_t p)
{
    pl->pg[p].state = KVD_PHYS_FREE;
    pl->pg[p].lid = KVD_NONE;
    pl->pg[p].stamp = 0;
    pl->pg[p].next = pl->free_head;
    pl->free_head = p;
    pl->nfree++;
}

void kvd__phys_unfill(kvd_core_t *c, kv_fmt_t f, uint32_t phys)
{
    KVD_ASSERT(c->pool[f].pg[phys].state == KVD_PHYS_FILLING);
    phys_push_free(&c->pool[f], phys);
}

void kvd__phys_retire(kvd_core_t *c, kv_fmt_t f, uint32_t phys, uint32_t lid, uint64_t stamp)
{
    kvd_pool_t *pl = &c->pool[f];
    kvd_ppage_t *pp = &pl->pg[phys];
    if (pp->state != KVD_PHYS_LIVE)
        KVD_PANIC("retiring physical page %s:%u in state %d", kvd_fmt_name(f), phys, pp->state);
    pp->state = KVD_PHYS_RETIRED;
    pp->lid = lid;
    pp->stamp = stamp;
    pp->next = pl->retire_head;
    pl->retire_head = phys;
    pl->nretired++;
    c->st.retired_pages++;
}

uint32_t kvd__logical_alloc(kvd_core_t *c)
{
    uint32_t l = c->lfree_head;
    if (l == KVD_NONE)
        return KVD_NONE;
    kvd_lpage_t *p = &c->lp[l];
    KVD_ASSERT(p->state == KVD_PAGE_FREE);
    c->lfree_head = p->next_free;
    c->nlfree--;
    p->next_free = KVD_NONE;
    return l;
}

/* Return logical id l to the free list, its directory entry invalid (generation + 1) in the
 * core's copy; the caller publishes it (kvd__dir_sync) before the id can be handed out again. */
static void logical_free(kvd_core_t *c, uint32_t l)
{
    kvd_lpage_t *p = &c->lp[l];
    if (kvd__lp_total(p) != 0 || p->on_lru)
        KVD_PANIC("freeing logical page %u that still has references (pins %u)", l, p->pins);
    kv_dir_entry_t old = __atomic_load_n(&c->dir[l], __ATOMIC_RELAXED);
    __atomic_store_n(&c->dir[l], kv_dir_make(0, KV_FMT_FP8, 0, kv_dir_gen(old) + 1),
                     __ATOMIC_RELEASE);
    memset(p, 0, sizeof(*p));
    p->state = KVD_PAGE_FREE;
    p->phys = KVD_NONE;
    p->lru_prev = p->lru_next = KVD_NONE;
    p->next_free = c->lfree_head;
    c->lfree_head = l;
    c->nlfree++;
}

void kvd__dir_store(kvd_core_t *c, uint32_t lid, kv_fmt_t f, uint32_t phys, uint32_t flags)
{
    kv_dir_entry_t old = __atomic_load_n(&c->dir[lid], __ATOMIC_RELAXED);
    /* One 64-bit store: a reader sees the old (fmt, phys) or the new one, never a mix. */
    __atomic_store_n(&c->dir[lid], kv_dir_make(phys, f, flags, kv_dir_gen(old) + 1),
                     __ATOMIC_RELEASE);
}

void kvd__dir_publish(kvd_core_t *c, uint32_t lid, kv_fmt_t f, uint32_t phys, uint32_t flags)
{
    kvd__dir_store(c, lid, f, phys, flags);
    dir_sync(c, lid);
}

void kvd__stamp_drop(kvd_core_t *c, uint32_t lid)
{
    c->lp[lid].stamp = c->epoch + 1;
    c->bump_pending = 1;
}

void kvd__epoch_publish(kvd_core_t *c)
{
    if (c->bump_pending) {
        c->epoch++;
        c->bump_pending = 0;
    }
}

uint64_t kvd__min_safe_epoch(const kvd_core_t *c)
{
    uint64_t m = UINT64_MAX, pos = 0, k, v;
    while (kvd_map_next(&c->sessions, &pos, &k, &v)) {
        const kvd_session_t *s = (const kvd_session_t *)(uintptr_t)v;
        if (!s->fenced && s->safe_epoch < m) /* a fenced session holds back nothing */
            m = s->safe_epoch;
    }
    return m;
}

void kvd__refs_changed(kvd_core_t *c, uint32_t lid)
{
    kvd_lpage_t *p = &c->lp[lid];
    KVD_ASSERT(p->state == KVD_PAGE_OPEN || p->state == KVD_PAGE_SEALED);
    int eligible = p->cached && !p->req_loose && !p->req_seq && !p->pins && !p->conv;
    if (eligible && !p->on_lru) {
        kvd__lru_insert(c, lid);
        kvd__cache_enforce_quota(c, (kv_fmt_t)p->fmt);
        return; /* quota enforcement may have evicted (and retired) this very page */
    }
    if (!eligible && p->on_lru)
        kvd__lru_remove(c, lid);
    if (kvd__lp_total(p) == 0) {
        p->state = KVD_PAGE_RETIRED;
        kvd__phys_retire(c, (kv_fmt_t)p->fmt, p->phys, lid, p->stamp);
    }
}

uint32_t kvd__retired_freeable(const kvd_core_t *c, kv_fmt_t f, uint64_t safe)
{
    uint32_t n = 0;
    const kvd_pool_t *pl = &c->pool[f];
    for (uint32_t p = pl->retire_head; p != KVD_NONE; p = pl->pg[p].next)
        n += pl->pg[p].stamp <= safe; /* kvd_core_collect's test */
    return n;
}

uint32_t kvd_core_collect(kvd_core_t *c)
{
    uint64_t safe = kvd__min_safe_epoch(c);
    uint32_t freed = 0, nsync = 0;
    for (int f = 0; f < KV_FMT_COUNT; f++) {
        kvd_pool_t *pl = &c->pool[f];
        uint32_t *link = &pl->retire_head;
        while (*link != KVD_NONE) {
            uint32_t p = *link;
            kvd_ppage_t *pp = &pl->pg[p];
            KVD_ASSERT(pp->state == KVD_PHYS_RETIRED);
            if (pp->stamp > safe) {
                link = &pp->next;
                continue;
            }
            *link = pp->next;
            pl->nretired--;
            uint32_t lid = pp->lid;
            phys_push_free(pl, p);
            freed++;
            if (lid != KVD_NONE) {
                KVD_ASSERT(c->lp[lid].state == KVD_PAGE_RETIRED && c->lp[lid].phys == p);
                logical_free(c, lid);
                KVD_ASSERT(nsync < c->nlogical);
                c->sync_lids[nsync++] = lid;
            }
        }
    }
    /* One push for every entry freed (cuda: one stream write each, one wait), before any of
     * these ids or pages can be allocated again. Per entry, a release of a 32K-token prompt's
     * 2048 pages waited on the device stream 2048 times inside the daemon's loop. */
    kvd__dir_sync(c, c->sync_lids, nsync);
    c->st.collected_pages += freed;
    return freed;
}
