/* test_core_model.c — randomized operation sequences against a reference model of kvdcore.
 *
 * Each step picks one public operation at random (sessions opening, dying and being fenced,
 * alloc, release, sequences, seal with dedupe, lookup, pins, admin eviction, quotas,
 * conversion batches with injected backend failures, snapshot restores, collection) and, for
 * the epoch rule, simulated client kernels: a session "launches" a kernel on a page it holds,
 * tagged with the last epoch it saw, "completes" it later and reports D = min(tag of its oldest
 * kernel in flight, last epoch seen), exactly what docs/core.md asks of a client.
 *
 * After every step the core is compared with the model:
 *   - kvd_core_check finds nothing;
 *   - every page's request refs (loose, in sequences) and pins equal what the model's sessions
 *     and operator hold; a page the model holds is OPEN or SEALED;
 *   - the epoch rule: every physical page a kernel in flight may read (what its logical id
 *     resolved to at launch or at any step since) is still mapped by that id or RETIRED with
 *     a stamp above the kernel's tag, so it cannot be collected before the kernel completes;
 *     alloc and restore never hand out a logical id such a kernel may still resolve;
 *   - a directory entry that changed (phys, format, flags) changed its generation too;
 *   - lookups return exactly the longest cached prefix, each page under the expected chain
 *     hash; seal returns the page bound under the hash it reports.
 * At the end every session dies, every pin and cache entry goes, and the pools must be whole.
 *
 * Fixed seeds, bounded steps (well under 10 s on the 2-core build machine); a failure names
 * the seed and step.
 */
#include "core_fixture.h"

#include <stdio.h>

#define M_SESS 4       /* live sessions at most */
#define M_SEQS 3       /* sequences per session */
#define M_SEQLEN 24    /* pages per sequence */
#define M_KERN 48      /* kernels in flight, all sessions */
#define M_RES 12       /* physical pages one kernel may have resolved */
#define M_KINDS 3      /* page contents: few, so that chains meet and seals dedupe */
#define M_DEPTH 5      /* longest chain the model seals */
#define M_PROMPTS 512  /* known chains (hash → kinds) */
#define M_NL 24        /* logical ids at most (the second configuration's) */

typedef struct mseq_s {
    uint64_t id;
    uint32_t n;
    uint32_t lids[M_SEQLEN];
} mseq_t;

typedef struct msess_s {
    int live, fenced;
    uint64_t sid, seen, reported;
    uint32_t loose[M_NL];
    mseq_t seq[M_SEQS];
    int nseq;
} msess_t;

typedef struct mkern_s {
    int s;
    uint32_t lid;
    uint64_t tag;
    uint32_t nres;
    uint8_t rf[M_RES];
    uint32_t rp[M_RES];
} mkern_t;

typedef struct mprompt_s {
    uint8_t hash[KVD_HASH_BYTES];
    uint32_t depth; /* pages in the chain, this one included */
    uint8_t kinds[M_DEPTH];
} mprompt_t;

typedef struct model_s {
    kvd_core_t *c;
    uint32_t nl;
    uint64_t rng;
    unsigned seed, step;
    const char *op;
    msess_t s[M_SESS];
    uint32_t pins[M_NL];
    mkern_t k[M_KERN];
    uint32_t nk;
    mprompt_t pr[M_PROMPTS];
    uint32_t npr;
    kv_dir_entry_t dir[M_NL];
    uint8_t cached[M_NL];  /* bound in the index after the previous step */
    uint32_t admin_evicted; /* the page this step's op_evict unbound, or KVD_NONE */
    int inj; /* this step runs with kvd_malloc failing (after 0-2 good calls) */
    uint64_t ops_refused, nomem, dedupes, hits, conversions, kernels;
} model_t;

/* rc is an injected allocation failure: the call must have changed nothing (compare() checks
 * the core against the unchanged model). */
static int nomem(model_t *m, int rc)
{
    if (rc != KV_ERR_NOMEM || !m->inj)
        return 0;
    m->nomem++;
    return 1;
}

#define M_FAIL(m, ...)                                                                             \
    do {                                                                                           \
        print_message("seed %u step %u op %s: ", (m)->seed, (m)->step, (m)->op);                  \
        fail_msg(__VA_ARGS__);                                                                     \
    } while (0)

