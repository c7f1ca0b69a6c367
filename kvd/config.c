/* config.c — parser, flags, help and get/set, all driven by KVD_CONFIG_MAP (config.h).
 *
 * Values are always set through kvd_config_set(), defaults included, so a default that breaks
 * its own bounds fails kvd_config_init() at once instead of shipping silently.
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static const kvd_config_desc_t kvd_cfg_table[] = {
#define KVD_CFG_ROW_(n, t, lo, hi, ch, def, mut, help)                                             \
    {#n, KVD_CT_##t, (uint64_t)(lo), (uint64_t)(hi), ch, def, mut, help, offsetof(kvd_config_t, n)},
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
        const char *p = value;
        if (!isdigit((unsigned char)*p))
            return kvd_cfg_err(err, cap, "'%s' wants a non-negative integer, got '%s'", key,
                               value);
        errno = 0;
        char *end;
        unsigned long long v = strtoull(p, &end, 10);
        if (errno || *end)
            return kvd_cfg_err(err, cap, "'%s' wants a non-negative integer, got '%s'", key,
                               value);
        if (v < d->min || v > d->max)
            return kvd_cfg_err(err, cap, "'%s' = %llu is outside %" PRIu64 "..%" PRIu64, key, v,
                               d->min, d->max);
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
    case KVD_CT_IDS:
        if (kvd_config_ids(value, NULL, 0) < 0)
            return kvd_cfg_err(err, cap, "'%s' wants comma separated numeric ids, got '%s'", key,
                               value);
        goto store; /* stored as text, like STR */
    case KVD_CT_STR:
    store: {
        if (d->type == KVD_CT_STR && d->choices[0] && !kvd_cfg_in_choices(d->choices, value))
            return kvd_cfg_err(err, cap, "'%s' must be one of %s, got '%s'", key, d->choices,
                               value);
        if (strlen(value) > 4096)
            return kvd_cfg_err(err, cap, "'%s' is longer than 4096 bytes", key);
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

int kvd_config_load_file(kvd_config_t *c, const char *path, FILE *report)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        if (report)
            fprintf(report, "%s: cannot open: %s\n", path, strerror(errno));
        return 1;
    }
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

void kvd_config_help(FILE *f)
{
    for (size_t i = 0; i < KVD_CFG_N; i++) {
        const kvd_config_desc_t *d = &kvd_cfg_table[i];
        char arg[64];
        if (d->choices[0])
            snprintf(arg, sizeof arg, "%s", d->choices);
        else
            snprintf(arg, sizeof arg, "%s", kvd_config_type_name(d->type));
        fprintf(f, "  --%-14s %-18s %s [default: %s]%s\n", d->name, arg, d->help,
                d->def[0] ? d->def : "\"\"", d->mutable_ ? " (runtime)" : "");
    }
}
