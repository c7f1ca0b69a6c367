/* kv_err.h — the one error vocabulary of kvd.
 *
 * KV_ERR_MAP generates the enum, the names and the default messages from one table (libuv's
 * UV_ERRNO_MAP habit). proto/kvd.proto's `Status` enum mirrors these numbers exactly; a test
 * (tests/unit/test_err.c) checks that the two agree, so the daemon, libkvc, kvctl and the logs
 * say the same words. Codes are stable on the wire: append, never renumber.
 */
#ifndef KV_ERR_H
#define KV_ERR_H

#define KV_ERR_MAP(XX)                                                                             \
    XX(OK, 0, "ok")                                                                                \
    XX(INVALID_ARGUMENT, 1, "a field of the request is out of range or malformed")                 \
    XX(MALFORMED, 2, "the request could not be decoded")                                           \
    XX(VERSION_MISMATCH, 3, "protocol version not supported")                                      \
    XX(PERMISSION_DENIED, 4, "the peer is not admitted")                                           \
    XX(NOT_FOUND, 5, "no such object")                                                             \
    XX(RESOURCE_EXHAUSTED, 6, "pool exhausted: nothing left to evict; preempt or retry later")     \
    XX(FAILED_PRECONDITION, 7, "the object is not in a state that allows this operation")          \
    XX(NO_SESSION, 8, "no session: send hello first")                                              \
    XX(GEOMETRY_MISMATCH, 9, "the geometry does not match the namespace")                          \
    XX(DRAINING, 10, "the daemon is draining and accepts no new work")                             \
    XX(INTERNAL, 11, "internal error")                                                             \
    XX(UNAVAILABLE, 12, "the daemon cannot be reached")                                            \
    XX(TIMEOUT, 13, "no reply in time")                                                            \
    XX(NOMEM, 14, "out of memory")                                                                 \
    XX(IO, 15, "I/O error")                                                                        \
    XX(DEVICE, 16, "device (CUDA) error")

typedef enum kv_err_e {
#define KV_ERR_ENUM_(name, code, msg) KV_ERR_##name = code,
    KV_ERR_MAP(KV_ERR_ENUM_)
#undef KV_ERR_ENUM_
    KV_ERR_COUNT_
} kv_err_t;

/* "RESOURCE_EXHAUSTED"; "UNKNOWN" for a code outside the table. Static strings. */
const char *kv_err_name(int code);
/* The default human message of a code. Static string. */
const char *kv_err_msg(int code);
/* 1 when code is in the table. */
int kv_err_valid(int code);

#endif /* KV_ERR_H */