static uint32_t rnd(model_t *m, uint32_t n) /* uniform-ish in [0, n) (xorshift64*) */
{
    m->rng ^= m->rng >> 12;
    m->rng ^= m->rng << 25;
    m->rng ^= m->rng >> 27;
    return n ? (uint32_t)((m->rng * 2685821657736338717ull) >> 33) % n : 0;
}

static void kind_tokens(uint8_t kind, uint32_t *tok)
{
    for (uint32_t j = 0; j < FX_PT; j++)
        tok[j] = 1000u + kind * 17u + j;
}

static kvd_page_info_t info(model_t *m, uint32_t lid)
{
    kvd_page_info_t pi;
    if (kvd_core_page_info(m->c, lid, &pi) != KV_ERR_OK)
        M_FAIL(m, "page_info(%u) failed", lid);
    return pi;
}

/* A live session at random (its index), or -1. */
static int pick_sess(model_t *m)
{
    int live[M_SESS], n = 0;
    for (int i = 0; i < M_SESS; i++)
        if (m->s[i].live)
            live[n++] = i;
    return n ? live[rnd(m, (uint32_t)n)] : -1;
}

/* How many refs session s holds on lid: loose, and in its sequences. */
static uint32_t held(const msess_t *s, uint32_t lid)
{
    uint32_t n = s->loose[lid];
    for (int q = 0; q < s->nseq; q++)
        for (uint32_t i = 0; i < s->seq[q].n; i++)
            n += s->seq[q].lids[i] == lid;
    return n;
}

/* A logical id session s holds (loose only when `loose_only`), or KVD_NONE. */
static uint32_t pick_held(model_t *m, const msess_t *s, int loose_only)
{
    uint32_t cand[M_NL], n = 0;
    for (uint32_t l = 0; l < m->nl; l++)
        if (loose_only ? s->loose[l] > 0 : held(s, l) > 0)
            cand[n++] = l;
    return n ? cand[rnd(m, n)] : KVD_NONE;
}

static const mprompt_t *prompt_find(const model_t *m, const uint8_t *hash)
{
    for (uint32_t i = 0; i < m->npr; i++)
        if (memcmp(m->pr[i].hash, hash, KVD_HASH_BYTES) == 0)
            return &m->pr[i];
    return NULL;
}

/* The reply to session s's call carried the current epoch. */
static void saw(model_t *m, int s)
{
    m->s[s].seen = kvd_core_epoch(m->c);
}

/* A logical id just handed out (alloc, restore): no kernel in flight may still resolve it. */
static void fresh_lid(model_t *m, uint32_t lid)
{
    m->cached[lid] = 0; /* a new page under an old id: what the old one was says nothing */
    for (uint32_t i = 0; i < m->nk; i++)
        if (m->k[i].lid == lid)
            M_FAIL(m, "logical %u handed out again while session %d's kernel tagged %llu may "
                      "still resolve it",
                   lid, m->k[i].s, (unsigned long long)m->k[i].tag);
}

static void kern_drop(model_t *m, uint32_t i)
{
    m->k[i] = m->k[--m->nk];
}

static void kern_drop_session(model_t *m, int s)
{
    for (uint32_t i = 0; i < m->nk;)
        if (m->k[i].s == s)
            kern_drop(m, i);
        else
            i++;
}

/* ---- operations ------------------------------------------------------------------------- */
static void op_open(model_t *m)
{
    for (int i = 0; i < M_SESS; i++) {
        if (m->s[i].live)
            continue;
        memset(&m->s[i], 0, sizeof(m->s[i]));
        int rc = kvd_core_session_open(m->c, 100 + i, 0, &m->s[i].sid);
        if (nomem(m, rc))
            return;
        if (rc != KV_ERR_OK)
            M_FAIL(m, "session_open: %s", kvd_core_errmsg(m->c));
        m->s[i].live = 1;
        saw(m, i);
        m->s[i].reported = m->s[i].seen;
        return;
    }
}

static void op_close(model_t *m, int s)
{
    if (kvd_core_session_close(m->c, m->s[s].sid) != KV_ERR_OK)
        M_FAIL(m, "session_close: %s", kvd_core_errmsg(m->c));
    m->s[s].live = 0; /* the process died: its kernels with it */
    kern_drop_session(m, s);
}

