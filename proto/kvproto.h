/* kvproto.h — decode and validate untrusted protocol bytes; pack replies.
 *
 * The daemon never touches a Kvd__Request that did not come through kvp_request_decode():
 * that function is the one gate between hostile bytes and the daemon (and exactly what the
 * fuzz target tests/fuzz/fuzz_request.c drives). It checks, in order:
 *   1. size bounds (empty or larger than the limit → MALFORMED),
 *   2. a structural scan of the protobuf wire format (varints ≤ 10 bytes, lengths inside the
 *      buffer, known wire types, nesting depth ≤ 8) before protobuf-c's unpacker runs, so
 *      the unpacker only ever sees well-formed framing,
 *   3. protobuf-c unpacking (MALFORMED on failure),
 *   4. protocol version (VERSION_MISMATCH), presence of a body (MALFORMED),
 *   5. per-operation field bounds (INVALID_ARGUMENT): counts (an alloc's reserve: 0 or
 *      count .. KVP_MAX_RESERVE), token lengths, page ids below the directory size, format
 *      values, strings (length, UTF-8, no control characters).
 * On any failure it returns the code with a human message naming the field and the bound, and
 * still reports the request id when the bytes got that far, so the reply can be matched.
 *
 * Operations are one table (KVP_OP_MAP): the oneof case, the short name used in logs and
 * metrics, and whether the call needs a session (hello and admin calls do not).
 */
#ifndef KVPROTO_H
#define KVPROTO_H

#include <stddef.h>
#include <stdint.h>

#include "kv_err.h"
#include "kvd.pb-c.h"

#define KVP_VERSION 1u

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "LookupReq.tokens is little-endian uint32 bytes; a big-endian port must convert"
#endif
#define KVP_NO_PAGE 0xFFFFFFFFu
#define KVP_MAX_EXTRA 256u  /* bytes of SealReq/LookupReq.extra */
#define KVP_MAX_STRING 256u /* bytes of any string field */
#define KVP_MAX_DEPTH 8     /* nesting depth of the wire scan */
#define KVP_FORMATS 2       /* Format values: FP8, TQ3 (kv_fmt_t) */
/* AllocReq.reserve upper bound: a sanity bound only (the daemon compares a reserve with what
 * its pool can provide, and refuses more than the pool holds with RESOURCE_EXHAUSTED). */
#define KVP_MAX_RESERVE (1u << 31)

/*  XX(case suffix, name, needs session, admin) */
#define KVP_OP_MAP(XX)                                                                             \
    XX(HELLO, hello, 0, 0)                                                                         \
    XX(ALLOC, alloc, 1, 0)                                                                         \
    XX(SEAL, seal, 1, 0)                                                                           \
    XX(LOOKUP, lookup, 1, 0)                                                                       \
    XX(RELEASE, release, 1, 0)                                                                     \
    XX(SEQ_OPEN, seq_open, 1, 0)                                                                   \
    XX(SEQ_APPEND, seq_append, 1, 0)                                                               \
    XX(SEQ_CLOSE, seq_close, 1, 0)                                                                 \
    XX(HEARTBEAT, heartbeat, 1, 0)                                                                 \
    XX(GOODBYE, goodbye, 1, 0)                                                                     \
    XX(STATUS, status, 0, 1)                                                                       \
    XX(SESSIONS, sessions, 0, 1)                                                                   \
    XX(CACHE_LS, cache_ls, 0, 1)                                                                   \
    XX(CACHE_EVICT, cache_evict, 0, 1)                                                             \
    XX(CACHE_PIN, cache_pin, 0, 1)                                                                 \
    XX(PAGE_INFO, page_info, 0, 1)                                                                 \
    XX(CONFIG_GET, config_get, 0, 1)                                                               \
    XX(CONFIG_SET, config_set, 0, 1)                                                               \
    XX(DRAIN, drain, 0, 1)                                                                         \
    XX(CHECK, check, 0, 1)                                                                         \
    XX(SNAPSHOT, snapshot, 0, 1)                                                                   \
    XX(EVENTS_SYNC, events_sync, 0, 1)                                                             \
    XX(SESSION_FENCE, session_fence, 0, 1)

/* Dense operation index (for per-op tables such as latency histograms). */
typedef enum kvp_op_e {
#define KVP_OP_ENUM_(c, n, s, a) KVP_OP_##c,
    KVP_OP_MAP(KVP_OP_ENUM_)
#undef KVP_OP_ENUM_
        KVP_OP_COUNT,
    KVP_OP_INVALID = KVP_OP_COUNT, /* undecodable request: counted under this index */
} kvp_op_t;

/* Limits the validator enforces; the daemon fills them from its config and geometry. */
typedef struct kvp_limits_s {
    size_t max_msg_bytes;  /* whole message; 0 = unlimited */
    uint32_t page_tokens;  /* SealReq.tokens must have exactly this many (0: not checked) */
    uint32_t dir_entries;  /* page ids must be below this (0: not checked) */
    uint32_t max_alloc;    /* AllocReq.count upper bound */
    uint32_t max_tokens;   /* LookupReq.tokens upper bound */
    uint32_t max_pages;    /* page lists (release, append) upper bound */
} kvp_limits_t;

/* Sensible limits for tests and the fuzz target. */
void kvp_limits_default(kvp_limits_t *lim);

/* Decode and validate. On KV_ERR_OK *out owns the request (free with kvp_request_free) and
 * *op is its operation. On failure *out is NULL, msg holds a NUL-terminated explanation, *id
 * is the request id when it could be read (else 0) and *op the operation when the body decoded
 * but failed validation (else KVP_OP_INVALID). Never crashes on any input. */
kv_err_t kvp_request_decode(const uint8_t *buf, size_t len, const kvp_limits_t *lim,
                            Kvd__Request **out, kvp_op_t *op, uint64_t *id, char *msg,
                            size_t msgcap);
void kvp_request_free(Kvd__Request **req);

/* Structural scan of protobuf wire bytes of message type d (step 2 above), recursing into
 * embedded messages the descriptor names; 0 when well formed. Exposed for tests. */
int kvp_wire_scan(const ProtobufCMessageDescriptor *d, const uint8_t *buf, size_t len, int depth);

/* Operation of a decoded request's oneof case; KVP_OP_INVALID for an unknown case. */
kvp_op_t kvp_op_of_case(int body_case);
const char *kvp_op_name(kvp_op_t op); /* "alloc"; "invalid" */
int kvp_op_needs_session(kvp_op_t op);
int kvp_op_is_admin(kvp_op_t op);

/* Status enum value ↔ kv_err_t: identical numbers by construction (checked by test_err). */
static inline Kvd__Status kvp_status(kv_err_t e)
{
    return (Kvd__Status)e;
}

/* Bytes of v as a protobuf varint (1-10): for encoded-size bounds computed without packing
 * (the daemon's derived max_msg_bytes, its event message bound). */
static inline size_t kvp_varint_size(uint64_t v)
{
    size_t n = 1;
    for (; v >= 128; v >>= 7)
        n++;
    return n;
}

#endif /* KVPROTO_H */
