/* kvproto.c — the gate between hostile bytes and the daemon. See kvproto.h for the order of
 * checks. Why a wire scan before protobuf-c: its unpacker trusts some length arithmetic on
 * hostile input (DESIGN.md, "Control protocol"); scanning framing first with plain 64-bit
 * bounds checks means the unpacker only sees messages whose every length prefix, varint and
 * wire type is sane, and the fuzz target checks the pair under ASan/UBSan.
 */
#include "kvproto.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void kvp_limits_default(kvp_limits_t *lim)
{
    memset(lim, 0, sizeof *lim);
    lim->max_msg_bytes = 64u << 20;
    lim->page_tokens = 16;
    lim->dir_entries = 1u << 20;
    lim->max_alloc = 4096;
    lim->max_tokens = 1u << 20;
    lim->max_pages = 1u << 16;
}

/* ---- operation table --------------------------------------------------------------------- */
static const struct {
    int body_case;
    const char *name;
    int needs_session, admin;
} kvp_ops[KVP_OP_COUNT] = {
#define KVP_OP_ROW_(c, n, s, a) {KVD__REQUEST__BODY_##c, #n, s, a},
    KVP_OP_MAP(KVP_OP_ROW_)
#undef KVP_OP_ROW_
};

kvp_op_t kvp_op_of_case(int body_case)
{
    for (int i = 0; i < KVP_OP_COUNT; i++)
        if (kvp_ops[i].body_case == body_case)
            return (kvp_op_t)i;
    return KVP_OP_INVALID;
}

const char *kvp_op_name(kvp_op_t op)
{
    return (unsigned)op < KVP_OP_COUNT ? kvp_ops[op].name : "invalid";
}

int kvp_op_needs_session(kvp_op_t op)
{
    return (unsigned)op < KVP_OP_COUNT ? kvp_ops[op].needs_session : 0;
}

int kvp_op_is_admin(kvp_op_t op)
{
    return (unsigned)op < KVP_OP_COUNT ? kvp_ops[op].admin : 0;
}

/* ---- wire scan --------------------------------------------------------------------------- */
/* Reads a varint of at most 10 bytes; returns bytes consumed or 0 on error. */
static size_t kvp_varint(const uint8_t *p, size_t len, uint64_t *v)
{
    uint64_t x = 0;
    for (size_t i = 0; i < len && i < 10; i++) {
        if (i == 9 && p[i] > 1)
            return 0; /* would overflow 64 bits */
        x |= (uint64_t)(p[i] & 0x7f) << (7 * i);
        if (!(p[i] & 0x80)) {
            *v = x;
            return i + 1;
        }
    }
    return 0;
}

