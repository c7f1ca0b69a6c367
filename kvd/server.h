/* server.h — the daemon's I/O side: libuv loop, ZeroMQ ROUTER, ZAP, fd socket, sessions,
 * timers, metrics. It decodes a request (proto/kvproto.h), calls one kvdcore function
 * (core.h), encodes the reply; nothing about pages is decided here.
 *
 * Loop handles (one thread, the loop thread, owns everything):
 *   router poll   ZMQ_FD of the ROUTER; edge-triggered, so every callback drains until
 *                 ZMQ_EVENTS has no POLLIN. Every reply is sent inside that drain, and the
 *                 drain re-reads ZMQ_EVENTS after each send, so a send that consumes the
 *                 edge cannot leave a readable socket unserved.
 *   zap poll      the ZAP handler (zap.h), same rule.
 *   fds poll      listening Unix socket for the SCM_RIGHTS handover (fdpass.h).
 *   pidfd polls   one per session: the ONLY place references are reclaimed (process exit).
 *   timers        epoch collection (epoch_ms), lease check (lease_ms / 4).
 *   http          optional Prometheus listener.
 *
 * Sessions: a hello opens one, bound to the connection's routing id and to the pid the kernel
 * reported for that connection (ZAP User-Id, from SO_PEERCRED). The socket closing changes
 * nothing; the pidfd becoming readable closes the session in the core.
 */
#ifndef KVD_SERVER_H
#define KVD_SERVER_H

#include <stddef.h>
#include <uv.h>

#include "config.h"

typedef struct kvd_server_s kvd_server_t;

/* Build the core, bind the sockets, start every handle on loop. cfg is borrowed and must
 * outlive the server (config set writes into it). Returns 0, or -1 with err filled. */
int kvd_server_init(kvd_server_t **out, uv_loop_t *loop, kvd_config_t *cfg, char *err,
                    size_t errlen);
/* Begin shutdown: stop every handle (uv_close). Run the loop until it returns, then free. */
void kvd_server_stop(kvd_server_t *s);
/* Free everything (sockets, core, sessions); *s = NULL. Call after the loop has run dry. */
void kvd_server_free(kvd_server_t **s);

#endif /* KVD_SERVER_H */