static void op_fence(model_t *m, int s)
{
    if (kvd_core_session_fence(m->c, m->s[s].sid) != KV_ERR_OK)
        M_FAIL(m, "fence: %s", kvd_core_errmsg(m->c));
    /* the operator's call: pages may be recycled under its kernels; the model stops watching
     * them, and a fenced engine launches nothing more */
    m->s[s].fenced = 1;
    kern_drop_session(m, s);
}

static void op_alloc(model_t *m, int s)
{
    uint32_t n = 1 + rnd(m, 3), ids[3];
    int rc = kvd_core_alloc(m->c, m->s[s].sid, n, ids);
    saw(m, s);
    if (rc == KV_ERR_RESOURCE_EXHAUSTED) {
        m->ops_refused++;
        return;
    }
    if (nomem(m, rc))
        return;
    if (rc != KV_ERR_OK)
        M_FAIL(m, "alloc(%u): %s: %s", n, kv_err_name(rc), kvd_core_errmsg(m->c));
    for (uint32_t i = 0; i < n; i++) {
        fresh_lid(m, ids[i]);
        kvd_page_info_t pi = info(m, ids[i]);
        if (pi.state != KVD_PAGE_OPEN || pi.owner_sid != m->s[s].sid)
            M_FAIL(m, "alloc gave %u in state %d owner %llu", ids[i], pi.state,
                   (unsigned long long)pi.owner_sid);
        m->s[s].loose[ids[i]]++;
    }
}

static void op_release(model_t *m, int s)
{
    uint32_t ids[2], n = 0;
    for (uint32_t tries = 0; tries < 2; tries++) {
        uint32_t l = pick_held(m, &m->s[s], 1);
        if (l == KVD_NONE)
            break;
        uint32_t dup = n == 1 && ids[0] == l;
        if (dup && m->s[s].loose[l] < 2)
            break;
        ids[n++] = l;
    }
    if (n == 0)
        return;
    int rc = kvd_core_release(m->c, m->s[s].sid, ids, n);
    saw(m, s);
    if (rc != KV_ERR_OK)
        M_FAIL(m, "release: %s", kvd_core_errmsg(m->c));
    for (uint32_t i = 0; i < n; i++)
        m->s[s].loose[ids[i]]--;
}

static void op_seq_open(model_t *m, int s)
{
    msess_t *ss = &m->s[s];
    if (ss->nseq == M_SEQS)
        return;
    mseq_t *q = &ss->seq[ss->nseq];
    int rc = kvd_core_seq_open(m->c, ss->sid, &q->id);
    if (nomem(m, rc))
        return;
    if (rc != KV_ERR_OK)
        M_FAIL(m, "seq_open: %s", kvd_core_errmsg(m->c));
    q->n = 0;
    ss->nseq++;
    saw(m, s);
}

static void op_seq_append(model_t *m, int s)
{
    msess_t *ss = &m->s[s];
    if (ss->nseq == 0)
        return;
    mseq_t *q = &ss->seq[rnd(m, (uint32_t)ss->nseq)];
    uint32_t l = pick_held(m, ss, 1);
    if (l == KVD_NONE || q->n == M_SEQLEN)
        return;
    int rc = kvd_core_seq_append(m->c, ss->sid, q->id, &l, 1);
    if (nomem(m, rc))
        return;
    if (rc != KV_ERR_OK)
        M_FAIL(m, "seq_append: %s", kvd_core_errmsg(m->c));
    saw(m, s);
    ss->loose[l]--;
    q->lids[q->n++] = l;
}

static void op_seq_close(model_t *m, int s)
{
    msess_t *ss = &m->s[s];
    if (ss->nseq == 0)
        return;
    int i = (int)rnd(m, (uint32_t)ss->nseq);
    if (kvd_core_seq_close(m->c, ss->sid, ss->seq[i].id) != KV_ERR_OK)
        M_FAIL(m, "seq_close: %s", kvd_core_errmsg(m->c));
    saw(m, s);
    ss->seq[i] = ss->seq[--ss->nseq];
}

