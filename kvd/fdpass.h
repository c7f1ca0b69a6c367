/* fdpass.h — the Unix socket beside the ZeroMQ one that hands pool fds over SCM_RIGHTS.
 *
 * Protocol (docs/protocol.md, "Fd handover"): the client connects after a successful hello;
 * the daemon reads nothing, takes the peer's SO_PEERCRED, requires its uid/gid to be admitted
 * and its pid to own a live session, then sends ONE message: 16 bytes ("KVDFDS01" + session id
 * as little-endian u64) with the fds attached, in PoolDesc.fd_index order, and closes. Anything
 * else gets the connection closed with nothing sent. Reading nothing means a slow or hostile
 * peer can never stall the loop; it also means the session named is the first of the peer's
 * pid that the server finds, which libkvc accepts (the fds are the same for every session).
 */
#ifndef KVD_FDPASS_H
#define KVD_FDPASS_H

#include <stdint.h>
#include <sys/types.h>

#define KVD_FDPASS_MAGIC "KVDFDS01"

/* Create, bind (unlinking a stale file) and listen; socket file mode 0600. Returns the
 * non-blocking listening fd or -1 with err filled. */
int kvd_fdpass_listen(const char *path, char *err, size_t errlen);
/* Credentials of a connected Unix socket. 0 on success. */
int kvd_fdpass_peer(int fd, uint32_t *uid, uint32_t *gid, int32_t *pid);
/* Send the header and n fds (n ≤ 8). 0 on success, -1 with errno. */
int kvd_fdpass_send(int fd, uint64_t session, const int *fds, int n);

#endif /* KVD_FDPASS_H */
