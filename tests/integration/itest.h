/* itest.h — helpers shared by the integration tests: start the real kvd on a temporary ipc
 * endpoint (mkdtemp), wait for it without fixed sleeps, run kvctl, read figures, stop it and
 * require a clean exit. Binaries come from the build (KVD_BIN, KVCTL_BIN compile definitions).
 *
 * Timeouts are generous (tens of seconds) because CI is a loaded 2-core machine; every wait
 * polls a condition every few milliseconds and returns as soon as it holds.
 */
#ifndef ITEST_H
#define ITEST_H

#include <stdint.h>
#include <sys/types.h>

#include "kvc.h"

typedef struct itest_kvd_s {
    char dir[256];      /* mkdtemp directory */
    char endpoint[320]; /* ipc://DIR/run/kvd.sock */
    char log[320];      /* daemon's stderr */
    pid_t pid;
} itest_kvd_t;

/* Start kvd with small test geometry plus extra "--key value" args (NULL-terminated list).
 * Aborts the test on failure. */
void itest_kvd_start(itest_kvd_t *k, const char *const *extra);
/* Fork and exec kvd (argv[0] = KVD_BIN) with stdout and stderr into `log` (appended to when
 * `append`), killed with the test process if that dies first; returns its pid at once. */
pid_t itest_kvd_exec(const char *const *argv, const char *log, int append);
/* A daemon's log to stderr (a failing test shows why kvd ended as it did). */
void itest_print_log(const char *log);
/* SIGTERM, wait; returns the exit status (0 = clean). Removes the temp dir. */
int itest_kvd_stop(itest_kvd_t *k);
/* A fresh directory /tmp/<prefix>-XXXXXX into buf (aborts the test on failure), and its
 * removal with everything in it (fails the test when that fails). */
void itest_tmpdir(char *buf, size_t cap, const char *prefix);
void itest_rmtree(const char *dir);
/* SIGTERM, wait, then start a new kvd on the SAME endpoint and directory with `extra` (as
 * itest_kvd_start; its log is appended to the old one). Returns the old daemon's exit status;
 * aborts the test when the new one does not start. Clients connected to the old daemon stay
 * connected: their DEALER reconnects to the new one (the daemon-restart tests). */
int itest_kvd_restart(itest_kvd_t *k, const char *const *extra);
/* The two halves of itest_kvd_restart, for tests that act while no daemon listens. */
int itest_kvd_down(itest_kvd_t *k);
void itest_kvd_up(itest_kvd_t *k, const char *const *extra);
/* Connect + hello (map = 1) with a generous timeout; aborts on failure. */
kvc_t *itest_connect(const itest_kvd_t *k, const char *name);
/* Value of a status stat by name ("request_refs", "pages_open.fp8"); aborts when missing. */
uint64_t itest_stat(const itest_kvd_t *k, const char *name);
/* Run kvctl with args (NULL-terminated); stdout into out[cap]; returns its exit status. */
int itest_kvctl(const itest_kvd_t *k, char *out, size_t cap, const char *const *args);
/* Wait (polling) until stat `name` == want, up to timeout_ms. Returns elapsed ms or -1. */
int64_t itest_wait_stat(const itest_kvd_t *k, const char *name, uint64_t want, int timeout_ms);
int64_t itest_now_us(void);
/* Run argv (argv[0] a path) with stdout and stderr into out[cap]; returns its exit status
 * (128 when it did not exit normally). */
int itest_run(const char *const *argv, char *out, size_t cap);
/* The same as uid and gid `as` when as >= 0 (the caller is root; 126 when it cannot switch),
 * killed after alarm_s seconds when alarm_s > 0 (128 + SIGALRM), so a hang fails the test. */
int itest_run_as(const char *const *argv, int as, unsigned alarm_s, char *out, size_t cap);
/* A loopback TCP port free at the time of the call. */
int itest_free_port(void);
/* GET /metrics from 127.0.0.1:port into out[cap] (headers included); returns the length. */
size_t itest_scrape(int port, char *out, size_t cap);
/* A prompt of known content (tests of sharing, snapshots, restarts): npages pages of
 * ITEST_PT tokens from `seed`, and a known byte for every page position. */
#define ITEST_PT 16u /* itest_kvd_start's page_tokens */
void itest_prompt_tokens(uint32_t seed, uint32_t npages, uint32_t *tok);
uint8_t itest_prompt_byte(uint32_t seed, uint32_t page, uint64_t i);
/* Allocate npages FP8 pages, write the known bytes through c's mapping, seal them in order
 * with the known tokens; pages[npages] receives the ids (references stay held). */
void itest_seal_known(kvc_t *c, uint32_t seed, uint32_t npages, uint32_t *pages);
/* Every byte of pages[0..np) (hits of a lookup of the known prompt) read through c's mapping
 * equals the known byte; fails the test naming the first difference. */
void itest_check_known(kvc_t *c, uint32_t seed, const uint32_t *pages, size_t np);
/* kvctl check passes (exit 0 and "leaks: 0"). */
void itest_assert_check(const itest_kvd_t *k);

#endif /* ITEST_H */