static void op_seal(model_t *m, int s)
{
    msess_t *ss = &m->s[s];
    uint32_t open[M_NL], no = 0, prevs[M_NL], np = 0;
    for (uint32_t l = 0; l < m->nl; l++) {
        if (!held(ss, l))
            continue;
        kvd_page_info_t pi = info(m, l);
        if (pi.state == KVD_PAGE_OPEN && pi.owner_sid == ss->sid)
            open[no++] = l;
        else if (pi.state == KVD_PAGE_SEALED) {
            const mprompt_t *p = prompt_find(m, pi.hash);
            if (p && p->depth < M_DEPTH)
                prevs[np++] = l;
        }
    }
    if (no == 0)
        return;
    uint32_t lid = open[rnd(m, no)];
    uint32_t prev = np && rnd(m, 3) ? prevs[rnd(m, np)] : KVD_NONE;
    uint8_t kind = (uint8_t)rnd(m, M_KINDS);
    uint32_t tok[FX_PT], canon;
    uint8_t h[KVD_HASH_BYTES], want[KVD_HASH_BYTES];
    kind_tokens(kind, tok);
    const mprompt_t *pp = NULL;
    if (prev != KVD_NONE) {
        kvd_page_info_t pi = info(m, prev);
        pp = prompt_find(m, pi.hash);
    }
    kvd_core_chain_hash(m->c, pp ? pp->hash : NULL, tok, FX_PT, NULL, 0, want);
    int rc = kvd_core_seal(m->c, ss->sid, lid, prev, tok, FX_PT, NULL, 0, h, &canon);
    saw(m, s);
    if (nomem(m, rc))
        return;
    if (rc != KV_ERR_OK)
        M_FAIL(m, "seal(%u after %u): %s", lid, prev, kvd_core_errmsg(m->c));
    if (memcmp(h, want, KVD_HASH_BYTES) != 0)
        M_FAIL(m, "seal reported a hash other than the chain hash");
    kvd_page_info_t ci = info(m, canon);
    if (ci.state != KVD_PAGE_SEALED || memcmp(ci.hash, h, KVD_HASH_BYTES) != 0)
        M_FAIL(m, "seal's canonical page %u is not sealed under its hash", canon);
    uint32_t bound;
    if (kvd_core_cache_find(m->c, h, &bound) != KV_ERR_OK || bound != canon)
        M_FAIL(m, "hash of sealed page %u not bound to it", canon);
    if (canon != lid) { /* dedupe: every ref of s on lid moved to canon, same positions */
        m->dedupes++;
        if (info(m, lid).state != KVD_PAGE_RETIRED)
            M_FAIL(m, "deduplicated page %u not retired", lid);
        ss->loose[canon] += ss->loose[lid];
        ss->loose[lid] = 0;
        for (int q = 0; q < ss->nseq; q++)
            for (uint32_t i = 0; i < ss->seq[q].n; i++)
                if (ss->seq[q].lids[i] == lid)
                    ss->seq[q].lids[i] = canon;
    }
    if (!prompt_find(m, h) && m->npr < M_PROMPTS) {
        mprompt_t *p = &m->pr[m->npr++];
        memcpy(p->hash, h, KVD_HASH_BYTES);
        p->depth = pp ? pp->depth + 1 : 1;
        if (pp)
            memcpy(p->kinds, pp->kinds, pp->depth);
        p->kinds[p->depth - 1] = kind;
    }
}

