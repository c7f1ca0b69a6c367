/* kvbench.c — `kvbench rpc`: the control-plane benchmark of issue 3, printed as one JSON object;
 * `kvbench engine`: a multi-process engine workload on libkvshim (its design block is at
 * bench_engine's section below; docs/engine-shim.md, "kvbench engine").
 *
 *   kvbench rpc [--endpoint EP] [--kvd PATH] [--iters N] [--prompt-tokens T]
 *
 * Figures (all round trips measured by the client with CLOCK_MONOTONIC):
 *   raw_zmq        DEALER→ROUTER ping-pong of a small frame against a ROUTER in another process
 *                  on an ipc endpoint: the floor any RPC on this transport pays.
 *   alloc, lookup  p50/p99 round trip of alloc(1 page) and lookup+acquire of a cached 4-page
 *                  prompt; `overhead_vs_raw` = their p50 / raw p50 (goal ≤ 1.5).
 *   pipelined      ops/s with 64 allocs in flight, each batch released in one call.
 *   lookup_32k     lookup+acquire round trip of a fully cached prompt of --prompt-tokens tokens
 *                  (default 32768; goal ≤ 1 ms).
 *   reclaim        a child holding 100 references is SIGKILLed; time from kill() until the
 *                  daemon's status shows its references gone (goal ≤ 100 ms). Polling adds at
 *                  most one status round trip to each sample.
 *
 * Unless --endpoint is given, kvbench starts its own kvd (path: --kvd, else the build's) on a
 * temporary endpoint with a geometry large enough for the prompt, and stops it at the end.
 * The raw ping-pong always uses its own temporary endpoint. Default run time is a few seconds.
 *
 * The temporary directory ($TMPDIR, else /tmp: kvbench-XXXXXX) goes at exit however kvbench
 * ends (a failure, SIGINT, SIGTERM), and the kvd it started is stopped with SIGTERM first;
 * only a kvd that failed to start or to stop cleanly leaves it, for its log.
 */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvc.h"
#include "kvkern.h"
#include "kvshim.h"
#ifdef KVB_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#ifndef KVD_BIN
#define KVD_BIN "kvd"
#endif

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* percentile of n samples (sorted in place), in microseconds */
static double pct_us(int64_t *v, int n, double p)
{
    qsort(v, (size_t)n, sizeof *v, cmp_i64);
    int i = (int)(p * (n - 1) + 0.5);
    return (double)v[i] / 1000.0;
}

static void die(const char *what, kvc_t *c)
{
    fprintf(stderr, "kvbench: %s failed: %s\n", what, c ? kvc_errmsg(c) : strerror(errno));
    exit(1);
}

/* ---- daemon and raw server processes ----------------------------------------------------- */
static char tmpdir[256];
static pid_t tmpdir_owner; /* the process that made tmpdir: only it cleans up (forked workers
                            * and children exit through the same atexit handler) */
static int tmpdir_keep;    /* 1: left for the user, with the log of a kvd that failed */
static pid_t own_kvd;      /* the kvd this process started and has not reaped yet, or 0 */

/* Stop our kvd (SIGTERM: a clean stop removes its sockets) and remove tmpdir unless kept.
 * Async-signal-safe (kill, waitpid, fork, execv): the SIGINT/SIGTERM handler runs it too.
 * It used to be done only at the end of a successful run: every failure, early return and
 * Ctrl-C left a /tmp/kvbench-* directory behind. */
static void cleanup(void)
{
    if (getpid() != tmpdir_owner)
        return;
    if (own_kvd > 0) {
        kill(own_kvd, SIGTERM);
        waitpid(own_kvd, NULL, 0);
        own_kvd = 0;
    }
    if (!tmpdir[0] || tmpdir_keep)
        return;
    pid_t p = fork();
    if (p == 0) {
        char *const av[] = {"rm", "-rf", "--", tmpdir, NULL};
        execv("/bin/rm", av);
        _exit(127);
    }
    if (p > 0)
        waitpid(p, NULL, 0);
    tmpdir[0] = '\0';
}

static void on_fatal_signal(int sig)
{
    cleanup();
    signal(sig, SIG_DFL);
    raise(sig);
}

/* SIGTERM to our kvd and its exit status (-1: none running); tmpdir is kept for the log when
 * it did not exit 0. */
static int stop_own_kvd(void)
{
    if (own_kvd <= 0)
        return -1;
    int ds = 0;
    kill(own_kvd, SIGTERM);
    waitpid(own_kvd, &ds, 0);
    own_kvd = 0;
    if (!WIFEXITED(ds) || WEXITSTATUS(ds) != 0)
        tmpdir_keep = 1;
    return ds;
}

/* Why nobody answers at an ipc:// endpoint (kvc_endpoint_probe, as kvctl says it), or NULL
 * when somebody may: ZeroMQ would just wait out the timeout (30 s) in each of these cases. */
static const char *ipc_unreachable(const char *ep, char *why, size_t cap)
{
    kv_err_t e = kvc_endpoint_probe(ep, why, cap);
    if (e == KV_ERR_OK)
        return NULL;
    size_t n = strlen(why);
    if (e == KV_ERR_PERMISSION_DENIED && n < cap)
        snprintf(why + n, cap - n, " (run as kvd's user, or see socket_group in docs/daemon.md)");
    return why;
}

/* An --endpoint nobody answers at: say so at once. NULL (kvbench starts its own) passes. */
static int daemon_reachable(const char *ep_arg)
{
    char why[512];
    if (ep_arg && ipc_unreachable(ep_arg, why, sizeof why)) {
        fprintf(stderr, "kvbench: no daemon at %s: %s\n", ep_arg, why);
        return 0;
    }
    return 1;
}

/* the run's temporary directory (tmpdir) under $TMPDIR (else /tmp, and /tmp when $TMPDIR is
 * too long for the socket paths inside it), removed at exit by cleanup() */
static void make_tmpdir(void)
{
    const char *base = getenv("TMPDIR");
    if (!base || !*base || strlen(base) > 64)
        base = "/tmp";
    snprintf(tmpdir, sizeof tmpdir, "%s/kvbench-XXXXXX", base);
    if (!mkdtemp(tmpdir))
        die("mkdtemp", NULL);
    tmpdir_owner = getpid();
    atexit(cleanup);
    const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction sa, old;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_fatal_signal;
        sigemptyset(&sa.sa_mask);
        /* a signal the caller ignores (nohup, a background job's SIGINT) stays ignored */
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler != SIG_IGN)
            sigaction(sigs[i], &sa, NULL);
    }
}

/* Start kvd (argv[0] its path, NULL-terminated) with its output in tmpdir/kvd.log and wait for
 * its fd socket (ep's path + ".fds"), which it creates once it serves. */
static pid_t spawn_kvd(char *const *argv, const char *ep)
{
    const char *kvd = argv[0];
    char fds[512], logp[300];
    snprintf(fds, sizeof fds, "%s.fds", ep + 6);
    snprintf(logp, sizeof logp, "%s/kvd.log", tmpdir);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        /* its own process group: a Ctrl-C reaches kvbench, which stops kvd with one SIGTERM
         * (two signals would cut kvd's clean stop short) */
        setpgid(0, 0);
        int fd = open(logp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execv(kvd, argv);
        /* into the log, which the parent shows: an empty log said nothing (a --kvd that names
         * a directory or a file without the x bit is EACCES here) */
        fprintf(stderr, "kvbench: cannot execute %s: %s\n", kvd, strerror(errno));
        _exit(127);
    }
    if (pid < 0)
        die("fork", NULL);
    own_kvd = pid;
    for (int64_t t0 = now_ns(); now_ns() - t0 < 30000000000LL;) {
        struct stat st;
        if (stat(fds, &st) == 0)
            return pid;
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            own_kvd = 0;
            tmpdir_keep = 1; /* the log the message points to */
            fprintf(stderr, "kvbench: %s exited during startup (see %s)\n", kvd, logp);
            FILE *lf = fopen(logp, "r"); /* its last lines, where the reason usually is */
            if (lf) {
                char tail[2048];
                if (fseek(lf, 0, SEEK_END) == 0 && ftell(lf) > (long)sizeof tail - 1)
                    fseek(lf, -(long)(sizeof tail - 1), SEEK_END);
                else
                    rewind(lf);
                const size_t n = fread(tail, 1, sizeof tail - 1, lf);
                tail[n] = '\0';
                fclose(lf);
                fputs(tail, stderr);
            }
            exit(1);
        }
        usleep(2000);
    }
    tmpdir_keep = 1;
    fprintf(stderr, "kvbench: kvd did not start within 30 s (see %s)\n", logp);
    exit(1);
}

static pid_t start_kvd(const char *kvd, const char *ep, uint32_t prompt_pages)
{
    char pages[32];
    snprintf(pages, sizeof pages, "%u", prompt_pages + 1024);
    char *const argv[] = {
        (char *)kvd, "--endpoint",  (char *)ep, "--layers",      "4",    "--kv_heads",
        "8",         "--head_dim",  "128",      "--page_tokens", "16",   "--pages_fp8",
        pages,       "--pages_tq3", "64",       "--log_level",   "warn", NULL};
    return spawn_kvd(argv, ep);
}

static void raw_server(const char *ep)
{
    void *ctx = zmq_ctx_new(), *r = zmq_socket(ctx, ZMQ_ROUTER);
    if (zmq_bind(r, ep) != 0)
        _exit(1);
    for (;;) {
        zmq_msg_t id, m;
        zmq_msg_init(&id);
        zmq_msg_init(&m);
        if (zmq_msg_recv(&id, r, 0) < 0 || zmq_msg_recv(&m, r, 0) < 0)
            _exit(0);
        if (zmq_msg_size(&m) == 4 && memcmp(zmq_msg_data(&m), "quit", 4) == 0)
            _exit(0);
        zmq_msg_send(&id, r, ZMQ_SNDMORE);
        zmq_msg_send(&m, r, 0);
    }
}

static double raw_pingpong(int iters, int64_t *lat, double *p99)
{
    char ep[400];
    snprintf(ep, sizeof ep, "ipc://%s/raw.sock", tmpdir);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        raw_server(ep);
    }
    void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    zmq_connect(d, ep);
    uint8_t buf[64] = {0}, rb[64];
    /* warm up: the first round trips include the connect */
    for (int i = 0; i < 200; i++) {
        zmq_send(d, buf, 24, 0);
        zmq_recv(d, rb, sizeof rb, 0);
    }
    for (int i = 0; i < iters; i++) {
        int64_t t0 = now_ns();
        zmq_send(d, buf, 24, 0); /* about the size of a packed alloc request */
        zmq_recv(d, rb, sizeof rb, 0);
        lat[i] = now_ns() - t0;
    }
    zmq_send(d, "quit", 4, 0);
    zmq_close(d);
    zmq_ctx_term(ctx);
    waitpid(pid, NULL, 0);
    double p50 = pct_us(lat, iters, 0.50);
    *p99 = pct_us(lat, iters, 0.99);
    return p50;
}

/* One STATUS round trip; *rep is kvc_reply_free's on KV_ERR_OK. */
static kv_err_t status_call(kvc_t *c, Kvd__Reply **rep)
{
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__StatusReq st = KVD__STATUS_REQ__INIT;
    req.body_case = KVD__REQUEST__BODY_STATUS;
    req.status = &st;
    return kvc_call(c, &req, rep);
}

static uint64_t stat_of(const char *ep, const char *name)
{
    kvc_t *c;
    if (kvc_connect(&c, ep, 10000) != KV_ERR_OK)
        die("connect", NULL);
    Kvd__Reply *rep;
    if (status_call(c, &rep) != KV_ERR_OK)
        die("status", c);
    uint64_t v = UINT64_MAX;
    for (size_t i = 0; i < rep->status_rep->n_stats; i++)
        if (!strcmp(rep->status_rep->stats[i]->name, name))
            v = rep->status_rep->stats[i]->value;
    kvc_reply_free(&rep);
    kvc_close(&c);
    return v;
}

