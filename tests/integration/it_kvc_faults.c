/* it_kvc_faults.c — libkvc against a daemon that lies or stalls.
 *
 * No kvd here: a ZeroMQ ROUTER on a temporary ipc endpoint answers hello with a HelloRep the
 * test builds, and a Unix socket beside it plays the fd socket (real memfds over SCM_RIGHTS).
 * libkvc must refuse what would put a page or the directory outside its mapping, and must not
 * hang on the fd socket (session 10's review fixes in client/kvc.c, kvc_check_desc and
 * kvc_recv_fds):
 *   good       consistent descriptors: the hello maps (the fake itself is right);
 *   page_bytes a pool whose page size is not the geometry's: MALFORMED;
 *   short fd   a pool larger than its memfd: MALFORMED (not SIGBUS on first touch);
 *   two dirs   a second directory descriptor: MALFORMED;
 *   bad geom   head_dim 96: MALFORMED;
 *   silent     the fd socket accepts and sends nothing: TIMEOUT after the client's timeout;
 *   too many   nine fds for a client that takes eight: MALFORMED (MSG_CTRUNC).
 * Each failed hello leaves kvc_session_id() at 0.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "itest.h"

enum { GOOD, PAGE_BYTES, SHORT_FD, TWO_DIRS, BAD_GEOM, SILENT, TOO_MANY };

typedef struct fake_s {
    char dir[64], ep[96], fds_path[96];
    int mode;
    void *ctx, *router;
    int listen_fd;
    pthread_t zt, ft;
    kv_geom_t g;
    uint32_t pages;
} fake_t;

/* (runs in the fd socket's thread: no cmocka assert there) */
static int memfd_of(const char *name, size_t bytes)
{
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0)
        abort();
    return fd;
}

/* The ROUTER: answer one hello with the mode's HelloRep. */
static void *fake_router(void *arg)
{
    fake_t *f = arg;
    zmq_msg_t rid, pl;
    zmq_msg_init(&rid);
    zmq_msg_init(&pl);
    if (zmq_msg_recv(&rid, f->router, 0) < 0 || zmq_msg_recv(&pl, f->router, 0) < 0)
        return NULL;
    Kvd__Request *req = kvd__request__unpack(NULL, zmq_msg_size(&pl), zmq_msg_data(&pl));
    assert_non_null(req);
    Kvd__Geometry geo = KVD__GEOMETRY__INIT;
    geo.layers = f->g.layers;
    geo.kv_heads = f->g.kv_heads;
    geo.head_dim = f->mode == BAD_GEOM ? 96 : f->g.head_dim;
    geo.page_tokens = f->g.page_tokens;
    geo.seed = f->g.seed;
    const uint64_t pb = kv_page_bytes(&f->g, KV_FMT_FP8);
    Kvd__PoolDesc pool = KVD__POOL_DESC__INIT, dir = KVD__POOL_DESC__INIT,
                  dir2 = KVD__POOL_DESC__INIT;
    pool.kind = KVD__POOL_DESC__KIND__KIND_POOL;
    pool.format = KVD__FORMAT__FORMAT_FP8;
    pool.pages = f->pages;
    pool.page_bytes = f->mode == PAGE_BYTES ? pb / 2 : pb;
    pool.bytes = (uint64_t)f->pages * pb * (f->mode == SHORT_FD ? 2 : 1);
    pool.fd_index = 1;
    dir.kind = dir2.kind = KVD__POOL_DESC__KIND__KIND_DIRECTORY;
    dir.pages = dir2.pages = f->pages;
    dir.bytes = dir2.bytes = (uint64_t)f->pages * sizeof(kv_dir_entry_t);
    dir.fd_index = dir2.fd_index = 0;
    Kvd__PoolDesc *pools[3] = {&dir, &pool, &dir2};
    Kvd__HelloRep h = KVD__HELLO_REP__INIT;
    h.session_id = 7;
    h.geometry = &geo;
    h.pools = pools;
    h.n_pools = f->mode == TWO_DIRS ? 3 : 2;
    h.epoch = 1;
    h.fd_socket = f->fds_path;
    h.lease_ms = 10000;
    h.instance = 0x1234;
    h.pid = (uint32_t)getpid();
    h.backend = "host";
    Kvd__Reply rep = KVD__REPLY__INIT;
    rep.version = KVP_VERSION;
    rep.id = req->id;
    rep.status = KVD__STATUS__OK;
    rep.epoch = 1;
    rep.instance = 0x1234;
    rep.body_case = KVD__REPLY__BODY_HELLO;
    rep.hello = &h;
    uint8_t buf[1024];
    size_t n = kvd__reply__pack(&rep, buf);
    kvd__request__free_unpacked(req, NULL);
    zmq_msg_send(&rid, f->router, ZMQ_SNDMORE);
    zmq_send(f->router, buf, n, 0);
    zmq_msg_close(&pl);
    return NULL;
}