static void op_lookup(model_t *m, int s)
{
    uint8_t kinds[M_DEPTH + 2];
    uint32_t depth = 0;
    if (m->npr && rnd(m, 4)) {
        const mprompt_t *p = &m->pr[rnd(m, m->npr)];
        memcpy(kinds, p->kinds, p->depth);
        depth = p->depth;
    }
    for (uint32_t extra = rnd(m, 3); extra && depth < M_DEPTH + 2; extra--)
        kinds[depth++] = (uint8_t)rnd(m, M_KINDS);
    uint32_t tok[(M_DEPTH + 2) * FX_PT + 2], out[M_DEPTH + 2], np = 0, nt = 0;
    for (uint32_t i = 0; i < depth; i++)
        kind_tokens(kinds[i], tok + i * FX_PT);
    uint32_t ntok = depth * FX_PT + rnd(m, 2); /* sometimes a partial last page */
    tok[depth * FX_PT] = 7;
    uint32_t max = rnd(m, 4) ? M_DEPTH + 2 : rnd(m, 3);
    int rc = kvd_core_lookup(m->c, m->s[s].sid, tok, ntok, NULL, 0, out, max, &np, &nt);
    saw(m, s);
    if (nomem(m, rc))
        return;
    if (rc != KV_ERR_OK)
        M_FAIL(m, "lookup: %s", kvd_core_errmsg(m->c));
    uint8_t h[KVD_HASH_BYTES], prev[KVD_HASH_BYTES];
    for (uint32_t i = 0; i <= np && i < depth; i++) {
        kvd_core_chain_hash(m->c, i ? prev : NULL, tok + i * FX_PT, FX_PT, NULL, 0, h);
        uint32_t bound;
        int found = kvd_core_cache_find(m->c, h, &bound) == KV_ERR_OK;
        if (i == np) { /* the longest prefix: the next page is not cached (or max stopped) */
            if (found && np < max)
                M_FAIL(m, "lookup stopped at %u pages but page %u (logical %u) is cached", np,
                       i, bound);
            break;
        }
        kvd_page_info_t pi = info(m, out[i]);
        if (!found || bound != out[i] || pi.state != KVD_PAGE_SEALED ||
            memcmp(pi.hash, h, KVD_HASH_BYTES) != 0)
            M_FAIL(m, "lookup page %u: logical %u is not the page bound under its chain hash", i,
                   out[i]);
        memcpy(prev, h, KVD_HASH_BYTES);
        m->s[s].loose[out[i]]++;
    }
    if (np > depth || nt != np * FX_PT)
        M_FAIL(m, "lookup returned %u pages / %u tokens of %u full pages", np, nt, depth);
    m->hits += np;
}

/* A cached (or, when `pinned`, pinned) logical id at random, or KVD_NONE. */
static uint32_t pick_cached(model_t *m, int pinned)
{
    uint32_t cand[M_NL], n = 0;
    for (uint32_t l = 0; l < m->nl; l++) {
        kvd_page_info_t pi = info(m, l);
        if (pinned ? m->pins[l] > 0 : pi.cache != 0)
            cand[n++] = l;
    }
    return n ? cand[rnd(m, n)] : KVD_NONE;
}

static void op_pin(model_t *m, int unpin)
{
    uint32_t l = pick_cached(m, unpin);
    if (l == KVD_NONE)
        return;
    if ((unpin ? kvd_core_unpin(m->c, l) : kvd_core_pin(m->c, l)) != KV_ERR_OK)
        M_FAIL(m, "%s(%u): %s", unpin ? "unpin" : "pin", l, kvd_core_errmsg(m->c));
    m->pins[l] += unpin ? -1u : 1u;
}

static void op_evict(model_t *m)
{
    uint32_t l = pick_cached(m, 0);
    if (l == KVD_NONE)
        return;
    int rc = kvd_core_cache_evict(m->c, l);
    m->admin_evicted = l;
    if (rc != (m->pins[l] ? KV_ERR_FAILED_PRECONDITION : KV_ERR_OK))
        M_FAIL(m, "cache_evict(%u, pins %u): %s", l, m->pins[l], kv_err_name(rc));
    kvd_page_info_t pi = info(m, l);
    if (!m->pins[l] && pi.cache)
        M_FAIL(m, "evicted page %u still cached", l);
}

static void op_quota(model_t *m)
{
    kv_fmt_t f = (kv_fmt_t)rnd(m, KV_FMT_COUNT);
    if (kvd_core_set_cache_quota(m->c, f, rnd(m, 8)) != KV_ERR_OK)
        M_FAIL(m, "set_cache_quota: %s", kvd_core_errmsg(m->c));
}

