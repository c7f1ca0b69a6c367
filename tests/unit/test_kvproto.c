/* test_kvproto.c — the request gate (proto/kvproto.c): every kind of bad input maps to the
 * documented code, good input passes, and the request id survives failures that happen after
 * decoding so the daemon can still address its error reply. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvproto.h"

static size_t pack(const Kvd__Request *r, uint8_t *buf)
{
    return kvd__request__pack(r, buf);
}

static kv_err_t decode(const uint8_t *b, size_t n, const kvp_limits_t *lim, uint64_t *id,
                       kvp_op_t *op, char *msg)
{
    Kvd__Request *r = NULL;
    kv_err_t e = kvp_request_decode(b, n, lim, &r, op, id, msg, 256);
    if (e == KV_ERR_OK)
        assert_non_null(r);
    else
        assert_null(r);
    kvp_request_free(&r);
    assert_null(r);
    return e;
}

static void test_kvproto_alloc_ok_and_bounds(void **state)
{
    (void)state;
    kvp_limits_t lim;
    kvp_limits_default(&lim);
    lim.max_alloc = 7;
    uint8_t buf[256];
    char msg[256];
    uint64_t id;
    kvp_op_t op;
    Kvd__Request r = KVD__REQUEST__INIT;
    Kvd__AllocReq a = KVD__ALLOC_REQ__INIT;
    r.version = KVP_VERSION;
    r.id = 77;
    r.body_case = KVD__REQUEST__BODY_ALLOC;
    r.alloc = &a;
    a.count = 7;
    assert_int_equal(decode(buf, pack(&r, buf), &lim, &id, &op, msg), KV_ERR_OK);
    assert_int_equal(op, KVP_OP_ALLOC);
    assert_int_equal(id, 77);
    a.count = 8;
    assert_int_equal(decode(buf, pack(&r, buf), &lim, &id, &op, msg), KV_ERR_INVALID_ARGUMENT);
    assert_int_equal(id, 77);
    assert_non_null(strstr(msg, "count 8"));
    a.count = 0;
    assert_int_equal(decode(buf, pack(&r, buf), &lim, &id, &op, msg), KV_ERR_INVALID_ARGUMENT);
    a.count = 1;
    a.format = (Kvd__Format)5;
    assert_int_equal(decode(buf, pack(&r, buf), &lim, &id, &op, msg), KV_ERR_INVALID_ARGUMENT);
    /* reserve: 0 (none), or count .. KVP_MAX_RESERVE, whatever max_alloc says */
    a.format = KVD__FORMAT__FORMAT_FP8;
    a.count = 4;
    const uint32_t ok[] = {0, 4, 5, 1000000, KVP_MAX_RESERVE};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        a.reserve = ok[i];
        assert_int_equal(decode(buf, pack(&r, buf), &lim, &id, &op, msg), KV_ERR_OK);
    }
    const uint32_t bad[] = {1, 3, KVP_MAX_RESERVE + 1, UINT32_MAX};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        a.reserve = bad[i];
        assert_int_equal(decode(buf, pack(&r, buf), &lim, &id, &op, msg),
                         KV_ERR_INVALID_ARGUMENT);
        assert_non_null(strstr(msg, "alloc: reserve"));
    }
}

/* session_fence (an admin call): any session id but 0 passes the gate */
static void test_kvproto_session_fence(void **state)
{
    (void)state;
    uint8_t buf[64];
    char msg[256];
    uint64_t id;
    kvp_op_t op;
    Kvd__Request r = KVD__REQUEST__INIT;
    Kvd__SessionFenceReq f = KVD__SESSION_FENCE_REQ__INIT;
    r.version = KVP_VERSION;
    r.id = 5;
    r.body_case = KVD__REQUEST__BODY_SESSION_FENCE;
    r.session_fence = &f;
    f.session_id = 12;
    assert_int_equal(decode(buf, pack(&r, buf), NULL, &id, &op, msg), KV_ERR_OK);
    assert_int_equal(op, KVP_OP_SESSION_FENCE);
    assert_false(kvp_op_needs_session(op));
    f.session_id = 0;
    assert_int_equal(decode(buf, pack(&r, buf), NULL, &id, &op, msg), KV_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(msg, "session_id 0"));
}

