/* itest.c — see itest.h. */
#include "itest.h"

#include "kvproto.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

int64_t itest_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void itest_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

void itest_print_log(const char *log)
{
    char cmd[400];
    snprintf(cmd, sizeof cmd, "cat %s >&2", log);
    if (system(cmd)) { /* the log is a diagnostic: a failed cat changes nothing */
    }
}

pid_t itest_kvd_exec(const char *const *argv, const char *log, int append)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* If the test dies (a failed assertion aborts it), the daemon must not outlive it:
         * an orphan would keep ctest's output pipe open and turn a failure into a timeout. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() == 1)
            _exit(126);
        int fd = open(log, O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC), 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execv(KVD_BIN, (char *const *)argv);
        _exit(127);
    }
    return pid;
}

/* Start kvd on k->endpoint and wait until it is ready. append: keep the log of an earlier
 * daemon on the same directory (restarts). */
static void itest_kvd_spawn(itest_kvd_t *k, const char *const *extra, int append)
{
    char fds[400];
    snprintf(fds, sizeof fds, "%s/run/kvd.sock.fds", k->dir);
    const char *argv[64];
    int n = 0;
    argv[n++] = KVD_BIN;
    const char *base[] = {"--endpoint",  k->endpoint, "--layers",      "2",  "--kv_heads",  "2",
                          "--head_dim",  "64",        "--page_tokens", "16", "--pages_fp8", "256",
                          "--pages_tq3", "64",        "--epoch_ms",    "5",  NULL};
    for (int i = 0; base[i]; i++)
        argv[n++] = base[i];
    for (int i = 0; extra && extra[i] && n < 62; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    const pid_t pid = itest_kvd_exec(argv, k->log, append);
    k->pid = pid;
    /* ready when the fd socket exists (the daemon creates it last) */
    for (int64_t t0 = itest_now_us(); itest_now_us() - t0 < 30000000;) {
        struct stat st;
        if (stat(fds, &st) == 0)
            return;
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            itest_print_log(k->log);
            fail_msg("kvd exited during startup (status %d)", status);
        }
        itest_sleep_ms(5);
    }
    kill(pid, SIGKILL);
    fail_msg("kvd did not become ready within 30 s");
}

void itest_kvd_start(itest_kvd_t *k, const char *const *extra)
{
    memset(k, 0, sizeof *k);
    snprintf(k->dir, sizeof k->dir, "/tmp/kvd-it-XXXXXX");
    assert_non_null(mkdtemp(k->dir));
    snprintf(k->endpoint, sizeof k->endpoint, "ipc://%s/run/kvd.sock", k->dir);
    snprintf(k->log, sizeof k->log, "%s/kvd.log", k->dir);
    itest_kvd_spawn(k, extra, 0);
}

