/* it_deploy.c — the files under deploy/ against the real daemon, so that they cannot rot:
 *
 *  - every kvd_* metric name, and every literal format/code/op label value, that the rules
 *    (deploy/prometheus, .yml) and dashboards (deploy/grafana, .json) reference appears in a
 *    live scrape of kvd --metrics_port; every recorded kvd:* series they use is defined by a
 *    rule;
 *  - deploy/kvd.conf and the kvd.conf block of the Kubernetes ConfigMap pass --check-config;
 *  - deploy/kvd-svc (systemd ExecStop / k8s preStop): drain refuses new work and waits, bounded,
 *    while a client session is attached, and returns at once when none is; ready fails while
 *    draining, live does not; a bad kvctl path is said as such, kvctl's reason for no answer is
 *    passed on, and the kvctl beside the script is found through a symlink to it;
 *  - regressions pinned in the text of the files: the epoch lag guard, the unit's Assert, the
 *    namespace's Pod Security label;
 *  - deploy/k8s/kvd-node starts one daemon per (pretend) GPU, probes them, and stops cleanly;
 *  - deploy/bundle.sh makes a tarball whose checksum verifies and whose unpacked kvd serves.
 *
 * Names are found by scanning the text (a kvd_ token not preceded by a name character), not
 * by parsing YAML/JSON: CI has no YAML parser for C, and a scan over-approximates, which is
 * the safe direction (a stray name makes the test fail, never pass). A floor on the number of
 * names found guards against a scan that silently finds nothing. No GPU, no systemd needed.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "itest.h"

#define DEPLOY KVD_SOURCE_DIR "/deploy"

/* ---- helpers ---------------------------------------------------------------------------- */

/* Whole file into a malloc'd NUL-terminated buffer; aborts the test when unreadable. */
static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("cannot open %s", path);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    assert_true(n >= 0);
    rewind(f);
    char *b = malloc((size_t)n + 1);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    b[n] = '\0';
    fclose(f);
    return b;
}