static void op_convert(model_t *m)
{
    uint32_t lid[3], n = 1 + rnd(m, 3);
    kv_fmt_t dst[3];
    int rc[3];
    for (uint32_t i = 0; i < n; i++) {
        lid[i] = rnd(m, m->nl);
        kvd_page_info_t pi = info(m, lid[i]);
        dst[i] = pi.fmt == KV_FMT_FP8 ? KV_FMT_TQ3 : KV_FMT_FP8;
    }
    int inject = rnd(m, 8) == 0;
    kvd_backend_t *be = kvd_core_backend(m->c);
    be->test_fail_convert = inject;
    kvd_core_convert_batch(m->c, n, lid, dst, rc);
    be->test_fail_convert = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (rc[i] == KV_ERR_OK) {
            m->conversions++;
            if (info(m, lid[i]).fmt != dst[i] && info(m, lid[i]).state != KVD_PAGE_FREE)
                M_FAIL(m, "converted page %u is not %s", lid[i], kvd_fmt_name(dst[i]));
        } else if (rc[i] != KV_ERR_RESOURCE_EXHAUSTED && rc[i] != KV_ERR_FAILED_PRECONDITION &&
                   rc[i] != KV_ERR_INVALID_ARGUMENT && !(inject && rc[i] == KV_ERR_DEVICE) &&
                   !nomem(m, rc[i])) {
            M_FAIL(m, "convert(%u): %s", lid[i], kv_err_name(rc[i]));
        }
    }
}

static void op_restore(model_t *m)
{
    kv_fmt_t f = (kv_fmt_t)rnd(m, KV_FMT_COUNT);
    kvd_backend_t *be = kvd_core_backend(m->c);
    size_t len = (size_t)be->exp.page_bytes[f];
    uint8_t *bytes = calloc(1, len), hash[KVD_HASH_BYTES];
    assert_non_null(bytes);
    for (int i = 0; i < KVD_HASH_BYTES; i++)
        hash[i] = (uint8_t)rnd(m, 256);
    uint32_t lid;
    int rc = kvd_core_cache_restore(m->c, hash, f, bytes, len, &lid);
    free(bytes);
    if (rc == KV_ERR_RESOURCE_EXHAUSTED || nomem(m, rc))
        return;
    if (rc != KV_ERR_OK)
        M_FAIL(m, "restore: %s", kvd_core_errmsg(m->c));
    if (lid != KVD_NONE)
        fresh_lid(m, lid);
}

static void op_launch(model_t *m, int s)
{
    if (m->nk == M_KERN || m->s[s].fenced)
        return;
    uint32_t l = pick_held(m, &m->s[s], 0);
    if (l == KVD_NONE)
        return;
    mkern_t *k = &m->k[m->nk++];
    memset(k, 0, sizeof(*k));
    k->s = s;
    k->lid = l;
    k->tag = m->s[s].seen; /* the latest epoch its session has seen */
    m->kernels++;
    /* what it resolves is recorded by watch_kernels, now and at every later step */
}

static void op_complete(model_t *m, int s)
{
    uint32_t cand[M_KERN], n = 0;
    for (uint32_t i = 0; i < m->nk; i++)
        if (m->k[i].s == s)
            cand[n++] = i;
    if (n)
        kern_drop(m, cand[rnd(m, n)]);
}

static void op_report(model_t *m, int s)
{
    msess_t *ss = &m->s[s];
    uint64_t d = ss->seen;
    for (uint32_t i = 0; i < m->nk; i++)
        if (m->k[i].s == s && m->k[i].tag < d)
            d = m->k[i].tag;
    if (d < ss->reported)
        M_FAIL(m, "model: safe epoch went back (%llu < %llu)", (unsigned long long)d,
               (unsigned long long)ss->reported);
    int rc = kvd_core_session_report_epoch(m->c, ss->sid, d);
    if (rc != KV_ERR_OK)
        M_FAIL(m, "report_epoch(%llu): %s", (unsigned long long)d, kvd_core_errmsg(m->c));
    ss->reported = d;
    saw(m, s);
}

