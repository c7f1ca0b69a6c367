/* test_err.c — the error vocabulary and the protocol's Status enum are one table.
 *
 * proto/kv_err.h (KV_ERR_MAP) is the source; proto/kvd.proto mirrors it by hand because
 * protoc cannot include a C macro. These tests fail the moment the two drift: every code has
 * the same number and the same name on both sides, and neither side has extra values.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "kv_err.h"
#include "kvd.pb-c.h"

static void test_err_codes_match_proto(void **state)
{
    (void)state;
    const ProtobufCEnumDescriptor *d = &kvd__status__descriptor;
    assert_int_equal(d->n_values, KV_ERR_COUNT_);
#define CHECK_(nm_, code_, msg_)                                                                    \
    do {                                                                                           \
        const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(d, code_);              \
        assert_non_null(v);                                                                        \
        assert_string_equal(v->name, #nm_);                                                       \
        assert_int_equal(v->value, KV_ERR_##nm_);                                                 \
        assert_int_equal((int)KVD__STATUS__##nm_, code_);                                          \
    } while (0);
    KV_ERR_MAP(CHECK_)
#undef CHECK_
}

static void test_err_names_from_proto(void **state)
{
    (void)state;
    const ProtobufCEnumDescriptor *d = &kvd__status__descriptor;
    for (unsigned i = 0; i < d->n_values; i++) {
        assert_true(kv_err_valid(d->values[i].value));
        assert_string_equal(kv_err_name(d->values[i].value), d->values[i].name);
        assert_non_null(protobuf_c_enum_descriptor_get_value_by_name(d, d->values[i].name));
    }
}

static void test_err_unknown_codes(void **state)
{
    (void)state;
    assert_string_equal(kv_err_name(-1), "UNKNOWN");
    assert_string_equal(kv_err_name(KV_ERR_COUNT_), "UNKNOWN");
    assert_false(kv_err_valid(KV_ERR_COUNT_));
    assert_false(kv_err_valid(-3));
    assert_string_equal(kv_err_msg(9999), "unknown error code");
    assert_string_equal(kv_err_name(KV_ERR_RESOURCE_EXHAUSTED), "RESOURCE_EXHAUSTED");
    assert_true(strlen(kv_err_msg(KV_ERR_RESOURCE_EXHAUSTED)) > 10);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_err_codes_match_proto),
        cmocka_unit_test(test_err_names_from_proto),
        cmocka_unit_test(test_err_unknown_codes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
