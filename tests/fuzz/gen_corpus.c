/* gen_corpus.c — writes the seed corpus (one valid request per operation, plus edge cases)
 * into the directory given as argv[1]. Not built by default; regenerate with:
 *   cc -Iproto -Ibuild/proto/gen tests/fuzz/gen_corpus.c build/proto/libkvproto.a \
 *      -lprotobuf-c -o /tmp/gen && /tmp/gen tests/fuzz/corpus                           */
#include <stdio.h>
#include <string.h>

#include "kvproto.h"

static void emit(const char *dir, const char *name, Kvd__Request *r)
{
    uint8_t buf[8192];
    r->version = KVP_VERSION;
    r->id = 42;
    size_t n = kvd__request__pack(r, buf);
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(buf, 1, n, f);
        fclose(f);
    }
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : ".";
    uint32_t tok[64], pages[4] = {1, 2, 3, 4};
    for (int i = 0; i < 64; i++)
        tok[i] = (uint32_t)(i * 31 + 7);
    Kvd__Request r = KVD__REQUEST__INIT;
    Kvd__HelloReq h = KVD__HELLO_REQ__INIT;
    Kvd__Geometry g = KVD__GEOMETRY__INIT;
    g.layers = 2, g.kv_heads = 2, g.head_dim = 64, g.page_tokens = 16, g.seed = 1;
    h.namespace_ = "default", h.client_name = "seed", h.pid = 1, h.geometry = &g;
    r.body_case = KVD__REQUEST__BODY_HELLO, r.hello = &h;
    emit(dir, "hello", &r);
    Kvd__AllocReq a = KVD__ALLOC_REQ__INIT;
    a.count = 4;
    r.body_case = KVD__REQUEST__BODY_ALLOC, r.alloc = &a;
    emit(dir, "alloc", &r);
    a.reserve = 3000; /* the first chunk of a larger allocation */
    emit(dir, "alloc_reserve", &r);
    Kvd__SealReq s = KVD__SEAL_REQ__INIT;
    uint8_t extra[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    s.page = 3, s.has_prev = 1, s.prev = 2, s.tokens = tok, s.n_tokens = 16;
    s.extra.data = extra, s.extra.len = sizeof extra;
    r.body_case = KVD__REQUEST__BODY_SEAL, r.seal = &s;
    emit(dir, "seal", &r);
    Kvd__LookupReq l = KVD__LOOKUP_REQ__INIT;
    l.tokens.data = (uint8_t *)tok, l.tokens.len = sizeof tok;
    r.body_case = KVD__REQUEST__BODY_LOOKUP, r.lookup = &l;
    emit(dir, "lookup", &r);
    Kvd__ReleaseReq rl = KVD__RELEASE_REQ__INIT;
    rl.pages = pages, rl.n_pages = 4;
    r.body_case = KVD__REQUEST__BODY_RELEASE, r.release = &rl;
    emit(dir, "release", &r);
    Kvd__SeqAppendReq sa = KVD__SEQ_APPEND_REQ__INIT;
    sa.seq_id = 5, sa.pages = pages, sa.n_pages = 4;
    r.body_case = KVD__REQUEST__BODY_SEQ_APPEND, r.seq_append = &sa;
    emit(dir, "seq_append", &r);
    Kvd__HeartbeatReq hb = KVD__HEARTBEAT_REQ__INIT;
    hb.completed_epoch = 9;
    r.body_case = KVD__REQUEST__BODY_HEARTBEAT, r.heartbeat = &hb;
    emit(dir, "heartbeat", &r);
    Kvd__GoodbyeReq gb = KVD__GOODBYE_REQ__INIT;
    r.body_case = KVD__REQUEST__BODY_GOODBYE, r.goodbye = &gb;
    emit(dir, "goodbye", &r);
    Kvd__ConfigSetReq cs = KVD__CONFIG_SET_REQ__INIT;
    cs.key = "lease_ms", cs.value = "1000";
    r.body_case = KVD__REQUEST__BODY_CONFIG_SET, r.config_set = &cs;
    emit(dir, "config_set", &r);
    Kvd__CacheEvictReq ce = KVD__CACHE_EVICT_REQ__INIT;
    ce.all = 1;
    r.body_case = KVD__REQUEST__BODY_CACHE_EVICT, r.cache_evict = &ce;
    emit(dir, "cache_evict", &r);
    Kvd__StatusReq st = KVD__STATUS_REQ__INIT;
    r.body_case = KVD__REQUEST__BODY_STATUS, r.status = &st;
    emit(dir, "status", &r);
    return 0;
}
