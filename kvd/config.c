/* config.c — parser, flags, help and get/set, all driven by KVD_CONFIG_MAP (config.h).
 *
 * Values are always set through kvd_config_set(), defaults included, so a default that breaks
 * its own bounds fails kvd_config_init() at once instead of shipping silently.
 *
 * Everything the daemon would refuse at startup about a single value is refused here too, by
 * the row's check (kvd_cfg_chk_*): an operator runs `kvd --check-config` (systemd's
 * ExecStartPre, kvd-node) to learn what is wrong before a start, and a check that passed a
 * value the daemon then refused sent them to the journal for the reason, without a line number.
 * The daemon keeps its own checks (they cost nothing and guard callers that skip this file).
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <uv.h>

static int kvd_cfg_err(char *err, size_t cap, const char *fmt, ...);

/* Digits only (no sign, space or '+', which strtoull would take), nothing after them. */
static int kvd_cfg_dec(const char *s, uint64_t *out)
{
    if (!isdigit((unsigned char)*s))
        return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end)
        return -1;
    *out = v;
    return 0;
}

/* ---- value checks (the table's `check` column) -------------------------------------------- */

#define KVD_CFG_SUN_PATH (sizeof((struct sockaddr_un *)0)->sun_path)
/* The control endpoint's path must fit sockaddr_un with ".fds" appended: the daemon binds the
 * fd-handover socket PATH.fds beside it (PATH.lock, the other companion, is a plain file). */
#define KVD_CFG_IPC_MAX (KVD_CFG_SUN_PATH - sizeof ".fds")

/* An ipc:// path relative to kvd's working directory is one that clients and kvctl, started
 * elsewhere, would not find (and its lock file would land in that directory). */
static int kvd_cfg_chk_abs(const char *key, const char *v, char *err, size_t cap)
{
    if (v[6] == '/')
        return 0;
    return kvd_cfg_err(err, cap,
                       "'%s' = '%s': the socket path must be absolute (ipc:///DIR/NAME.sock): "
                       "clients and kvctl started in another directory would not find a relative "
                       "one",
                       key, v);
}

/* ipc://PATH only: peers are identified by SO_PEERCRED, which only a Unix socket has. */
static int kvd_cfg_chk_ipc(const char *key, const char *v, char *err, size_t cap)
{
    if (strncmp(v, "ipc://", 6) != 0)
        return kvd_cfg_err(err, cap,
                           "'%s' = '%s': only ipc://PATH is supported (peer credentials come "
                           "from SO_PEERCRED)",
                           key, v);
    if (!v[6])
        return kvd_cfg_err(err, cap, "'%s' = '%s' names no socket path", key, v);
    int r = kvd_cfg_chk_abs(key, v, err, cap);
    if (r != 0)
        return r;
    if (strlen(v + 6) > KVD_CFG_IPC_MAX)
        return kvd_cfg_err(err, cap,
                           "'%s': socket path of %zu bytes is too long (at most %zu: PATH.fds "
                           "must fit a Unix socket address)",
                           key, strlen(v + 6), (size_t)KVD_CFG_IPC_MAX);
    return 0;
}

/* The events PUB socket: what kvd/events.c prepares, ipc://PATH (its directory made 0700) or
 * tcp://HOST:PORT; empty is off. zmq itself would take more schemes, none of them tested. */
