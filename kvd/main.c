/* main.c — the kvd executable: arguments, config, signals, the loop.
 *
 *   kvd [--config FILE] [--KEY VALUE]...     run (flags override the file)
 *   kvd --check-config FILE [--KEY VALUE]... parse FILE and the flags, report every error
 *                                            (the file's with their lines); start nothing; 0/1
 *   kvd --help | --version
 * Every `--NAME VALUE` may also be written `--NAME=VALUE`, --config and --check-config included.
 * One config file at most: a second --config or --check-config is a usage error naming both.
 *
 * SIGTERM / SIGINT: stop every handle, let the loop run dry, free everything and exit 0 (the
 * ASan build checks that nothing leaks on this path). SIGHUP is logged and ignored: kvd has no
 * reload, and the default action (terminate) skipped the snapshot and left the socket files
 * behind. The allocator is jemalloc (linked by kvd/server.cmake in non-sanitizer builds).
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
               "       kvd --check-config FILE [--KEY VALUE]...\n"
               "       kvd --help | --version\n\n"
               "kvd serves one model namespace's KV-cache pages to the engine processes of this\n"
               "host over ZeroMQ (docs/daemon.md). Directives, as flags (--key value or\n"
               "--key=value) or config-file lines 'key = value' (deploy/kvd.conf documents\n"
               "each); MIN..MAX are inclusive bounds; (runtime): `kvctl config set` changes it\n"
               "in the running daemon, until it restarts:\n");
    kvd_config_help(f);
    fprintf(f,
            "\nenvironment (read at startup):\n"
            "  KVD_CUDA_DEVICE=N         backend cuda: CUDA device ordinal (default 0)\n"
            "  KVD_CUDA_LEGACY_IPC=1     backend cuda: export the pools as legacy cudaIpc\n"
            "                            handles in memfds instead of VMM POSIX fds (opt-in, for\n"
            "                            devices without VMM fd export; docs/backend-cuda.md)\n"
            "  KVD_TEST_SNAPSHOT_HOLD=N  test hook only (it_snapshot): snapshot writes stall\n"
            "                            after N slices until shutdown; never set in production\n"
            "\nsignals:\n"
            "  SIGTERM, SIGINT           clean stop: with snapshot_dir set, snapshot the prefix\n"
            "                            cache (unless unchanged), then close everything; exit 0\n"
            "  SIGHUP                    logged and ignored (kvd has no reload)\n"
            "\nreadiness: with endpoint ipc://PATH the fd socket PATH.fds is created last; kvd\n"
            "is ready (and a SIGTERM takes the clean path) once it exists.\n"
            "\nexit status:\n"
            "  0  clean stop after SIGTERM/SIGINT; --help, --version; --check-config found no\n"
            "     error\n"
            "  1  a bad flag or config (--check-config: errors found), a second config file,\n"
            "     or a startup failure (endpoint or snapshot_dir locked by another kvd,\n"
            "     backend, sockets)\n"
            "  a broken internal invariant aborts (SIGABRT) after printing file:line\n");
}

typedef struct kvd_main_s {
    kvd_server_t *srv;
    uv_signal_t sigterm, sigint, sighup;
} kvd_main_t;

static void kvd_main_close_signals(kvd_main_t *m)
{
    uv_signal_t *hs[] = {&m->sigterm, &m->sigint, &m->sighup};
    for (size_t i = 0; i < sizeof hs / sizeof hs[0]; i++)
        if (!uv_is_closing((uv_handle_t *)hs[i]))
            uv_close((uv_handle_t *)hs[i], NULL);
}

static void kvd_on_signal(uv_signal_t *h, int sig)
{
    kvd_main_t *m = h->data;
    KVD_LOGI("signal %d: shutting down", sig);
    kvd_server_stop(m->srv);
    kvd_main_close_signals(m);
}

/* Supervisors and habits send SIGHUP for "reload"; kvd has none, and dying of it would skip
 * the shutdown snapshot and leave stale socket files. Say so once per signal. */
static void kvd_on_sighup(uv_signal_t *h, int sig)
{
    (void)h;
    (void)sig;
    KVD_LOGW("SIGHUP ignored: kvd does not reload its config; change a runtime setting with "
             "`kvctl config set KEY VALUE` (lost at restart), anything else by editing the config "
             "file and restarting kvd");
}

/* `--NAME FILE` or `--NAME=FILE` at argv[*i]: 1 with *file set (*i past FILE), 0 when
 * argv[*i] is some other argument, -1 (said on stderr) when FILE is missing or empty. */
