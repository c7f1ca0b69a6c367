/* fuzz_request.c — libFuzzer target over the request gate (proto/kvproto.c): wire scan,
 * protobuf-c unpack, version and per-operation validation, exactly what the daemon runs on
 * every untrusted message. Built only with clang and -DKVD_FUZZ=ON (tests/fuzz/CMakeLists.txt);
 * .ci/fuzz runs it for about a minute under ASan+UBSan from the seed corpus in corpus/.
 *
 * Properties checked beyond "no crash, no sanitizer report":
 *   - the verdict is a code of the error vocabulary,
 *   - a failure always comes with a message, and never with a decoded request,
 *   - an accepted request re-packs and decodes again to the same verdict (round trip),
 *   - the client's reply parser (kvd__reply__unpack, used by libkvc) survives the same bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvproto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvp_limits_t lim;
    kvp_limits_default(&lim);
    lim.max_msg_bytes = 1u << 20;
    lim.page_tokens = 16;
    lim.dir_entries = 4096;
    lim.max_alloc = 1024;
    lim.max_tokens = 65536;
    lim.max_pages = 4096;
    Kvd__Request *r = NULL;
    kvp_op_t op;
    uint64_t id;
    char msg[512];
    kv_err_t e = kvp_request_decode(data, size, &lim, &r, &op, &id, msg, sizeof msg);
    if (!kv_err_valid((int)e))
        abort();
    if (e != KV_ERR_OK) {
        if (r || msg[0] == '\0')
            abort();
    } else {
        if (!r || op >= KVP_OP_COUNT)
            abort();
        size_t n = kvd__request__get_packed_size(r);
        uint8_t *buf = malloc(n ? n : 1);
        if (!buf)
            abort();
        if (kvd__request__pack(r, buf) != n)
            abort();
        Kvd__Request *r2 = NULL;
        kvp_op_t op2;
        uint64_t id2;
        if (kvp_request_decode(buf, n, &lim, &r2, &op2, &id2, msg, sizeof msg) != KV_ERR_OK ||
            op2 != op || id2 != id)
            abort();
        kvp_request_free(&r2);
        free(buf);
    }
    kvp_request_free(&r);
    if (kvp_wire_scan(&kvd__reply__descriptor, data, size, 0) == 0) {
        Kvd__Reply *rep = kvd__reply__unpack(NULL, size, data);
        if (rep)
            kvd__reply__free_unpacked(rep, NULL);
    }
    return 0;
}