static int kvd_cfg_chk_pub(const char *key, const char *v, char *err, size_t cap)
{
    if (!*v)
        return 0;
    if (!strncmp(v, "ipc://", 6)) {
        if (!v[6])
            return kvd_cfg_err(err, cap, "'%s' = '%s' names no socket path", key, v);
        int r = kvd_cfg_chk_abs(key, v, err, cap);
        if (r != 0)
            return r;
        if (strlen(v + 6) >= KVD_CFG_SUN_PATH)
            return kvd_cfg_err(err, cap,
                               "'%s': socket path of %zu bytes is too long (at most %zu fit a "
                               "Unix socket address)",
                               key, strlen(v + 6), (size_t)KVD_CFG_SUN_PATH - 1);
        return 0;
    }
    if (!strncmp(v, "tcp://", 6)) {
        const char *colon = strrchr(v + 6, ':'); /* the last: [::1]:PORT has more */
        uint64_t port;
        if (!colon || colon == v + 6 ||
            (strcmp(colon + 1, "*") != 0 && /* "*": a port the system picks */
             (kvd_cfg_dec(colon + 1, &port) != 0 || port > 65535)))
            return kvd_cfg_err(err, cap,
                               "'%s' = '%s': tcp:// wants HOST:PORT (PORT 0..65535 or *)", key, v);
        return 0;
    }
    return kvd_cfg_err(err, cap, "'%s' = '%s': the scheme must be ipc:// or tcp:// (empty: off)",
                       key, v);
}

/* What kvd/metrics.c hands libuv: a numeric IPv4 or IPv6 address, no host name. */
static int kvd_cfg_chk_ipaddr(const char *key, const char *v, char *err, size_t cap)
{
    struct sockaddr_in a4;
    struct sockaddr_in6 a6;
    if (uv_ip4_addr(v, 0, &a4) != 0 && uv_ip6_addr(v, 0, &a6) != 0)
        return kvd_cfg_err(err, cap, "'%s' = '%s' is not an IP address (a host name is not "
                           "resolved)", key, v);
    return 0;
}

/* A group of this host: the daemon gives it the socket files at startup (chown). */
static int kvd_cfg_chk_group(const char *key, const char *v, char *err, size_t cap)
{
    if (!*v)
        return 0;
    errno = 0;
    if (!getgrnam(v))
        return kvd_cfg_err(err, cap, "'%s' = '%s': %s", key, v,
                           errno ? strerror(errno) : "no such group on this host");
    return 0;
}

#define kvd_cfg_chk_none NULL

static const kvd_config_desc_t kvd_cfg_table[] = {
#define KVD_CFG_ROW_(n, t, lo, hi, ch, def, mut, chk, help)                                        \
    {#n, KVD_CT_##t, (uint64_t)(lo), (uint64_t)(hi), ch, def, mut, help,                           \
     offsetof(kvd_config_t, n), kvd_cfg_chk_##chk},
    KVD_CONFIG_MAP(KVD_CFG_ROW_)
#undef KVD_CFG_ROW_
};
#define KVD_CFG_N (sizeof kvd_cfg_table / sizeof kvd_cfg_table[0])

size_t kvd_config_count(void)
{
    return KVD_CFG_N;
}

const kvd_config_desc_t *kvd_config_desc(size_t i)
{
    return i < KVD_CFG_N ? &kvd_cfg_table[i] : NULL;
}

const kvd_config_desc_t *kvd_config_find(const char *key)
{
    if (!key)
        return NULL;
    for (size_t i = 0; i < KVD_CFG_N; i++)
        if (strcmp(kvd_cfg_table[i].name, key) == 0)
            return &kvd_cfg_table[i];
    return NULL;
}

const char *kvd_config_type_name(kvd_ctype_t t)
{
    switch (t) {
    case KVD_CT_U64:
        return "integer";
    case KVD_CT_STR:
        return "string";
    case KVD_CT_BOOL:
        return "bool";
    case KVD_CT_IDS:
        return "id-list";
    }
    return "?";
}

static int kvd_cfg_err(char *err, size_t cap, const char *fmt, ...)
{
    if (err && cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, cap, fmt, ap);
        va_end(ap);
    }
    return KVD_CFG_BAD_VALUE;
}

/* "a|b|c" contains exactly v? */
static int kvd_cfg_in_choices(const char *choices, const char *v)
{
    size_t n = strlen(v);
    const char *p = choices;
    while (*p) {
        const char *e = strchr(p, '|');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l == n && strncmp(p, v, n) == 0)
            return 1;
        if (!e)
            break;
        p = e + 1;
    }
    return 0;
}

