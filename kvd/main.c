/* main.c — the kvd executable: arguments, config, signals, the loop.
 *
 *   kvd [--config FILE] [--KEY VALUE]...     run (flags override the file)
 *   kvd --check-config FILE                  parse FILE, report every error with its line; 0/1
 *   kvd --help | --version
 *
 * SIGTERM / SIGINT: stop every handle, let the loop run dry, free everything and exit 0 (the
 * ASan build checks that nothing leaks on this path). The allocator is jemalloc (linked by
 * kvd/server.cmake in non-sanitizer builds).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "config.h"
#include "log.h"
#include "server.h"

static void kvd_usage(FILE *f)
{
    fprintf(f, "usage: kvd [--config FILE] [--KEY VALUE]...\n"
               "       kvd --check-config FILE\n"
               "       kvd --help | --version\n\n"
               "kvd serves one model namespace's KV-cache pages to the engine processes of this\n"
               "host over ZeroMQ (docs/daemon.md). Directives, as flags or config-file lines\n"
               "'key = value' (deploy/kvd.conf documents each):\n");
    kvd_config_help(f);
}

typedef struct kvd_main_s {
    kvd_server_t *srv;
    uv_signal_t sigterm, sigint;
} kvd_main_t;

static void kvd_on_signal(uv_signal_t *h, int sig)
{
    kvd_main_t *m = h->data;
    KVD_LOGI("signal %d: shutting down", sig);
    kvd_server_stop(m->srv);
    uv_close((uv_handle_t *)&m->sigterm, NULL);
    uv_close((uv_handle_t *)&m->sigint, NULL);
}

int main(int argc, char **argv)
{
    kvd_config_t cfg;
    if (kvd_config_init(&cfg) != 0)
        return 1;
    int rc = 1;
    /* pass 1: --help, --check-config and --config (the file goes first, flags override it) */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            kvd_usage(stdout);
            rc = 0;
            goto out;
        }
        if (!strcmp(argv[i], "--version")) {
            printf("kvd 0.1.0 (protocol 1)\n");
            rc = 0;
            goto out;
        }
        if (!strcmp(argv[i], "--check-config")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "kvd: --check-config needs a FILE\n");
                goto out;
            }
            int n = kvd_config_load_file(&cfg, argv[i + 1], stderr);
            if (n == 0)
                printf("%s: ok (%zu directives known)\n", argv[i + 1], kvd_config_count());
            else
                fprintf(stderr, "%s: %d error%s\n", argv[i + 1], n, n == 1 ? "" : "s");
            rc = n == 0 ? 0 : 1;
            goto out;
        }
        if (!strcmp(argv[i], "--config")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "kvd: --config needs a FILE\n");
                goto out;
            }
            if (kvd_config_load_file(&cfg, argv[++i], stderr) != 0)
                goto out;
        }
    }
    /* pass 2: --key value flags */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--config")) {
            i++;
            continue;
        }
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0) {
            fprintf(stderr, "kvd: unexpected argument '%s' (see kvd --help)\n", a);
            goto out;
        }
        char key[128];
        const char *val;
        const char *eq = strchr(a + 2, '=');
        if (eq) { /* --key=value works too */
            snprintf(key, sizeof key, "%.*s", (int)(eq - a - 2), a + 2);
            val = eq + 1;
        } else {
            snprintf(key, sizeof key, "%s", a + 2);
            if (i + 1 >= argc) {
                fprintf(stderr, "kvd: --%s needs a value\n", key);
                goto out;
            }
            val = argv[++i];
        }
        for (char *p = key; *p; p++)
            if (*p == '-')
                *p = '_';
        char err[512];
        if (kvd_config_set(&cfg, key, val, 0, err, sizeof err) != 0) {
            fprintf(stderr, "kvd: --%s: %s\n", key, err);
            goto out;
        }
    }

    signal(SIGPIPE, SIG_IGN);
    uv_loop_t loop;
    uv_loop_init(&loop);
    kvd_main_t m;
    memset(&m, 0, sizeof m);
    /* The handlers go in before the server: kvd_server_init creates the fd socket last, and
     * its file appearing means "ready" (docs/daemon.md) to tests, kvctl and supervisors, so a
     * SIGTERM from that moment on must take the clean path. With the handlers installed after
     * it, a SIGTERM in between killed the daemon (exit by signal 15; it_reconnect under
     * ASan on a loaded 2-core machine). A signal that arrives during init is delivered when
     * the loop runs. */
    uv_signal_init(&loop, &m.sigterm);
    uv_signal_init(&loop, &m.sigint);
    m.sigterm.data = m.sigint.data = &m;
    uv_signal_start(&m.sigterm, kvd_on_signal, SIGTERM);
    uv_signal_start(&m.sigint, kvd_on_signal, SIGINT);
    char err[1024];
    if (kvd_server_init(&m.srv, &loop, &cfg, err, sizeof err) != 0) {
        KVD_LOGE("startup failed: %s", err);
        /* a SIGTERM during init may have closed them already (kvd_on_signal ran in the
         * server's clean-up iteration; kvd_server_stop(NULL) does nothing) */
        if (!uv_is_closing((uv_handle_t *)&m.sigterm))
            uv_close((uv_handle_t *)&m.sigterm, NULL);
        if (!uv_is_closing((uv_handle_t *)&m.sigint))
            uv_close((uv_handle_t *)&m.sigint, NULL);
        uv_run(&loop, UV_RUN_NOWAIT);
        uv_loop_close(&loop);
        goto out;
    }
    KVD_LOGI("ready (pid %d)", (int)getpid());
    uv_run(&loop, UV_RUN_DEFAULT);
    kvd_server_free(&m.srv);
    if (uv_loop_close(&loop) != 0)
        KVD_LOGW("uv_loop_close: handles still open at exit");
    KVD_LOGI("exited cleanly");
    rc = 0;
out:
    kvd_config_free(&cfg);
    return rc;
}