static int kvd_file_opt(int argc, char **argv, int *i, const char *name, const char **file)
{
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, "--", 2) != 0 || strncmp(a + 2, name, n) != 0)
        return 0;
    if (a[2 + n] == '=')
        *file = a + 3 + n;
    else if (a[2 + n] != '\0')
        return 0; /* a longer option that starts with NAME */
    else
        *file = *i + 1 < argc ? argv[++*i] : "";
    if (!**file) {
        fprintf(stderr, "kvd: --%s needs a FILE\n", name);
        return -1;
    }
    return 1;
}

int main(int argc, char **argv)
{
    kvd_config_t cfg;
    if (kvd_config_init(&cfg) != 0)
        return 1;
    int rc = 1;
    const char *check = NULL; /* --check-config FILE: check it and the flags, start nothing */
    int check_errors = 0;
    /* The one config file and the option that gave it. A second is refused before either is
     * read: both used to be loaded, the later file's directives silently winning (a --config
     * added to a command line that had one ran on a mix of the two files). */
    const char *conf = NULL, *conf_opt = NULL;
    /* The second one, said after pass 1: --help and --version win wherever they stand, as
     * they did when both files were read (`kvd --config a --config b --help` exited 1). */
    const char *second = NULL, *second_opt = NULL;
    /* pass 1: --help, --check-config and --config (the file goes first, flags override it) */
    for (int i = 1; i < argc; i++) {
        const char *file, *opt = "--check-config";
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
        int r = kvd_file_opt(argc, argv, &i, "check-config", &file);
        if (r == 0 && (r = kvd_file_opt(argc, argv, &i, "config", &file)) != 0)
            opt = "--config";
        if (r < 0)
            goto out;
        if (r == 0)
            continue;
        if (conf && !second) {
            second = file;
            second_opt = opt;
        } else if (!conf) {
            conf = file;
            conf_opt = opt;
        }
    }
    if (second) {
        fprintf(stderr,
                "kvd: %s %s: a second config file (%s %s came first); kvd reads one file: "
                "give one, and override its directives with --KEY VALUE flags\n",
                second_opt, second, conf_opt, conf);
        goto out;
    }
    if (conf && !strcmp(conf_opt, "--check-config")) {
        /* every error of the file, then pass 2 checks the flags given with it (they were
         * ignored: `--check-config f.conf --pages_fp8 0` said ok) */
        check = conf;
        check_errors = kvd_config_load_file(&cfg, conf, stderr);
    } else if (conf && kvd_config_load_file(&cfg, conf, stderr) != 0) {
        goto out;
    }
    /* pass 2: --key value flags */
    for (int i = 1; i < argc; i++) {
        const char *file;
        if (kvd_file_opt(argc, argv, &i, "config", &file) != 0 ||
            kvd_file_opt(argc, argv, &i, "check-config", &file) != 0)
            continue; /* loaded in pass 1 */
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
            if (!check)
                goto out;
            check_errors++; /* --check-config reports every bad flag too */
        }
    }
    if (check) {
        if (check_errors == 0)
            printf("%s: ok (%zu directives known)\n", check, kvd_config_count());
        else
            fprintf(stderr, "%s: %d error%s\n", check, check_errors,
                    check_errors == 1 ? "" : "s");
        rc = check_errors == 0 ? 0 : 1;
        goto out;
    }

    signal(SIGPIPE, SIG_IGN);
    /* Under a file size limit (ulimit -f, systemd LimitFSIZE=) a write or ftruncate past it
     * raises SIGXFSZ, whose default action kills the daemon without a word: a host pool's
     * memfd at start, a snapshot of a serving daemon. Ignored, the call fails with EFBIG and
     * its caller reports which file (the snapshot keeps the older generations). */
    signal(SIGXFSZ, SIG_IGN);
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
    uv_signal_init(&loop, &m.sighup);
    m.sigterm.data = m.sigint.data = m.sighup.data = &m;
    uv_signal_start(&m.sigterm, kvd_on_signal, SIGTERM);
    uv_signal_start(&m.sigint, kvd_on_signal, SIGINT);
    uv_signal_start(&m.sighup, kvd_on_sighup, SIGHUP);
    char err[1024];
    if (kvd_server_init(&m.srv, &loop, &cfg, err, sizeof err) != 0) {
        KVD_LOGE("startup failed: %s", err);
        /* a SIGTERM during init may have closed them already (kvd_on_signal ran in the
         * server's clean-up iteration; kvd_server_stop(NULL) does nothing) */
        kvd_main_close_signals(&m);
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