/* Run a shell command line, stdout+stderr into out[cap]; returns the exit status. */
static int sh(char *out, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int sh(char *out, size_t cap, const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(cmd, sizeof cmd - 8, fmt, ap);
    va_end(ap);
    assert_true(n > 0 && (size_t)n < sizeof cmd - 8);
    strcat(cmd, " 2>&1");
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t len = 0, r;
    char tmp[4096];
    while ((r = fread(tmp, 1, sizeof tmp, p)) > 0) {
        size_t take = r;
        if (len + take > cap - 1)
            take = cap - 1 - len;
        memcpy(out + len, tmp, take);
        len += take;
    }
    out[len] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static int is_name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == ':';
}

/* ---- names referenced by the rules and dashboards --------------------------------------- */

#define MAX_REFS 512
typedef struct refs_s {
    char name[MAX_REFS][96];
    char file[MAX_REFS][64];
    int n;
} refs_t;

static void refs_add(refs_t *r, const char *s, size_t len, const char *file)
{
    if (len == 0 || len >= sizeof r->name[0])
        return;
    for (int i = 0; i < r->n; i++)
        if (strlen(r->name[i]) == len && memcmp(r->name[i], s, len) == 0)
            return;
    assert_true(r->n < MAX_REFS);
    memcpy(r->name[r->n], s, len);
    r->name[r->n][len] = '\0';
    snprintf(r->file[r->n], sizeof r->file[0], "%s", file);
    r->n++;
}

/* Tokens starting with `prefix` (kvd_ or kvd:), not preceded by a name character. */
static void scan_names(const char *text, const char *prefix, const char *file, refs_t *r)
{
    size_t pl = strlen(prefix);
    for (const char *p = text; (p = strstr(p, prefix)) != NULL; p += pl) {
        if (p > text && is_name_char(p[-1]))
            continue;
        size_t n = pl;
        while (is_name_char(p[n]))
            n++;
        if (n > pl)
            refs_add(r, p, n, file);
    }
}

/* Label values of `label`: label="v" and each alternative of label=~"a|b|c" that is a plain
 * word (values built from dashboard variables, $format, or regexes like .* are skipped:
 * they name no exported value). Stored as the scrape spelling label="v". */
static void scan_label(const char *text, const char *label, const char *file, refs_t *r)
{
    size_t ll = strlen(label);
    for (const char *p = text; (p = strstr(p, label)) != NULL; p += ll) {
        if (p > text && is_name_char(p[-1]))
            continue;
        const char *q = p + ll;
        int re = 0;
        if (q[0] == '=' && q[1] == '"')
            q += 2;
        else if (q[0] == '=' && q[1] == '~' && q[2] == '"')
            q += 3, re = 1;
        else if (q[0] == '=' && q[1] == '\\' && q[2] == '"') /* inside a JSON string */
            q += 3;
        else if (q[0] == '=' && q[1] == '~' && q[2] == '\\' && q[3] == '"')
            q += 4, re = 1;
        else
            continue;
        for (;;) {
            size_t n = 0;
            while (q[n] && q[n] != '"' && q[n] != '\\' && q[n] != '|')
                n++;
            int plain = n > 0;
            for (size_t i = 0; i < n; i++)
                if (!is_name_char(q[i]) || q[i] == ':')
                    plain = 0;
            if (plain) {
                char v[128];
                snprintf(v, sizeof v, "%s=\"%.*s\"", label, (int)n, q);
                refs_add(r, v, strlen(v), file);
            }
            if (re && q[n] == '|') {
                q += n + 1;
                continue;
            }
            break;
        }
    }
}

typedef void (*scan_fn)(const char *text, const char *file, void *ud);

/* Calls fn on each file of dir whose name ends with one of the suffixes; returns the count. */
static int for_each_file(const char *dir, const char *const *suffixes, scan_fn fn, void *ud)
{
    DIR *d = opendir(dir);
    if (!d)
        fail_msg("cannot open directory %s", dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        size_t l = strlen(e->d_name);
        int ok = 0;
        for (int i = 0; suffixes[i]; i++) {
            size_t sl = strlen(suffixes[i]);
            if (l > sl && strcmp(e->d_name + l - sl, suffixes[i]) == 0)
                ok = 1;
        }
        if (!ok)
            continue;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        char *text = slurp(path);
        fn(text, e->d_name, ud);
        free(text);
        n++;
    }
    closedir(d);
    return n;
}

typedef struct scan_s {
    refs_t *names, *labels, *recorded_used, *recorded_defined;
} scan_t;

static void scan_file(const char *text, const char *file, void *ud)
{
    scan_t *s = ud;
    scan_names(text, "kvd_", file, s->names);
    scan_label(text, "format", file, s->labels);
    scan_label(text, "code", file, s->labels);
    scan_label(text, "op", file, s->labels);
    scan_names(text, "kvd:", file, s->recorded_used);
    /* "record: kvd:..." defines a series */
    for (const char *p = text; (p = strstr(p, "record:")) != NULL; p += 7) {
        const char *q = p + 7;
        while (*q == ' ')
            q++;
        size_t n = 0;
        while (is_name_char(q[n]))
            n++;
        refs_add(s->recorded_defined, q, n, file);
    }
}

static int in_scrape(const char *scrape_text, const char *name)
{
    char a[128], b[128];
    snprintf(a, sizeof a, "\n%s ", name);
    snprintf(b, sizeof b, "\n%s{", name);
    return strstr(scrape_text, a) || strstr(scrape_text, b);
}

static void test_rules_and_dashboards_use_exported_names(void **state)
{
    (void)state;
    static refs_t names, labels, used, defined;
    memset(&names, 0, sizeof names);
    memset(&labels, 0, sizeof labels);
    memset(&used, 0, sizeof used);
    memset(&defined, 0, sizeof defined);
    scan_t s = {&names, &labels, &used, &defined};
    const char *yml[] = {".yml", ".yaml", NULL}, *json[] = {".json", NULL};
    assert_true(for_each_file(DEPLOY "/prometheus", yml, scan_file, &s) >= 1);
    assert_true(for_each_file(DEPLOY "/grafana", json, scan_file, &s) >= 1);
    /* The shipped files reference ~70 names; far fewer means the scan is broken. */
    if (names.n < 40)
        fail_msg("only %d kvd_* names found in deploy/prometheus and deploy/grafana", names.n);
    if (labels.n < 5)
        fail_msg("only %d label values found", labels.n);

    char port[16];
    int p = itest_free_port();
    snprintf(port, sizeof port, "%d", p);
    const char *extra[] = {"--metrics_port", port, NULL};
    itest_kvd_t k;
    itest_kvd_start(&k, extra);
    static char out[1 << 20];
    out[0] = '\n'; /* so that the first line matches "\nNAME" too */
    assert_true(itest_scrape(p, out + 1, sizeof out - 1) > 1000);
    assert_non_null(strstr(out, "HTTP/1.1 200 OK"));
    assert_int_equal(itest_kvd_stop(&k), 0);

    int missing = 0;
    for (int i = 0; i < names.n; i++)
        if (!in_scrape(out, names.name[i])) {
            print_error("%s references %s, which kvd does not export\n", names.file[i],
                        names.name[i]);
            missing++;
        }
    for (int i = 0; i < labels.n; i++)
        if (!strstr(out, labels.name[i])) {
            print_error("%s uses label value %s, which no kvd series carries\n", labels.file[i],
                        labels.name[i]);
            missing++;
        }
    for (int i = 0; i < used.n; i++) {
        int found = 0;
        for (int j = 0; j < defined.n; j++)
            found |= strcmp(used.name[i], defined.name[j]) == 0;
        if (!found) {
            print_error("%s uses %s, which no rule in deploy/prometheus records\n", used.file[i],
                        used.name[i]);
            missing++;
        }
    }
    if (missing)
        fail_msg("%d reference(s) in deploy/ do not match what kvd exports", missing);
    print_message("checked %d metric names, %d label values, %d recorded series\n", names.n,
                  labels.n, used.n);
}

/* ---- example configurations ------------------------------------------------------------- */

/* The `kvd.conf: |` block scalar of the ConfigMap, de-indented, into path. */
static void extract_configmap_conf(const char *yaml, const char *path)
{
    const char *key = strstr(yaml, "kvd.conf: |");
    if (!key)
        fail_msg("deploy/k8s/kvd-daemonset.yaml has no `kvd.conf: |` block");
    const char *ls = key;
    while (ls > yaml && ls[-1] != '\n')
        ls--;
    size_t key_indent = (size_t)(key - ls);
    const char *p = strchr(key, '\n');
    assert_non_null(p);
    p++;
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    size_t indent = 0;
    int lines = 0;
    while (*p) {
        const char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        size_t sp = 0;
        while (sp < len && p[sp] == ' ')
            sp++;
        if (sp < len) { /* non-blank line: part of the block while indented deeper */
            if (sp <= key_indent)
                break;
            if (!indent)
                indent = sp;
            assert_true(sp >= indent);
            fprintf(f, "%.*s\n", (int)(len - indent), p + indent);
            lines++;
        } else {
            fputc('\n', f);
        }
        if (!e)
            break;
        p = e + 1;
    }
    fclose(f);
    if (lines < 5)
        fail_msg("the ConfigMap's kvd.conf block has only %d lines", lines);
}

static void test_example_configs_check(void **state)
{
    (void)state;
    static char out[65536];
    int rc = sh(out, sizeof out, "'%s' --check-config '%s'", KVD_BIN, DEPLOY "/kvd.conf");
    if (rc != 0)
        fail_msg("deploy/kvd.conf does not check:\n%s", out);
    char dir[] = "/tmp/kvd-it-deploy-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char conf[128];
    snprintf(conf, sizeof conf, "%s/configmap.conf", dir);
    char *yaml = slurp(DEPLOY "/k8s/kvd-daemonset.yaml");
    extract_configmap_conf(yaml, conf);
    free(yaml);
    rc = sh(out, sizeof out, "'%s' --check-config '%s'", KVD_BIN, conf);
    if (rc != 0)
        fail_msg("the ConfigMap's kvd.conf does not check:\n%s", out);
    assert_non_null(strstr(out, "ok"));
    /* and the check does fail on a broken file (the assertion above can fail) */
    FILE *f = fopen(conf, "a");
    assert_non_null(f);
    fputs("no_such_directive = 1\n", f);
    fclose(f);
    assert_int_not_equal(sh(out, sizeof out, "'%s' --check-config '%s'", KVD_BIN, conf), 0);
    assert_non_null(strstr(out, "no_such_directive"));
    unlink(conf);
    rmdir(dir);
}

/* ---- kvd-svc: the drain / probe helper of the systemd unit and the DaemonSet ------------ */

static void test_svc_drain_and_probes(void **state)
{
    (void)state;
    static char out[16384];
    itest_kvd_t k;
    itest_kvd_start(&k, NULL);
    char svc[1024];
    snprintf(svc, sizeof svc, "sh '%s' --kvctl '%s' --endpoint '%s'", DEPLOY "/kvd-svc", KVCTL_BIN,
             k.endpoint);
    assert_int_equal(sh(out, sizeof out, "%s wait", svc), 0);
    assert_int_equal(sh(out, sizeof out, "%s ready", svc), 0);
    assert_int_equal(sh(out, sizeof out, "%s live", svc), 0);
    /* Called through a symlink (/usr/local/bin/kvd-svc -> /opt/kvd/bin/kvd-svc), with no
     * kvctl on PATH: the kvctl beside the link's target is the one found. */
    char tdir[] = "/tmp/kvd-it-svclink-XXXXXX";
    assert_non_null(mkdtemp(tdir));
    int lrc = sh(out, sizeof out,
                 "mkdir '%s/real' '%s/link' && cp '%s' '%s/real/kvd-svc' && "
                 "ln -s '%s' '%s/real/kvctl' && ln -s ../real/kvd-svc '%s/link/kvd-svc' && "
                 "env -u KVCTL PATH=/usr/bin:/bin sh '%s/link/kvd-svc' --endpoint '%s' live",
                 tdir, tdir, DEPLOY "/kvd-svc", tdir, KVCTL_BIN, tdir, tdir, tdir, k.endpoint);
    if (lrc != 0)
        fail_msg("kvd-svc through a symlink (rc %d):\n%s", lrc, out);
    sh(out, sizeof out, "rm -rf '%s'", tdir);

    /* A session attached, held by a child process: a session ends only when its process
     * exits (there is no goodbye), so the child's exit is what lets the second drain finish. */
    int up[2], down[2];
    assert_int_equal(pipe(up), 0);
    assert_int_equal(pipe(down), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) { /* no cmocka in here: report through the exit status */
        kvc_t *c = NULL;
        if (kvc_connect(&c, k.endpoint, 30000) != KV_ERR_OK || kvc_hello(c, NULL, "deploy", 1))
            _exit(2);
        char ch = 'r';
        if (write(up[1], &ch, 1) != 1 || read(down[0], &ch, 1) != 1)
            _exit(3);
        uint32_t pages[2];
        _exit(kvc_alloc(c, KV_FMT_FP8, 2, pages) == KV_ERR_DRAINING ? 0 : 4);
    }
    char ch;
    assert_int_equal(read(up[0], &ch, 1), 1);
    int64_t t0 = itest_now_us();
    int rc = sh(out, sizeof out, "%s --timeout 2 drain", svc);
    int64_t ms = (itest_now_us() - t0) / 1000;
    assert_int_equal(rc, 0);
    if (!strstr(out, "1 session(s) still attached"))
        fail_msg("drain with a session attached said:\n%s", out);
    /* waited about its timeout: >= 1 s (date +%s has 1 s steps), well under 30 s */
    assert_true(ms >= 1000 && ms < 30000);
    assert_int_not_equal(sh(out, sizeof out, "%s ready", svc), 0);
    assert_non_null(strstr(out, "draining"));
    assert_int_equal(sh(out, sizeof out, "%s live", svc), 0);
    /* the attached engine is refused new pages, then exits */
    assert_int_equal(write(down[1], "x", 1), 1);
    int st;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fail_msg("the attached client was not refused with DRAINING (status %d)", st);
    close(up[0]);
    close(up[1]);
    close(down[0]);
    close(down[1]);
    assert_true(itest_wait_stat(&k, "sessions", 0, 30000) >= 0);
    t0 = itest_now_us();
    assert_int_equal(sh(out, sizeof out, "%s --timeout 20 drain", svc), 0);
    ms = (itest_now_us() - t0) / 1000;
    if (!strstr(out, "drained"))
        fail_msg("drain with no session said:\n%s", out);
    assert_true(ms < 10000);
    assert_int_equal(itest_kvd_stop(&k), 0);

    /* No daemon: drain is a no-op that lets the stop proceed; probes fail; bad use is exit 2. */
    assert_int_equal(sh(out, sizeof out, "%s drain", svc), 0);
    assert_int_not_equal(sh(out, sizeof out, "%s live", svc), 0);
    /* kvctl's reason reaches the probe's output (it was thrown away) */
    if (!strstr(out, "no socket file"))
        fail_msg("kvd-svc live without a daemon does not say why:\n%s", out);
    assert_int_not_equal(sh(out, sizeof out, "%s --timeout 1 wait", svc), 0);
    assert_int_equal(sh(out, sizeof out, "%s frobnicate", svc), 2);
    /* a wrong kvctl is reported as such, not as a daemon that does not answer */
    assert_int_equal(sh(out, sizeof out, "sh '%s' --kvctl /nonexistent/kvctl --endpoint '%s' live",
                        DEPLOY "/kvd-svc", k.endpoint),
                     2);
    if (!strstr(out, "/nonexistent/kvctl") || strstr(out, "no answer"))
        fail_msg("kvd-svc with a bad --kvctl said:\n%s", out);
}

/* ---- regressions pinned in the files' text ------------------------------------------------ */

/* Each was a review finding; the files are not executable here (no Prometheus, systemd or
 * cluster in CI), so the test holds the fixed text in place. */
static void test_deploy_text_regressions(void **state)
{
    (void)state;
    /* kvd_min_safe_epoch is 0 with no unfenced session: the lag was the whole epoch then */
    char *rules = slurp(DEPLOY "/prometheus/kvd-rules.yml");
    const char *lag = strstr(rules, "record: kvd:epoch_lag");
    assert_non_null(lag);
    const char *next = strstr(lag + 1, "- record:");
    const char *guard = strstr(lag, "kvd_min_safe_epoch > 0");
    if (!guard || (next && guard > next))
        fail_msg("kvd:epoch_lag does not guard kvd_min_safe_epoch == 0");
    free(rules);
    /* a missing config failed the unit's Condition silently (inactive, exit 0) */
    const char *units[] = {DEPLOY "/kvd@.service", DEPLOY "/kvd-mps@.service", NULL};
    for (int i = 0; units[i]; i++) {
        char *u = slurp(units[i]);
        if (strstr(u, "\nConditionPath"))
            fail_msg("%s: a Condition skips the unit silently; use Assert", units[i]);
        free(u);
    }
    char *unit = slurp(DEPLOY "/kvd@.service");
    assert_non_null(strstr(unit, "\nAssertPathExists=/etc/kvd/kvd-%i.conf"));
    free(unit);
    /* hostPID and hostPath need the privileged Pod Security level in kvd-system */
    char *yaml = slurp(DEPLOY "/k8s/kvd-daemonset.yaml");
    const char *ns = strstr(yaml, "kind: Namespace");
    assert_non_null(ns);
    const char *end = strstr(ns, "\n---");
    const char *label = strstr(ns, "pod-security.kubernetes.io/enforce: privileged");
    if (!label || (end && label > end))
        fail_msg("the kvd-system Namespace lacks pod-security.kubernetes.io/enforce: privileged");
    free(yaml);
}

/* ---- kvd-node: the DaemonSet's entry point, two pretend GPUs on the host backend --------- */

static void test_node_runs_one_daemon_per_gpu(void **state)
{
    (void)state;
    static char out[16384];
    char dir[] = "/tmp/kvd-it-node-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char conf[128], env[2048];
    snprintf(conf, sizeof conf, "%s/kvd.conf", dir);
    FILE *f = fopen(conf, "w");
    assert_non_null(f);
    fputs("layers = 2\nkv_heads = 2\nhead_dim = 64\npages_fp8 = 32\npages_tq3 = 32\n", f);
    fclose(f);
    snprintf(env, sizeof env,
             "env KVD_GPUS='0 1' KVD_CONFIG='%s' KVD_RUN_DIR='%s/run' KVD_METRICS_PORT_BASE=0 "
             "KVD_BIN='%s' KVD_SVC='%s' KVCTL='%s' KVD_DRAIN_TIMEOUT=5 KVD_STATE_DIR='%s/state' "
             "KVD_EVENTS=yes",
             conf, dir, KVD_BIN, DEPLOY "/kvd-svc", KVCTL_BIN, dir);
    char run[2304];
    snprintf(run, sizeof run, "%s sh '%s' ", env, DEPLOY "/k8s/kvd-node");
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char log[160];
        snprintf(log, sizeof log, "%s/node.log", dir);
        char cmd[2600];
        snprintf(cmd, sizeof cmd, "exec %s run >'%s' 2>&1", run, log);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    /* both daemons answer (the probe polls; kvd-svc wait gives each up to 30 s) */
    for (int g = 0; g < 2; g++) {
        int rc = sh(out, sizeof out,
                    "sh '%s' --kvctl '%s' --endpoint 'ipc://%s/run/%d/kvd.sock' "
                    "--timeout 30 wait",
                    DEPLOY "/kvd-svc", KVCTL_BIN, dir, g);
        if (rc != 0) {
            kill(pid, SIGTERM);
            waitpid(pid, NULL, 0);
            sh(out, sizeof out, "cat '%s/node.log'", dir);
            fail_msg("GPU %d's kvd never answered; kvd-node's log:\n%s", g, out);
        }
    }
    assert_int_equal(sh(out, sizeof out, "%s probe ready", run), 0);
    assert_int_equal(sh(out, sizeof out, "%s probe live", run), 0);
    /* per-GPU flags: own events socket and snapshot directory (with its salt) */
    for (int g = 0; g < 2; g++) {
        char path[256];
        struct stat sb;
        snprintf(path, sizeof path, "%s/run/%d/events.sock", dir, g);
        if (stat(path, &sb) != 0 || !S_ISSOCK(sb.st_mode))
            fail_msg("no events socket %s", path);
        snprintf(path, sizeof path, "%s/state/%d", dir, g);
        if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode) || (sb.st_mode & 077))
            fail_msg("no private snapshot directory %s", path);
    }
    assert_int_equal(sh(out, sizeof out, "%s drain", run), 0);
    assert_int_not_equal(sh(out, sizeof out, "%s probe ready", run), 0);
    assert_int_equal(sh(out, sizeof out, "%s probe live", run), 0);
    kill(pid, SIGTERM);
    int st = 0;
    int64_t t0 = itest_now_us();
    while (waitpid(pid, &st, WNOHANG) != pid) {
        if (itest_now_us() - t0 > 30000000) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            fail_msg("kvd-node did not stop within 30 s of SIGTERM");
        }
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    char log[160];
    snprintf(log, sizeof log, "%s/node.log", dir);
    char *text = slurp(log);
    int clean = 0;
    for (const char *p = text; (p = strstr(p, "exited cleanly")) != NULL; p++)
        clean++;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || clean != 2)
        fail_msg("kvd-node status %d, %d clean exits; log:\n%s", st, clean, text);
    free(text);
    assert_int_not_equal(sh(out, sizeof out, "%s probe live", run), 0);
    sh(out, sizeof out, "rm -rf '%s'", dir);
}

