/* util.h — the daemon's small shared helpers: panic/assert, the one allocation wrapper, and an
 * open-addressing u64 → u64 map.
 *
 * Panics are for broken invariants only ("cannot happen": refcount below zero, freeing a pinned
 * page, a page on two lists). They print file:line and the condition, then abort(), so a core
 * dump points at the bug. Anything a client or the environment can cause returns a kv_err_t.
 *
 * Every allocation of kvdcore goes through kvd_malloc/kvd_calloc/kvd_realloc/kvd_free. The
 * daemon executable links jemalloc, so these land there; tests set a "fail after N calls" hook
 * (SQLite's OOM loops, STYLE.md §14) and check that every operation either completes or leaves
 * the state exactly as before, with nothing leaked.
 *
 * Thread rule: kvdcore runs on the daemon's single loop thread (docs/core.md). The live count
 * is atomic because the snapshot writer's worker thread allocates too; the fault hook is a
 * plain global, set by single-threaded tests only.
 */
#ifndef KVD_UTIL_H
#define KVD_UTIL_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define KVD_NORETURN __attribute__((noreturn))
#define KVD_PRINTF(a, b) __attribute__((format(printf, a, b)))
#define KVD_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define KVD_NORETURN
#define KVD_PRINTF(a, b)
#define KVD_UNLIKELY(x) (x)
#endif

/* Print "kvd: PANIC at file:line (func): message" to stderr and abort(). Never returns. */
KVD_NORETURN void kvd_panic_at(const char *file, int line, const char *func, const char *fmt, ...)
    KVD_PRINTF(4, 5);

#define KVD_PANIC(...) kvd_panic_at(__FILE__, __LINE__, __func__, __VA_ARGS__)
/* Always on (also in release builds): an invariant check is cheap next to a corrupted cache. */
#define KVD_ASSERT(cond)                                                                           \
    do {                                                                                           \
        if (KVD_UNLIKELY(!(cond)))                                                                 \
            kvd_panic_at(__FILE__, __LINE__, __func__, "assertion failed: %s", #cond);             \
    } while (0)

/* ---- single-instance lock ----------------------------------------------------------------- */
/* An exclusive flock on PATH (created 0600, O_NOFOLLOW), which then holds this process's pid as
 * text. Returns the open fd, kept for the process's life (the kernel drops the lock when the
 * process ends, however it ends), or -1 with err naming WHAT, the holder's pid and the remedy:
 * another value of DIRECTIVE ("endpoint", "snapshot_dir"). The file is never unlinked: a daemon
 * unlinking it at exit could let a third one lock a new inode while a second still holds the
 * old one. */
int kvd_lock_file(const char *path, const char *what, const char *directive, char *err,
                  size_t errlen);

/* ---- allocation wrapper ------------------------------------------------------------------ */
void *kvd_malloc(size_t n);
void *kvd_calloc(size_t nmemb, size_t size); /* overflow-checked */
void *kvd_realloc(void *p, size_t n);
void kvd_free(void *p);

/* Test hook: the n-th allocation from now (1 = the next one) and every later one fail, until
 * reset with n = 0. Counts kvd_malloc, kvd_calloc and kvd_realloc with a non-zero size. */
void kvd_alloc_fail_after(uint64_t n);
/* Number of live blocks allocated through the wrapper (malloc'd minus freed). Tests use it to
 * prove that a failed operation leaked nothing. Pointers must be freed with kvd_free. */
int64_t kvd_alloc_live(void);

/* Write a formatted message into buf[len] (truncating, always NUL-terminated when len > 0). */
void kvd_fmt(char *buf, size_t len, const char *fmt, ...) KVD_PRINTF(3, 4);

/* CLOCK_MONOTONIC in ns: real elapsed time (the core's injectable clock, kvd__now, is for
 * ages and may be a test's) */
uint64_t kvd_mono_ns(void);

/* ---- u64 → u64 open-addressing map ------------------------------------------------------- */
/* Linear probing with backward-shift deletion (no tombstones), capacity a power of two, load
 * ≤ 3/4. The key KVD_MAP_EMPTY is reserved. Iteration order is unspecified and changes when the
 * map is modified. kvd_map_reserve() lets a caller make a later insert infallible, which is how
 * the core keeps each operation all-or-nothing under allocation failure. */
#define KVD_MAP_EMPTY UINT64_MAX

typedef struct kvd_map_s {
    uint64_t *keys;
    uint64_t *vals;
    uint64_t cap; /* 0 or a power of two */
    uint64_t len;
} kvd_map_t;

void kvd_map_init(kvd_map_t *m);
void kvd_map_fini(kvd_map_t *m);
/* 0, or -1 when memory for `extra` more keys could not be allocated (map unchanged). */
int kvd_map_reserve(kvd_map_t *m, uint64_t extra);
/* Pointer to the value of key, or NULL. Valid until the map is modified. */
uint64_t *kvd_map_get(const kvd_map_t *m, uint64_t key);
/* Insert or overwrite. 0, or -1 on allocation failure (map unchanged). */
int kvd_map_put(kvd_map_t *m, uint64_t key, uint64_t val);
/* 1 when the key was present and removed, 0 otherwise. */
int kvd_map_del(kvd_map_t *m, uint64_t key);
/* Iterate: start with *pos = 0; returns 1 and fills key/val while entries remain. Do not modify
 * the map during iteration. */
int kvd_map_next(const kvd_map_t *m, uint64_t *pos, uint64_t *key, uint64_t *val);
/* Drain: start with *pos = 0; removes one entry and returns 1 with its key/val, 0 when the map
 * is empty. Draining a whole map costs O(cap + len) (restarting kvd_map_next at 0 after every
 * kvd_map_del costs O(cap) per entry). Between pops the caller may delete other keys but must
 * not insert. */
int kvd_map_pop(kvd_map_t *m, uint64_t *pos, uint64_t *key, uint64_t *val);

#endif /* KVD_UTIL_H */