int kvp_wire_scan(const ProtobufCMessageDescriptor *d, const uint8_t *buf, size_t len, int depth)
{
    if (depth > KVP_MAX_DEPTH)
        return -1;
    size_t off = 0;
    while (off < len) {
        uint64_t key, v;
        size_t n = kvp_varint(buf + off, len - off, &key);
        if (!n)
            return -1;
        off += n;
        uint64_t field = key >> 3;
        unsigned wt = (unsigned)(key & 7);
        if (field == 0 || field > 536870911u)
            return -1;
        const ProtobufCFieldDescriptor *f =
            d ? protobuf_c_message_descriptor_get_field(d, (unsigned)field) : NULL;
        switch (wt) {
        case 0:
            n = kvp_varint(buf + off, len - off, &v);
            if (!n)
                return -1;
            off += n;
            break;
        case 1:
            if (len - off < 8)
                return -1;
            off += 8;
            break;
        case 5:
            if (len - off < 4)
                return -1;
            off += 4;
            break;
        case 2:
            n = kvp_varint(buf + off, len - off, &v);
            if (!n)
                return -1;
            off += n;
            if (v > (uint64_t)(len - off))
                return -1;
            if (f && f->type == PROTOBUF_C_TYPE_MESSAGE &&
                kvp_wire_scan((const ProtobufCMessageDescriptor *)f->descriptor, buf + off,
                              (size_t)v, depth + 1))
                return -1;
            if (f && f->label == PROTOBUF_C_LABEL_REPEATED && f->type != PROTOBUF_C_TYPE_MESSAGE &&
                f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_BYTES) {
                /* packed scalars: a whole number of well-formed elements */
                size_t po = off, pend = off + (size_t)v;
                if (f->type != PROTOBUF_C_TYPE_FIXED32 && f->type != PROTOBUF_C_TYPE_SFIXED32 &&
                    f->type != PROTOBUF_C_TYPE_FLOAT && f->type != PROTOBUF_C_TYPE_FIXED64 &&
                    f->type != PROTOBUF_C_TYPE_SFIXED64 && f->type != PROTOBUF_C_TYPE_DOUBLE) {
                    /* packed varints: no run of 10+ continuation bytes, last byte ends one.
                     * A byte loop, not a decode: this runs over whole prompts. */
                    unsigned run = 0;
                    for (; po < pend; po++) {
                        run = (buf[po] & 0x80) ? run + 1 : 0;
                        if (run >= 10)
                            return -1;
                    }
                    if (run)
                        return -1;
                }
                while (po < pend) {
                    size_t m;
                    if (f->type == PROTOBUF_C_TYPE_FIXED32 || f->type == PROTOBUF_C_TYPE_SFIXED32 ||
                        f->type == PROTOBUF_C_TYPE_FLOAT)
                        m = pend - po >= 4 ? 4 : 0;
                    else if (f->type == PROTOBUF_C_TYPE_FIXED64 ||
                             f->type == PROTOBUF_C_TYPE_SFIXED64 ||
                             f->type == PROTOBUF_C_TYPE_DOUBLE)
                        m = pend - po >= 8 ? 8 : 0;
                    else
                        m = kvp_varint(buf + po, pend - po, &key);
                    if (!m)
                        return -1;
                    po += m;
                }
            }
            off += (size_t)v;
            break;
        default: /* groups (3, 4) and 6, 7 are not part of this protocol */
            return -1;
        }
    }
    return 0;
}

/* ---- validation -------------------------------------------------------------------------- */
static kv_err_t kvp_fail(char *msg, size_t cap, kv_err_t e, const char *fmt, ...)
{
    if (msg && cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, cap, fmt, ap);
        va_end(ap);
    }
    return e;
}

/* What is wrong with the characters of string s (*at: the byte where), or NULL. Strings are
 * shown to operators (kvctl sessions, log lines) and echoed in replies, which the proto3
 * decoders of other languages refuse unless they are UTF-8 (protobuf-c does not check): valid
 * UTF-8 (no overlong form, surrogate or code point above U+10FFFF) and no control character
 * (C0, DEL, C1: a newline would forge a log line, an escape sequence would reach the
 * operator's terminal). */
static const char *kvp_str_bad(const char *s, size_t *at)
{
    if (!s)
        return NULL;
    const unsigned char *p = (const unsigned char *)s;
    size_t n = strlen(s);
    for (size_t i = 0; i < n;) {
        unsigned c = p[i];
        *at = i;
        if (c < 0x20 || c == 0x7f)
            return "a control character";
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
        if (len == 0 || c > 0xf4 || i + len > n)
            return "not UTF-8";
        uint32_t cp = c & (0x7fu >> len);
        for (size_t k = 1; k < len; k++) {
            if ((p[i + k] & 0xc0) != 0x80)
                return "not UTF-8";
            cp = cp << 6 | (p[i + k] & 0x3fu);
        }
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return "not UTF-8";
        if (cp >= 0x80 && cp < 0xa0)
            return "a control character";
        i += len;
    }
    return NULL;
}

/* INVALID_ARGUMENT naming the field, the problem and where, or OK. */
static kv_err_t kvp_str_ok(const char *s, const char *field, char *msg, size_t cap)
{
    size_t n = s ? strlen(s) : 0, at = 0;
    if (n > KVP_MAX_STRING)
        return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT, "%s: %zu bytes, max %u", field, n,
                        KVP_MAX_STRING);
    const char *why = kvp_str_bad(s, &at);
    if (why)
        return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT, "%s: %s at byte %zu", field, why, at);
    return KV_ERR_OK;
}