/* The fd socket: one peer, the mode's answer. Its own sendmsg rather than kvd/fdpass.c's
 * kvd_fdpass_send, which refuses more than 8 fds: the lie this test needs to tell. */
static void *fake_fds(void *arg)
{
    fake_t *f = arg;
    int s = accept4(f->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (s < 0)
        return NULL;
    if (f->mode == SILENT) { /* hold the connection past the client's timeout */
        usleep(1500 * 1000);
        close(s);
        return NULL;
    }
    const uint64_t pb = kv_page_bytes(&f->g, KV_FMT_FP8);
    int fds[9], n = f->mode == TOO_MANY ? 9 : 2;
    fds[0] = memfd_of("fake-dir", (size_t)f->pages * sizeof(kv_dir_entry_t));
    for (int i = 1; i < n; i++)
        fds[i] = memfd_of("fake-pool", (size_t)f->pages * pb);
    uint8_t hdr[16];
    memcpy(hdr, "KVDFDS01", 8);
    for (int i = 0; i < 8; i++)
        hdr[8 + i] = (uint8_t)((uint64_t)7 >> (8 * i)); /* session 7, little endian */
    union {
        char buf[CMSG_SPACE(sizeof(int) * 9)];
        struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u);
    struct iovec iov = {.iov_base = hdr, .iov_len = sizeof hdr};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                        .msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n)};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n);
    memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)n);
    sendmsg(s, &mh, MSG_NOSIGNAL); /* a peer that left must not raise SIGPIPE */
    for (int i = 0; i < n; i++)
        close(fds[i]);
    close(s);
    return NULL;
}

/* One hello of a fresh client against a fresh fake in `mode`; returns its status. */
static kv_err_t hello_against(int mode, char *msg, size_t cap)
{
    fake_t f;
    memset(&f, 0, sizeof f);
    f.mode = mode;
    f.g = (kv_geom_t){1, 1, 64, 16, 1};
    f.pages = 8;
    itest_tmpdir(f.dir, sizeof f.dir, "kvd-it-fake");
    snprintf(f.ep, sizeof f.ep, "ipc://%s/kvd.sock", f.dir);
    snprintf(f.fds_path, sizeof f.fds_path, "%s/kvd.sock.fds", f.dir);
    f.ctx = zmq_ctx_new();
    f.router = zmq_socket(f.ctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(f.router, ZMQ_LINGER, &linger, sizeof linger);
    assert_int_equal(zmq_bind(f.router, f.ep), 0);
    f.listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", f.fds_path);
    assert_int_equal(bind(f.listen_fd, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_int_equal(listen(f.listen_fd, 4), 0);
    assert_int_equal(pthread_create(&f.zt, NULL, fake_router, &f), 0);
    assert_int_equal(pthread_create(&f.ft, NULL, fake_fds, &f), 0);

    kvc_t *c = NULL;
    assert_int_equal(kvc_connect(&c, f.ep, 1000), KV_ERR_OK);
    kv_err_t e = kvc_hello(c, NULL, "fault", 1);
    snprintf(msg, cap, "%s", kvc_errmsg(c));
    if (e != KV_ERR_OK)
        assert_int_equal(kvc_session_id(c), 0);
    else
        assert_non_null(kvc_pool_base(c, KV_FMT_FP8));
    kvc_close(&c);
    pthread_join(f.zt, NULL);
    int wake = -1;
    if (mode == BAD_GEOM) { /* refused before the fd socket: wake the acceptor */
        wake = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        assert_int_equal(connect(wake, (struct sockaddr *)&sa, sizeof sa), 0);
    }
    pthread_join(f.ft, NULL);
    if (wake >= 0)
        close(wake);
    close(f.listen_fd);
    zmq_close(f.router);
    zmq_ctx_term(f.ctx);
    itest_rmtree(f.dir);
    return e;
}

static void expect(int mode, kv_err_t want, const char *what)
{
    char msg[512];
    kv_err_t e = hello_against(mode, msg, sizeof msg);
    if (e != want || (what && !strstr(msg, what)))
        fail_msg("mode %d: got %d (%s), want %d with \"%s\"", mode, (int)e, msg, (int)want,
                 what ? what : "");
}

static void test_kvc_faults(void **state)
{
    (void)state;
    expect(GOOD, KV_ERR_OK, NULL);
    expect(PAGE_BYTES, KV_ERR_MALFORMED, "the geometry says");
    expect(SHORT_FD, KV_ERR_MALFORMED, "its fd holds");
    expect(TWO_DIRS, KV_ERR_MALFORMED, "a second directory");
    expect(BAD_GEOM, KV_ERR_MALFORMED, "invalid geometry");
    expect(SILENT, KV_ERR_TIMEOUT, "no fds from");
    expect(TOO_MANY, KV_ERR_MALFORMED, "more fds than");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kvc_faults),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
