/* zap.c — see zap.h. */
#include "zap.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "config.h"
#include "log.h"

int kvd_admit_init(kvd_admit_t *a, const char *uids, const char *gids)
{
    memset(a, 0, sizeof *a);
    a->nuids = kvd_config_ids(uids ? uids : "", a->uids, 64);
    a->ngids = kvd_config_ids(gids ? gids : "", a->gids, 64);
    if (a->nuids < 0 || a->ngids < 0 || a->nuids > 64 || a->ngids > 64)
        return -1;
    if (a->nuids == 0 && a->ngids == 0) {
        a->uids[0] = (uint32_t)getuid();
        a->nuids = 1;
    }
    return 0;
}

int kvd_admit_ok(const kvd_admit_t *a, uint32_t uid, uint32_t gid)
{
    for (int i = 0; i < a->nuids; i++)
        if (a->uids[i] == uid)
            return 1;
    for (int i = 0; i < a->ngids; i++)
        if (a->gids[i] == gid)
            return 1;
    return 0;
}

int kvd_peer_parse(const char *s, uint32_t *uid, uint32_t *gid, int32_t *pid)
{
    if (!s)
        return -1;
    const char *p3 = strrchr(s, ':');
    if (!p3 || p3 == s)
        return -1;
    const char *p2 = p3 - 1;
    while (p2 > s && *p2 != ':')
        p2--;
    if (*p2 != ':' || p2 == s)
        return -1;
    const char *p1 = p2 - 1;
    while (p1 > s && *p1 != ':')
        p1--;
    const char *u = *p1 == ':' ? p1 + 1 : p1;
    char *end;
    unsigned long long vu = strtoull(u, &end, 10);
    if (end != p2)
        return -1;
    unsigned long long vg = strtoull(p2 + 1, &end, 10);
    if (end != p3)
        return -1;
    unsigned long long vp = strtoull(p3 + 1, &end, 10);
    if (*end || vu > UINT32_MAX || vg > UINT32_MAX || vp == 0 || vp > INT32_MAX)
        return -1;
    *uid = (uint32_t)vu;
    *gid = (uint32_t)vg;
    *pid = (int32_t)vp;
    return 0;
}

/* One ZAP request: version, request id, domain, address, identity, mechanism, credentials… */
static void kvd_zap_handle(kvd_zap_t *z)
{
    char f[6][256];
    int nf = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, z->sock, 0) < 0) {
            zmq_msg_close(&m);
            return;
        }
        if (nf < 6) {
            size_t n = zmq_msg_size(&m);
            if (n > 255)
                n = 255;
            memcpy(f[nf], zmq_msg_data(&m), n);
            f[nf][n] = '\0';
            nf++;
        }
        more = zmq_msg_more(&m);
        zmq_msg_close(&m);
    }
    const char *status = "400", *text = "malformed ZAP request";
    char user[64] = "";
    uint32_t uid = 0, gid = 0;
    int32_t pid = 0;
    if (nf >= 4 && strcmp(f[0], "1.0") == 0) {
        if (kvd_peer_parse(f[3], &uid, &gid, &pid) != 0) {
            text = "no peer credentials (only the ipc transport is supported)";
        } else if (!kvd_admit_ok(z->admit, uid, gid)) {
            text = "uid/gid not admitted";
            KVD_LOGW("zap: refused peer uid %u gid %u pid %d (not in admit_uids/admit_gids)", uid,
                     gid, (int)pid);
        } else {
            status = "200";
            text = "OK";
            snprintf(user, sizeof user, "%u:%u:%d", uid, gid, (int)pid);
        }
    }
    if (status[0] == '2')
        z->admitted++;
    else
        z->refused++;
    zmq_send(z->sock, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(z->sock, nf > 1 ? f[1] : "", nf > 1 ? strlen(f[1]) : 0, ZMQ_SNDMORE);
    zmq_send(z->sock, status, 3, ZMQ_SNDMORE);
    zmq_send(z->sock, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(z->sock, user, strlen(user), ZMQ_SNDMORE);
    zmq_send(z->sock, "", 0, 0);
}

/* ZMQ_FD is edge-triggered: drain until ZMQ_EVENTS has no POLLIN. */
static void kvd_zap_cb(uv_poll_t *h, int status, int events)
{
    kvd_zap_t *z = h->data;
    for (;;) {
        int ev = 0;
        size_t sz = sizeof ev;
        if (zmq_getsockopt(z->sock, ZMQ_EVENTS, &ev, &sz) != 0 || !(ev & ZMQ_POLLIN))
            break;
        kvd_zap_handle(z);
    }
}

int kvd_zap_start(kvd_zap_t *z, void *zctx, uv_loop_t *loop, const kvd_admit_t *admit,
                  char *err, size_t errlen)
{
    memset(z, 0, sizeof *z);
    z->admit = admit;
    z->sock = zmq_socket(zctx, ZMQ_REP);
    int linger = 0;
    if (!z->sock) {
        snprintf(err, errlen, "zmq_socket(REP) failed: %s", zmq_strerror(errno));
        return -1;
    }
    zmq_setsockopt(z->sock, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_bind(z->sock, "inproc://zeromq.zap.01") != 0) {
        snprintf(err, errlen, "zmq_bind(inproc://zeromq.zap.01) failed: %s", zmq_strerror(errno));
        zmq_close(z->sock);
        z->sock = NULL;
        return -1;
    }
    int fd;
    size_t sz = sizeof fd;
    zmq_getsockopt(z->sock, ZMQ_FD, &fd, &sz);
    uv_poll_init(loop, &z->poll, fd);
    z->poll.data = z;
    uv_poll_start(&z->poll, UV_READABLE, kvd_zap_cb);
    return 0;
}

void kvd_zap_stop(kvd_zap_t *z)
{
    if (z->sock && !uv_is_closing((uv_handle_t *)&z->poll))
        uv_close((uv_handle_t *)&z->poll, NULL);
}

void kvd_zap_free(kvd_zap_t *z)
{
    if (z->sock)
        zmq_close(z->sock);
    z->sock = NULL;
}