/* ---- bundle.sh -------------------------------------------------------------------------- */

static void test_bundle_unpacks_and_serves(void **state)
{
    (void)state;
    static char out[65536];
    /* the build tree is the one that built KVD_BIN (BUILD/kvd/kvd) */
    char build[512];
    snprintf(build, sizeof build, "%s", KVD_BIN);
    char *cut = strstr(build, "/kvd/kvd");
    assert_non_null(cut);
    *cut = '\0';
    char dir[] = "/tmp/kvd-it-bundle-XXXXXX";
    assert_non_null(mkdtemp(dir));
    int rc =
        sh(out, sizeof out, "'%s' --build '%s' --out '%s/out'", DEPLOY "/bundle.sh", build, dir);
    if (rc != 0)
        fail_msg("bundle.sh failed:\n%s", out);
    rc = sh(out, sizeof out,
            "cd '%s/out' && sha256sum -c kvd-*.tar.gz.sha256 && mkdir ../x && "
            "tar -C ../x -xzf kvd-*.tar.gz && ls ../x/*/bin ../x/*/lib ../x/*/etc "
            "../x/*/share/systemd",
            dir);
    if (rc != 0)
        fail_msg("bundle does not verify or unpack:\n%s", out);
    const char *want[] = {"kvd\n",
                          "kvctl\n",
                          "kvd-svc\n",
                          "kvd-node\n",
                          "libzmq.so.5\n",
                          "libuv.so.1\n",
                          "libprotobuf-c.so.1\n",
                          "kvd.conf\n",
                          "kvd@.service\n",
                          "kvd-mps@.service\n",
                          NULL};
    for (int i = 0; want[i]; i++)
        if (!strstr(out, want[i]))
            fail_msg("bundle lacks %s", want[i]);
    assert_null(strstr(out, "libc.so.6")); /* glibc stays the host's */

    /* the unpacked kvd serves, from an empty environment, and kvctl reaches it */
    char ep[256];
    snprintf(ep, sizeof ep, "ipc://%s/run/kvd.sock", dir);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd,
                 "exec env -i %s/x/*/bin/kvd --config %s/x/kvd-*/etc/kvd.conf --endpoint %s "
                 "--pages_fp8 32 --pages_tq3 32 >%s/kvd.log 2>&1",
                 dir, dir, ep, dir);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    rc = sh(out, sizeof out,
            "env -i %s/x/*/bin/kvd-svc --endpoint %s --timeout 30 wait && "
            "env -i %s/x/*/bin/kvctl --endpoint %s status",
            dir, ep, dir, ep);
    kill(pid, SIGTERM);
    int st;
    waitpid(pid, &st, 0);
    if (rc != 0 || !strstr(out, "backend host"))
        fail_msg("the bundle's kvd did not serve (rc %d):\n%s", rc, out);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    sh(out, sizeof out, "rm -rf '%s'", dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rules_and_dashboards_use_exported_names),
        cmocka_unit_test(test_example_configs_check),
        cmocka_unit_test(test_svc_drain_and_probes),
        cmocka_unit_test(test_deploy_text_regressions),
        cmocka_unit_test(test_node_runs_one_daemon_per_gpu),
        cmocka_unit_test(test_bundle_unpacks_and_serves),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