static kv_err_t kvp_pages_ok(const uint32_t *pages, size_t n, size_t min, const kvp_limits_t *lim,
                             const char *what, char *msg, size_t cap)
{
    if (n < min || n > lim->max_pages)
        return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT, "%s: %zu pages, allowed %zu..%u", what,
                        n, min, lim->max_pages);
    for (size_t i = 0; i < n; i++)
        if (lim->dir_entries && pages[i] >= lim->dir_entries)
            return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT,
                            "%s: page id %u at index %zu out of range (directory has %u entries)",
                            what, pages[i], i, lim->dir_entries);
    return KV_ERR_OK;
}

static kv_err_t kvp_page_ok(uint32_t page, const kvp_limits_t *lim, const char *what, char *msg,
                            size_t cap)
{
    if (lim->dir_entries && page >= lim->dir_entries)
        return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT,
                        "%s: page id %u out of range (directory has %u entries)", what, page,
                        lim->dir_entries);
    return KV_ERR_OK;
}

static kv_err_t kvp_validate(const Kvd__Request *r, kvp_op_t op, const kvp_limits_t *lim,
                             char *msg, size_t cap)
{
    switch (op) {
    case KVP_OP_HELLO: {
        const Kvd__HelloReq *h = r->hello;
        kv_err_t e = kvp_str_ok(h->namespace_, "hello.namespace", msg, cap);
        if (e == KV_ERR_OK)
            e = kvp_str_ok(h->client_name, "hello.client_name", msg, cap);
        return e;
    }
    case KVP_OP_ALLOC:
        if (r->alloc->count < 1 || r->alloc->count > lim->max_alloc)
            return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT, "alloc: count %u, allowed 1..%u",
                            r->alloc->count, lim->max_alloc);
        if ((unsigned)r->alloc->format >= KVP_FORMATS)
            return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT, "alloc: unknown format %d",
                            (int)r->alloc->format);
        if (r->alloc->reserve &&
            (r->alloc->reserve < r->alloc->count || r->alloc->reserve > KVP_MAX_RESERVE))
            return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT,
                            "alloc: reserve %u, allowed 0 (none) or count (%u) .. %u",
                            r->alloc->reserve, r->alloc->count, KVP_MAX_RESERVE);
        return KV_ERR_OK;
    case KVP_OP_SEAL: {
        const Kvd__SealReq *s = r->seal;
        kv_err_t e = kvp_page_ok(s->page, lim, "seal.page", msg, cap);
        if (e == KV_ERR_OK && s->has_prev)
            e = kvp_page_ok(s->prev, lim, "seal.prev", msg, cap);
        if (e != KV_ERR_OK)
            return e;
        if (s->has_prev && s->prev == s->page)
            return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT, "seal: page %u is its own prev",
                            s->page);
        if (lim->page_tokens && s->n_tokens != lim->page_tokens)
            return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT,
                            "seal: %zu tokens, a page holds exactly %u", s->n_tokens,
                            lim->page_tokens);
        if (s->extra.len > KVP_MAX_EXTRA)
            return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT, "seal: extra is %zu bytes, max %u",
                            s->extra.len, KVP_MAX_EXTRA);
        return KV_ERR_OK;
    }
    case KVP_OP_LOOKUP:
        if (r->lookup->tokens.len % 4)
            return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT,
                            "lookup: tokens is %zu bytes, not a whole number of uint32",
                            r->lookup->tokens.len);
        if (r->lookup->tokens.len / 4 > lim->max_tokens)
            return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT, "lookup: %zu tokens, max %u",
                            r->lookup->tokens.len / 4, lim->max_tokens);
        if (r->lookup->extra.len > KVP_MAX_EXTRA)
            return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT,
                            "lookup: extra is %zu bytes, max %u", r->lookup->extra.len,
                            KVP_MAX_EXTRA);
        return KV_ERR_OK;
    case KVP_OP_RELEASE:
        return kvp_pages_ok(r->release->pages, r->release->n_pages, 1, lim, "release", msg, cap);
    case KVP_OP_SEQ_OPEN:
        return kvp_str_ok(r->seq_open->tag, "seq_open.tag", msg, cap);
    case KVP_OP_SEQ_APPEND:
        return kvp_pages_ok(r->seq_append->pages, r->seq_append->n_pages, 1, lim, "seq_append",
                            msg, cap);
    case KVP_OP_CACHE_EVICT:
        if (r->cache_evict->all)
            return KV_ERR_OK;
        return kvp_page_ok(r->cache_evict->page, lim, "cache_evict.page", msg, cap);
    case KVP_OP_CACHE_PIN:
        return kvp_page_ok(r->cache_pin->page, lim, "cache_pin.page", msg, cap);
    case KVP_OP_PAGE_INFO:
        return kvp_page_ok(r->page_info->page, lim, "page_info.page", msg, cap);
    case KVP_OP_CONFIG_GET:
        return kvp_str_ok(r->config_get->key, "config_get.key", msg, cap);
    case KVP_OP_CONFIG_SET: {
        kv_err_t e = kvp_str_ok(r->config_set->key, "config_set.key", msg, cap);
        if (e == KV_ERR_OK)
            e = kvp_str_ok(r->config_set->value, "config_set.value", msg, cap);
        return e;
    }
    case KVP_OP_SESSION_FENCE:
        if (r->session_fence->session_id == 0)
            return kvp_fail(msg, cap, KV_ERR_INVALID_ARGUMENT,
                            "session_fence: session_id 0 names no session");
        return KV_ERR_OK;
    default:
        return KV_ERR_OK;
    }
}