/* One reclaim sample: fork a holder, kill -9 it, time until its refs are gone. */
static double reclaim_once(const char *ep)
{
    int p[2];
    if (pipe(p))
        die("pipe", NULL);
    uint64_t base = stat_of(ep, "request_refs");
    pid_t pid = fork();
    if (pid == 0) {
        kvc_t *c;
        uint32_t pages[100];
        /* map = 0: the victim only holds references; and a forked child must not touch
         * CUDA that the parent initialised when it mapped cuda pools (it would hang) */
        if (kvc_connect(&c, ep, 10000) || kvc_hello(c, NULL, "reclaim-victim", 0) ||
            kvc_alloc(c, KV_FMT_FP8, 100, pages))
            _exit(1);
        if (write(p[1], "r", 1) != 1)
            _exit(1);
        for (;;)
            pause();
    }
    close(p[1]); /* a child that fails exits and closes its end: read sees EOF, not a hang */
    char b;
    if (read(p[0], &b, 1) != 1) {
        waitpid(pid, NULL, 0);
        die("reclaim child could not connect, hello and allocate 100 pages", NULL);
    }
    close(p[0]);
    kvc_t *c;
    if (kvc_connect(&c, ep, 10000) != KV_ERR_OK)
        die("connect", NULL);
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__StatusReq st = KVD__STATUS_REQ__INIT;
    int64_t t0 = now_ns();
    kill(pid, SIGKILL);
    double ms = -1;
    while (now_ns() - t0 < 10000000000LL) {
        req.body_case = KVD__REQUEST__BODY_STATUS;
        req.status = &st;
        Kvd__Reply *rep;
        if (kvc_call(c, &req, &rep) != KV_ERR_OK)
            die("status", c);
        uint64_t refs = UINT64_MAX;
        for (size_t i = 0; i < rep->status_rep->n_stats; i++)
            if (!strcmp(rep->status_rep->stats[i]->name, "request_refs"))
                refs = rep->status_rep->stats[i]->value;
        kvc_reply_free(&rep);
        if (refs == base) {
            ms = (double)(now_ns() - t0) / 1e6;
            break;
        }
    }
    kvc_close(&c);
    waitpid(pid, NULL, 0);
    return ms;
}

static void prompt_tokens(uint32_t *t, size_t n, uint32_t salt)
{
    for (size_t i = 0; i < n; i++)
        t[i] = (uint32_t)((i * 2654435761u + salt) % 150000u);
}

/* Seal a prompt of npages full pages (in chunks to respect max_alloc); release the refs. */
static void seal_prompt(kvc_t *c, const uint32_t *tok, uint32_t npages)
{
    uint32_t pt = kvc_geom(c)->page_tokens, prev = KVP_NO_PAGE;
    uint32_t *held = malloc(sizeof(uint32_t) * npages);
    if (!held)
        die("malloc", NULL);
    for (uint32_t done = 0; done < npages;) {
        uint32_t chunk = npages - done < 1024 ? npages - done : 1024;
        if (kvc_alloc(c, KV_FMT_FP8, chunk, held + done) != KV_ERR_OK)
            die("alloc (prompt)", c);
        for (uint32_t i = 0; i < chunk; i++) {
            uint32_t canon;
            if (kvc_seal(c, held[done + i], prev, tok + (uint64_t)(done + i) * pt, pt, NULL, 0,
                         &canon) != KV_ERR_OK)
                die("seal (prompt)", c);
            held[done + i] = prev = canon;
        }
        done += chunk;
    }
    for (uint32_t done = 0; done < npages; done += 1024)
        if (kvc_release(c, held + done, npages - done < 1024 ? npages - done : 1024) != KV_ERR_OK)
            die("release (prompt)", c);
    free(held);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvbench rpc [--endpoint EP] [--kvd PATH] [--iters N] [--prompt-tokens T]\n"
            "       kvbench engine [options]   (engine workload on libkvshim: kvbench engine "
            "--help)\n"
            "\n"
            "Control-plane benchmark of kvd; prints one JSON object on stdout: raw ZeroMQ\n"
            "ping-pong, alloc and lookup round trips (p50/p99 and the ratio to raw), pipelined\n"
            "ops/s, lookup+acquire of a cached long prompt, reclaim after kill -9, and the goals.\n"
            "\n"
            "  --endpoint EP        use a running daemon (ipc://PATH) instead of starting one\n"
            "  --kvd PATH           kvd binary to start on a temporary endpoint (default: the\n"
            "                       build's)\n"
            "  --iters N            round trips per figure (default 5000, at least 100)\n"
            "  --prompt-tokens T    long-prompt length for lookup+acquire (default 32768; on a\n"
            "                       running daemon at most its FP8 pool's pages x page_tokens)\n"
            "\n"
            "Temporary files: $TMPDIR (else /tmp)/kvbench-XXXXXX, removed at exit.\n");
}

static int eng_u32(const char *a, uint32_t *v);

/* Before the first figure: the long prompt must be at least one page of the daemon's geometry
 * and fit its FP8 pool (one client holds all its pages while sealing them). It used to fail
 * after the other figures, with RESOURCE_EXHAUSTED on a pool too small, and a prompt under one
 * page measured a lookup of 0 pages and reported the 1 ms goal met. 0, or 1 said on stderr. */
static int rpc_preflight(const char *ep, uint32_t prompt)
{
    kvc_t *c;
    Kvd__Reply *rep;
    if (kvc_connect(&c, ep, 30000) != KV_ERR_OK)
        die("connect", NULL);
    if (status_call(c, &rep) != KV_ERR_OK)
        die("status", c);
    const Kvd__StatusRep *r = rep->status_rep;
    uint64_t fp8 = 0;
    for (size_t i = 0; i < r->n_stats; i++)
        if (!strcmp(r->stats[i]->name, "pages_total.fp8"))
            fp8 = r->stats[i]->value;
    const uint32_t pt = r->geometry ? r->geometry->page_tokens : 0;
    int rc = 0;
    if (!pt || prompt < pt) {
        fprintf(stderr,
                "kvbench: --prompt-tokens %u is less than one page of the daemon's "
                "geometry (page_tokens %u): pass at least %u\n",
                prompt, pt, pt);
        rc = 1;
    } else if (prompt / pt > fp8) {
        fprintf(stderr,
                "kvbench: --prompt-tokens %u needs %u FP8 pages, more than the daemon's "
                "pool of %" PRIu64 " (pages_fp8): pass --prompt-tokens %" PRIu64 " or less, or "
                "start kvd with pages_fp8 = %u or more (docs/daemon.md, \"Benchmark\")\n",
                prompt, prompt / pt, fp8, fp8 * pt, prompt / pt + 1024);
        rc = 1;
    }
    kvc_reply_free(&rep);
    kvc_close(&c);
    return rc;
}

