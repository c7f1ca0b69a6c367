/* kvbench.c — `kvbench rpc`: the control-plane benchmark of issue 3, printed as one JSON object.
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
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvc.h"

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

static pid_t start_kvd(const char *kvd, const char *ep, uint32_t prompt_pages)
{
    char fds[512], pages[32], logp[300];
    snprintf(fds, sizeof fds, "%s.fds", ep + 6);
    snprintf(pages, sizeof pages, "%u", prompt_pages + 1024);
    snprintf(logp, sizeof logp, "%s/kvd.log", tmpdir);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(logp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execl(kvd, kvd, "--endpoint", ep, "--layers", "4", "--kv_heads", "8", "--head_dim",
              "128", "--page_tokens", "16", "--pages_fp8", pages, "--pages_tq3", "64",
              "--log_level", "warn", (char *)NULL);
        _exit(127);
    }
    for (int64_t t0 = now_ns(); now_ns() - t0 < 30000000000LL;) {
        struct stat st;
        if (stat(fds, &st) == 0)
            return pid;
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            fprintf(stderr, "kvbench: %s exited during startup (see %s)\n", kvd, logp);
            exit(1);
        }
        usleep(2000);
    }
    fprintf(stderr, "kvbench: kvd did not start\n");
    exit(1);
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

static uint64_t stat_of(const char *ep, const char *name)
{
    kvc_t *c;
    if (kvc_connect(&c, ep, 10000) != KV_ERR_OK)
        die("connect", NULL);
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__StatusReq st = KVD__STATUS_REQ__INIT;
    req.body_case = KVD__REQUEST__BODY_STATUS;
    req.status = &st;
    Kvd__Reply *rep;
    if (kvc_call(c, &req, &rep) != KV_ERR_OK)
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
        if (kvc_release(c, held + done, npages - done < 1024 ? npages - done : 1024) !=
            KV_ERR_OK)
            die("release (prompt)", c);
    free(held);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvbench rpc [--endpoint EP] [--kvd PATH] [--iters N] [--prompt-tokens T]\n"
            "\n"
            "Control-plane benchmark of kvd; prints one JSON object on stdout: raw ZeroMQ\n"
            "ping-pong, alloc and lookup round trips (p50/p99 and the ratio to raw), pipelined\n"
            "ops/s, lookup+acquire of a cached long prompt, reclaim after kill -9, and the goals.\n"
            "\n"
            "  --endpoint EP        use a running daemon (ipc://PATH) instead of starting one\n"
            "  --kvd PATH           kvd binary to start on a temporary endpoint (default: the\n"
            "                       build's)\n"
            "  --iters N            round trips per figure (default 5000, at least 100)\n"
            "  --prompt-tokens T    long-prompt length for lookup+acquire (default 32768)\n");
}

static int bench_rpc(int argc, char **argv)
{
    const char *ep_arg = NULL, *kvd = KVD_BIN;
    int iters = 5000;
    uint32_t prompt = 32768;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--endpoint") && i + 1 < argc)
            ep_arg = argv[++i];
        else if (!strcmp(argv[i], "--kvd") && i + 1 < argc)
            kvd = argv[++i];
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--prompt-tokens") && i + 1 < argc)
            prompt = (uint32_t)strtoul(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "kvbench: unknown or incomplete argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (iters < 100)
        iters = 100;
    struct stat sock_st; /* ZeroMQ would wait for a missing daemon: say so at once (as kvctl) */
    if (ep_arg && !strncmp(ep_arg, "ipc://", 6) && stat(ep_arg + 6, &sock_st) != 0) {
        fprintf(stderr, "kvbench: no daemon at %s: no socket file %s (is kvd running?)\n",
                ep_arg, ep_arg + 6);
        return 1;
    }
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kvbench-XXXXXX");
    if (!mkdtemp(tmpdir))
        die("mkdtemp", NULL);
    char ep[400];
    pid_t dpid = 0;
    if (ep_arg)
        snprintf(ep, sizeof ep, "%s", ep_arg);
    else {
        snprintf(ep, sizeof ep, "ipc://%s/run/kvd.sock", tmpdir);
        dpid = start_kvd(kvd, ep, prompt / 16 + 16);
    }
    int64_t *lat = malloc(sizeof(int64_t) * (size_t)iters);
    if (!lat)
        die("malloc", NULL);

    double raw_p99, raw_p50 = raw_pingpong(iters, lat, &raw_p99);

    kvc_t *c;
    if (kvc_connect(&c, ep, 30000) != KV_ERR_OK || kvc_hello(c, NULL, "kvbench", 1) != KV_ERR_OK)
        die("connect/hello", c);
    uint32_t pt = kvc_geom(c)->page_tokens;

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

    /* lookup+acquire of a cached 4-page prompt */
    uint32_t small[4 * 64];
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
    kvc_close(&c);

    double rc[5];
    int nrc = 5;
    for (int i = 0; i < nrc; i++)
        rc[i] = reclaim_once(ep);
    double rc_max = 0, rc_sum = 0;
    for (int i = 0; i < nrc; i++) {
        rc_max = rc[i] > rc_max ? rc[i] : rc_max;
        rc_sum += rc[i];
    }

    printf("{\n  \"bench\": \"rpc\",\n  \"iters\": %d,\n  \"geometry\": {\"layers\": 4, "
           "\"kv_heads\": 8, \"head_dim\": 128, \"page_tokens\": %u},\n",
           iters, pt);
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
    printf("  \"reclaim_ms\": {\"samples\": %d, \"mean\": %.2f, \"max\": %.2f, \"refs\": 100},\n",
           nrc, rc_sum / nrc, rc_max);
    printf("  \"goals\": {\"overhead_le_1_5\": %s, \"lookup_32k_le_1ms\": %s, "
           "\"reclaim_le_100ms\": %s}\n}\n",
           alloc_p50 / raw_p50 <= 1.5 ? "true" : "false",
           long_p50 <= 1000.0 ? "true" : "false", rc_max >= 0 && rc_max <= 100 ? "true" : "false");
    free(tok);
    free(got);
    free(lat);
    if (dpid > 0) {
        kill(dpid, SIGTERM);
        waitpid(dpid, NULL, 0);
    }
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
    if (system(cmd)) {
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        usage(stdout);
        return 0;
    }
    if (argc >= 2 && !strcmp(argv[1], "rpc")) {
        for (int i = 2; i < argc; i++)
            if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
                usage(stdout);
                return 0;
            }
        return bench_rpc(argc - 2, argv + 2);
    }
    usage(stderr);
    return 2;
}