int kvd_config_ids(const char *s, uint32_t *out, int cap)
{
    int n = 0;
    const char *p = s;
    while (*p) {
        while (*p == ' ' || *p == ',')
            p++;
        if (!*p)
            break;
        if (!isdigit((unsigned char)*p))
            return -1;
        errno = 0;
        char *end;
        unsigned long long v = strtoull(p, &end, 10);
        if (errno || v > UINT32_MAX - 1)
            return -1;
        if (n < cap)
            out[n] = (uint32_t)v;
        n++;
        p = end;
        while (*p == ' ')
            p++;
        if (*p && *p != ',')
            return -1;
    }
    return n;
}

int kvd_config_set(kvd_config_t *c, const char *key, const char *value, int runtime, char *err,
                   size_t cap)
{
    const kvd_config_desc_t *d = kvd_config_find(key);
    if (!d) {
        if (err && cap)
            snprintf(err, cap, "unknown directive '%s' (kvd --help lists them)", key ? key : "");
        return KVD_CFG_UNKNOWN;
    }
    if (runtime && !d->mutable_) {
        if (err && cap)
            snprintf(err, cap, "'%s' cannot change at runtime; edit the config and restart", key);
        return KVD_CFG_IMMUTABLE;
    }
    char *field = (char *)c + d->offset;
    switch (d->type) {
    case KVD_CT_U64: {
        uint64_t v;
        if (kvd_cfg_dec(value, &v) != 0)
            return kvd_cfg_err(err, cap, "'%s' wants a non-negative integer, got '%s'", key,
                               value);
        if (v < d->min || v > d->max)
            return kvd_cfg_err(err, cap, "'%s' = %" PRIu64 " is outside %" PRIu64 "..%" PRIu64,
                               key, v, d->min, d->max);
        if (d->choices[0] && !kvd_cfg_in_choices(d->choices, value))
            return kvd_cfg_err(err, cap, "'%s' must be one of %s, got '%s'", key, d->choices,
                               value);
        *(uint64_t *)(void *)field = v;
        return KVD_CFG_OK;
    }
    case KVD_CT_BOOL: {
        int v;
        if (!strcmp(value, "yes") || !strcmp(value, "true") || !strcmp(value, "on") ||
            !strcmp(value, "1"))
            v = 1;
        else if (!strcmp(value, "no") || !strcmp(value, "false") || !strcmp(value, "off") ||
                 !strcmp(value, "0"))
            v = 0;
        else
            return kvd_cfg_err(err, cap, "'%s' wants yes or no, got '%s'", key, value);
        *(int *)(void *)field = v;
        return KVD_CFG_OK;
    }
    case KVD_CT_IDS: {
        int n = kvd_config_ids(value, NULL, 0);
        if (n < 0)
            return kvd_cfg_err(err, cap, "'%s' wants comma separated numeric ids, got '%s'", key,
                               value);
        if ((uint64_t)n > d->max) /* the admission table is fixed-size (kvd/zap.h) */
            return kvd_cfg_err(err, cap, "'%s' lists %d ids; at most %" PRIu64, key, n, d->max);
        goto store; /* stored as text, like STR */
    }
    case KVD_CT_STR:
    store: {
        if (d->type == KVD_CT_STR && d->choices[0] && !kvd_cfg_in_choices(d->choices, value))
            return kvd_cfg_err(err, cap, "'%s' must be one of %s, got '%s'", key, d->choices,
                               value);
        if (strlen(value) > 4096)
            return kvd_cfg_err(err, cap, "'%s' is longer than 4096 bytes", key);
        if (d->check && d->check(key, value, err, cap) != 0)
            return KVD_CFG_BAD_VALUE;
        char *s = strdup(value);
        if (!s)
            return kvd_cfg_err(err, cap, "out of memory");
        char **slot = (char **)(void *)field;
        free(*slot);
        *slot = s;
        return KVD_CFG_OK;
    }
    }
    return KVD_CFG_BAD_VALUE;
}