static int bench_rpc(int argc, char **argv)
{
    const char *ep_arg = NULL, *kvd = KVD_BIN;
    uint32_t iters_arg = 5000, prompt = 32768;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint32_t *num = !strcmp(a, "--iters")           ? &iters_arg
                        : !strcmp(a, "--prompt-tokens") ? &prompt
                                                        : NULL;
        if (num) {
            /* digits only, as kvbench engine's: "abc" was 0 (--iters then 100, a 0-token
             * "long prompt") and "-1" 2^32 - 1 */
            if (!v || eng_u32(v, num) || !*num || (num == &iters_arg && *num > 100000000)) {
                fprintf(stderr, "kvbench: %s needs a positive integer%s, got '%s'\n", a,
                        num == &iters_arg ? " (at most 100000000)" : "", v ? v : "");
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--endpoint") && v)
            ep_arg = argv[++i];
        else if (!strcmp(a, "--kvd") && v)
            kvd = argv[++i];
        else {
            fprintf(stderr, "kvbench: unknown or incomplete argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    const int iters = iters_arg < 100 ? 100 : (int)iters_arg;
    if (!daemon_reachable(ep_arg))
        return 1;
    make_tmpdir();
    char ep[400];
    if (ep_arg)
        snprintf(ep, sizeof ep, "%s", ep_arg);
    else {
        snprintf(ep, sizeof ep, "ipc://%s/run/kvd.sock", tmpdir);
        start_kvd(kvd, ep, prompt / 16 + 16);
    }
    if (rpc_preflight(ep, prompt) != 0)
        return 1;
    int64_t *lat = malloc(sizeof(int64_t) * (size_t)iters);
    if (!lat)
        die("malloc", NULL);

    double raw_p99, raw_p50 = raw_pingpong(iters, lat, &raw_p99);

    kvc_t *c;
    if (kvc_connect(&c, ep, 30000) != KV_ERR_OK || kvc_hello(c, NULL, "kvbench", 1) != KV_ERR_OK)
        die("connect/hello", c);
    const kv_geom_t geom = *kvc_geom(c);
    const uint32_t pt = geom.page_tokens;

    /* alloc round trips (release outside the timed region) */
    for (int i = 0; i < iters + 200; i++) {
        uint32_t pg;
        int64_t t0 = now_ns();
        if (kvc_alloc(c, KV_FMT_FP8, 1, &pg) != KV_ERR_OK)
            die("alloc", c);
        int64_t dt = now_ns() - t0;
        if (i >= 200)
            lat[i - 200] = dt;
        if (kvc_release(c, &pg, 1) != KV_ERR_OK)
            die("release", c);
    }
    double alloc_p50 = pct_us(lat, iters, 0.5), alloc_p99 = pct_us(lat, iters, 0.99);

    /* lookup+acquire of a cached 4-page prompt (4 pages of the daemon's page_tokens, up to
     * 4096: a stack array of 4 x 64 tokens overflowed on a daemon of page_tokens > 64) */
    uint32_t *small = malloc(sizeof(uint32_t) * 4 * pt);
    if (!small)
        die("malloc", NULL);
    prompt_tokens(small, 4 * pt, 7);
    seal_prompt(c, small, 4);
    for (int i = 0; i < iters + 200; i++) {
        uint32_t got[4];
        size_t n;
        int64_t t0 = now_ns();
        if (kvc_lookup(c, small, 4 * pt, NULL, 0, 0, got, 4, &n, NULL) != KV_ERR_OK || n != 4)
            die("lookup", c);
        int64_t dt = now_ns() - t0;
        if (i >= 200)
            lat[i - 200] = dt;
        if (kvc_release(c, got, n) != KV_ERR_OK)
            die("release", c);
    }
    double lookup_p50 = pct_us(lat, iters, 0.5), lookup_p99 = pct_us(lat, iters, 0.99);

    /* pipelined: 64 allocs in flight, then one release of the batch */
    enum { WIN = 64 };
    int batches = iters * 4 / WIN;
    if (batches < 20)
        batches = 20;
    int64_t tp0 = now_ns();
    for (int b = 0; b < batches; b++) {
        uint64_t ids[WIN];
        uint32_t pages[WIN];
        for (int j = 0; j < WIN; j++)
            if (kvc_alloc_send(c, KV_FMT_FP8, 1, &ids[j]) != KV_ERR_OK)
                die("alloc_send", c);
        for (int j = 0; j < WIN; j++)
            if (kvc_alloc_recv(c, ids[j], 1, &pages[j]) != KV_ERR_OK)
                die("alloc_recv", c);
        if (kvc_release(c, pages, WIN) != KV_ERR_OK)
            die("release", c);
    }
    double pipe_s = (double)(now_ns() - tp0) / 1e9;
    double pipe_ops = (double)batches * (WIN + 1) / pipe_s;

    /* the long prompt */
    uint32_t npages = prompt / pt;
    uint32_t *tok = malloc(sizeof(uint32_t) * (size_t)npages * pt);
    uint32_t *got = malloc(sizeof(uint32_t) * npages);
    if (!tok || !got)
        die("malloc", NULL);
    prompt_tokens(tok, (size_t)npages * pt, 99);
    int64_t ts0 = now_ns();
    seal_prompt(c, tok, npages);
    double seal_ms = (double)(now_ns() - ts0) / 1e6;
    int reps = 50;
    int64_t lv[50];
    for (int i = 0; i < reps; i++) {
        size_t n;
        int64_t t0 = now_ns();
        if (kvc_lookup(c, tok, (size_t)npages * pt, NULL, 0, 0, got, npages, &n, NULL) !=
                KV_ERR_OK ||
            n != npages)
            die("lookup (long prompt)", c);
        lv[i] = now_ns() - t0;
        for (uint32_t done = 0; done < npages; done += 1024)
            if (kvc_release(c, got + done, npages - done < 1024 ? npages - done : 1024) !=
                KV_ERR_OK)
                die("release (long prompt)", c);
    }
    double long_p50 = pct_us(lv, reps, 0.5), long_p99 = pct_us(lv, reps, 0.99);
    /* this session reported no epoch since its releases: left open (a kvc_close does not end
     * it), it kept the prompt's pages from being recycled, and on a 1024-page pool the
     * reclaim clients' allocs failed. No kernel ran here, so goodbye is true. */
    if (kvc_goodbye(c, NULL) != KV_ERR_OK)
        die("goodbye", c);
    kvc_close(&c);

    double rc[5];
    int nrc = 5;
    for (int i = 0; i < nrc; i++)
        rc[i] = reclaim_once(ep);
    double rc_max = 0, rc_sum = 0;
    int rc_ok = 1, rc_timeouts = 0; /* a sample that timed out is -1: the goal fails (it read
                                      * true before) and the mean is over the others */
    for (int i = 0; i < nrc; i++) {
        if (rc[i] < 0) {
            rc_ok = 0, rc_timeouts++;
            continue;
        }
        rc_max = rc[i] > rc_max ? rc[i] : rc_max;
        rc_sum += rc[i];
    }

    printf("{\n  \"bench\": \"rpc\",\n  \"iters\": %d,\n  \"geometry\": {\"layers\": %u, "
           "\"kv_heads\": %u, \"head_dim\": %u, \"page_tokens\": %u},\n",
           iters, geom.layers, geom.kv_heads, geom.head_dim, pt);
    printf("  \"raw_zmq_us\": {\"p50\": %.2f, \"p99\": %.2f},\n", raw_p50, raw_p99);
    printf("  \"alloc_us\": {\"p50\": %.2f, \"p99\": %.2f, \"overhead_vs_raw\": %.2f},\n",
           alloc_p50, alloc_p99, alloc_p50 / raw_p50);
    printf("  \"lookup_us\": {\"p50\": %.2f, \"p99\": %.2f, \"overhead_vs_raw\": %.2f, "
           "\"pages\": 4},\n",
           lookup_p50, lookup_p99, lookup_p50 / raw_p50);
    printf("  \"pipelined\": {\"window\": %d, \"ops_per_s\": %.0f},\n", WIN, pipe_ops);
    printf("  \"lookup_long\": {\"tokens\": %u, \"pages\": %u, \"p50_ms\": %.3f, \"p99_ms\": "
           "%.3f, \"seal_all_ms\": %.1f},\n",
           npages * pt, npages, long_p50 / 1000.0, long_p99 / 1000.0, seal_ms);
    printf("  \"reclaim_ms\": {\"samples\": %d, \"timeouts\": %d, \"mean\": %.2f, \"max\": %.2f, "
           "\"refs\": 100},\n",
           nrc, rc_timeouts, nrc > rc_timeouts ? rc_sum / (nrc - rc_timeouts) : 0.0, rc_max);
    printf("  \"goals\": {\"overhead_le_1_5\": %s, \"lookup_32k_le_1ms\": %s, "
           "\"reclaim_le_100ms\": %s}\n}\n",
           alloc_p50 / raw_p50 <= 1.5 ? "true" : "false", long_p50 <= 1000.0 ? "true" : "false",
           rc_ok && rc_max <= 100 ? "true" : "false");
    free(tok);
    free(got);
    free(small);
    free(lat);
    stop_own_kvd(); /* the directory goes at exit (cleanup) */
    return 0;
}

/* ---- kvbench engine ----------------------------------------------------------------------- *
 * A multi-process engine workload on libkvshim (DESIGN.md: "kvbench, a multi-process engine
 * workload"). W worker processes (fork; each its own kvs_t, as an engine runs one shim per
 * worker) serve R requests each: a prompt of P shared tokens (a system prompt, the same for every
 * request) and U tokens unique to the request, then G decode steps.
 *
 *   begin (prefix lookup) → extend + append K/V of the uncached prompt tokens in every layer →
 *   commit (seal full pages) → G × { extend 1, append every layer, attention, commit } → end.
 *
 * Batched decode (--batch N, default 1): a worker keeps up to N requests in flight, as a
 * serving engine's decode batch. A decode step extends each of them by one token, appends the
 * new tokens with ONE kvs_append_batch per layer over all of them (at N = 1 kvs_append, the
 * calls of before batching), runs ONE kvs_attention per attended layer over all of them
 * (nseq = N), then commits each. A request that made its G steps is ended and its slot takes
 * the worker's next request, prefilled before the next step (continuous batching), until its R
 * are done. The step loop is the same at N = 1: the calls of one request after another, as
 * before batching.
 * decode_steps and tokens/s count every sequence's token; the append, attention and
 * decode-step latencies are per call / per batched step (check.append_seqs / append_calls and
 * attention_seqs / attention_calls: the mean batch).
 *
 * K/V are synthetic and depend only on (position, token id, layer), so a page another request
 * sealed holds exactly what this request would have written: the prefix hits are correct reuse.
 * Values are multiples of 1/16 in [-2, 2), exact in f16, and handed to kvs_append as f16 on
 * both backends (on device pools they are copied to device buffers first, outside the timed
 * region, because an engine's K/V are already on the device).
 *
 * Timed (CLOCK_MONOTONIC, in the worker): kvs_seq_begin, every kvs_append (prefill: per call,
 * divided by its tokens; decode: one call for one layer, of one token per sequence: one
 * sequence at --batch 1, the step's batch with kvs_append_batch above), kvs_attention,
 * kvs_seq_commit, and the decode step as the sum of its shim calls (extend, appends,
 * attention, commit: the synthetic K/V, the copies and the reference check are not an
 * engine's cost). Wall time and tokens/s include everything, the reference check of worker
 * 0's first request too (host pools), so measure throughput with enough requests that it does
 * not matter. Samples go into shared memory (MAP_SHARED before fork) so the parent computes
 * per-worker and aggregate percentiles. The workers start together (a go pipe) once
 * every one has opened its shim; the parent meanwhile polls the daemon's status every 50 ms for
 * the FP8 / TQ3 pages in use (the lifecycle controller retiers Stale pages of live sequences to
 * TQ3, so long sequences become mixed-format) and reads the counters at the end.
 *
 * Start barrier: each worker writes one byte to the ready pipe ('r' shim open, 'x' failed with
 * its own error) and waits for one on the go pipe. A worker that died first (OOM killer, a
 * crash) wrote nothing while the others, waiting for go, held the pipe's write end open: the
 * parent's blocking read waited forever. The parent polls the pipe and reaps the workers
 * between polls instead. A worker that failed or ended before the start calls the run off,
 * since it cannot be ok: the go pipe is closed without a byte, and each other worker fails at
 * its barrier with the reason (shared memory, stop_why) and closes its shim, so its daemon
 * session ends with goodbye. The test hook KVBENCH_TEST_DIE_BEFORE_READY=W makes worker W kill
 * itself (SIGKILL, shim open) just before its ready byte (it_kvbench_engine). A worker that
 * hangs before its byte (a daemon that accepts and never answers, a stuck device) held the
 * barrier for ever: after --ready-timeout seconds (default 300) kvbench calls the run off and
 * kills the workers not ready (KVBENCH_TEST_HANG_BEFORE_READY=W: worker W waits for ever
 * there). Each worker marks itself ready in shared memory before its byte, so that one which
 * dies at the barrier after it is not reported "before it was ready".
 *
 * Self-check: every attention output must be finite; on host pools, every decode attention of
 * worker 0's first request is compared with the float64 reference kv_attn_reference over the same
 * pages (read through a second libkvc mapping, which reports its epoch after each check and
 * ends after that request, else its idle session holds back page recycling for every client)
 * — relative L2 ≤ 1e-4, since both read the same FP8/TQ3 pages and differ only in float vs
 * double accumulation (it_shim measures ~1e-8). A page
 * the lifecycle controller converts between the shim's read and the reference's would make the
 * two read different bytes: the directory entries of the table are compared before and after,
 * and the pair is redone when one changed. In a batch the check reads that request's rows of
 * the batched call, which the other sequences must not change; a redo repeats the whole call.
 * "ok" false → exit status 1.
 */
#define ENG_REF_TOL      1e-4
#define ENG_MAX_KVD_OPTS 16
#define ENG_WHY_CAP      512 /* why the run was called off at the start barrier */
/* --batch at most: well under what one kvs_attention takes, and each slot stages its tokens */
#define ENG_MAX_BATCH 1024u
_Static_assert(ENG_MAX_BATCH <= KVS_MAX_BATCH, "--batch beyond one kvs_attention call");
/* default --ready-timeout: kvs_open and the reference mapping wait up to 60 s each on a daemon
 * that is slow */
#define ENG_READY_TIMEOUT_S 300u

typedef struct eng_opts_s {
    const char *ep_arg, *kvd, *backend;
    uint32_t workers, requests, prefix, suffix, decode;
    uint32_t batch; /* requests in flight per worker: one kvs_attention over them per layer */
    uint32_t layers, kv_heads, head_dim, page_tokens, q_heads;
    uint32_t pages_fp8, pages_tq3;                /* 0: sized from the workload */
    uint32_t ready_timeout_s;                     /* start barrier bound */
    int lifecycle_ms, recent_pages, anchor_pages; /* -1: the daemon's default */
    int attn_all;
    uint64_t seed;
    const char *kvd_opts[ENG_MAX_KVD_OPTS];
    int n_kvd_opts;
} eng_opts_t;

/* One worker's results, in the shared region (written by the worker only). */
typedef struct eng_wres_s {
    int done, failed;
    int ready; /* set before its ready byte is written */
    char err[512];
    int on_device;
    uint64_t requests, prompt_tokens, cached_tokens, prefill_tokens, decode_steps;
    int64_t first_cached;            /* cached tokens of the worker's first request */
    uint64_t cached_min, cached_max; /* over the worker's requests */
    int64_t wall_ns;                 /* from go to the last kvs_seq_end */
    int64_t prefill_append_ns;
    uint64_t prefill_token_layers;
    uint64_t attn_calls, attn_seqs, nonfinite; /* attn_seqs: the calls' nseq, summed */
    uint64_t app_calls, app_seqs; /* decode appends: calls, and their sequences summed */
    uint64_t ref_checks, ref_retries;
    double ref_err_max;
    uint32_t ref_tq3_pages_max; /* TQ3 pages in the checked table at a reference check */
    /* sample counts */
    uint64_t n_begin, n_app, n_attn, n_commit, n_step;
} eng_wres_t;

/* A request in flight in a worker's batch. */
typedef struct eng_slot_s {
    kvs_seq_t *q;   /* NULL: the slot is free */
    uint32_t r, st; /* the request's number, its decode steps done */
    uint32_t *tok;  /* [P + U + G] its token ids */
} eng_slot_t;

typedef struct eng_shared_s {
    eng_wres_t *w;
    int64_t *begin, *app, *attn, *commit, *step; /* [W][cap_*] */
    uint64_t cap_begin, cap_app, cap_attn, cap_commit, cap_step;
    char *stop_why; /* [ENG_WHY_CAP]: written by the parent before it closes go without a byte */
} eng_shared_t;

static uint64_t eng_mix(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Token i of request (w, r): the shared prefix below P, unique tokens after. */
static uint32_t eng_token(const eng_opts_t *o, uint32_t w, uint32_t r, uint64_t i)
{
    if (i < o->prefix)
        return (uint32_t)(eng_mix(o->seed * 1000003u + i) % 150000u);
    return (uint32_t)(eng_mix(eng_mix(o->seed ^ ((uint64_t)w << 40) ^ ((uint64_t)r << 20)) + i) %
                      150000u);
}

/* f16 K/V of m tokens (positions pos0.., ids tok[]) of one layer: k, v [m][kv_heads][head_dim].
 * A Weyl sequence from a per-(position, token, layer) hash; values (j - 32) / 16, j in [0, 64). */
static void eng_kv(const kv_geom_t *g, uint32_t layer, uint64_t pos0, const uint32_t *tok, size_t m,
                   uint16_t *k, uint16_t *v, const uint16_t *halves)
{
    size_t row = (size_t)g->kv_heads * g->head_dim;
    for (size_t t = 0; t < m; t++) {
        uint64_t base = eng_mix(((pos0 + t) << 20) ^ ((uint64_t)tok[t] << 4) ^ layer);
        for (size_t j = 0; j < row; j++) {
            k[t * row + j] = halves[(base + j * 0x9E3779B97F4A7C15ull) >> 58];
            v[t * row + j] = halves[(base + (j + row) * 0x9E3779B97F4A7C15ull) >> 58];
        }
    }
}

static void eng_query(const eng_opts_t *o, uint32_t w, uint32_t r, uint32_t step, uint32_t layer,
                      size_t n, float *q)
{
    uint64_t b = eng_mix(((uint64_t)w << 48) ^ ((uint64_t)r << 32) ^ ((uint64_t)step << 8) ^ layer);
    for (size_t i = 0; i < n; i++)
        q[i] = (float)((int)((b + i * 0x9E3779B97F4A7C15ull) >> 59) - 16) / 16.0f;
}

#define EW_FAIL(...)                                                                               \
    do {                                                                                           \
        snprintf(res->err, sizeof res->err, __VA_ARGS__);                                          \
        goto fail;                                                                                 \
    } while (0)
#define EW_CALL(call)                                                                              \
    do {                                                                                           \
        kv_err_t e_ = (call);                                                                      \
        if (e_ != KV_ERR_OK)                                                                       \
            EW_FAIL("%s: %s (%s)", #call, kv_err_name(e_), kvs_errmsg(s));                         \
    } while (0)
#ifdef KVB_HAVE_CUDA
#define EW_CUDA(call)                                                                              \
    do {                                                                                           \
        cudaError_t ce_ = (call);                                                                  \
        if (ce_ != cudaSuccess)                                                                    \
            EW_FAIL("%s: %s", #call, cudaGetErrorString(ce_));                                     \
    } while (0)
#endif

/* Float64 reference over the table of q (host pools, read through ref's mapping); returns the
 * relative L2 error of out, or a negative value when the table changed under the comparison. */
static double eng_ref_err(kvc_t *ref, kvs_seq_t *q, uint32_t layer, uint32_t qh, const float *qv,
                          const float *out, const kv_dir_entry_t *before, uint32_t *pages,
                          uint32_t np, uint32_t *tq3)
{
    const kv_geom_t *g = kvc_geom(ref);
    kv_pools_t pools;
    kvc_pools(ref, &pools);
    uint32_t indptr[2] = {0, np}, len = (uint32_t)kvs_seq_len(q);
    size_t n = (size_t)qh * g->head_dim;
    double *r = malloc(sizeof(double) * n);
    if (!r)
        return INFINITY;
    kv_attn_batch_t b = {.batch = 1,
                         .q_heads = qh,
                         .layer = layer,
                         .sm_scale = 1.0f / sqrtf((float)g->head_dim),
                         .page_indptr = indptr,
                         .page_ids = pages,
                         .seq_len = &len};
    const volatile kv_dir_entry_t *dir = kvc_directory(ref);
    int rc =
        kv_attn_reference(g, &pools, (const kv_dir_entry_t *)dir, kvc_dir_entries(ref), &b, qv, r);
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = out[i] - r[i];
        num += d * d;
        den += r[i] * r[i];
    }
    free(r);
    *tq3 = 0;
    for (uint32_t i = 0; i < np; i++) {
        if (dir[pages[i]] != before[i])
            return -1.0;
        *tq3 += kv_dir_fmt(before[i]) == KV_FMT_TQ3;
    }
    if (rc != KVK_OK)
        return INFINITY;
    return den > 0 ? sqrt(num / den) : (num == 0 ? 0 : INFINITY);
}

/* How a worker that did not say why ended, from its wait status ws; `when` is "before it
 * finished" or "before it was ready" (the start barrier). */
static void eng_ended_how(int ws, const char *when, char *how, size_t cap)
{
    if (WIFSIGNALED(ws))
        snprintf(how, cap, "killed by signal %d (%s)%s %s", WTERMSIG(ws), strsignal(WTERMSIG(ws)),
                 WCOREDUMP(ws) ? ", core dumped," : "", when);
    else
        snprintf(how, cap, "exited with status %d %s, without an error of its own", WEXITSTATUS(ws),
                 when);
}

/* The error of a worker that did not finish and did not say why (err empty): how it ended,
 * from its wait status ws (`when` as eng_ended_how), and gone_why when the daemon went away
 * during the run (NULL when it stayed), after which kvbench kills the workers. A worker that
 * finished keeps "". */
static void eng_worker_ended(eng_wres_t *r, int ws, const char *when, const char *gone_why)
{
    if ((r->done && !r->failed) || r->err[0])
        return;
    if (gone_why && WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL) {
        snprintf(r->err, sizeof r->err, "killed by kvbench (SIGKILL) %s: %.440s", when, gone_why);
        return;
    }
    char how[128];
    eng_ended_how(ws, when, how, sizeof how);
    snprintf(r->err, sizeof r->err, "%s%s%.360s", how, gone_why ? "; " : "",
             gone_why ? gone_why : "");
}

/* When a worker that ended at the start barrier ended: its ready byte is anonymous, so the
 * flag it set before the byte says which (one that died waiting for go read "before it was
 * ready"). */
static const char *eng_barrier_when(const eng_wres_t *r)
{
    return r->ready ? "at the start barrier, after it was ready" : "before it was ready";
}

/* SIGKILL to the workers still running and not ready after --ready-timeout (they cannot stop at
 * the barrier: they never read go), each one's error saying so; who: "worker 1, 3". Returns
 * how many. */
static uint32_t eng_kill_unready(const eng_opts_t *o, eng_shared_t *sh, const pid_t *pids,
                                 char *who, size_t cap)
{
    uint32_t n = 0;
    size_t at = 0;
    who[0] = '\0';
    for (uint32_t w = 0; w < o->workers; w++) {
        if (pids[w] <= 0 || sh->w[w].ready || sh->w[w].failed || sh->w[w].err[0])
            continue;
        snprintf(sh->w[w].err, sizeof sh->w[w].err,
                 "killed by kvbench (SIGKILL): not ready after %u s (--ready-timeout)",
                 o->ready_timeout_s);
        kill(pids[w], SIGKILL);
        if (at < cap)
            at += (size_t)snprintf(who + at, cap - at, "%s%u", n ? ", " : "worker ", w);
        n++;
    }
    return n;
}

static int eng_worker(const eng_opts_t *o, const char *ep, uint32_t w, eng_shared_t *sh,
                      int ready_fd, int go_fd)
{
    eng_wres_t *res = &sh->w[w];
    int64_t *s_begin = sh->begin + w * sh->cap_begin, *s_app = sh->app + w * sh->cap_app;
    int64_t *s_attn = sh->attn + w * sh->cap_attn, *s_commit = sh->commit + w * sh->cap_commit;
    int64_t *s_step = sh->step + w * sh->cap_step;
    kvs_t *s = NULL;
    kvc_t *ref = NULL;
    uint16_t *hk = NULL, *hv = NULL;
    float *hq = NULL, *hout = NULL;
    uint32_t *tok = NULL, *pages = NULL, *bslot = NULL;
    kv_dir_entry_t *before = NULL;
    eng_slot_t *slots = NULL;
    kvs_seq_t **bseq = NULL;
    void *dk = NULL, *dv = NULL, *dq = NULL, *dout = NULL; /* device buffers (cuda pools) */
    char name[32];
    snprintf(name, sizeof name, "kvbench-w%u", w);
#ifdef KVB_HAVE_CUDA
    if (!strncmp(o->backend, "cuda", 4))
        EW_CUDA(cudaSetDevice(0)); /* before kvs_open: libkvc imports into this context */
#endif
    if (kvs_open(&s, &(kvs_opts_t){.endpoint = ep, .name = name, .timeout_ms = 60000}) != KV_ERR_OK)
        EW_FAIL("kvs_open: %s", kvs_errmsg(NULL));
    const kv_geom_t *g = kvs_geom(s);
    res->on_device = kvs_on_device(s);
    uint64_t n = (uint64_t)o->prefix + o->suffix, total = n + o->decode;
    size_t row = (size_t)g->kv_heads * g->head_dim, qn = (size_t)o->q_heads * g->head_dim;
    uint32_t attn_layers = o->attn_all ? g->layers : 1;
    uint32_t maxpages = (uint32_t)((total + g->page_tokens - 1) / g->page_tokens);
    /* no more slots than requests: a batch of 8 over 3 requests holds 3 */
    uint32_t nslots = o->batch < o->requests ? o->batch : o->requests;
    /* K/V staging: a prefill's n tokens, or one decode token of each of the batch's sequences */
    const uint64_t stage = n > nslots ? n : nslots;
    hk = malloc(sizeof(uint16_t) * stage * row);
    hv = malloc(sizeof(uint16_t) * stage * row);
    hq = malloc(sizeof(float) * nslots * qn);
    hout = malloc(sizeof(float) * nslots * qn);
    tok = malloc(sizeof(uint32_t) * total * nslots);
    pages = malloc(sizeof(uint32_t) * maxpages);
    before = malloc(sizeof(kv_dir_entry_t) * maxpages);
    slots = calloc(nslots, sizeof *slots);
    bslot = malloc(sizeof(uint32_t) * nslots);
    bseq = malloc(sizeof(kvs_seq_t *) * nslots);
    if (!hk || !hv || !hq || !hout || !tok || !pages || !before || !slots || !bslot || !bseq)
        EW_FAIL("out of memory (K/V staging of %llu tokens, batch %u)", (unsigned long long)n,
                nslots);
    for (uint32_t b = 0; b < nslots; b++)
        slots[b].tok = tok + (size_t)b * total;
    if (res->on_device) {
#ifdef KVB_HAVE_CUDA
        EW_CUDA(cudaMalloc(&dk, sizeof(uint16_t) * stage * row));
        EW_CUDA(cudaMalloc(&dv, sizeof(uint16_t) * stage * row));
        EW_CUDA(cudaMalloc(&dq, sizeof(float) * nslots * qn));
        EW_CUDA(cudaMalloc(&dout, sizeof(float) * nslots * qn));
#else
        EW_FAIL("device pools but kvbench was built without CUDA (rebuild with -DKVD_CUDA=ON)");
#endif
    } else if (w == 0) {
        if (kvc_connect(&ref, ep, 60000) != KV_ERR_OK ||
            kvc_hello(ref, NULL, "kvbench-ref", 1) != KV_ERR_OK)
            EW_FAIL("reference mapping: %s", ref ? kvc_errmsg(ref) : "kvc_connect failed");
    }
    uint16_t halves[64];
    for (int j = 0; j < 64; j++)
        halves[j] = kv_half_from_float((float)(j - 32) / 16.0f);

    /* Test hook (it_kvbench_engine): this worker dies here as the OOM killer would end it, its
     * shim open and its ready byte not written. An environment variable: no operator option. */
    const char *die = getenv("KVBENCH_TEST_DIE_BEFORE_READY");
    if (die && die[0] && strtoul(die, NULL, 10) == w)
        raise(SIGKILL);
    const char *hang = getenv("KVBENCH_TEST_HANG_BEFORE_READY");
    if (hang && hang[0] && strtoul(hang, NULL, 10) == w)
        for (;;)
            pause();
    res->ready = 1;
    char c = 'r';
    if (write(ready_fd, &c, 1) != 1)
        EW_FAIL("start barrier: writing the ready byte: %s", strerror(errno));
    /* the byte is written: our write end need not stay open while we wait for go */
    close(ready_fd);
    ready_fd = -1;
    ssize_t gn = read(go_fd, &c, 1);
    if (gn == 0) /* the parent closed go without a byte: the run was called off */
        EW_FAIL("stopped by kvbench before the start: %.440s", sh->stop_why);
    if (gn != 1)
        EW_FAIL("start barrier: reading the go byte: %s", strerror(errno));
    close(go_fd);

    res->cached_min = UINT64_MAX;
    int64_t t_go = now_ns();
    /* Continuous batching: up to `batch` requests in flight. Each round starts the worker's
     * next requests in the free slots (begin, prefill, commit), runs one decode step over every
     * live request, then ends the ones that made their G steps. With --batch 1 the calls and
     * their order are those of one request after another. */
    uint32_t next = 0, live = 0;
    while (next < o->requests || live > 0) {
        for (uint32_t b = 0; b < nslots && next < o->requests; b++) {
            eng_slot_t *sl = &slots[b];
            if (sl->q)
                continue;
            sl->r = next++;
            sl->st = 0;
            for (uint64_t i = 0; i < total; i++)
                sl->tok[i] = eng_token(o, w, sl->r, i);
            size_t cached = 0;
            int64_t t0 = now_ns();
            EW_CALL(kvs_seq_begin(s, sl->tok, n, &sl->q, &cached));
            s_begin[res->n_begin++] = now_ns() - t0;
            live++;
            if (sl->r == 0)
                res->first_cached = (int64_t)cached;
            res->cached_min = cached < res->cached_min ? cached : res->cached_min;
            res->cached_max = cached > res->cached_max ? cached : res->cached_max;
            res->prompt_tokens += n;
            res->cached_tokens += cached;
            size_t m = n - cached;
            EW_CALL(kvs_seq_extend(sl->q, sl->tok + cached, m));
            for (uint32_t l = 0; l < g->layers; l++) {
                eng_kv(g, l, cached, sl->tok + cached, m, hk, hv, halves);
                const void *k = hk, *v = hv;
#ifdef KVB_HAVE_CUDA
                if (res->on_device) {
                    EW_CUDA(cudaMemcpy(dk, hk, sizeof(uint16_t) * m * row, cudaMemcpyHostToDevice));
                    EW_CUDA(cudaMemcpy(dv, hv, sizeof(uint16_t) * m * row, cudaMemcpyHostToDevice));
                    k = dk;
                    v = dv;
                }
#endif
                t0 = now_ns();
                EW_CALL(kvs_append(sl->q, l, k, v, KVS_F16, m));
                res->prefill_append_ns += now_ns() - t0;
                res->prefill_token_layers += m;
            }
            res->prefill_tokens += m;
            t0 = now_ns();
            EW_CALL(kvs_seq_commit(sl->q));
            s_commit[res->n_commit++] = now_ns() - t0;
        }

        /* One decode step of the live requests, in slot order: q rows [nb][q_heads][head_dim].
         * The step's time is the sum of its timed calls: the K/V generation, copies and the
         * reference check are not the engine's. */
        uint32_t nb = 0;
        int ci = -1; /* the batch row of worker 0's first request, checked against ref */
        for (uint32_t b = 0; b < nslots; b++)
            if (slots[b].q && slots[b].st < o->decode) {
                if (ref && slots[b].r == 0)
                    ci = (int)nb;
                bslot[nb] = b;
                bseq[nb++] = slots[b].q;
            }
        if (nb > 0) {
            int64_t step_ns = 0;
            for (uint32_t i = 0; i < nb; i++) {
                eng_slot_t *sl = &slots[bslot[i]];
                int64_t ts = now_ns();
                EW_CALL(kvs_seq_extend(sl->q, sl->tok + n + sl->st, 1));
                step_ns += now_ns() - ts;
            }
            /* --batch > 1: one kvs_append_batch per layer over the step's sequences (rows
             * [nb][row], in bseq order); --batch 1: kvs_append, the calls of before */
            const uint32_t per_call = o->batch > 1 ? nb : 1;
            for (uint32_t l = 0; l < g->layers; l++)
                for (uint32_t i0 = 0; i0 < nb; i0 += per_call) {
                    for (uint32_t i = i0; i < i0 + per_call; i++) {
                        eng_slot_t *sl = &slots[bslot[i]];
                        uint64_t pos = n + sl->st;
                        eng_kv(g, l, pos, sl->tok + pos, 1, hk + (size_t)(i - i0) * row,
                               hv + (size_t)(i - i0) * row, halves);
                    }
                    const void *k = hk, *v = hv;
#ifdef KVB_HAVE_CUDA
                    if (res->on_device) {
                        size_t bytes = sizeof(uint16_t) * row * per_call;
                        EW_CUDA(cudaMemcpy(dk, hk, bytes, cudaMemcpyHostToDevice));
                        EW_CUDA(cudaMemcpy(dv, hv, bytes, cudaMemcpyHostToDevice));
                        k = dk;
                        v = dv;
                    }
#endif
                    int64_t t0 = now_ns();
                    if (o->batch > 1)
                        EW_CALL(kvs_append_batch(s, bseq, nb, l, k, v, KVS_F16, 1));
                    else
                        EW_CALL(kvs_append(bseq[i0], l, k, v, KVS_F16, 1));
                    s_app[res->n_app++] = now_ns() - t0;
                    step_ns += s_app[res->n_app - 1];
                    res->app_calls++;
                    res->app_seqs += per_call;
                }
            for (uint32_t la = 0; la < attn_layers; la++) {
                uint32_t l = o->attn_all ? la : g->layers - 1;
                for (uint32_t i = 0; i < nb; i++)
                    eng_query(o, w, slots[bslot[i]].r, slots[bslot[i]].st, l, qn, hq + i * qn);
                const float *qp = hq;
                float *op = hout;
#ifdef KVB_HAVE_CUDA
                if (res->on_device) {
                    EW_CUDA(cudaMemcpy(dq, hq, sizeof(float) * nb * qn, cudaMemcpyHostToDevice));
                    qp = dq;
                    op = dout;
                }
#endif
                for (int attempt = 0;; attempt++) {
                    uint32_t np = 0;
                    if (ci >= 0) {
                        np = (uint32_t)kvs_seq_pages(bseq[ci], pages, maxpages);
                        for (uint32_t i = 0; i < np; i++)
                            before[i] = kvc_directory(ref)[pages[i]];
                    }
                    int64_t t0 = now_ns();
                    EW_CALL(kvs_attention(s, bseq, nb, l, o->q_heads, qp, 0.0f, op));
                    if (attempt == 0) {
                        s_attn[res->n_attn++] = now_ns() - t0;
                        step_ns += s_attn[res->n_attn - 1];
                        res->attn_calls++;
                        res->attn_seqs += nb;
                    }
#ifdef KVB_HAVE_CUDA
                    if (res->on_device)
                        EW_CUDA(cudaMemcpy(hout, dout, sizeof(float) * nb * qn,
                                           cudaMemcpyDeviceToHost));
#endif
                    if (attempt == 0)
                        for (size_t i = 0; i < nb * qn; i++)
                            res->nonfinite += !isfinite(hout[i]);
                    if (ci < 0)
                        break;
                    /* the checked request's rows of the batched call: the other sequences
                     * of the batch must not change them */
                    uint32_t tq3 = 0;
                    double err = eng_ref_err(ref, bseq[ci], l, o->q_heads, hq + ci * qn,
                                             hout + ci * qn, before, pages, np, &tq3);
                    if (err < 0 && attempt < 20) { /* a page converted in between: redo */
                        res->ref_retries++;
                        continue;
                    }
                    if (err < 0)
                        EW_FAIL("reference check: the table kept changing (20 attempts)");
                    res->ref_checks++;
                    res->ref_err_max = err > res->ref_err_max ? err : res->ref_err_max;
                    res->ref_tq3_pages_max =
                        tq3 > res->ref_tq3_pages_max ? tq3 : res->ref_tq3_pages_max;
                    /* ref reads the pools but makes no call: its session's epoch report,
                     * left at its hello, kept every page any session released from being
                     * recycled (a small pool ran dry at request 8 of 30). Done reading: report
                     * (outside the timed calls). */
                    if (kvc_heartbeat(ref, 0) != KV_ERR_OK)
                        EW_FAIL("reference mapping: heartbeat: %s", kvc_errmsg(ref));
                    break;
                }
            }
            for (uint32_t i = 0; i < nb; i++) {
                int64_t t0 = now_ns();
                EW_CALL(kvs_seq_commit(bseq[i]));
                s_commit[res->n_commit++] = now_ns() - t0;
                step_ns += s_commit[res->n_commit - 1];
                slots[bslot[i]].st++;
            }
            s_step[res->n_step++] = step_ns;
            res->decode_steps += nb;
        }

        for (uint32_t b = 0; b < nslots; b++) {
            eng_slot_t *sl = &slots[b];
            if (!sl->q || sl->st < o->decode)
                continue;
            kvs_seq_end(&sl->q);
            live--;
            /* the reference checks only the first request: end its session now rather than at
             * exit, since an idle one holds back the recycling of pages (above) */
            if (sl->r == 0) {
                if (ref && kvc_goodbye(ref, NULL) != KV_ERR_OK)
                    EW_FAIL("reference mapping: goodbye: %s", kvc_errmsg(ref));
                kvc_close(&ref);
            }
            res->requests++;
            if (o->requests >= 4 && res->requests % (o->requests / 4) == 0)
                fprintf(stderr, "kvbench engine: worker %u: %llu/%u requests\n", w,
                        (unsigned long long)res->requests, o->requests);
        }
    }
    res->wall_ns = now_ns() - t_go;
    res->done = 1;
    goto out;
fail:
    res->failed = 1;
    fprintf(stderr, "kvbench engine: worker %u: %s\n", w, res->err);
    if (ready_fd >= 0) { /* the parent waits for our byte: say we are out */
        char x = 'x';
        if (write(ready_fd, &x, 1) != 1) {
        }
    }
out:
#ifdef KVB_HAVE_CUDA
    if (dk)
        cudaFree(dk);
    if (dv)
        cudaFree(dv);
    if (dq)
        cudaFree(dq);
    if (dout)
        cudaFree(dout);
#else
    (void)dk;
    (void)dv;
    (void)dq;
    (void)dout;
#endif
    kvc_close(&ref);
    kvs_close(&s);
    free(hk);
    free(hv);
    free(hq);
    free(hout);
    free(tok);
    free(pages);
    free(before);
    free(slots); /* their sequences were ended by kvs_close */
    free(bslot);
    free(bseq);
    return res->failed ? 1 : 0;
}

/* ---- daemon figures ---- */
typedef struct eng_status_s {
    int ok;
    char backend[16];
    kv_geom_t geom;
    uint64_t fp8_used, tq3_used, fp8_total, tq3_total, fp8_cached, tq3_cached;
    uint64_t retiers, promotes, conversion_failures, seals, seal_dedupes, lookup_tokens_asked,
        lookup_tokens_hit, evictions_pressure, alloc_exhausted, lifecycle_ticks, request_refs,
        lifecycle_skipped_tq3_full, retier_ns, promote_ns, lifecycle_tick_ns,
        lifecycle_tick_ns_max;
} eng_status_t;

static int eng_status(kvc_t *c, eng_status_t *st)
{
    memset(st, 0, sizeof *st);
    Kvd__Reply *rep;
    if (status_call(c, &rep) != KV_ERR_OK)
        return -1;
    const Kvd__StatusRep *r = rep->status_rep;
    snprintf(st->backend, sizeof st->backend, "%s",
             r->backend && *r->backend ? r->backend : "host");
    if (r->geometry) {
        st->geom.layers = r->geometry->layers;
        st->geom.kv_heads = r->geometry->kv_heads;
        st->geom.head_dim = r->geometry->head_dim;
        st->geom.page_tokens = r->geometry->page_tokens;
    }
    uint64_t free8 = 0, free3 = 0;
    static const struct {
        const char *name;
        size_t off;
    } tab[] = {
#define EST_(n, f) {n, offsetof(eng_status_t, f)}
        EST_("pages_total.fp8", fp8_total),
        EST_("pages_total.tq3", tq3_total),
        EST_("pages_cached.fp8", fp8_cached),
        EST_("pages_cached.tq3", tq3_cached),
        EST_("retiers", retiers),
        EST_("promotes", promotes),
        EST_("conversion_failures", conversion_failures),
        EST_("seals", seals),
        EST_("seal_dedupes", seal_dedupes),
        EST_("lookup_tokens_asked", lookup_tokens_asked),
        EST_("lookup_tokens_hit", lookup_tokens_hit),
        EST_("evictions_pressure", evictions_pressure),
        EST_("alloc_exhausted", alloc_exhausted),
        EST_("lifecycle_ticks", lifecycle_ticks),
        EST_("lifecycle_skipped_tq3_full", lifecycle_skipped_tq3_full),
        EST_("retier_ns", retier_ns),
        EST_("promote_ns", promote_ns),
        EST_("lifecycle_tick_ns", lifecycle_tick_ns),
        EST_("lifecycle_tick_ns_max", lifecycle_tick_ns_max),
        EST_("request_refs", request_refs),
#undef EST_
    };
    for (size_t i = 0; i < r->n_stats; i++) {
        const char *nm = r->stats[i]->name;
        uint64_t v = r->stats[i]->value;
        if (!strcmp(nm, "pages_free.fp8"))
            free8 = v;
        else if (!strcmp(nm, "pages_free.tq3"))
            free3 = v;
        for (size_t j = 0; j < sizeof tab / sizeof tab[0]; j++)
            if (!strcmp(nm, tab[j].name))
                *(uint64_t *)((char *)st + tab[j].off) = v;
    }
    st->fp8_used = st->fp8_total - free8;
    st->tq3_used = st->tq3_total - free3;
    st->ok = 1;
    kvc_reply_free(&rep);
    return 0;
}

static void eng_usage(FILE *f)
{
    fprintf(
        f, "usage: kvbench engine [options]\n"
           "\n"
           "Multi-process engine workload on libkvshim; prints one JSON object on stdout\n"
           "(progress on stderr). W worker processes serve R requests each: prompt = P shared\n"
           "tokens + U unique ones; prefix lookup, K/V append of the uncached tokens in every\n"
           "layer, commit, then G decode steps (extend 1, append every layer, attention,\n"
           "commit). Reports prefix hits, p50/p99 of begin / append / attention / commit /\n"
           "decode step, decode tokens/s, the daemon's FP8/TQ3 pages, and a correctness check\n"
           "(finite outputs; on host pools worker 0's first request against the float64\n"
           "reference, rel L2 <= 1e-4). Exit status 1 when the check fails.\n"
           "\n"
           "  --endpoint EP        use a running daemon instead of starting one (the geometry and\n"
           "                       daemon options below are then the daemon's)\n"
           "  --kvd PATH           kvd binary to start on a temporary endpoint (default: the\n"
           "                       build's)\n"
           "  --backend B          host | cuda: backend of the daemon it starts (default host)\n"
           "  --workers W          worker processes, one kvs_t each (default 2)\n"
           "  --requests R         requests per worker (default 8)\n"
           "  --prefix P           shared prompt tokens (default 256)\n"
           "  --suffix U           unique prompt tokens per request (default 48, at least 1)\n"
           "  --decode G           decode steps per request (default 32)\n"
           "  --batch N            requests in flight per worker (1..1024, default 1): a decode\n"
           "                       step extends and commits each, with one append call (N > 1)\n"
           "                       and one attention call per layer over all N; a finished\n"
           "                       request's slot takes the worker's next one (continuous\n"
           "                       batching)\n"
           "  --attn-all           decode attention in every layer (default: the last layer)\n"
           "  --q-heads H          query heads, a multiple of kv_heads (default 2 x kv_heads)\n"
           "  --layers L --kv-heads K --head-dim D --page-tokens T\n"
           "                       geometry of the daemon it starts (default 2, 2, 64, 16)\n"
           "  --pages-fp8 N --pages-tq3 N\n"
           "                       pool sizes (default: sized from the workload, no eviction)\n"
           "  --lifecycle-ms MS    lifecycle controller period (retier Stale pages to TQ3)\n"
           "  --recent-pages N --anchor-pages N\n"
           "                       the lifecycle's Recent window and Anchor sinks\n"
           "  --kvd-opt KEY=VALUE  any other directive for the daemon it starts (repeatable)\n"
           "  --seed S             token and K/V seed (default 1)\n"
           "  --ready-timeout S    seconds to wait for every worker to open its shim; then the\n"
           "                       run is called off and the workers not ready are killed\n"
           "                       (default 300)\n");
}

static int eng_u32(const char *a, uint32_t *v)
{
    char *end;
    errno = 0;
    unsigned long x = strtoul(a, &end, 10);
    if (errno || *end || end == a || x > UINT32_MAX || a[0] == '-')
        return -1;
    *v = (uint32_t)x;
    return 0;
}

/* v printed with fmt into buf, or null when it was not measured (valid 0). */
static const char *eng_json_num(char *buf, size_t cap, const char *fmt, double v, int valid)
{
    if (valid)
        snprintf(buf, cap, fmt, v);
    else
        snprintf(buf, cap, "null");
    return buf;
}

/* Percentiles of the n samples at v (sorted in place); zeros when there are none. */
static void eng_pct(int64_t *v, uint64_t n, double *p50, double *p99)
{
    *p50 = n ? pct_us(v, (int)n, 0.50) : 0;
    *p99 = n ? pct_us(v, (int)n, 0.99) : 0;
}

/* Aggregate percentiles of one sample kind over every worker. */
static void eng_pct_all(const eng_opts_t *o, const eng_shared_t *sh, const int64_t *base,
                        uint64_t cap, size_t count_off, double *p50, double *p99)
{
    uint64_t tot = 0;
    for (uint32_t w = 0; w < o->workers; w++)
        tot += *(const uint64_t *)((const char *)&sh->w[w] + count_off);
    int64_t *all = malloc(sizeof(int64_t) * (tot ? tot : 1));
    if (!all)
        die("malloc", NULL);
    uint64_t k = 0;
    for (uint32_t w = 0; w < o->workers; w++) {
        uint64_t nw = *(const uint64_t *)((const char *)&sh->w[w] + count_off);
        memcpy(all + k, base + w * cap, sizeof(int64_t) * nw);
        k += nw;
    }
    eng_pct(all, tot, p50, p99);
    free(all);
}


/* A KVBENCH_TEST_* hook's value (the number of the worker that misbehaves), announced on
 * stderr so that a run with one set by accident says so */
static const char *test_hook(const char *name, const char *what)
{
    const char *v = getenv(name);
    if (v && v[0])
        fprintf(stderr,
                "kvbench engine: %s=%s: test hook, that worker %s before the start barrier\n",
                name, v, what);
    return v;
}
static int bench_engine(int argc, char **argv)
{
    eng_opts_t o = {.kvd = KVD_BIN,
                    .backend = "host",
                    .workers = 2,
                    .requests = 8,
                    .prefix = 256,
                    .suffix = 48,
                    .decode = 32,
                    .batch = 1,
                    .layers = 2,
                    .kv_heads = 2,
                    .head_dim = 64,
                    .page_tokens = 16,
                    .lifecycle_ms = -1,
                    .recent_pages = -1,
                    .anchor_pages = -1,
                    .ready_timeout_s = ENG_READY_TIMEOUT_S,
                    .seed = 1};
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        static const struct {
            const char *name;
            size_t off;
        } u32s[] = {
#define EO_(n, f) {n, offsetof(eng_opts_t, f)}
            EO_("--workers", workers),
            EO_("--requests", requests),
            EO_("--prefix", prefix),
            EO_("--suffix", suffix),
            EO_("--decode", decode),
            EO_("--batch", batch),
            EO_("--layers", layers),
            EO_("--kv-heads", kv_heads),
            EO_("--head-dim", head_dim),
            EO_("--page-tokens", page_tokens),
            EO_("--q-heads", q_heads),
            EO_("--pages-fp8", pages_fp8),
            EO_("--pages-tq3", pages_tq3),
            EO_("--ready-timeout", ready_timeout_s),
#undef EO_
        };
        int matched = 0;
        for (size_t j = 0; j < sizeof u32s / sizeof u32s[0]; j++)
            if (!strcmp(a, u32s[j].name)) {
                if (!v || eng_u32(v, (uint32_t *)((char *)&o + u32s[j].off))) {
                    fprintf(stderr, "kvbench engine: %s needs a non-negative integer\n", a);
                    return 2;
                }
                matched = 1;
                i++;
            }
        if (matched)
            continue;
        uint32_t x;
        if (!strcmp(a, "--attn-all"))
            o.attn_all = 1;
        else if (!strcmp(a, "--endpoint") && v)
            o.ep_arg = argv[++i];
        else if (!strcmp(a, "--kvd") && v)
            o.kvd = argv[++i];
        else if (!strcmp(a, "--backend") && v)
            o.backend = argv[++i];
        else if (!strcmp(a, "--kvd-opt") && v && strchr(v, '=') &&
                 o.n_kvd_opts < ENG_MAX_KVD_OPTS) {
            o.kvd_opts[o.n_kvd_opts++] = v;
            i++;
        } else if ((!strcmp(a, "--lifecycle-ms") || !strcmp(a, "--recent-pages") ||
                    !strcmp(a, "--anchor-pages")) &&
                   v && !eng_u32(v, &x) && x <= INT32_MAX) {
            *(a[2] == 'l'   ? &o.lifecycle_ms
              : a[2] == 'r' ? &o.recent_pages
                            : &o.anchor_pages) = (int)x;
            i++;
        } else if (!strcmp(a, "--seed") && v && isdigit((unsigned char)v[0])) {
            char *end; /* digits only: "abc" was seed 0 */
            errno = 0;
            o.seed = strtoull(argv[++i], &end, 10);
            if (*end || errno) {
                fprintf(stderr, "kvbench engine: --seed needs a non-negative integer, got '%s'\n",
                        v);
                return 2;
            }
        } else {
            fprintf(stderr, "kvbench engine: unknown, incomplete or bad argument '%s'\n", a);
            eng_usage(stderr);
            return 2;
        }
    }
    if (o.workers < 1 || o.requests < 1 || o.suffix < 1 || o.workers > 1024 ||
        o.ready_timeout_s < 1) {
        fprintf(stderr, "kvbench engine: need 1 <= workers <= 1024, requests >= 1, suffix >= 1, "
                        "ready-timeout >= 1\n");
        return 2;
    }
    if (o.batch < 1 || o.batch > ENG_MAX_BATCH) {
        fprintf(stderr, "kvbench engine: --batch needs 1 <= N <= %u, got %u\n", ENG_MAX_BATCH,
                o.batch);
        return 2;
    }
    if (strcmp(o.backend, "host") && strcmp(o.backend, "cuda")) {
        fprintf(stderr, "kvbench engine: --backend is host or cuda, not '%s'\n", o.backend);
        return 2;
    }
    if (!daemon_reachable(o.ep_arg))
        return 1;
    make_tmpdir();
    char ep[400];
    pid_t dpid = 0;
    uint64_t total = (uint64_t)o.prefix + o.suffix + o.decode;
    uint32_t pt = o.page_tokens ? o.page_tokens : 1;
    if (o.ep_arg)
        snprintf(ep, sizeof ep, "%s", o.ep_arg);
    else {
        /* No eviction by default: every live table (a batch of them per worker), every
         * request's sealed unique pages and the prefix fit, with slack for the lifecycle's
         * conversions in flight. */
        uint64_t seq_pages = (total + pt - 1) / pt + 2;
        uint64_t uniq = ((uint64_t)o.suffix + o.decode + pt - 1) / pt + 2;
        uint64_t live = o.batch < o.requests ? o.batch : o.requests;
        uint64_t want = o.workers * live * seq_pages + (uint64_t)o.workers * o.requests * uniq +
                        (o.prefix + pt - 1) / pt + 64;
        if (!o.pages_fp8)
            o.pages_fp8 = want > UINT32_MAX ? UINT32_MAX : (uint32_t)want;
        if (!o.pages_tq3)
            o.pages_tq3 = o.pages_fp8;
        snprintf(ep, sizeof ep, "ipc://%s/run/kvd.sock", tmpdir);
        char num[10][24];
        snprintf(num[0], 24, "%u", o.layers);
        snprintf(num[1], 24, "%u", o.kv_heads);
        snprintf(num[2], 24, "%u", o.head_dim);
        snprintf(num[3], 24, "%u", o.page_tokens);
        snprintf(num[4], 24, "%u", o.pages_fp8);
        snprintf(num[5], 24, "%u", o.pages_tq3);
        snprintf(num[6], 24, "%d", o.lifecycle_ms);
        snprintf(num[7], 24, "%d", o.recent_pages);
        snprintf(num[8], 24, "%d", o.anchor_pages);
        char *av[64 + 2 * ENG_MAX_KVD_OPTS];
        char kbuf[ENG_MAX_KVD_OPTS][128];
        int n = 0;
#define AV_(x) av[n++] = (char *)(x)
        AV_(o.kvd), AV_("--endpoint"), AV_(ep), AV_("--backend"), AV_(o.backend);
        AV_("--layers"), AV_(num[0]), AV_("--kv_heads"), AV_(num[1]), AV_("--head_dim");
        AV_(num[2]), AV_("--page_tokens"), AV_(num[3]), AV_("--pages_fp8"), AV_(num[4]);
        AV_("--pages_tq3"), AV_(num[5]), AV_("--log_level"), AV_("warn");
        if (o.lifecycle_ms >= 0)
            AV_("--lifecycle_ms"), AV_(num[6]);
        if (o.recent_pages >= 0)
            AV_("--recent_pages"), AV_(num[7]);
        if (o.anchor_pages >= 0)
            AV_("--anchor_pages"), AV_(num[8]);
        for (int j = 0; j < o.n_kvd_opts; j++) {
            const char *eq = strchr(o.kvd_opts[j], '=');
            snprintf(kbuf[j], sizeof kbuf[j], "--%.*s", (int)(eq - o.kvd_opts[j]), o.kvd_opts[j]);
            AV_(kbuf[j]), AV_(eq + 1);
        }
        av[n] = NULL;
#undef AV_
        fprintf(stderr, "kvbench engine: starting %s (backend %s, %u FP8 + %u TQ3 pages)\n", o.kvd,
                o.backend, o.pages_fp8, o.pages_tq3);
        dpid = spawn_kvd(av, ep);
    }

    /* Geometry and backend from the daemon's status (no mapping: no CUDA in the parent, whose
     * forked workers initialise their own), then close before forking (ZeroMQ contexts do not
     * survive fork). */
    kvc_t *c;
    eng_status_t st0, st;
    if (kvc_connect(&c, ep, 30000) != KV_ERR_OK || eng_status(c, &st0) != 0)
        die("status", c);
    kvc_close(&c);
    const kv_geom_t g = st0.geom;
#ifndef KVB_HAVE_CUDA
    if (!strncmp(st0.backend, "cuda", 4)) {
        fprintf(stderr,
                "kvbench engine: the daemon's backend is %s (device pools) but this "
                "kvbench was built without CUDA; rebuild with -DKVD_CUDA=ON\n",
                st0.backend);
        return 1; /* cleanup() stops the daemon */
    }
#endif
    if (!o.q_heads) /* the default: two query heads per KV head of the daemon's geometry */
        o.q_heads = 2 * g.kv_heads;
    if (!g.kv_heads || o.q_heads % g.kv_heads) {
        fprintf(stderr, "kvbench engine: --q-heads %u is not a multiple of kv_heads %u\n",
                o.q_heads, g.kv_heads);
        return 2;
    }
    o.pages_fp8 = (uint32_t)st0.fp8_total; /* what the daemon has, started here or not */
    o.pages_tq3 = (uint32_t)st0.tq3_total;
    o.backend = st0.backend; /* workers: cudaSetDevice before kvs_open */
    uint32_t attn_layers = o.attn_all ? g.layers : 1;

    eng_shared_t sh;
    sh.cap_begin = o.requests;
    sh.cap_commit = (uint64_t)o.requests * (o.decode + 1);
    sh.cap_app = (uint64_t)o.requests * o.decode * g.layers;
    sh.cap_attn = (uint64_t)o.requests * o.decode * attn_layers;
    sh.cap_step = (uint64_t)o.requests * o.decode;
    uint64_t per = sh.cap_begin + sh.cap_commit + sh.cap_app + sh.cap_attn + sh.cap_step;
    size_t bytes = sizeof(eng_wres_t) * o.workers + sizeof(int64_t) * per * o.workers + ENG_WHY_CAP;
    void *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED)
        die("mmap (shared results)", NULL);
    sh.w = mem;
    int64_t *p = (int64_t *)(sh.w + o.workers);
    sh.begin = p;
    p += sh.cap_begin * o.workers;
    sh.commit = p;
    p += sh.cap_commit * o.workers;
    sh.app = p;
    p += sh.cap_app * o.workers;
    sh.attn = p;
    p += sh.cap_attn * o.workers;
    sh.step = p;
    p += sh.cap_step * o.workers;
    sh.stop_why = (char *)p; /* "" (MAP_ANONYMOUS is zeroed) */

    int ready[2], go[2];
    if (pipe(ready) || pipe(go))
        die("pipe", NULL);
    pid_t *pids = calloc(o.workers, sizeof *pids);
    int *wstat = calloc(o.workers, sizeof *wstat);     /* each worker's wait status */
    int64_t *ended = calloc(o.workers, sizeof *ended); /* when it was reaped (now_ns) */
    if (!pids || !wstat || !ended)
        die("calloc", NULL);
    (void)test_hook("KVBENCH_TEST_DIE_BEFORE_READY", "kills itself");
    (void)test_hook("KVBENCH_TEST_HANG_BEFORE_READY", "waits for ever");
    for (uint32_t w = 0; w < o.workers; w++) {
        pids[w] = fork();
        if (pids[w] < 0)
            die("fork", NULL);
        if (pids[w] == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            close(ready[0]);
            close(go[1]);
            _exit(eng_worker(&o, ep, w, &sh, ready[1], go[0]));
        }
    }
    close(ready[1]);
    close(go[0]);
    /* The parent writes to pipes whose readers may all be gone: the go pipe when every worker
     * died after its ready byte (the write fails with EPIPE; the reap below says how each
     * ended), stdout when its reader left. SIGPIPE killed kvbench there (status 141), with no
     * JSON and its TMPDIR left: cleanup() runs for the signals it catches only. The workers,
     * forked before, keep the default. */
    signal(SIGPIPE, SIG_IGN);
    /* The start barrier (design block above): wait for every worker's 'r' byte, reaping the
     * workers between polls, until one fails ('x', its error in its result) or ends without a
     * byte, which calls the run off. ready[0] stays open until every worker is reaped: a worker
     * still opening its shim writes its byte later, and a closed read end would kill it with
     * SIGPIPE instead of letting it close its shim. */
    uint32_t nready = 0;
    int left = (int)o.workers, bad_exit = 0;
    char *stop_why = sh.stop_why;
    const int64_t t_barrier = now_ns();
    while (nready < o.workers && !stop_why[0]) {
        struct pollfd pf = {.fd = ready[0], .events = POLLIN};
        char b[64];
        ssize_t n = poll(&pf, 1, 50) > 0 ? read(ready[0], b, sizeof b) : -1;
        if (n == 0)
            usleep(1000); /* every write end closed: all wrote or ended; the reap names who */
        for (ssize_t i = 0; i < n; i++)
            nready += b[i] == 'r';
        for (uint32_t w = 0; w < o.workers; w++) {
            int ws;
            if (pids[w] > 0 && waitpid(pids[w], &ws, WNOHANG) == pids[w]) {
                pids[w] = 0;
                wstat[w] = ws;
                ended[w] = now_ns();
                left--;
                bad_exit++; /* no worker exits before go but by failing */
            }
            /* sh.w[w].failed is set before its 'x' is written, and its err before that */
            if (stop_why[0])
                continue;
            if (sh.w[w].failed)
                snprintf(stop_why, ENG_WHY_CAP, "worker %u failed before the start: %.440s", w,
                         sh.w[w].err);
            else if (!pids[w]) {
                char how[128];
                eng_ended_how(wstat[w], eng_barrier_when(&sh.w[w]), how, sizeof how);
                snprintf(stop_why, ENG_WHY_CAP, "worker %u %s", w, how);
            }
        }
        /* A worker hung before its byte held the barrier, and kvbench, for ever. */
        if (!stop_why[0] && now_ns() - t_barrier > (int64_t)o.ready_timeout_s * 1000000000) {
            char who[ENG_WHY_CAP / 2];
            if (eng_kill_unready(&o, &sh, pids, who, sizeof who))
                snprintf(stop_why, ENG_WHY_CAP,
                         "%.200s not ready after %u s (--ready-timeout): killed", who,
                         o.ready_timeout_s);
        }
    }
    /* 2 s per poll, not 30: a daemon that went away is noticed after one of them */
    if (kvc_connect(&c, ep, 2000) != KV_ERR_OK)
        die("connect (status poll)", NULL);
    int64_t t0 = now_ns();
    int started = !stop_why[0];
    if (started) {
        fprintf(stderr, "kvbench engine: %u workers ready; go\n", nready);
        for (uint32_t w = 0; w < o.workers; w++) {
            char b = 'g';
            if (write(go[1], &b, 1) != 1) /* EPIPE: every worker died since: reaped below */
                continue;
        }
    } else /* no byte: each worker still running reads EOF at its barrier and stops */
        fprintf(stderr, "kvbench engine: %s; calling the run off, stopping the others\n", stop_why);
    close(go[1]);
    /* Poll the daemon while the workers run: the highest FP8 / TQ3 pages in use. When the
     * daemon goes away the workers are killed: each of their calls in flight would wait out
     * libkvshim's 60 s timeout, and this loop waited with them (over 2 minutes in all). */
    uint64_t fp8_max = 0, tq3_max = 0, polls = 0;
    int gone = 0;
    char gone_why[640] = ""; /* how the daemon went away: the error of each worker killed */
    while (left > 0) {
        char why[512];
        if (!gone && eng_status(c, &st) == 0) {
            polls++;
            fp8_max = st.fp8_used > fp8_max ? st.fp8_used : fp8_max;
            tq3_max = st.tq3_used > tq3_max ? st.tq3_used : tq3_max;
        } else if (!gone && ipc_unreachable(ep, why, sizeof why)) {
            snprintf(gone_why, sizeof gone_why,
                     "the daemon at %.120s went away during the run: %.400s", ep, why);
            fprintf(stderr, "kvbench engine: %s\n", gone_why);
            gone = 1;
        }
        /* a run called off for another reason waits for its workers to stop at the barrier:
         * one hung before it never does */
        if (!started && now_ns() - t_barrier > (int64_t)o.ready_timeout_s * 1000000000) {
            char who[ENG_WHY_CAP / 2];
            eng_kill_unready(&o, &sh, pids, who, sizeof who);
        }
        if (gone == 1) {
            for (uint32_t w = 0; w < o.workers; w++)
                if (pids[w] > 0)
                    kill(pids[w], SIGKILL);
            gone = 2;
            bad_exit++;
        }
        for (int64_t tw = now_ns(); left > 0 && now_ns() - tw < 50000000;) {
            int ws;
            pid_t d = waitpid(-1, &ws, WNOHANG);
            if (d > 0 && d != dpid) {
                left--;
                bad_exit += !WIFEXITED(ws) || WEXITSTATUS(ws) != 0;
                for (uint32_t w = 0; w < o.workers; w++)
                    if (pids[w] == d) {
                        pids[w] = 0;
                        wstat[w] = ws;
                        ended[w] = now_ns();
                    }
            } else if (d > 0 && d == dpid) {
                snprintf(gone_why, sizeof gone_why,
                         "the daemon exited during the run (%s %d; log %.300s/kvd.log)",
                         WIFSIGNALED(ws) ? "signal" : "status",
                         WIFSIGNALED(ws) ? WTERMSIG(ws) : WEXITSTATUS(ws), tmpdir);
                fprintf(stderr, "kvbench engine: %s\n", gone_why);
                dpid = own_kvd = 0;
                tmpdir_keep = 1; /* its log says why */
                gone = gone ? gone : 1;
            } else
                usleep(1000);
        }
    }
    close(ready[0]);
    /* the run's wall time, from go; none when it was called off before the start */
    double wall_s = (double)(now_ns() - t0) / 1e9;
    /* the workers' sessions are gone: their references should drop to 0 (the daemon closes a
     * session on goodbye / process exit; poll briefly) */
    for (int64_t tw = now_ns(); !gone && now_ns() - tw < 5000000000LL; usleep(5000))
        if (eng_status(c, &st) != 0 || st.request_refs == 0)
            break;
    if (!st.ok)
        memset(&st, 0, sizeof st);
    kvc_close(&c);
    /* A worker that did not finish says why: its own error, or else how it ended. One killed
     * here (the daemon went away), or by a signal of its own (a crash), or that exited without
     * writing one, showed "error": "" in the JSON. */
    for (uint32_t w = 0; w < o.workers; w++)
        eng_worker_ended(&sh.w[w], wstat[w],
                         started ? "before it finished" : eng_barrier_when(&sh.w[w]),
                         gone ? gone_why : NULL);

    /* ---- aggregate ---- */
    uint64_t reqs = 0, prompt = 0, cachedt = 0, prefill = 0, steps = 0, attn_calls = 0;
    uint64_t attn_seqs = 0, app_calls = 0, app_seqs = 0;
    uint64_t nonfinite = 0, ref_checks = 0, ref_retries = 0, failed = 0, ptl = 0;
    int64_t pans = 0;
    double ref_err = 0;
    uint32_t ref_tq3 = 0;
    int on_device = 0;
    for (uint32_t w = 0; w < o.workers; w++) {
        const eng_wres_t *r = &sh.w[w];
        reqs += r->requests;
        prompt += r->prompt_tokens;
        cachedt += r->cached_tokens;
        prefill += r->prefill_tokens;
        steps += r->decode_steps;
        attn_calls += r->attn_calls;
        attn_seqs += r->attn_seqs;
        app_calls += r->app_calls;
        app_seqs += r->app_seqs;
        nonfinite += r->nonfinite;
        ref_checks += r->ref_checks;
        ref_retries += r->ref_retries;
        failed += r->failed || !r->done;
        pans += r->prefill_append_ns;
        ptl += r->prefill_token_layers;
        ref_err = r->ref_err_max > ref_err ? r->ref_err_max : ref_err;
        ref_tq3 = r->ref_tq3_pages_max > ref_tq3 ? r->ref_tq3_pages_max : ref_tq3;
        on_device |= r->on_device;
    }
    uint64_t pfull = o.prefix / (g.page_tokens ? g.page_tokens : 1) * g.page_tokens;
    /* the lookup covers only whole pages before the last prompt token (U >= 1: all of P's) */
    uint64_t exp_min = ((uint64_t)o.workers * o.requests - o.workers) * pfull;
    uint64_t exp_max = (uint64_t)o.workers * o.requests * pfull;
    int ref_ok = on_device ? 1 : (ref_checks > 0 && ref_err <= ENG_REF_TOL);
    if (o.decode == 0)
        ref_ok = 1; /* no decode attention to check */
    int ok = failed == 0 && bad_exit == 0 && nonfinite == 0 && ref_ok &&
             reqs == (uint64_t)o.workers * o.requests;

    double b50, b99, a50, a99, t50, t99, c50, c99, s50, s99;
    eng_pct_all(&o, &sh, sh.begin, sh.cap_begin, offsetof(eng_wres_t, n_begin), &b50, &b99);
    eng_pct_all(&o, &sh, sh.app, sh.cap_app, offsetof(eng_wres_t, n_app), &a50, &a99);
    eng_pct_all(&o, &sh, sh.attn, sh.cap_attn, offsetof(eng_wres_t, n_attn), &t50, &t99);
    eng_pct_all(&o, &sh, sh.commit, sh.cap_commit, offsetof(eng_wres_t, n_commit), &c50, &c99);
    eng_pct_all(&o, &sh, sh.step, sh.cap_step, offsetof(eng_wres_t, n_step), &s50, &s99);
    /* decode alone: each worker's decode tokens (a batched step makes one per sequence) over
     * the time its steps took, summed over the workers (they run at once);
     * decode_tokens_per_s divides by the whole run's wall time instead */
    double step_rate = 0;
    for (uint32_t w = 0; w < o.workers; w++) {
        int64_t ns = 0;
        for (uint64_t i = 0; i < sh.w[w].n_step; i++)
            ns += sh.step[w * sh.cap_step + i];
        step_rate += ns > 0 ? (double)sh.w[w].decode_steps / ((double)ns / 1e9) : 0.0;
    }

    printf("{\n  \"bench\": \"engine\",\n  \"ok\": %s,\n  \"error\": \"", ok ? "true" : "false");
    if (!started)
        printf("the run was called off at the start barrier: ");
    kvc_json_chars(stdout, started ? gone_why : stop_why,
                   started ? sizeof gone_why : ENG_WHY_CAP);
    printf("\",\n  \"backend\": \"%s\",\n", st0.backend);
    printf("  \"geometry\": {\"layers\": %u, \"kv_heads\": %u, \"head_dim\": %u, \"page_tokens\": "
           "%u, \"q_heads\": %u},\n",
           g.layers, g.kv_heads, g.head_dim, g.page_tokens, o.q_heads);
    printf("  \"params\": {\"workers\": %u, \"requests\": %u, \"prefix\": %u, \"suffix\": %u, "
           "\"decode\": %u, \"batch\": %u, \"attn_layers\": %u, \"own_daemon\": %s, "
           "\"pages_fp8\": %u, \"pages_tq3\": %u, \"lifecycle_ms\": %d, \"recent_pages\": %d, "
           "\"anchor_pages\": %d, \"seed\": %llu},\n",
           o.workers, o.requests, o.prefix, o.suffix, o.decode, o.batch, attn_layers,
           o.ep_arg ? "false" : "true", o.pages_fp8, o.pages_tq3, o.lifecycle_ms, o.recent_pages,
           o.anchor_pages, (unsigned long long)o.seed);
    printf(
        "  \"requests\": %llu,\n  \"prompt_tokens\": %llu,\n  \"cached_tokens\": %llu,\n"
        "  \"cached_expected_min\": %llu,\n  \"cached_expected_max\": %llu,\n"
        "  \"prefix_hit_ratio\": %.4f,\n  \"prefill_tokens\": %llu,\n  \"decode_steps\": %llu,\n",
        (unsigned long long)reqs, (unsigned long long)prompt, (unsigned long long)cachedt,
        (unsigned long long)exp_min, (unsigned long long)exp_max,
        prompt ? (double)cachedt / (double)prompt : 0.0, (unsigned long long)prefill,
        (unsigned long long)steps);
    char wall[3][32]; /* null when the run was called off before the start: no time to divide */
    eng_json_num(wall[0], sizeof wall[0], "%.3f", wall_s, started);
    eng_json_num(wall[1], sizeof wall[1], "%.1f", wall_s > 0 ? (double)steps / wall_s : 0, started);
    eng_json_num(wall[2], sizeof wall[2], "%.2f", wall_s > 0 ? (double)reqs / wall_s : 0, started);
    printf("  \"wall_s\": %s,\n  \"decode_tokens_per_s\": %s,\n"
           "  \"decode_step_tokens_per_s\": %.1f,\n  \"requests_per_s\": %s,\n",
           wall[0], wall[1], step_rate, wall[2]);
    printf("  \"latency_us\": {\"begin\": {\"p50\": %.2f, \"p99\": %.2f}, "
           "\"append_token_layer\": {\"p50\": %.2f, \"p99\": %.2f}, "
           "\"prefill_append_per_token_layer_mean\": %.3f, "
           "\"attention\": {\"p50\": %.2f, \"p99\": %.2f}, "
           "\"commit\": {\"p50\": %.2f, \"p99\": %.2f}, "
           "\"decode_step\": {\"p50\": %.2f, \"p99\": %.2f}},\n",
           b50, b99, a50, a99, ptl ? (double)pans / 1000.0 / (double)ptl : 0.0, t50, t99, c50, c99,
           s50, s99);
    char errbuf[32];
    printf("  \"check\": {\"reference\": \"%s\", \"tol_rel_l2\": %g, \"checks\": %llu, "
           "\"retries\": %llu, \"rel_err_max\": %s, \"tq3_pages_in_checked_table_max\": %u, "
           "\"attention_calls\": %llu, \"attention_seqs\": %llu, \"append_calls\": %llu, "
           "\"append_seqs\": %llu, \"nonfinite\": %llu, \"workers_failed\": %llu},\n",
           on_device ? "skipped (device pools; outputs checked finite)"
                     : "float64 kv_attn_reference",
           ENG_REF_TOL, (unsigned long long)ref_checks, (unsigned long long)ref_retries,
           /* null, not inf: a reference of norm 0 gives an infinite relative error */
           eng_json_num(errbuf, sizeof errbuf, "%.3g", ref_err, isfinite(ref_err)), ref_tq3,
           (unsigned long long)attn_calls, (unsigned long long)attn_seqs,
           (unsigned long long)app_calls, (unsigned long long)app_seqs,
           (unsigned long long)nonfinite,
           (unsigned long long)failed);
    printf("  \"daemon\": {\"polls\": %llu, \"fp8_pages_used_max\": %llu, \"tq3_pages_used_max\": "
           "%llu, \"fp8_pages_used_end\": %llu, \"tq3_pages_used_end\": %llu, "
           "\"fp8_pages_cached_end\": %llu, \"tq3_pages_cached_end\": %llu, \"retiers\": %llu, "
           "\"promotes\": %llu, \"conversion_failures\": %llu, \"lifecycle_ticks\": %llu, "
           "\"lifecycle_skipped_tq3_full\": %llu, \"seals\": %llu, \"seal_dedupes\": %llu, "
           "\"lookup_tokens_asked\": %llu, \"lookup_tokens_hit\": %llu, "
           "\"evictions_pressure\": %llu, \"alloc_exhausted\": %llu, \"request_refs_end\": "
           "%llu, \"conversion_us_per_page\": %.2f, \"lifecycle_tick_us_mean\": %.1f, "
           "\"lifecycle_tick_us_max\": %.1f},\n",
           (unsigned long long)polls, (unsigned long long)fp8_max, (unsigned long long)tq3_max,
           (unsigned long long)st.fp8_used, (unsigned long long)st.tq3_used,
           (unsigned long long)st.fp8_cached, (unsigned long long)st.tq3_cached,
           (unsigned long long)st.retiers, (unsigned long long)st.promotes,
           (unsigned long long)st.conversion_failures, (unsigned long long)st.lifecycle_ticks,
           (unsigned long long)st.lifecycle_skipped_tq3_full, (unsigned long long)st.seals,
           (unsigned long long)st.seal_dedupes, (unsigned long long)st.lookup_tokens_asked,
           (unsigned long long)st.lookup_tokens_hit, (unsigned long long)st.evictions_pressure,
           (unsigned long long)st.alloc_exhausted, (unsigned long long)st.request_refs,
           st.retiers + st.promotes
               ? (double)(st.retier_ns + st.promote_ns) / 1e3 / (double)(st.retiers + st.promotes)
               : 0.0,
           st.lifecycle_ticks ? (double)st.lifecycle_tick_ns / 1e3 / (double)st.lifecycle_ticks
                              : 0.0,
           (double)st.lifecycle_tick_ns_max / 1e3);
    printf("  \"workers\": [");
    for (uint32_t w = 0; w < o.workers; w++) {
        eng_wres_t *r = &sh.w[w];
        double wb50, wb99, wa50, wa99, wt50, wt99;
        eng_pct(sh.begin + w * sh.cap_begin, r->n_begin, &wb50, &wb99);
        eng_pct(sh.app + w * sh.cap_app, r->n_app, &wa50, &wa99);
        eng_pct(sh.attn + w * sh.cap_attn, r->n_attn, &wt50, &wt99);
        /* a worker that did not finish: from go until it was reaped (wall_ns is set when it
         * finishes: a killed worker showed 0.000); null when the run never started */
        int fin = r->done && !r->failed;
        double ws = (double)(fin ? r->wall_ns : ended[w] - t0) / 1e9;
        char wws[32], wtps[32];
        eng_json_num(wws, sizeof wws, "%.3f", ws, started);
        eng_json_num(wtps, sizeof wtps, "%.1f", ws > 0 ? (double)r->decode_steps / ws : 0, started);
        printf("%s\n    {\"worker\": %u, \"ok\": %s, \"requests\": %llu, \"prompt_tokens\": %llu, "
               "\"cached_tokens\": %llu, \"first_cached\": %lld, \"cached_min\": %llu, "
               "\"cached_max\": %llu, \"prefill_tokens\": %llu, \"decode_steps\": %llu, "
               "\"wall_s\": %s, \"decode_tokens_per_s\": %s, \"begin_us\": {\"p50\": %.2f, "
               "\"p99\": %.2f}, \"append_us\": {\"p50\": %.2f, \"p99\": %.2f}, "
               "\"attention_us\": {\"p50\": %.2f, \"p99\": %.2f}, \"error\": \"",
               w ? "," : "", w, fin ? "true" : "false", (unsigned long long)r->requests,
               (unsigned long long)r->prompt_tokens, (unsigned long long)r->cached_tokens,
               (long long)r->first_cached, (unsigned long long)(r->requests ? r->cached_min : 0),
               (unsigned long long)r->cached_max, (unsigned long long)r->prefill_tokens,
               (unsigned long long)r->decode_steps, wws, wtps, wb50, wb99, wa50, wa99, wt50, wt99);
        kvc_json_chars(stdout, r->err, sizeof r->err);
        printf("\"}");
    }
    printf("\n  ]\n}\n");
    fflush(stdout);
    if (!started)
        fprintf(stderr, "kvbench engine: FAILED: called off before the start: %s\n", stop_why);
    else
        fprintf(stderr,
                "kvbench engine: %s: %llu requests, cached %llu of %llu prompt tokens, %llu "
                "decode steps (batch %u) in %.2f s (%.0f tokens/s), attention p50 %.1f us, "
                "ref err %.3g\n",
                ok ? "ok" : "FAILED", (unsigned long long)reqs, (unsigned long long)cachedt,
                (unsigned long long)prompt, (unsigned long long)steps, o.batch, wall_s,
                wall_s > 0 ? (double)steps / wall_s : 0, t50, ref_err);

    munmap(mem, bytes);
    free(pids);
    free(wstat);
    free(ended);
    if (dpid > 0) {
        int ds = stop_own_kvd();
        if (!WIFEXITED(ds) || WEXITSTATUS(ds) != 0) {
            fprintf(stderr, "kvbench engine: the daemon did not exit cleanly (log %s/kvd.log)\n",
                    tmpdir);
            return 1; /* the log is kept (stop_own_kvd) */
        }
    }
    return ok ? 0 : 1; /* the directory goes at exit (cleanup) */
}

/* Does any of argv[0..argc) ask for help? */
static int wants_help(int argc, char **argv)
{
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return 1;
    return 0;
}

int main(int argc, char **argv)
{
    const char *cmd = argc >= 2 ? argv[1] : "";
    const int is_engine = !strcmp(cmd, "engine"), is_rpc = !strcmp(cmd, "rpc");
    if ((is_engine || is_rpc) && wants_help(argc - 2, argv + 2)) {
        (is_engine ? eng_usage : usage)(stdout);
        return 0;
    }
    if (is_engine)
        return bench_engine(argc - 2, argv + 2);
    if (is_rpc)
        return bench_rpc(argc - 2, argv + 2);
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
        usage(stdout);
        return 0;
    }
    usage(stderr);
    return 2;
}
