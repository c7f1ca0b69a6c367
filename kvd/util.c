/* util.c — panic, the allocation wrapper with its fault hook, and the u64 map (see util.h).
 *
 * The map uses linear probing with backward-shift deletion: no tombstones, so lookups stay
 * short after churn (sessions release and re-take references all the time), and iteration is a
 * plain scan of the slot array. Hash: the splitmix64 finaliser, good enough for sequential ids.
 */
#include "util.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include "kv_format.h"

void kvd_panic_at(const char *file, int line, const char *func, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "kvd: PANIC at %s:%d (%s): ", file, line, func);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
    abort();
}

void kvd_fmt(char *buf, size_t len, const char *fmt, ...)
{
    va_list ap;
    if (!buf || len == 0)
        return;
    va_start(ap, fmt);
    vsnprintf(buf, len, fmt, ap);
    va_end(ap);
}

/* ---- allocation wrapper ------------------------------------------------------------------ */
static uint64_t g_fail_after; /* 0 = off; else the countdown to the first failing call */
/* atomic: the snapshot writer's worker thread allocates and frees too (snap_writer_settle) */
static _Atomic int64_t g_live;

static int alloc_should_fail(void)
{
    if (g_fail_after == 0)
        return 0;
    if (g_fail_after == 1)
        return 1; /* stays at 1: every later call fails too, until reset */
    g_fail_after--;
    return 0;
}

void kvd_alloc_fail_after(uint64_t n)
{
    g_fail_after = n;
}

int64_t kvd_alloc_live(void)
{
    return atomic_load_explicit(&g_live, memory_order_relaxed);
}

void *kvd_malloc(size_t n)
{
    if (n == 0)
        n = 1;
    if (alloc_should_fail())
        return NULL;
    void *p = malloc(n);
    if (p)
        atomic_fetch_add_explicit(&g_live, 1, memory_order_relaxed);
    return p;
}

void *kvd_calloc(size_t nmemb, size_t size)
{
    if (size && nmemb > SIZE_MAX / size)
        return NULL;
    if (nmemb == 0 || size == 0)
        nmemb = size = 1;
    if (alloc_should_fail())
        return NULL;
    void *p = calloc(nmemb, size);
    if (p)
        atomic_fetch_add_explicit(&g_live, 1, memory_order_relaxed);
    return p;
}

void *kvd_realloc(void *p, size_t n)
{
    if (!p)
        return kvd_malloc(n);
    if (n == 0)
        n = 1;
    if (alloc_should_fail())
        return NULL;
    return realloc(p, n); /* on failure p is untouched and still counted */
}

void kvd_free(void *p)
{
    if (p) {
        atomic_fetch_sub_explicit(&g_live, 1, memory_order_relaxed);
        free(p);
    }
}

/* ---- u64 map ----------------------------------------------------------------------------- */
static uint64_t map_hash(uint64_t k)
{
    return kv_splitmix64(k);
}

void kvd_map_init(kvd_map_t *m)
{
    memset(m, 0, sizeof(*m));
}

void kvd_map_fini(kvd_map_t *m)
{
    kvd_free(m->keys);
    kvd_free(m->vals);
    memset(m, 0, sizeof(*m));
}

static void map_insert_nogrow(kvd_map_t *m, uint64_t key, uint64_t val)
{
    uint64_t mask = m->cap - 1;
    for (uint64_t i = map_hash(key) & mask;; i = (i + 1) & mask) {
        if (m->keys[i] == KVD_MAP_EMPTY) {
            m->keys[i] = key;
            m->vals[i] = val;
            m->len++;
            return;
        }
        if (m->keys[i] == key) {
            m->vals[i] = val;
            return;
        }
    }
}

int kvd_map_reserve(kvd_map_t *m, uint64_t extra)
{
    uint64_t need = m->len + extra;
    if (need * 4 <= m->cap * 3)
        return 0;
    uint64_t cap = m->cap ? m->cap : 8;
    while (need * 4 > cap * 3)
        cap *= 2;
    uint64_t *keys = kvd_malloc(cap * sizeof(uint64_t));
    uint64_t *vals = kvd_malloc(cap * sizeof(uint64_t));
    if (!keys || !vals) {
        kvd_free(keys);
        kvd_free(vals);
        return -1;
    }
    memset(keys, 0xff, cap * sizeof(uint64_t)); /* KVD_MAP_EMPTY everywhere */
    kvd_map_t n = {.keys = keys, .vals = vals, .cap = cap, .len = 0};
    for (uint64_t i = 0; i < m->cap; i++)
        if (m->keys[i] != KVD_MAP_EMPTY)
            map_insert_nogrow(&n, m->keys[i], m->vals[i]);
    kvd_free(m->keys);
    kvd_free(m->vals);
    *m = n;
    return 0;
}

