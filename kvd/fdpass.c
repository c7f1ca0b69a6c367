/* fdpass.c — see fdpass.h. */
#include "fdpass.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

int kvd_fdpass_listen(const char *path, char *err, size_t errlen)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) {
        snprintf(err, errlen, "fd socket path '%s' longer than %zu bytes", path,
                 sizeof sa.sun_path - 1);
        return -1;
    }
    strcpy(sa.sun_path, path);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s < 0) {
        snprintf(err, errlen, "socket(AF_UNIX) failed: %s", strerror(errno));
        return -1;
    }
    unlink(path);
    mode_t old = umask(0177);
    int r = bind(s, (struct sockaddr *)&sa, sizeof sa);
    umask(old);
    if (r != 0 || listen(s, 64) != 0) {
        snprintf(err, errlen, "bind/listen(%s) failed: %s", path, strerror(errno));
        close(s);
        return -1;
    }
    return s;
}

int kvd_fdpass_peer(int fd, uint32_t *uid, uint32_t *gid, int32_t *pid)
{
    struct ucred cr;
    socklen_t len = sizeof cr;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0)
        return -1;
    *uid = cr.uid;
    *gid = cr.gid;
    *pid = cr.pid;
    return 0;
}

int kvd_fdpass_send(int fd, uint64_t session, const int *fds, int n)
{
    if (n < 0 || n > 8) {
        errno = EINVAL;
        return -1;
    }
    uint8_t hdr[16];
    memcpy(hdr, KVD_FDPASS_MAGIC, 8);
    for (int i = 0; i < 8; i++)
        hdr[8 + i] = (uint8_t)(session >> (8 * i));
    union {
        char buf[CMSG_SPACE(sizeof(int) * 8)];
        struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u);
    struct iovec iov = {.iov_base = hdr, .iov_len = sizeof hdr};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (n > 0) {
        mh.msg_control = u.buf;
        mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)n);
    }
    ssize_t r;
    do
        r = sendmsg(fd, &mh, MSG_NOSIGNAL);
    while (r < 0 && errno == EINTR);
    return r == (ssize_t)sizeof hdr ? 0 : -1;
}