int kvd_config_get(const kvd_config_t *c, const char *key, char *buf, size_t cap)
{
    const kvd_config_desc_t *d = kvd_config_find(key);
    if (!d)
        return KVD_CFG_UNKNOWN;
    const char *field = (const char *)c + d->offset;
    switch (d->type) {
    case KVD_CT_U64:
        snprintf(buf, cap, "%" PRIu64, *(const uint64_t *)(const void *)field);
        break;
    case KVD_CT_BOOL:
        snprintf(buf, cap, "%s", *(const int *)(const void *)field ? "yes" : "no");
        break;
    case KVD_CT_STR:
    case KVD_CT_IDS: {
        const char *s = *(char *const *)(const void *)field;
        snprintf(buf, cap, "%s", s ? s : "");
        break;
    }
    }
    return KVD_CFG_OK;
}

int kvd_config_init(kvd_config_t *c)
{
    memset(c, 0, sizeof *c);
    for (size_t i = 0; i < KVD_CFG_N; i++) {
        char err[256];
        if (kvd_config_set(c, kvd_cfg_table[i].name, kvd_cfg_table[i].def, 0, err, sizeof err)) {
            fprintf(stderr, "kvd: built-in default broken: %s\n", err);
            kvd_config_free(c);
            return -1;
        }
    }
    return 0;
}

void kvd_config_free(kvd_config_t *c)
{
    for (size_t i = 0; i < KVD_CFG_N; i++) {
        if (kvd_cfg_table[i].type == KVD_CT_STR || kvd_cfg_table[i].type == KVD_CT_IDS) {
            char **slot = (char **)(void *)((char *)c + kvd_cfg_table[i].offset);
            free(*slot);
            *slot = NULL;
        }
    }
}

static char *kvd_cfg_trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1]))
        s[--n] = '\0';
    return s;
}

static const char *kvd_cfg_file_kind(mode_t m)
{
    return S_ISDIR(m)    ? "a directory"
           : S_ISFIFO(m) ? "a FIFO"
           : S_ISSOCK(m) ? "a socket"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
                         : "not a regular file";
}

int kvd_config_load_file(kvd_config_t *c, const char *path, FILE *report)
{
    /* A directory opens and reads as empty on Linux, so `--config /etc/kvd/` ran on defaults
     * without a word; stat first so that a FIFO is refused rather than waited on. */
    struct stat sb;
    if (stat(path, &sb) != 0) {
        if (report)
            fprintf(report, "%s: cannot open: %s\n", path, strerror(errno));
        return 1;
    }
    if (!S_ISREG(sb.st_mode)) {
        if (report)
            fprintf(report, "%s: is %s; a config file must be a regular file\n", path,
                    kvd_cfg_file_kind(sb.st_mode));
        return 1;
    }
    FILE *f = fopen(path, "r");
    if (!f) {
        if (report)
            fprintf(report, "%s: cannot open: %s\n", path, strerror(errno));
        return 1;
    }
    /* the line each directive was set on: a second one is an error, not a silent last-wins
     * (two people editing one file each believed their value was the one in force) */
    int set_at[KVD_CFG_N] = {0};
    int errors = 0, lineno = 0;
    char line[8192];
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t len = strlen(line);
        if (len == sizeof line - 1 && line[len - 1] != '\n') {
            if (report)
                fprintf(report, "%s:%d: line longer than %zu bytes\n", path, lineno,
                        sizeof line - 2);
            errors++;
            int ch;
            while ((ch = fgetc(f)) != EOF && ch != '\n')
                ;
            continue;
        }
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        char *s = kvd_cfg_trim(line);
        if (!*s)
            continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            if (report)
                fprintf(report, "%s:%d: expected 'key = value', got '%s'\n", path, lineno, s);
            errors++;
            continue;
        }
        *eq = '\0';
        char *key = kvd_cfg_trim(s), *val = kvd_cfg_trim(eq + 1);
        const kvd_config_desc_t *d = kvd_config_find(key);
        if (d && set_at[d - kvd_cfg_table]) {
            if (report)
                fprintf(report, "%s:%d: '%s' already set at line %d\n", path, lineno, key,
                        set_at[d - kvd_cfg_table]);
            errors++;
            continue;
        }
        if (d)
            set_at[d - kvd_cfg_table] = lineno;
        char err[512];
        if (kvd_config_set(c, key, val, 0, err, sizeof err)) {
            if (report)
                fprintf(report, "%s:%d: key '%s': %s\n", path, lineno, key, err);
            errors++;
        }
    }
    fclose(f);
    return errors;
}