/* Each oneof member is a pointer; protobuf-c leaves it NULL only when the case is unset, but
 * keep the check local and explicit. */
static int kvp_body_present(const Kvd__Request *r)
{
    return r->body_case != KVD__REQUEST__BODY__NOT_SET && r->hello != NULL;
}

kv_err_t kvp_request_decode(const uint8_t *buf, size_t len, const kvp_limits_t *lim,
                            Kvd__Request **out, kvp_op_t *op, uint64_t *id, char *msg,
                            size_t msgcap)
{
    kvp_limits_t dl;
    if (!lim) {
        kvp_limits_default(&dl);
        lim = &dl;
    }
    *out = NULL;
    *op = KVP_OP_INVALID;
    *id = 0;
    if (msg && msgcap)
        msg[0] = '\0';
    if (!buf || len == 0)
        return kvp_fail(msg, msgcap, KV_ERR_MALFORMED, "empty request");
    if (lim->max_msg_bytes && len > lim->max_msg_bytes)
        return kvp_fail(msg, msgcap, KV_ERR_MALFORMED, "request of %zu bytes exceeds %zu", len,
                        lim->max_msg_bytes);
    if (kvp_wire_scan(&kvd__request__descriptor, buf, len, 0))
        return kvp_fail(msg, msgcap, KV_ERR_MALFORMED,
                        "request of %zu bytes is not a well-formed protobuf message", len);
    Kvd__Request *r = kvd__request__unpack(NULL, len, buf);
    if (!r)
        return kvp_fail(msg, msgcap, KV_ERR_MALFORMED, "request of %zu bytes does not decode",
                        len);
    *id = r->id;
    kv_err_t e;
    if (r->version != KVP_VERSION) {
        e = kvp_fail(msg, msgcap, KV_ERR_VERSION_MISMATCH,
                     "protocol version %u, this daemon speaks %u", r->version, KVP_VERSION);
        goto fail;
    }
    if (!kvp_body_present(r)) {
        e = kvp_fail(msg, msgcap, KV_ERR_MALFORMED, "request %llu has no operation",
                     (unsigned long long)r->id);
        goto fail;
    }
    kvp_op_t o = kvp_op_of_case((int)r->body_case);
    if (o == KVP_OP_INVALID) {
        e = kvp_fail(msg, msgcap, KV_ERR_MALFORMED, "unknown operation %d", (int)r->body_case);
        goto fail;
    }
    *op = o; /* known from here on, also when validation fails (metrics count it per op) */
    e = kvp_validate(r, o, lim, msg, msgcap);
    if (e != KV_ERR_OK)
        goto fail;
    *out = r;
    return KV_ERR_OK;
fail:
    kvd__request__free_unpacked(r, NULL);
    return e;
}

void kvp_request_free(Kvd__Request **req)
{
    if (req && *req) {
        kvd__request__free_unpacked(*req, NULL);
        *req = NULL;
    }
}
