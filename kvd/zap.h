/* zap.h — admission of peers: the ZAP handler (RFC 27) and the rule it shares with the fd
 * socket.
 *
 * libzmq asks inproc://zeromq.zap.01 about every new connection to a socket that has a
 * ZAP domain. On the ipc transport the request's Address frame is "<host>:uid:gid:pid" built
 * by libzmq from SO_PEERCRED (checked: libzmq 4.3.4, src/stream_engine_base.cpp), i.e. the
 * kernel's word, not the peer's. We admit when uid ∈ admit_uids or gid ∈ admit_gids (empty
 * admit_uids: the daemon's own uid) and answer User-Id = "uid:gid:pid", which libzmq then
 * attaches to every message of that connection (zmq_msg_gets(msg, "User-Id")): that is how the
 * server learns a request's pid for pidfd_open without trusting the client.
 *
 * The handler's REP socket is served by the daemon's libuv loop through its ZMQ_FD, like the
 * ROUTER: libzmq's I/O thread sends the request asynchronously, so answering from the loop
 * thread cannot deadlock.
 */
#ifndef KVD_ZAP_H
#define KVD_ZAP_H

#include <stdint.h>
#include <uv.h>

typedef struct kvd_admit_s {
    uint32_t uids[64];
    int nuids;
    uint32_t gids[64];
    int ngids;
} kvd_admit_t;

/* Build the rule from the config strings (IDS syntax). -1 on a bad list. */
int kvd_admit_init(kvd_admit_t *a, const char *uids, const char *gids);
int kvd_admit_ok(const kvd_admit_t *a, uint32_t uid, uint32_t gid);
/* Parse "...:uid:gid:pid" (the last three fields). 0 on success. */
int kvd_peer_parse(const char *s, uint32_t *uid, uint32_t *gid, int32_t *pid);

typedef struct kvd_zap_s {
    void *sock;
    uv_poll_t poll;
    const kvd_admit_t *admit;
    uint64_t admitted, refused;
} kvd_zap_t;

/* Bind the handler on zctx and start serving it from loop. admit is borrowed. */
int kvd_zap_start(kvd_zap_t *z, void *zctx, uv_loop_t *loop, const kvd_admit_t *admit,
                  char *err, size_t errlen);
/* Stop polling (uv_close); call zmq_close via kvd_zap_free after the loop ran the close. */
void kvd_zap_stop(kvd_zap_t *z);
void kvd_zap_free(kvd_zap_t *z);

#endif /* KVD_ZAP_H */