/* ---- the comparison after each step ----------------------------------------------------- */
static void watch_kernels(model_t *m)
{
    const kvd_core_t *c = m->c;
    for (uint32_t i = 0; i < m->nk; i++) {
        mkern_t *k = &m->k[i];
        /* a kernel resolves its logical id whenever it runs: add the current mapping */
        kv_dir_entry_t e = __atomic_load_n(&c->dir[k->lid], __ATOMIC_ACQUIRE);
        if (kv_dir_flags(e) & KV_DIR_VALID) {
            uint32_t j;
            for (j = 0; j < k->nres; j++)
                if (k->rf[j] == kv_dir_fmt(e) && k->rp[j] == kv_dir_phys(e))
                    break;
            if (j == k->nres && k->nres < M_RES) {
                k->rf[k->nres] = (uint8_t)kv_dir_fmt(e);
                k->rp[k->nres++] = kv_dir_phys(e);
            }
        }
        for (uint32_t j = 0; j < k->nres; j++) {
            const kvd_ppage_t *pp = &c->pool[k->rf[j]].pg[k->rp[j]];
            int ok = (pp->state == KVD_PHYS_LIVE && pp->lid == k->lid) ||
                     (pp->state == KVD_PHYS_RETIRED && pp->stamp > k->tag);
            if (!ok)
                M_FAIL(m, "session %d's kernel tagged %llu on logical %u may read %s phys %u, "
                          "which is now %s (lid %u, stamp %llu)",
                       k->s, (unsigned long long)k->tag, k->lid, kvd_fmt_name(k->rf[j]), k->rp[j],
                       pp->state == KVD_PHYS_FREE      ? "FREE"
                       : pp->state == KVD_PHYS_LIVE    ? "LIVE"
                       : pp->state == KVD_PHYS_RETIRED ? "RETIRED (stamp too low)"
                                                       : "FILLING",
                       pp->lid, (unsigned long long)pp->stamp);
        }
    }
}

static void compare(model_t *m)
{
    char rep[2048];
    int n = kvd_core_check(m->c, rep, sizeof(rep));
    if (n)
        M_FAIL(m, "kvd_core_check: %d problems:\n%s", n, rep);
    for (uint32_t l = 0; l < m->nl; l++) {
        uint32_t loose = 0, seq = 0;
        for (int s = 0; s < M_SESS; s++) {
            if (!m->s[s].live)
                continue;
            loose += m->s[s].loose[l];
            seq += held(&m->s[s], l) - m->s[s].loose[l];
        }
        kvd_page_info_t pi = info(m, l);
        if (pi.req_loose != loose || pi.req_seq != seq || pi.pins != m->pins[l])
            M_FAIL(m, "logical %u: core loose %u seq %u pins %u, model %u %u %u", l,
                   pi.req_loose, pi.req_seq, pi.pins, loose, seq, m->pins[l]);
        if ((loose || seq || m->pins[l]) && pi.state != KVD_PAGE_OPEN &&
            pi.state != KVD_PAGE_SEALED)
            M_FAIL(m, "logical %u is held but %s", l, kvd_page_state_name(pi.state));
        if (m->pins[l] && !pi.cache)
            M_FAIL(m, "pinned logical %u left the cache", l);
        /* only the operator unbinds a page in use; quota and pressure take idle entries */
        if (m->cached[l] && !pi.cache && l != m->admin_evicted && (loose || seq))
            M_FAIL(m, "logical %u was evicted with %u loose and %u sequence refs", l, loose,
                   seq);
        m->cached[l] = pi.cache != 0;
        kv_dir_entry_t e = __atomic_load_n(&m->c->dir[l], __ATOMIC_ACQUIRE);
        const kv_dir_entry_t body = ~((kv_dir_entry_t)0xffff << 48);
        if ((e & body) != (m->dir[l] & body) && kv_dir_gen(e) == kv_dir_gen(m->dir[l]))
            M_FAIL(m, "directory entry %u changed (%016llx -> %016llx) without a new "
                      "generation",
                   l, (unsigned long long)m->dir[l], (unsigned long long)e);
        m->dir[l] = e;
    }
    watch_kernels(m);
}

