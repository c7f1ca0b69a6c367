/* kvctl.c — the operator CLI: a thin client of the public protocol (redis-cli habit).
 *
 *   kvctl [--endpoint EP] [--json] [--timeout MS] COMMAND [ARGS]
 *     status                       daemon figures (the core's stats table, in table order)
 *     sessions                     attached processes, refs, epochs, lease state
 *     sessions fence SESSION       a hung session stops holding back page recycling
 *     cache ls [LIMIT]             cache entries, evictable (LRU) first
 *     cache evict PAGE|all         drop cache bindings (referenced pages stay live)
 *     cache pin PAGE | unpin PAGE  pin: never evicted
 *     page ID                      one page's state, refs, format, hash
 *     config get [KEY]             directives and current values
 *     config set KEY VALUE         runtime-mutable directives only
 *     drain                        refuse new sessions/pages (until kvd restarts); existing
 *                                  work continues
 *     check                        invariant check; exit 1 when anything is inconsistent
 *     snapshot                     write a durable cache snapshot now (docs/snapshot.md)
 *     events sync                  republish the whole index on the events socket (CLEARED,
 *                                  then one STORED per entry), for routers that saw a gap
 *     events [--count N] [--from EP]
 *                                  subscribe to the index events (docs/protocol.md "Index
 *                                  events") and print one line per entry as they arrive;
 *                                  EP defaults to the daemon's events_endpoint (config get)
 *
 * Every command speaks admin RPCs that need no session (no hello, no fd handover). --json
 * prints one JSON object per command on stdout. Exit 0 on success, 1 on any error (the
 * daemon's status name and message on stderr), 2 on usage errors: an unknown option, an
 * option without its value, a number that is not plain decimal digits (parse_num: no sign,
 * no space, nothing after it, within range) — never a silent default.
 */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "kvc.h"

static int json;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvctl [--endpoint EP] [--json] [--timeout MS] COMMAND [ARGS]\n"
            "       kvctl -h | --help | --version\n"
            "commands:\n"
            "  status                      daemon figures\n"
            "  sessions                    attached client processes\n"
            "  sessions fence SESSION      stop a hung session from holding back page\n"
            "                              recycling (its requests are refused from then on)\n"
            "  cache ls [LIMIT]            cache entries, evictable first (LIMIT: default\n"
            "                              1000, at most 100000)\n"
            "  cache evict PAGE|all        drop cache entries\n"
            "  cache pin PAGE              pin a cached page (never evicted)\n"
            "  cache unpin PAGE            unpin\n"
            "  page ID                     one page's state\n"
            "  config get [KEY]            directives and values\n"
            "  config set KEY VALUE        change a runtime-mutable directive\n"
            "  drain                       stop accepting new work, until kvd restarts\n"
            "                              (a graceful stop: drain, wait for sessions to go,\n"
            "                              then SIGTERM)\n"
            "  check                       verify the daemon's invariants (exit 1 if broken)\n"
            "  snapshot                    write a snapshot of the prefix cache now\n"
            "  events sync                 republish the whole index on the events socket\n"
            "  events [--count N] [--from EP]  print index events as they arrive (one line\n"
            "                              per entry; N entries then exit; EP: the PUB endpoint,\n"
            "                              default the daemon's events_endpoint)\n"
            "endpoint: --endpoint, else $KVD_ENDPOINT, else ipc:///run/kvd/kvd.sock\n"
            "timeout: --timeout MS bounds each call (default 5000)\n"
            "--json (before or after the command): one JSON object per command on stdout\n"
            "  (events: one per entry); a failed call prints {\"error\":NAME,\"message\":...}\n"
            "exit status: 0 ok; 1 failure (cannot connect, the daemon's error, check found a\n"
            "  problem); 2 usage error (unknown option or command, missing or bad value)\n");
}

/* A free-text field as a JSON string (kvc_json_chars) */
static void jstr(const char *s)
{
    putchar('"');
    kvc_json_chars(stdout, s, SIZE_MAX);
    putchar('"');
}

static void hex(const uint8_t *d, size_t n, size_t max)
{
    for (size_t i = 0; i < n && i < max; i++)
        printf("%02x", d[i]);
}

static const char *fmtname(int f)
{
    return f == 0 ? "fp8" : f == 1 ? "tq3" : "?";
}

/* a decimal number of at most `max`: digits only (strtoull alone takes " 5", "+5" and "-1",
 * the last as a huge number), nothing after them */