/* SIGTERM and wait (SIGKILL after 30 s); the exit code, 128 + signal when killed. */
static int itest_kvd_term(itest_kvd_t *k)
{
    kill(k->pid, SIGTERM);
    int status = 0;
    for (int64_t t0 = itest_now_us(); itest_now_us() - t0 < 30000000;) {
        if (waitpid(k->pid, &status, WNOHANG) == k->pid)
            goto done;
        itest_sleep_ms(5);
    }
    kill(k->pid, SIGKILL);
    waitpid(k->pid, &status, 0);
done:
    k->pid = 0;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int itest_kvd_down(itest_kvd_t *k)
{
    if (k->pid <= 0)
        return -1;
    int rc = itest_kvd_term(k);
    if (rc != 0)
        itest_print_log(k->log);
    return rc;
}

void itest_kvd_up(itest_kvd_t *k, const char *const *extra)
{
    assert_true(k->pid == 0 && k->dir[0]);
    itest_kvd_spawn(k, extra, 1);
}

int itest_kvd_restart(itest_kvd_t *k, const char *const *extra)
{
    int rc = itest_kvd_down(k);
    if (rc != -1)
        itest_kvd_up(k, extra);
    return rc;
}

int itest_kvd_stop(itest_kvd_t *k)
{
    int rc = itest_kvd_down(k);
    if (rc == -1)
        return -1;
    itest_rmtree(k->dir);
    return rc;
}

void itest_tmpdir(char *buf, size_t cap, const char *prefix)
{
    int n = snprintf(buf, cap, "/tmp/%s-XXXXXX", prefix);
    assert_true(n > 0 && (size_t)n < cap);
    assert_non_null(mkdtemp(buf));
}

void itest_rmtree(const char *dir)
{
    char cmd[400];
    int n = snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_true(n > 0 && (size_t)n < sizeof cmd);
    assert_int_equal(system(cmd), 0);
}

kvc_t *itest_connect(const itest_kvd_t *k, const char *name)
{
    kvc_t *c = NULL;
    assert_int_equal(kvc_connect(&c, k->endpoint, 30000), KV_ERR_OK);
    kv_err_t e = kvc_hello(c, NULL, name, 1);
    if (e != KV_ERR_OK)
        fail_msg("hello failed: %s", kvc_errmsg(c));
    return c;
}

uint64_t itest_stat(const itest_kvd_t *k, const char *name)
{
    kvc_t *c = NULL;
    assert_int_equal(kvc_connect(&c, k->endpoint, 30000), KV_ERR_OK);
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__StatusReq st = KVD__STATUS_REQ__INIT;
    req.body_case = KVD__REQUEST__BODY_STATUS;
    req.status = &st;
    Kvd__Reply *rep = NULL;
    kv_err_t e = kvc_call(c, &req, &rep);
    if (e != KV_ERR_OK)
        fail_msg("status failed: %s", kvc_errmsg(c));
    int found = 0;
    uint64_t v = 0;
    for (size_t i = 0; i < rep->status_rep->n_stats; i++)
        if (strcmp(rep->status_rep->stats[i]->name, name) == 0) {
            v = rep->status_rep->stats[i]->value;
            found = 1;
        }
    kvc_reply_free(&rep);
    kvc_close(&c);
    if (!found)
        fail_msg("no stat named %s", name);
    return v;
}

int64_t itest_wait_stat(const itest_kvd_t *k, const char *name, uint64_t want, int timeout_ms)
{
    int64_t t0 = itest_now_us();
    for (;;) {
        if (itest_stat(k, name) == want)
            return (itest_now_us() - t0) / 1000;
        if (itest_now_us() - t0 > (int64_t)timeout_ms * 1000)
            return -1;
        itest_sleep_ms(2);
    }
}

int itest_kvctl(const itest_kvd_t *k, char *out, size_t cap, const char *const *args)
{
    int p[2];
    assert_int_equal(pipe(p), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        const char *argv[32];
        int n = 0;
        argv[n++] = KVCTL_BIN;
        argv[n++] = "--endpoint";
        argv[n++] = k->endpoint;
        argv[n++] = "--timeout";
        argv[n++] = "30000";
        for (int i = 0; args[i] && n < 31; i++)
            argv[n++] = args[i];
        argv[n] = NULL;
        dup2(p[1], 1);
        close(p[0]);
        close(p[1]);
        execv(KVCTL_BIN, (char *const *)argv);
        _exit(127);
    }
    close(p[1]);
    size_t len = 0;
    for (;;) {
        char tmp[4096];
        ssize_t r = read(p[0], tmp, sizeof tmp);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        size_t take = (size_t)r;
        if (cap && len + take > cap - 1)
            take = cap - 1 - len;
        if (cap)
            memcpy(out + len, tmp, take);
        len += take;
    }
    if (cap)
        out[len] = '\0';
    close(p[0]);
    int status;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void itest_assert_check(const itest_kvd_t *k)
{
    char out[8192];
    const char *args[] = {"check", NULL};
    int rc = itest_kvctl(k, out, sizeof out, args);
    if (rc != 0 || !strstr(out, "leaks: 0"))
        fail_msg("kvctl check failed (rc %d):\n%s", rc, out);
}

int itest_run_as(const char *const *argv, int as, unsigned alarm_s, char *out, size_t cap)
{
    int p[2];
    if (pipe(p) != 0)
        fail_msg("pipe: %s", strerror(errno));
    pid_t pid = fork();
    if (pid < 0)
        fail_msg("fork: %s", strerror(errno));
    if (pid == 0) {
        dup2(p[1], 1);
        dup2(p[1], 2);
        close(p[0]);
        close(p[1]);
        if (as >= 0 && (setgroups(0, NULL) != 0 || setgid((gid_t)as) != 0 ||
                        setuid((uid_t)as) != 0))
            _exit(126);
        if (alarm_s)
            alarm(alarm_s);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(p[1]);
    size_t len = 0;
    ssize_t r;
    while (len < cap - 1 && (r = read(p[0], out + len, cap - 1 - len)) > 0)
        len += (size_t)r;
    out[len] = '\0';
    close(p[0]);
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

int itest_run(const char *const *argv, char *out, size_t cap)
{
    return itest_run_as(argv, -1, 0, out, cap);
}

int itest_free_port(void)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    assert_int_equal(bind(s, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(getsockname(s, (struct sockaddr *)&a, &l), 0);
    close(s);
    return ntohs(a.sin_port);
}

size_t itest_scrape(int port, char *out, size_t cap)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    /* no retry: kvd listens on the metrics port before its fd socket (the "ready" file
     * itest_kvd_start waits for) appears, so a refused connect is a bug */
    if (connect(s, (struct sockaddr *)&a, sizeof a) != 0)
        fail_msg("metrics port %d refused the connection: %s", port, strerror(errno));
    const char *req = "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";
    assert_int_equal(write(s, req, strlen(req)), (ssize_t)strlen(req));
    size_t len = 0;
    ssize_t r;
    while (len < cap - 1 && (r = read(s, out + len, cap - 1 - len)) > 0)
        len += (size_t)r;
    out[len] = '\0';
    close(s);
    return len;
}

void itest_prompt_tokens(uint32_t seed, uint32_t npages, uint32_t *tok)
{
    for (uint32_t i = 0; i < npages * ITEST_PT; i++)
        tok[i] = seed + i * 13u;
}

uint8_t itest_prompt_byte(uint32_t seed, uint32_t page, uint64_t i)
{
    return (uint8_t)(seed * 3u + page * 37u + i * 7u + (i >> 8));
}

void itest_seal_known(kvc_t *c, uint32_t seed, uint32_t npages, uint32_t *pages)
{
    uint32_t *tok = malloc(sizeof(uint32_t) * npages * ITEST_PT);
    assert_non_null(tok);
    itest_prompt_tokens(seed, npages, tok);
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, npages, pages), KV_ERR_OK);
    uint64_t pb = kvc_page_bytes(c, KV_FMT_FP8);
    uint32_t prev = KVP_NO_PAGE;
    for (uint32_t i = 0; i < npages; i++) {
        uint8_t *p = kvc_page_ptr(c, pages[i]);
        assert_non_null(p);
        for (uint64_t b = 0; b < pb; b++)
            p[b] = itest_prompt_byte(seed, i, b);
        uint32_t out;
        assert_int_equal(kvc_seal(c, pages[i], prev, tok + i * ITEST_PT, ITEST_PT, NULL, 0, &out),
                         KV_ERR_OK);
        assert_int_equal(out, pages[i]);
        prev = pages[i];
    }
    free(tok);
}

void itest_check_known(kvc_t *c, uint32_t seed, const uint32_t *pages, size_t np)
{
    uint64_t pb = kvc_page_bytes(c, KV_FMT_FP8);
    assert_true(pb > 0);
    for (size_t i = 0; i < np; i++) {
        const uint8_t *p = kvc_page_ptr(c, pages[i]);
        assert_non_null(p);
        for (uint64_t b = 0; b < pb; b++)
            if (p[b] != itest_prompt_byte(seed, (uint32_t)i, b))
                fail_msg("page %zu (logical %u) byte %llu: %u, written %u", i, pages[i],
                         (unsigned long long)b, p[b], itest_prompt_byte(seed, (uint32_t)i, b));
    }
}