static void test_kvproto_version_and_body(void **state)
{
    (void)state;
    uint8_t buf[256];
    char msg[256];
    uint64_t id;
    kvp_op_t op;
    Kvd__Request r = KVD__REQUEST__INIT;
    Kvd__StatusReq s = KVD__STATUS_REQ__INIT;
    r.version = KVP_VERSION + 1;
    r.id = 5;
    r.body_case = KVD__REQUEST__BODY_STATUS;
    r.status = &s;
    assert_int_equal(decode(buf, pack(&r, buf), NULL, &id, &op, msg), KV_ERR_VERSION_MISMATCH);
    assert_int_equal(id, 5);
    r.version = KVP_VERSION;
    r.body_case = KVD__REQUEST__BODY__NOT_SET;
    r.status = NULL;
    assert_int_equal(decode(buf, pack(&r, buf), NULL, &id, &op, msg), KV_ERR_MALFORMED);
}

static void test_kvproto_seal_tokens_and_ids(void **state)
{
    (void)state;
    kvp_limits_t lim;
    kvp_limits_default(&lim);
    lim.page_tokens = 13; /* awkward size */
    lim.dir_entries = 100;
    uint8_t buf[1024];
    char msg[256];
    uint64_t id;
    kvp_op_t op;
    uint32_t toks[14] = {0};
    Kvd__Request r = KVD__REQUEST__INIT;
    Kvd__SealReq s = KVD__SEAL_REQ__INIT;
    r.version = KVP_VERSION;
    r.body_case = KVD__REQUEST__BODY_SEAL;
    r.seal = &s;
    s.page = 99;
    s.tokens = toks;
    s.n_tokens = 13;
    assert_int_equal(decode(buf, pack(&r, buf), &lim, &id, &op, msg), KV_ERR_OK);
    s.n_tokens = 14;
    assert_int_equal(decode(buf, pack(&r, buf), &lim, &id, &op, msg), KV_ERR_INVALID_ARGUMENT);
    s.n_tokens = 13;
    s.page = 100;
    assert_int_equal(decode(buf, pack(&r, buf), &lim, &id, &op, msg), KV_ERR_INVALID_ARGUMENT);
    s.page = 3;
    s.has_prev = 1;
    s.prev = 3;
    assert_int_equal(decode(buf, pack(&r, buf), &lim, &id, &op, msg), KV_ERR_INVALID_ARGUMENT);
    s.prev = 4000000000u;
    assert_int_equal(decode(buf, pack(&r, buf), &lim, &id, &op, msg), KV_ERR_INVALID_ARGUMENT);
}

static void test_kvproto_garbage(void **state)
{
    (void)state;
    char msg[256];
    uint64_t id;
    kvp_op_t op;
    assert_int_equal(decode(NULL, 0, NULL, &id, &op, msg), KV_ERR_MALFORMED);
    /* truncated varint, group wire type, length past the end */
    const uint8_t t1[] = {0x08, 0xff};
    const uint8_t t2[] = {0x0b, 0x00};
    const uint8_t t3[] = {0x5a, 0x7f, 0x01};
    const uint8_t t4[] = {0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f};
    assert_int_equal(decode(t1, sizeof t1, NULL, &id, &op, msg), KV_ERR_MALFORMED);
    assert_int_equal(decode(t2, sizeof t2, NULL, &id, &op, msg), KV_ERR_MALFORMED);
    assert_int_equal(decode(t3, sizeof t3, NULL, &id, &op, msg), KV_ERR_MALFORMED);
    assert_int_equal(decode(t4, sizeof t4, NULL, &id, &op, msg), KV_ERR_MALFORMED);
    /* random bytes: whatever the verdict, never OK without a body, never a crash */
    uint8_t rnd[97];
    srand(12345);
    for (int it = 0; it < 2000; it++) {
        size_t n = (size_t)(rand() % (int)sizeof rnd) + 1;
        for (size_t i = 0; i < n; i++)
            rnd[i] = (uint8_t)rand();
        kv_err_t e = decode(rnd, n, NULL, &id, &op, msg);
        assert_true(kv_err_valid(e));
        if (e != KV_ERR_OK)
            assert_true(strlen(msg) > 0);
    }
    kvp_limits_t lim;
    kvp_limits_default(&lim);
    lim.max_msg_bytes = 4;
    const uint8_t ok5[] = {0x08, 0x01, 0x10, 0x01, 0x00};
    assert_int_equal(decode(ok5, sizeof ok5, &lim, &id, &op, msg), KV_ERR_MALFORMED);
}

/* Strings reach operators (kvctl sessions, log lines) and replies: the gate names the field
 * and refuses, besides length, control characters and bytes that are not UTF-8. Before
 * session 12 a client_name with a newline or invalid UTF-8 passed (a forged log line; a
 * SessionsRep that proto3 decoders of other languages refuse), and the message of a long
 * string did not say which one. */
