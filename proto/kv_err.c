/* kv_err.c — names and messages of the error vocabulary, generated from KV_ERR_MAP. */
#include "kv_err.h"

#include <stddef.h>

const char *kv_err_name(int code)
{
    switch (code) {
#define KV_ERR_NAME_(name, c, msg)                                                                 \
    case c:                                                                                        \
        return #name;
        KV_ERR_MAP(KV_ERR_NAME_)
#undef KV_ERR_NAME_
    }
    return "UNKNOWN";
}

const char *kv_err_msg(int code)
{
    switch (code) {
#define KV_ERR_MSG_(name, c, msg)                                                                  \
    case c:                                                                                        \
        return msg;
        KV_ERR_MAP(KV_ERR_MSG_)
#undef KV_ERR_MSG_
    }
    return "unknown error code";
}

int kv_err_valid(int code)
{
    return code >= 0 && code < KV_ERR_COUNT_;
}
