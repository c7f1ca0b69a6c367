/* snap_fuzz.h — the namespace both fuzz_snapshot.c and gen_snapshot_corpus.c use, so that the
 * generated seeds pass the identity checks and the fuzzer starts from valid files: a tiny
 * geometry (1 layer, 1 KV head, head_dim 64, 1 token per page: pages of a few hundred bytes),
 * 6 FP8 and 3 TQ3 pages, a fixed salt and namespace. */
#ifndef SNAP_FUZZ_H
#define SNAP_FUZZ_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "snapshot.h"

static kvd_core_t *snap_fuzz_core(kvd_snap_ident_t *id)
{
    kv_geom_t g = {.layers = 1, .kv_heads = 1, .head_dim = 64, .page_tokens = 1, .seed = 3};
    kvd_core_opts_t o;
    kvd_core_opts_default(&o, &g, 6, 3);
    for (int i = 0; i < KVD_HASH_KEY_BYTES; i++)
        o.hash_key[i] = (uint8_t)(0xA5 ^ i);
    char err[256];
    kvd_core_t *c = NULL;
    if (kvd_core_init(&c, &o, err, sizeof(err)) != KV_ERR_OK) {
        fprintf(stderr, "snap_fuzz_core: %s\n", err);
        abort();
    }
    kvd_snap_ident(id, c, "fuzz", o.hash_key);
    return c;
}

#endif /* SNAP_FUZZ_H */