static void test_kvproto_strings(void **state)
{
    (void)state;
    uint8_t buf[1024];
    char msg[256];
    uint64_t id;
    kvp_op_t op;
    Kvd__Request r = KVD__REQUEST__INIT;
    Kvd__HelloReq h = KVD__HELLO_REQ__INIT;
    r.version = KVP_VERSION;
    r.body_case = KVD__REQUEST__BODY_HELLO;
    r.hello = &h;
    static const char *good[] = {"", "engine-7 (tp=2)", "caf\xc3\xa9", "\xe2\x82\xac 100",
                                 "\xf0\x9f\x98\x80", "\xf4\x8f\xbf\xbf"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        h.client_name = (char *)good[i];
        assert_int_equal(decode(buf, pack(&r, buf), NULL, &id, &op, msg), KV_ERR_OK);
    }
    static const struct {
        const char *s, *why;
    } bad[] = {
        {"a\nkvd: forged log line", "hello.client_name: a control character at byte 1"},
        {"\x1b[2J", "hello.client_name: a control character at byte 0"},
        {"x\x7f", "hello.client_name: a control character at byte 1"},
        {"\xc2\x85", "hello.client_name: a control character at byte 0"}, /* C1 NEL */
        {"ab\xff", "hello.client_name: not UTF-8 at byte 2"},
        {"\xc3", "hello.client_name: not UTF-8 at byte 0"},            /* truncated */
        {"\xc0\xaf", "hello.client_name: not UTF-8 at byte 0"},        /* overlong '/' */
        {"\xed\xa0\x80", "hello.client_name: not UTF-8 at byte 0"},    /* surrogate */
        {"\xf4\x90\x80\x80", "hello.client_name: not UTF-8 at byte 0"}, /* > U+10FFFF */
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        h.client_name = (char *)bad[i].s;
        assert_int_equal(decode(buf, pack(&r, buf), NULL, &id, &op, msg),
                         KV_ERR_INVALID_ARGUMENT);
        assert_string_equal(msg, bad[i].why);
    }
    char big[KVP_MAX_STRING + 2];
    memset(big, 'n', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    h.client_name = "ok";
    h.namespace_ = big;
    assert_int_equal(decode(buf, pack(&r, buf), NULL, &id, &op, msg), KV_ERR_INVALID_ARGUMENT);
    assert_string_equal(msg, "hello.namespace: 257 bytes, max 256");
    /* the other string fields go through the same check */
    Kvd__Request q = KVD__REQUEST__INIT;
    Kvd__ConfigSetReq cs = KVD__CONFIG_SET_REQ__INIT;
    q.version = KVP_VERSION;
    q.body_case = KVD__REQUEST__BODY_CONFIG_SET;
    q.config_set = &cs;
    cs.key = "log_level";
    cs.value = "debug\r";
    assert_int_equal(decode(buf, pack(&q, buf), NULL, &id, &op, msg), KV_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(msg, "config_set.value"));
    Kvd__SeqOpenReq so = KVD__SEQ_OPEN_REQ__INIT;
    q.body_case = KVD__REQUEST__BODY_SEQ_OPEN;
    q.seq_open = &so;
    so.tag = "req\t1";
    assert_int_equal(decode(buf, pack(&q, buf), NULL, &id, &op, msg), KV_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(msg, "seq_open.tag"));
}

static void test_kvproto_op_table(void **state)
{
    (void)state;
    assert_string_equal(kvp_op_name(KVP_OP_ALLOC), "alloc");
    assert_string_equal(kvp_op_name(KVP_OP_INVALID), "invalid");
    assert_int_equal(kvp_op_of_case(KVD__REQUEST__BODY_CHECK), KVP_OP_CHECK);
    assert_int_equal(kvp_op_of_case(12345), KVP_OP_INVALID);
    assert_true(kvp_op_needs_session(KVP_OP_SEAL));
    assert_false(kvp_op_needs_session(KVP_OP_HELLO));
    assert_true(kvp_op_is_admin(KVP_OP_DRAIN));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kvproto_alloc_ok_and_bounds),
        cmocka_unit_test(test_kvproto_session_fence),
        cmocka_unit_test(test_kvproto_version_and_body),
        cmocka_unit_test(test_kvproto_seal_tokens_and_ids),
        cmocka_unit_test(test_kvproto_garbage),
        cmocka_unit_test(test_kvproto_strings),
        cmocka_unit_test(test_kvproto_op_table),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