uint64_t *kvd_map_get(const kvd_map_t *m, uint64_t key)
{
    if (m->cap == 0 || key == KVD_MAP_EMPTY)
        return NULL;
    uint64_t mask = m->cap - 1;
    for (uint64_t i = map_hash(key) & mask;; i = (i + 1) & mask) {
        if (m->keys[i] == key)
            return &m->vals[i];
        if (m->keys[i] == KVD_MAP_EMPTY)
            return NULL;
    }
}

int kvd_map_put(kvd_map_t *m, uint64_t key, uint64_t val)
{
    KVD_ASSERT(key != KVD_MAP_EMPTY);
    uint64_t *v = kvd_map_get(m, key);
    if (v) {
        *v = val;
        return 0;
    }
    if (kvd_map_reserve(m, 1) != 0)
        return -1;
    map_insert_nogrow(m, key, val);
    return 0;
}

int kvd_map_del(kvd_map_t *m, uint64_t key)
{
    if (m->cap == 0 || key == KVD_MAP_EMPTY)
        return 0;
    uint64_t mask = m->cap - 1;
    uint64_t i = map_hash(key) & mask;
    while (m->keys[i] != key) {
        if (m->keys[i] == KVD_MAP_EMPTY)
            return 0;
        i = (i + 1) & mask;
    }
    /* Backward shift: pull later members of the probe run into the hole when the hole lies
     * between their home slot and their current slot (cyclically). */
    uint64_t hole = i;
    for (uint64_t j = (i + 1) & mask; m->keys[j] != KVD_MAP_EMPTY; j = (j + 1) & mask) {
        uint64_t home = map_hash(m->keys[j]) & mask;
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            m->keys[hole] = m->keys[j];
            m->vals[hole] = m->vals[j];
            hole = j;
        }
    }
    m->keys[hole] = KVD_MAP_EMPTY;
    m->len--;
    return 1;
}

/* Every slot below *pos is empty (the earlier pops emptied them, and a deletion's backward shift
 * moves entries only into its hole or later holes of the same run, never below the slot it
 * deleted: a run that wraps past the end would have to start in a slot below *pos). So the slot
 * just emptied is looked at again (an entry may have moved into it) and the scan never goes
 * back. */
int kvd_map_pop(kvd_map_t *m, uint64_t *pos, uint64_t *key, uint64_t *val)
{
    for (; *pos < m->cap; (*pos)++) {
        if (m->keys[*pos] != KVD_MAP_EMPTY) {
            *key = m->keys[*pos];
            if (val)
                *val = m->vals[*pos];
            kvd_map_del(m, *key);
            return 1;
        }
    }
    return 0;
}

int kvd_map_next(const kvd_map_t *m, uint64_t *pos, uint64_t *key, uint64_t *val)
{
    for (; *pos < m->cap; (*pos)++) {
        if (m->keys[*pos] != KVD_MAP_EMPTY) {
            *key = m->keys[*pos];
            if (val)
                *val = m->vals[*pos];
            (*pos)++;
            return 1;
        }
    }
    return 0;
}

uint64_t kvd_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int kvd_lock_file(const char *path, const char *what, const char *directive, char *err,
                  size_t errlen)
{
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        kvd_fmt(err, errlen, "%s: cannot open lock file %s: %s", what, path, strerror(errno));
        return -1;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        const int e = errno;
        char pid[32] = "";
        const ssize_t n = pread(fd, pid, sizeof pid - 1, 0);
        pid[n > 0 ? n : 0] = '\0';
        pid[strcspn(pid, "\n")] = '\0';
        if (e == EWOULDBLOCK)
            kvd_fmt(err, errlen,
                    "%s is in use by another kvd (pid %s, lock file %s): stop that "
                    "kvd, or give this one another %s",
                    what, pid[0] ? pid : "unknown", path, directive);
        else
            kvd_fmt(err, errlen, "%s: flock(%s) failed: %s", what, path, strerror(e));
        close(fd);
        return -1;
    }
    char buf[32];
    const int len = snprintf(buf, sizeof buf, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, buf, (size_t)len, 0) != len) {
        kvd_fmt(err, errlen, "%s: writing lock file %s failed: %s", what, path, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}