static void run_one(unsigned seed, uint32_t steps, int config)
{
    model_t *m = calloc(1, sizeof(*m));
    assert_non_null(m);
    kvd_core_opts_t o;
    fx_opts(&o);
    if (config == 1) { /* more ids than pages, small FP8 cache quota, bigger TQ3 pool */
        o.pages[KV_FMT_TQ3] = 9;
        o.cache_quota_pages[KV_FMT_TQ3] = 9;
        o.cache_quota_pages[KV_FMT_FP8] = 3;
        o.logical_ids = M_NL;
    }
    m->c = fx_core_opts(&o);
    m->nl = o.logical_ids ? o.logical_ids : o.pages[KV_FMT_FP8] + o.pages[KV_FMT_TQ3];
    assert_true(m->nl <= M_NL);
    m->seed = seed;
    m->rng = 0x9e3779b97f4a7c15ull * (seed + 1);
    for (uint32_t l = 0; l < m->nl; l++)
        m->dir[l] = m->c->dir[l];
    m->op = "open";
    op_open(m);
    for (m->step = 0; m->step < steps; m->step++) {
        int s = pick_sess(m);
        uint32_t r = rnd(m, 100);
        m->admin_evicted = KVD_NONE;
        m->inj = rnd(m, 12) == 0;
        if (m->inj)
            kvd_alloc_fail_after(1 + rnd(m, 3));
        if (s < 0 || r < 3) {
            m->op = "open";
            op_open(m);
        } else if (r < 5) {
            m->op = "close";
            op_close(m, s);
        } else if (r < 6) {
            m->op = "fence";
            if (rnd(m, 4) == 0)
                op_fence(m, s);
        } else if (r < 18) {
            m->op = "alloc";
            op_alloc(m, s);
        } else if (r < 25) {
            m->op = "release";
            op_release(m, s);
        } else if (r < 28) {
            m->op = "seq_open";
            op_seq_open(m, s);
        } else if (r < 36) {
            m->op = "seq_append";
            op_seq_append(m, s);
        } else if (r < 40) {
            m->op = "seq_close";
            op_seq_close(m, s);
        } else if (r < 52) {
            m->op = "seal";
            op_seal(m, s);
        } else if (r < 60) {
            m->op = "lookup";
            op_lookup(m, s);
        } else if (r < 62) {
            m->op = "pin";
            op_pin(m, 0);
        } else if (r < 64) {
            m->op = "unpin";
            op_pin(m, 1);
        } else if (r < 66) {
            m->op = "evict";
            op_evict(m);
        } else if (r < 67) {
            m->op = "quota";
            op_quota(m);
        } else if (r < 74) {
            m->op = "convert";
            op_convert(m);
        } else if (r < 75) {
            m->op = "restore";
            op_restore(m);
        } else if (r < 84) {
            m->op = "launch";
            op_launch(m, s);
        } else if (r < 91) {
            m->op = "complete";
            op_complete(m, s);
        } else if (r < 98) {
            m->op = "report";
            op_report(m, s);
        } else {
            m->op = "collect";
            kvd_core_collect(m->c);
        }
        kvd_alloc_fail_after(0); /* before compare: the checker allocates too */
        compare(m);
    }
    /* Everything goes: sessions die, pins and cache entries are dropped; nothing may leak. */
    m->op = "teardown";
    for (int s = 0; s < M_SESS; s++)
        if (m->s[s].live)
            op_close(m, s);
    for (uint32_t l = 0; l < m->nl; l++) {
        while (m->pins[l]) {
            assert_int_equal(kvd_core_unpin(m->c, l), KV_ERR_OK);
            m->pins[l]--;
        }
        if (info(m, l).cache)
            assert_int_equal(kvd_core_cache_evict(m->c, l), KV_ERR_OK);
    }
    kvd_core_collect(m->c);
    compare(m);
    kvd_stats_t st = fx_stats(m->c);
    for (int f = 0; f < KV_FMT_COUNT; f++)
        if (st.pages_free[f] != o.pages[f])
            M_FAIL(m, "%s pool: %llu of %u pages free after teardown", kvd_fmt_name(f),
                   (unsigned long long)st.pages_free[f], o.pages[f]);
    if (st.logical_free != m->nl)
        M_FAIL(m, "%llu of %u logical ids free after teardown",
               (unsigned long long)st.logical_free, m->nl);
    print_message("seed %u config %d: %u steps, %llu kernels, %llu conversions, %llu dedupes, "
                  "%llu lookup hits, %llu allocs refused, %llu calls failed NOMEM\n",
                  seed, config, steps, (unsigned long long)m->kernels,
                  (unsigned long long)m->conversions, (unsigned long long)m->dedupes,
                  (unsigned long long)m->hits, (unsigned long long)m->ops_refused,
                  (unsigned long long)m->nomem);
    kvd_core_free(&m->c);
    free(m);
}

static void test_model_small_pools(void **state)
{
    (void)state;
    for (unsigned seed = 1; seed <= 6; seed++)
        run_one(seed, 20000, 0);
}

static void test_model_more_ids_than_pages(void **state)
{
    (void)state;
    for (unsigned seed = 101; seed <= 106; seed++)
        run_one(seed, 20000, 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_small_pools),
        cmocka_unit_test(test_model_more_ids_than_pages),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