static int parse_num(const char *s, uint64_t max, uint64_t *out)
{
    char *end;
    if (!isdigit((unsigned char)*s))
        return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || errno || v > max)
        return -1;
    *out = v;
    return 0;
}

/* `NAME VALUE` or `NAME=VALUE` at argv[*i]: 1 with *val set (*i past VALUE), 0 when argv[*i]
 * is another argument, -1 (said on stderr; a usage error) when the value is missing. */
static int opt_value(int argc, const char **argv, int *i, const char *name, const char **val)
{
    size_t n = strlen(name);
    if (strncmp(argv[*i], name, n) != 0)
        return 0;
    if (argv[*i][n] == '=')
        *val = argv[*i] + n + 1;
    else if (argv[*i][n] != '\0')
        return 0;
    else if (*i + 1 < argc)
        *val = argv[++*i];
    else
        *val = "";
    if (!**val) {
        fprintf(stderr, "kvctl: option '%s' needs a value\n", name);
        return -1;
    }
    return 1;
}

/* A failure before any call (the socket check, connect): its reason on stderr and, with
 * --json, as {"error":NAME,"message":...} on stdout, the shape of a failed call's. */
static void fail_early(const char *name, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void fail_early(const char *name, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (json) {
        printf("{\"error\":\"%s\",\"message\":", name);
        jstr(msg);
        printf("}\n");
    }
    fprintf(stderr, "kvctl: %s\n", msg);
}

/* ZeroMQ lets a client connect before the server binds, so a missing socket, one this uid may
 * not open, or one nothing listens on (left by a kvd that did not stop cleanly) would only show
 * as a timeout (5 s by default) or a hang (events); an operator deserves the plain reason at
 * once (kvc_endpoint_probe), with what to do. 0 when ep may answer; else -1, said by
 * fail_early. `whose`: "daemon" or "kvd's events publisher". */
static int check_socket(const char *ep, const char *whose)
{
    char why[768];
    kv_err_t e = kvc_endpoint_probe(ep, why, sizeof why);
    if (e == KV_ERR_OK)
        return 0;
    if (e == KV_ERR_PERMISSION_DENIED)
        fail_early(kv_err_name(e),
                   "cannot reach %s at %s: %s; run kvctl as kvd's user (or root), or set "
                   "socket_group in kvd's config and add this user to that group",
                   whose, ep, why);
    else
        fail_early(kv_err_name(e),
                   "no %s at %s: %s; set --endpoint or $KVD_ENDPOINT, or start kvd (it replaces "
                   "a stale socket file)",
                   whose, ep, why);
    return -1;
}

static int parse_u32(const char *s, uint32_t *out)
{
    uint64_t v;
    if (parse_num(s, UINT32_MAX, &v))
        return -1;
    *out = (uint32_t)v;
    return 0;
}

static void print_status(const Kvd__StatusRep *r)
{
    if (json) {
        printf("{\"version\":");
        jstr(r->version);
        printf(",\"namespace\":");
        jstr(r->namespace_);
        printf(",\"backend\":");
        jstr(r->backend);
        printf(",\"uptime_ms\":%" PRIu64 ",\"epoch\":%" PRIu64 ",\"sessions\":%u,\"draining\":%s",
               r->uptime_ms, r->epoch, r->sessions, r->draining ? "true" : "false");
        if (r->geometry)
            printf(",\"geometry\":{\"layers\":%u,\"kv_heads\":%u,\"head_dim\":%u,"
                   "\"page_tokens\":%u,\"seed\":%" PRIu64 "}",
                   r->geometry->layers, r->geometry->kv_heads, r->geometry->head_dim,
                   r->geometry->page_tokens, r->geometry->seed);
        printf(",\"stats\":{");
        for (size_t i = 0; i < r->n_stats; i++) {
            printf("%s", i ? "," : "");
            jstr(r->stats[i]->name);
            printf(":%" PRIu64, r->stats[i]->value);
        }
        printf("}}\n");
        return;
    }
    printf("%s  namespace %s  backend %s  uptime %.1f s  epoch %" PRIu64 "  sessions %u%s\n",
           r->version, r->namespace_, r->backend, (double)r->uptime_ms / 1000.0, r->epoch,
           r->sessions, r->draining ? "  DRAINING" : "");
    if (r->geometry)
        printf("geometry: %u layers x %u kv heads x %u head dim, %u tokens/page, seed %" PRIu64
               "\n",
               r->geometry->layers, r->geometry->kv_heads, r->geometry->head_dim,
               r->geometry->page_tokens, r->geometry->seed);
    for (size_t i = 0; i < r->n_stats; i++)
        printf("  %-28s %14" PRIu64 "   %s\n", r->stats[i]->name, r->stats[i]->value,
               r->stats[i]->help);
}

static void print_sessions(const Kvd__SessionsRep *r)
{
    if (json)
        printf("{\"sessions\":[");
    else
        printf("%-8s %-8s %-6s %-6s %-10s %-5s %-10s %-10s %-6s %s\n", "SESSION", "PID", "UID",
               "GID", "REFS", "SEQS", "EPOCH", "IDLE_MS", "LEASE", "NAME");
    for (size_t i = 0; i < r->n_sessions; i++) {
        const Kvd__SessionInfo *s = r->sessions[i];
        if (json) {
            printf("%s{\"id\":%" PRIu64 ",\"pid\":%u,\"uid\":%u,\"gid\":%u,\"refs\":%" PRIu64
                   ",\"sequences\":%u,\"completed_epoch\":%" PRIu64 ",\"idle_ms\":%" PRIu64
                   ",\"lease_expired\":%s,\"connected\":%s,\"fenced\":%s,\"name\":",
                   i ? "," : "", s->id, s->pid, s->uid, s->gid, s->refs, s->sequences,
                   s->completed_epoch, s->idle_ms, s->lease_expired ? "true" : "false",
                   s->connected ? "true" : "false", s->fenced ? "true" : "false");
            jstr(s->client_name);
            printf("}");
        } else {
            printf("%-8" PRIu64 " %-8u %-6u %-6u %-10" PRIu64 " %-5u %-10" PRIu64 " %-10" PRIu64
                   " %-6s %s\n",
                   s->id, s->pid, s->uid, s->gid, s->refs, s->sequences, s->completed_epoch,
                   s->idle_ms, s->fenced ? "FENCED" : s->lease_expired ? "EXPIRED" : "ok",
                   s->client_name);
        }
    }
    if (json)
        printf("]}\n");
}

static void print_cache_ls(const Kvd__CacheLsRep *r)
{
    if (json)
        printf("{\"total\":%" PRIu64 ",\"entries\":[", r->total);
    else
        printf("%" PRIu64 " entries%s\n%-10s %-4s %-6s %-6s %-16s %s\n", r->total,
               r->n_entries < r->total ? " (listing truncated)" : "", "PAGE", "FMT", "REFS",
               "PINNED", "LAST_USE_NS", "HASH");
    for (size_t i = 0; i < r->n_entries; i++) {
        const Kvd__CacheEntry *e = r->entries[i];
        if (json) {
            printf("%s{\"page\":%u,\"format\":\"%s\",\"refs\":%u,\"pinned\":%s,\"last_use\":%" PRIu64
                   ",\"hash\":\"",
                   i ? "," : "", e->page, fmtname(e->format), e->refs,
                   e->pinned ? "true" : "false", e->last_use);
            hex(e->hash.data, e->hash.len, 64);
            printf("\"}");
        } else {
            printf("%-10u %-4s %-6u %-6s %-16" PRIu64 " ", e->page, fmtname(e->format), e->refs,
                   e->pinned ? "yes" : "no", e->last_use);
            hex(e->hash.data, e->hash.len, 8);
            printf("…\n");
        }
    }
    if (json)
        printf("]}\n");
}

static void print_page(const Kvd__PageInfoRep *p)
{
    if (json) {
        printf("{\"page\":%u,\"state\":\"%s\",\"format\":\"%s\",\"phys\":%u,\"refs\":%u,"
               "\"sealed\":%s,\"pinned\":%s,\"retire_epoch\":%" PRIu64 ",\"generation\":%u,"
               "\"hash\":\"",
               p->page, p->state, fmtname(p->format), p->phys, p->refs,
               p->sealed ? "true" : "false", p->pinned ? "true" : "false", p->retire_epoch,
               p->generation);
        hex(p->hash.data, p->hash.len, 64);
        printf("\",\"detail\":");
        jstr(p->detail);
        printf("}\n");
        return;
    }
    /* a free page has no physical page (UINT32_MAX), and a sealed one needs no "sealed" flag */
    char phys[16] = "none";
    if (p->phys != UINT32_MAX)
        snprintf(phys, sizeof phys, "%u", p->phys);
    printf("page %u: %s, %s phys %s, refs %u%s%s, epoch stamp %" PRIu64 ", generation %u\n",
           p->page, p->state, fmtname(p->format), phys, p->refs,
           p->sealed && strcmp(p->state, "sealed") ? ", sealed" : "", p->pinned ? ", pinned" : "",
           p->retire_epoch, p->generation);
    printf("  hash ");
    hex(p->hash.data, p->hash.len, 64);
    printf("\n  %s\n", p->detail);
}

static void print_config(Kvd__ConfigItem **items, size_t n, int single)
{
    int kw = 16; /* the key column: as wide as the longest key (max_sessions_per_pid) */
    for (size_t i = 0; i < n; i++)
        if (strlen(items[i]->key) > (size_t)kw && strlen(items[i]->key) < 40)
            kw = (int)strlen(items[i]->key);
    if (json && !single)
        printf("{\"config\":[");
    for (size_t i = 0; i < n; i++) {
        const Kvd__ConfigItem *it = items[i];
        if (json) {
            printf("%s{\"key\":", i ? "," : "");
            jstr(it->key);
            printf(",\"value\":");
            jstr(it->value);
            printf(",\"type\":");
            jstr(it->type);
            printf(",\"mutable\":%s,\"default\":", it->mutable_ ? "true" : "false");
            jstr(it->default_value);
            printf(",\"help\":");
            jstr(it->help);
            printf("}");
        } else {
            printf("%-*s = %-28s %s%s\n", kw, it->key, it->value, it->mutable_ ? "[runtime] " : "",
                   it->help);
        }
    }
    if (json)
        printf(single ? "\n" : "]}\n");
}

/* ---- events ------------------------------------------------------------------------------ */
static const char *ev_kind(int k)
{
    switch (k) {
    case KVD__EVENT_ENTRY__KIND__KIND_STORED: return "stored";
    case KVD__EVENT_ENTRY__KIND__KIND_REMOVED: return "removed";
    case KVD__EVENT_ENTRY__KIND__KIND_FORMAT_CHANGED: return "format_changed";
    case KVD__EVENT_ENTRY__KIND__KIND_CLEARED: return "cleared";
    default: return "unknown";
    }
}

static const char *ev_reason(int r)
{
    static const char *names[] = {"", "pressure", "quota", "admin", "start", "shutdown",
                                  "restored", "resync"};
    return r >= 0 && r < 8 ? names[r] : "unknown";
}

static void print_entry(const Kvd__Event *ev, const Kvd__EventEntry *x)
{
    if (json) {
        printf("{\"instance\":\"%016" PRIx64 "\",\"seq\":%" PRIu64 ",\"time_ns\":%" PRIu64
               ",\"namespace\":",
               ev->instance, ev->seq, ev->time_ns);
        jstr(ev->namespace_);
        printf(",\"kind\":\"%s\"", ev_kind(x->kind));
        if (x->hash.len) {
            printf(",\"hash\":\"");
            hex(x->hash.data, x->hash.len, 64);
            printf("\"");
        }
        if (x->kind == KVD__EVENT_ENTRY__KIND__KIND_STORED) {
            printf(",\"parent\":");
            if (x->parent_hash.len) {
                printf("\"");
                hex(x->parent_hash.data, x->parent_hash.len, 64);
                printf("\"");
            } else {
                printf("null");
            }
            printf(",\"tokens\":%u,\"token_ids\":[", x->tokens);
            for (size_t i = 0; i < x->n_token_ids; i++)
                printf("%s%u", i ? "," : "", x->token_ids[i]);
            printf("],\"extra\":\"");
            hex(x->extra.data, x->extra.len, x->extra.len);
            printf("\"");
        }
        if (x->kind != KVD__EVENT_ENTRY__KIND__KIND_CLEARED)
            printf(",\"format\":\"%s\",\"page\":%u", fmtname(x->format), x->page);
        if (x->reason)
            printf(",\"reason\":\"%s\"", ev_reason(x->reason));
        printf("}\n");
        return;
    }
    printf("%-8" PRIu64 " %-15s", ev->seq, ev_kind(x->kind));
    if (x->hash.len) {
        printf(" hash ");
        hex(x->hash.data, x->hash.len, 8);
    }
    if (x->kind == KVD__EVENT_ENTRY__KIND__KIND_STORED) {
        printf(" parent ");
        if (x->parent_hash.len)
            hex(x->parent_hash.data, x->parent_hash.len, 8);
        else
            printf("%-16s", "-");
        printf(" tokens %u", x->tokens);
    }
    if (x->kind != KVD__EVENT_ENTRY__KIND__KIND_CLEARED)
        printf(" %s page %u", fmtname(x->format), x->page);
    if (x->reason)
        printf(" (%s)", ev_reason(x->reason));
    printf("\n");
}

/* The daemon's events_endpoint through config get (an admin RPC: no session is opened). */
static int events_endpoint(const char *ep, int timeout, char *out, size_t cap)
{
    if (check_socket(ep, "daemon") != 0)
        return -1;
    kvc_t *c;
    kv_err_t e = kvc_connect(&c, ep, timeout);
    if (e != KV_ERR_OK) {
        fail_early(kv_err_name(e), "cannot connect to %s: %s%s", ep, kv_err_name(e),
                   e == KV_ERR_INVALID_ARGUMENT ? " (kvd's endpoint is ipc://PATH)" : "");
        return -1;
    }
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__ConfigGetReq cg = KVD__CONFIG_GET_REQ__INIT;
    cg.key = (char *)"events_endpoint";
    req.body_case = KVD__REQUEST__BODY_CONFIG_GET;
    req.config_get = &cg;
    Kvd__Reply *rep = NULL;
    e = kvc_call(c, &req, &rep);
    int rc = -1;
    if (e != KV_ERR_OK)
        fprintf(stderr, "kvctl: %s\n", kvc_errmsg(c)[0] ? kvc_errmsg(c) : kv_err_name((int)e));
    else if (rep->body_case != KVD__REPLY__BODY_CONFIG_GET || rep->config_get->n_items != 1)
        fprintf(stderr, "kvctl: unexpected reply to config get events_endpoint\n");
    else if (!rep->config_get->items[0]->value[0])
        fprintf(stderr, "kvctl: events are off on %s (events_endpoint is empty)\n", ep);
    else {
        snprintf(out, cap, "%s", rep->config_get->items[0]->value);
        rc = 0;
    }
    kvc_reply_free(&rep);
    kvc_close(&c);
    return rc;
}

/* Subscribe to every namespace and print entries until `count` (0: forever). A sequence gap
 * (PUB dropped messages at its high-water mark) or a new instance is reported on stderr. */
static int cmd_events(const char *ep, int timeout, int nargs, const char **args)
{
    uint64_t count = 0;
    const char *from = NULL;
    for (int i = 1; i < nargs; i++) {
        const char *v;
        int r;
        if ((r = opt_value(nargs, args, &i, "--count", &v)) != 0) {
            if (r < 0)
                return 2;
            /* 0 is refused: without --count it already runs until interrupted */
            if (parse_num(v, UINT64_MAX, &count) || count == 0) {
                fprintf(stderr,
                        "kvctl: events: option '--count' wants a number of entries (1 or "
                        "more), got '%s'\n",
                        v);
                return 2;
            }
        } else if ((r = opt_value(nargs, args, &i, "--from", &v)) != 0) {
            if (r < 0)
                return 2;
            from = v;
        } else {
            fprintf(stderr, "kvctl: events: unknown argument '%s'\n", args[i]);
            return 2;
        }
    }
    char pub[512];
    if (!from) {
        if (events_endpoint(ep, timeout, pub, sizeof pub) != 0)
            return 1;
        from = pub;
    }
    if (check_socket(from, "kvd's events publisher") != 0)
        return 1;
    void *ctx = zmq_ctx_new();
    void *sub = ctx ? zmq_socket(ctx, ZMQ_SUB) : NULL;
    if (!sub || zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0) != 0 || zmq_connect(sub, from) != 0) {
        fprintf(stderr, "kvctl: events: cannot subscribe to %s: %s\n", from,
                zmq_strerror(zmq_errno()));
        if (sub)
            zmq_close(sub);
        if (ctx)
            zmq_ctx_term(ctx);
        return 1;
    }
    fprintf(stderr, "kvctl: subscribed to %s\n", from);
    uint64_t seen = 0, last_seq = 0, instance = 0;
    int rc = 0;
    while (!count || seen < count) {
        zmq_msg_t topic, body;
        zmq_msg_init(&topic);
        zmq_msg_init(&body);
        if (zmq_msg_recv(&topic, sub, 0) < 0 || !zmq_msg_more(&topic) ||
            zmq_msg_recv(&body, sub, 0) < 0) {
            fprintf(stderr, "kvctl: events: receive failed: %s\n", zmq_strerror(zmq_errno()));
            zmq_msg_close(&topic);
            zmq_msg_close(&body);
            rc = 1;
            break;
        }
        Kvd__Event *ev = kvd__event__unpack(NULL, zmq_msg_size(&body), zmq_msg_data(&body));
        if (!ev) {
            fprintf(stderr, "kvctl: events: undecodable message of %zu bytes\n",
                    zmq_msg_size(&body));
        } else {
            if (instance && ev->instance != instance)
                fprintf(stderr, "kvctl: events: new daemon instance %016" PRIx64 "\n",
                        ev->instance);
            else if (last_seq && ev->seq != last_seq + 1)
                fprintf(stderr, "kvctl: events: gap: seq %" PRIu64 " after %" PRIu64
                        " (%" PRIu64 " messages lost)\n",
                        ev->seq, last_seq, ev->seq - last_seq - 1);
            instance = ev->instance;
            last_seq = ev->seq;
            for (size_t i = 0; i < ev->n_entries && (!count || seen < count); i++, seen++)
                print_entry(ev, ev->entries[i]);
            fflush(stdout);
            kvd__event__free_unpacked(ev, NULL);
        }
        zmq_msg_close(&topic);
        zmq_msg_close(&body);
    }
    int zero = 0;
    zmq_setsockopt(sub, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(sub);
    zmq_ctx_term(ctx);
    return rc;
}

int main(int argc, char **argv)
{
    const char *ep = getenv("KVD_ENDPOINT");
    int timeout = 5000, ai = 1;
    if (!ep || !*ep)
        ep = "ipc:///run/kvd/kvd.sock";
    const char **av = (const char **)argv;
    for (; ai < argc && argv[ai][0] == '-'; ai++) {
        const char *v;
        int r;
        if (!strcmp(argv[ai], "--json")) {
            json = 1;
        } else if (!strcmp(argv[ai], "--help") || !strcmp(argv[ai], "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[ai], "--version")) {
            printf("kvctl 0.1.0 (protocol %u)\n", KVP_VERSION);
            return 0;
        } else if ((r = opt_value(argc, av, &ai, "--endpoint", &v)) != 0) {
            if (r < 0)
                return 2;
            ep = v;
        } else if ((r = opt_value(argc, av, &ai, "--timeout", &v)) != 0) {
            uint64_t ms;
            if (r < 0)
                return 2;
            if (parse_num(v, INT_MAX, &ms) || ms == 0) {
                fprintf(stderr,
                        "kvctl: option '--timeout' wants milliseconds (1 or more), got '%s'\n",
                        v);
                return 2;
            }
            timeout = (int)ms;
        } else {
            fprintf(stderr, "kvctl: unknown option '%s'\n", argv[ai]);
            usage(stderr);
            return 2;
        }
    }
    /* allow --json after the command too */
    int nargs = 0;
    const char *args[8];
    for (int i = ai; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            json = 1;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout); /* `kvctl cache --help` asks for help, not a usage error */
            return 0;
        }
        else if (nargs == 8) { /* more than any command takes: refused, not cut short */
            fprintf(stderr, "kvctl: too many arguments (see kvctl --help)\n");
            return 2;
        } else
            args[nargs++] = argv[i];
    }
    if (nargs == 0) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(args[0], "events") && !(nargs == 2 && !strcmp(args[1], "sync")))
        return cmd_events(ep, timeout, nargs, args);
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__StatusReq st = KVD__STATUS_REQ__INIT;
    Kvd__SessionsReq ss = KVD__SESSIONS_REQ__INIT;
    Kvd__CacheLsReq cl = KVD__CACHE_LS_REQ__INIT;
    Kvd__CacheEvictReq ce = KVD__CACHE_EVICT_REQ__INIT;
    Kvd__CachePinReq cp = KVD__CACHE_PIN_REQ__INIT;
    Kvd__PageInfoReq pi = KVD__PAGE_INFO_REQ__INIT;
    Kvd__ConfigGetReq cg = KVD__CONFIG_GET_REQ__INIT;
    Kvd__ConfigSetReq cs = KVD__CONFIG_SET_REQ__INIT;
    Kvd__DrainReq dr = KVD__DRAIN_REQ__INIT;
    Kvd__CheckReq ck = KVD__CHECK_REQ__INIT;
    Kvd__EventsSyncReq es = KVD__EVENTS_SYNC_REQ__INIT;
    Kvd__SnapshotReq sn = KVD__SNAPSHOT_REQ__INIT;
    Kvd__SessionFenceReq sf = KVD__SESSION_FENCE_REQ__INIT;
    const char *cmd = args[0], *sub = nargs > 1 ? args[1] : "";
    if (!strcmp(cmd, "status") && nargs == 1) {
        req.body_case = KVD__REQUEST__BODY_STATUS;
        req.status = &st;
    } else if (!strcmp(cmd, "sessions") && nargs == 1) {
        req.body_case = KVD__REQUEST__BODY_SESSIONS;
        req.sessions = &ss;
    } else if (!strcmp(cmd, "sessions") && !strcmp(sub, "fence") && nargs == 3) {
        req.body_case = KVD__REQUEST__BODY_SESSION_FENCE;
        req.session_fence = &sf;
        if (parse_num(args[2], UINT64_MAX, &sf.session_id) || sf.session_id == 0) {
            fprintf(stderr, "kvctl: sessions fence: SESSION must be a session id (kvctl "
                            "sessions)\n");
            return 2;
        }
    } else if (!strcmp(cmd, "cache") && !strcmp(sub, "ls") && nargs <= 3) {
        req.body_case = KVD__REQUEST__BODY_CACHE_LS;
        req.cache_ls = &cl;
        if (nargs == 3 && parse_u32(args[2], &cl.limit)) {
            fprintf(stderr, "kvctl: cache ls: LIMIT must be a number\n");
            return 2;
        }
    } else if (!strcmp(cmd, "cache") && !strcmp(sub, "evict") && nargs == 3) {
        req.body_case = KVD__REQUEST__BODY_CACHE_EVICT;
        req.cache_evict = &ce;
        if (!strcmp(args[2], "all"))
            ce.all = 1;
        else if (parse_u32(args[2], &ce.page)) {
            fprintf(stderr, "kvctl: cache evict: PAGE must be a number or 'all'\n");
            return 2;
        }
    } else if (!strcmp(cmd, "cache") && (!strcmp(sub, "pin") || !strcmp(sub, "unpin")) &&
               nargs == 3) {
        req.body_case = KVD__REQUEST__BODY_CACHE_PIN;
        req.cache_pin = &cp;
        cp.pin = !strcmp(sub, "pin");
        if (parse_u32(args[2], &cp.page)) {
            fprintf(stderr, "kvctl: cache %s: PAGE must be a number\n", sub);
            return 2;
        }
    } else if (!strcmp(cmd, "page") && nargs == 2) {
        req.body_case = KVD__REQUEST__BODY_PAGE_INFO;
        req.page_info = &pi;
        if (parse_u32(args[1], &pi.page)) {
            fprintf(stderr, "kvctl: page: ID must be a number\n");
            return 2;
        }
    } else if (!strcmp(cmd, "config") && !strcmp(sub, "get") && nargs <= 3) {
        req.body_case = KVD__REQUEST__BODY_CONFIG_GET;
        req.config_get = &cg;
        cg.key = (char *)(nargs == 3 ? args[2] : "");
    } else if (!strcmp(cmd, "config") && !strcmp(sub, "set") && nargs == 4) {
        req.body_case = KVD__REQUEST__BODY_CONFIG_SET;
        req.config_set = &cs;
        cs.key = (char *)args[2];
        cs.value = (char *)args[3];
    } else if (!strcmp(cmd, "drain") && nargs == 1) {
        req.body_case = KVD__REQUEST__BODY_DRAIN;
        req.drain = &dr;
    } else if (!strcmp(cmd, "check") && nargs == 1) {
        req.body_case = KVD__REQUEST__BODY_CHECK;
        req.check = &ck;
    } else if (!strcmp(cmd, "events") && !strcmp(sub, "sync")) {
        req.body_case = KVD__REQUEST__BODY_EVENTS_SYNC;
        req.events_sync = &es;
    } else if (!strcmp(cmd, "snapshot") && nargs == 1) {
        req.body_case = KVD__REQUEST__BODY_SNAPSHOT;
        req.snapshot = &sn;
    } else {
        fprintf(stderr, "kvctl: unknown command or wrong arguments: %s %s\n", cmd, sub);
        usage(stderr);
        return 2;
    }

    if (check_socket(ep, "daemon") != 0)
        return 1;
    kvc_t *c;
    kv_err_t e = kvc_connect(&c, ep, timeout);
    if (e != KV_ERR_OK) {
        fail_early(kv_err_name(e), "cannot connect to %s: %s%s", ep, kv_err_name(e),
                   e == KV_ERR_INVALID_ARGUMENT ? " (kvd's endpoint is ipc://PATH)" : "");
        return 1;
    }
    Kvd__Reply *rep = NULL;
    e = kvc_call(c, &req, &rep);
    int rc = 0;
    if (e != KV_ERR_OK) {
        if (json) {
            printf("{\"error\":\"%s\",\"message\":", kv_err_name((int)e));
            jstr(kvc_errmsg(c));
            printf("}\n");
        }
        fprintf(stderr, "kvctl: %s\n", kvc_errmsg(c)[0] ? kvc_errmsg(c) : kv_err_name((int)e));
        rc = 1;
    } else {
        switch (rep->body_case) {
        case KVD__REPLY__BODY_STATUS_REP:
            print_status(rep->status_rep);
            break;
        case KVD__REPLY__BODY_SESSIONS:
            print_sessions(rep->sessions);
            break;
        case KVD__REPLY__BODY_CACHE_LS:
            print_cache_ls(rep->cache_ls);
            break;
        case KVD__REPLY__BODY_CACHE_EVICT:
            printf(json ? "{\"evicted\":%u}\n" : "evicted %u\n", rep->cache_evict->evicted);
            break;
        case KVD__REPLY__BODY_CACHE_PIN:
            printf(json ? "{\"ok\":true}\n" : "ok\n");
            break;
        case KVD__REPLY__BODY_PAGE_INFO:
            print_page(rep->page_info);
            break;
        case KVD__REPLY__BODY_CONFIG_GET:
            print_config(rep->config_get->items, rep->config_get->n_items, 0);
            break;
        case KVD__REPLY__BODY_CONFIG_SET:
            print_config(&rep->config_set->item, 1, 1);
            break;
        case KVD__REPLY__BODY_SESSION_FENCE:
            printf(json ? "{\"fenced\":%" PRIu64 ",\"min_safe_epoch\":%" PRIu64 "}\n"
                        : "session %" PRIu64 " fenced; minimum safe epoch now %" PRIu64 "\n",
                   rep->session_fence->session_id, rep->session_fence->min_safe_epoch);
            break;
        case KVD__REPLY__BODY_EVENTS_SYNC:
            printf(json ? "{\"seq\":%" PRIu64 ",\"entries\":%u}\n"
                        : "republished: CLEARED in message %" PRIu64 ", then %u entries\n",
                   rep->events_sync->seq, rep->events_sync->entries);
            break;
        case KVD__REPLY__BODY_DRAIN:
            printf(json ? "{\"draining\":true,\"sessions\":%u}\n"
                        : "draining (until kvd restarts); %u sessions still attached\n",
                   rep->drain->sessions);
            break;
        case KVD__REPLY__BODY_CHECK: {
            const Kvd__CheckRep *k = rep->check;
            if (json) {
                printf("{\"ok\":%s,\"leaks\":%" PRIu64 ",\"problems\":[", k->ok ? "true" : "false",
                       k->leaked_pages);
                for (size_t i = 0; i < k->n_problems; i++) {
                    printf("%s", i ? "," : "");
                    jstr(k->problems[i]);
                }
                printf("]}\n");
            } else {
                printf("check: %s, leaks: %" PRIu64 "\n", k->ok ? "ok" : "FAILED",
                       k->leaked_pages);
                for (size_t i = 0; i < k->n_problems; i++)
                    printf("  %s\n", k->problems[i]);
            }
            rc = k->ok ? 0 : 1;
            break;
        }
        case KVD__REPLY__BODY_SNAPSHOT: {
            const Kvd__SnapshotRep *k = rep->snapshot;
            if (json) {
                printf("{\"generation\":%" PRIu64 ",\"pages\":%" PRIu64 ",\"bytes\":%" PRIu64
                       ",\"ms\":%" PRIu64 ",\"path\":",
                       k->generation, k->pages, k->bytes, k->ms);
                jstr(k->path);
                printf("}\n");
            } else {
                printf("snapshot: generation %" PRIu64 ", %" PRIu64 " pages, %" PRIu64
                       " bytes in %" PRIu64 " ms -> %s\n",
                       k->generation, k->pages, k->bytes, k->ms, k->path ? k->path : "");
            }
            break;
        }
        default:
            fprintf(stderr, "kvctl: unexpected reply body %d\n", (int)rep->body_case);
            rc = 1;
        }
    }
    kvc_reply_free(&rep);
    kvc_close(&c);
    return rc;
}
