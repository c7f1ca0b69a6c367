/* test_kvc.c — libkvc helpers that need no daemon (the rest of libkvc is tested against a real
 * kvd in tests/integration).
 *
 * kvc_json_chars writes the free-text fields of kvctl --json and kvbench's JSON: its output
 * must stay a valid JSON string body, valid UTF-8, whatever the text holds (error messages
 * carry "→", user-supplied paths, and are cut by "%.Ns" precisions).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvc.h"

/* kvc_json_chars(s, max) into a string the caller frees */
static char *json_of(const char *s, size_t max)
{
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    assert_non_null(f);
    kvc_json_chars(f, s, max);
    assert_int_equal(fclose(f), 0);
    return buf;
}

static void expect(const char *s, size_t max, const char *want)
{
    char *got = json_of(s, max);
    assert_string_equal(got, want);
    free(got);
}

static void test_json_chars_escapes(void **state)
{
    (void)state;
    expect("plain text", SIZE_MAX, "plain text");
    expect("say \"hi\" \\ there", SIZE_MAX, "say \\\"hi\\\" \\\\ there");
    expect("tab\there\nnl", SIZE_MAX, "tab\\u0009here\\u000anl");
    expect(NULL, SIZE_MAX, "");
    expect("abcdef", 3, "abc"); /* max bounds the bytes read: no NUL needed past them */
}

static void test_json_chars_whole_utf8_only(void **state)
{
    (void)state;
    const char *arrow = "a\xe2\x86\x92" "b";                  /* a→b */
    expect(arrow, SIZE_MAX, arrow);                           /* whole sequences stay */
    expect(arrow, 3, "a");                                    /* cut by max inside → */
    expect("x\xe2\x86", SIZE_MAX, "x");                       /* cut by a %.Ns before NUL */
    expect("x\xff\x80y\xc0\xafz", SIZE_MAX, "xyz");           /* stray and overlong bytes */
    expect("\xf0\x9f\x99\x82!", SIZE_MAX, "\xf0\x9f\x99\x82!"); /* four bytes */
    expect("\xe2\x86\"", SIZE_MAX, "\\\"");                   /* a quote ends the sequence */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_chars_escapes),
        cmocka_unit_test(test_json_chars_whole_utf8_only),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