/* The argument column of directive d: its choices, MIN..MAX, yes|no, ... */
static void kvd_config_help_arg(const kvd_config_desc_t *d, char *arg, size_t cap)
{
    if (d->choices[0])
        snprintf(arg, cap, "%s", d->choices);
    else if (d->type == KVD_CT_U64 && (d->min != 0 || d->max != UINT64_MAX))
        snprintf(arg, cap, "%" PRIu64 "..%" PRIu64, d->min, d->max);
    else if (d->type == KVD_CT_BOOL)
        snprintf(arg, cap, "yes|no");
    else if (d->type == KVD_CT_IDS)
        snprintf(arg, cap, "ids (max %" PRIu64 ")", d->max);
    else
        snprintf(arg, cap, "%s", kvd_config_type_name(d->type));
}

/* One line per directive, `  --NAME ARG HELP [default: D] (runtime)`: the name column as wide
 * as the longest name, the argument column as the longest argument of at most 16 characters (a
 * longer one, e.g. error|warn|info|debug, puts its text on the next line), the text wrapped at
 * 100 columns under its own column. */
void kvd_config_help(FILE *f)
{
    enum { KVD_HELP_COLS = 100 };
    int wn = 0, wa = 0;
    for (size_t i = 0; i < KVD_CFG_N; i++) {
        char arg[64];
        kvd_config_help_arg(&kvd_cfg_table[i], arg, sizeof arg);
        int n = (int)strlen(kvd_cfg_table[i].name), a = (int)strlen(arg);
        wn = n > wn ? n : wn;
        wa = a > wa && a <= 16 ? a : wa;
    }
    int col = 2 + 2 + wn + 1 + wa + 1; /* "  --" NAME ' ' ARG ' ' */
    for (size_t i = 0; i < KVD_CFG_N; i++) {
        const kvd_config_desc_t *d = &kvd_cfg_table[i];
        char arg[64], text[1024];
        kvd_config_help_arg(d, arg, sizeof arg);
        snprintf(text, sizeof text, "%s [default: %s]%s", d->help, d->def[0] ? d->def : "\"\"",
                 d->mutable_ ? " (runtime)" : "");
        const char *p = text;
        int first = 1;
        if ((int)strlen(arg) > wa) {
            fprintf(f, "  --%-*s %s\n", wn, d->name, arg);
            first = 0;
        } else {
            fprintf(f, "  --%-*s %-*s ", wn, d->name, wa, arg);
        }
        while (*p) {
            int room = KVD_HELP_COLS - col, n = (int)strlen(p);
            if (n > room) { /* break at the last space that fits (or the first one after) */
                int b = room;
                while (b > 0 && p[b] != ' ')
                    b--;
                if (b == 0)
                    for (b = room; p[b] && p[b] != ' '; b++) {
                    }
                n = b;
            }
            fprintf(f, "%*s%.*s\n", first ? 0 : col, "", n, p);
            first = 0;
            p += n;
            while (*p == ' ')
                p++;
        }
    }
}
