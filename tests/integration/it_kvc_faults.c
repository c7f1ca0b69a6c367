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
 * The libkvc review (round 1) added, each failing before its fix in client/kvc.c:
 *   bad magic  fds under a header that is not "KVDFDS01": MALFORMED naming the header (it was
 *              PERMISSION_DENIED, "peer pid not matched", which sends one to admit_uids);
 *   no dir     a hello with an FP8 pool and no directory: MALFORMED (it "succeeded" with
 *              kvc_page_ptr NULL for every page); no fp8 likewise;
 *   session 0  a hello reply naming session 0: MALFORMED (kvc_session_id() 0 is "none");
 *   stale cmsg the fd socket times out (silent) while the control buffer holds stale bytes
 *              that look like an SCM_RIGHTS fd: that fd stays open (kvc_recv_fds read the
 *              uninitialised buffer after a failed recvmsg and closed what it found there);
 * and, after a good hello (test_reply_lies):
 *   alloc      2 pages for an alloc of 1: MALFORMED, and both are released (they leaked);
 *   alloc id   a page id past the directory: MALFORMED, released;
 *   lookup     1 page and 32 tokens matched (16-token pages): MALFORMED, released (it was OK,
 *              inviting the caller to skip prefill for a page it does not hold);
 *   seal       the content "moved" to a page past the directory: MALFORMED (it was OK);
 *   heartbeat  an epoch below the hello's: kvc_epoch() does not go back;
 *   reuse      one request sent twice, the safe epoch raised in between: the second carries
 *              the new epoch (kvc_send left the first one in the caller's struct);
 *   recv_any   the reply to a request sent before a second hello, arriving after the hello's
 *              reply: dropped (kvc_recv_any returned it).
 * test_calls_after_close: every call on the NULL that kvc_close leaves is INVALID_ARGUMENT
 * (they dereferenced it), a second close is a no-op.
 * The libkvc review (round 2), each failing before its fix in client/kvc.c:
 *   fds died   the fd socket's process exits with nothing sent: UNAVAILABLE naming the exit (it
 *              was PERMISSION_DENIED, "peer pid not matched"); fds refuse: a live one closing
 *              says it knows no session of our pid;
 *   late list  70 allocs time out, their replies come after: all 70 pages released (the list
 *              held 64 and forgot the oldest: 64);
 *   seal dedupe a seal times out, its late reply is a dedupe to page 6: a later release of the
 *              page and a seal naming it as prev send 6 (they sent the retired page);
 *   undecodable a frame that does not decode before an alloc's reply: the alloc fails and its
 *              late reply is released (it was kept for ever, with its reference);
 *   version    a reply in protocol version 2: VERSION_MISMATCH naming both (it was read);
 *   stash      one request answered 70 000 times: RESOURCE_EXHAUSTED past 65 536 unclaimed
 *              replies (they piled up without bound);
 *   lookup cap 3 pages for a cap of 1 and the release of the 2 beyond fails: all 3 are given
 *              back (the one within the cap leaked).
 * The moved-page review (round 3), each failing before its fix in client/kvc.c; after a late
 * dedupe moved page 2 to 6 (moved_2_to_6):
 *   by seal    a seal deduplicates onto the reused id 2: its release and the prev of the next
 *              seal name 2 (they named 6: only alloc and lookup replies ended a move);
 *   late alloc a timed-out alloc's late reply names 2 (libkvc releases it): the caller's old
 *              2 is still sent as 6 (it was sent as 2: released twice, 6 leaked);
 *   peek       a peek lookup naming 2, typed or pipelined, grants nothing: 6 still; a lookup
 *              without peek does: then 2.
 * Each failed hello leaves kvc_session_id() at 0, and no fd of this process is left open.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "itest.h"

enum {
    GOOD,
    PAGE_BYTES,
    SHORT_FD,
    TWO_DIRS,
    BAD_GEOM,
    SILENT,
    TOO_MANY,
    BAD_MAGIC,
    NO_DIR,
    NO_FP8,
    SESSION_0,
    FDS_REFUSE,
    FDS_DIED
};

#define HELLO_EPOCH 10u
#define MAX_SEEN    256
#define MAX_HELD    128

/* A reply the fake sends later: when its time comes (due_ms), before the answer to the next
 * status request (due_ms 0), or once the test sets release_held (due_ms HELD_FOR_TEST). */
#define HELD_FOR_TEST INT64_MAX
typedef struct held_s {
    zmq_msg_t rid;
    uint8_t *buf;
    size_t len;
    int64_t due_ms;
} held_t;

typedef struct fake_s {
    char dir[64], ep[96], fds_path[96];
    int mode;
    void *ctx, *router;
    int listen_fd;
    pthread_t zt, ft;
    kv_geom_t g;
    uint32_t pages;
    volatile int stop;   /* set by the test thread: the router returns */
    int hold_status;     /* answer the next status request only after the next hello */
    uint64_t held_id;    /* the status request held back (0: none) */
    zmq_msg_t held_rid;  /* its routing id */
    uint32_t alloc_page; /* first page id an alloc returns */
    /* the review's round 2 (see the top) */
    int honest_alloc;       /* an alloc returns exactly the pages asked for */
    int hold_alloc;         /* alloc replies wait for the next status request */
    int garbage_alloc;      /* a frame that does not decode goes before the next alloc reply */
    int seal_honest;        /* a seal returns its own page (not one past the directory) */
    uint32_t seal_to;       /* != KVP_NO_PAGE: the next seal is a dedupe to this page... */
    int seal_hold;          /* ...answered once the test sets release_held (0: at once) */
    /* set by the test thread (release_held): send the replies held for it (HELD_FOR_TEST) */
    int release_held;
    uint32_t lookup_pages;  /* > 0: a lookup returns pages lookup_first, +1, ... and tokens */
    uint32_t lookup_first;  /* 0: 5 */
    int release_fail;       /* this many releases answered NOMEM (not applied) */
    uint32_t reply_version; /* != 0: the next reply's protocol version */
    int status_copies;      /* the next status request is answered this many times */
    held_t held[MAX_HELD];
    size_t nheld;
    pid_t fds_child; /* FDS_DIED: the process that plays the fd socket and exits */
    /* what the router saw (read after it is joined) */
    uint32_t released[MAX_SEEN];
    size_t nreleased;
    uint64_t status_epoch[MAX_SEEN];
    size_t nstatus;
    uint32_t seal_prev[MAX_SEEN];
    size_t nseal;
} fake_t;

/* libkvc is linked in statically, so this is the recvmsg its fd handover calls (the kernel's
 * does the work). Armed, a failed call leaves in the control buffer what a failed recvmsg
 * leaves there: whatever the stack held before — here an SCM_RIGHTS header naming
 * g_stale_fd, as stale bytes may look by chance. libkvc must read no fds from it. */
static int g_stale_fd = -1;
ssize_t recvmsg(int fd, struct msghdr *mh, int flags)
{
    ssize_t n = syscall(SYS_recvmsg, fd, mh, flags);
    if (n < 0 && g_stale_fd >= 0 && mh->msg_control &&
        mh->msg_controllen >= CMSG_SPACE(sizeof(int))) {
        const int en = errno;
        struct cmsghdr *cm = (struct cmsghdr *)mh->msg_control;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        memcpy(CMSG_DATA(cm), &g_stale_fd, sizeof(int));
        errno = en;
    }
    return n;
}

/* Open fds of this process (a leak check around each client). */
static int open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    assert_non_null(d);
    int n = 0;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

/* (runs in the fake's threads: no cmocka assert there) */
static int memfd_of(const char *name, size_t bytes)
{
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0)
        abort();
    return fd;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void send_frame(fake_t *f, zmq_msg_t *rid, const void *buf, size_t n)
{
    zmq_msg_t r;
    zmq_msg_init(&r);
    zmq_msg_copy(&r, rid);
    zmq_msg_send(&r, f->router, ZMQ_SNDMORE);
    zmq_send(f->router, buf, n, 0);
}

/* Send rep now (due_ms < 0), or hold it (see held_t). */
static void send_reply_at(fake_t *f, zmq_msg_t *rid, Kvd__Reply *rep, int64_t due_ms)
{
    rep->version = f->reply_version ? f->reply_version : KVP_VERSION;
    f->reply_version = 0;
    rep->instance = 0x1234;
    if (!rep->epoch)
        rep->epoch = HELLO_EPOCH;
    size_t n = kvd__reply__get_packed_size(rep);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf)
        abort();
    kvd__reply__pack(rep, buf);
    if (due_ms < 0) {
        send_frame(f, rid, buf, n);
        free(buf);
        return;
    }
    if (f->nheld == MAX_HELD)
        abort();
    held_t *h = &f->held[f->nheld++];
    zmq_msg_init(&h->rid);
    zmq_msg_copy(&h->rid, rid);
    h->buf = buf;
    h->len = n;
    h->due_ms = due_ms;
}

static void send_reply(fake_t *f, zmq_msg_t *rid, Kvd__Reply *rep)
{
    send_reply_at(f, rid, rep, -1);
}

/* Send the held replies that are due (all: those held until a status request too). */
static void send_held(fake_t *f, int all)
{
    size_t k = 0;
    const int released = __atomic_exchange_n(&f->release_held, 0, __ATOMIC_SEQ_CST);
    for (size_t i = 0; i < f->nheld; i++) {
        held_t *h = &f->held[i];
        const int due = h->due_ms == HELD_FOR_TEST ? released
                                                   : h->due_ms && now_ms() >= h->due_ms;
        if (all || due) {
            send_frame(f, &h->rid, h->buf, h->len);
            zmq_msg_close(&h->rid);
            free(h->buf);
        } else {
            f->held[k++] = *h;
        }
    }
    f->nheld = k;
}

/* (test thread) The replies held for the test go before the answer to the next request. */
static void release_held(fake_t *f)
{
    __atomic_store_n(&f->release_held, 1, __ATOMIC_SEQ_CST);
}

/* The mode's HelloRep. */
static void send_hello(fake_t *f, zmq_msg_t *rid, uint64_t id)
{
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
    pool.format = f->mode == NO_FP8 ? KVD__FORMAT__FORMAT_TQ3 : KVD__FORMAT__FORMAT_FP8;
    pool.pages = f->pages;
    pool.page_bytes = f->mode == PAGE_BYTES ? pb / 2 : kv_page_bytes(&f->g, (kv_fmt_t)pool.format);
    pool.bytes = (uint64_t)f->pages * pb * (f->mode == SHORT_FD ? 2 : 1);
    pool.fd_index = 1;
    dir.kind = dir2.kind = KVD__POOL_DESC__KIND__KIND_DIRECTORY;
    dir.pages = dir2.pages = f->pages;
    dir.bytes = dir2.bytes = (uint64_t)f->pages * sizeof(kv_dir_entry_t);
    dir.fd_index = dir2.fd_index = 0;
    Kvd__PoolDesc *pools[3] = {&dir, &pool, &dir2};
    Kvd__HelloRep h = KVD__HELLO_REP__INIT;
    h.session_id = f->mode == SESSION_0 ? 0 : 7;
    h.geometry = &geo;
    h.pools = f->mode == NO_DIR ? pools + 1 : pools;
    h.n_pools = f->mode == TWO_DIRS ? 3 : f->mode == NO_DIR ? 1 : 2;
    h.epoch = HELLO_EPOCH;
    h.fd_socket = f->fds_path;
    h.lease_ms = 10000;
    h.instance = 0x1234;
    h.pid = (uint32_t)getpid();
    h.backend = "host";
    Kvd__Reply rep = KVD__REPLY__INIT;
    rep.id = id;
    rep.status = KVD__STATUS__OK;
    rep.body_case = KVD__REPLY__BODY_HELLO;
    rep.hello = &h;
    send_reply(f, rid, &rep);
}

static void send_status(fake_t *f, zmq_msg_t *rid, uint64_t id)
{
    Kvd__StatusRep st = KVD__STATUS_REP__INIT;
    Kvd__Reply rep = KVD__REPLY__INIT;
    rep.id = id;
    rep.status = KVD__STATUS__OK;
    rep.body_case = KVD__REPLY__BODY_STATUS_REP;
    rep.status_rep = &st;
    send_reply(f, rid, &rep);
}

/* One request: hello as the mode says; the session calls with the lies test_reply_lies
 * expects. Records releases and the epochs of status requests. */
static void fake_answer(fake_t *f, zmq_msg_t *rid, const Kvd__Request *req)
{
    Kvd__Reply rep = KVD__REPLY__INIT;
    rep.id = req->id;
    rep.status = KVD__STATUS__OK;
    uint32_t pages[4];
    Kvd__AllocRep a = KVD__ALLOC_REP__INIT;
    Kvd__LookupRep l = KVD__LOOKUP_REP__INIT;
    Kvd__HeartbeatRep hb = KVD__HEARTBEAT_REP__INIT;
    Kvd__ReleaseRep rl = KVD__RELEASE_REP__INIT;
    Kvd__SealRep sl = KVD__SEAL_REP__INIT;
    switch (req->body_case) {
    case KVD__REQUEST__BODY_HELLO:
        send_hello(f, rid, req->id);
        if (f->held_id) { /* the earlier request's reply comes after the hello's */
            send_status(f, &f->held_rid, f->held_id);
            zmq_msg_close(&f->held_rid);
            f->held_id = 0;
        }
        return;
    case KVD__REQUEST__BODY_STATUS:
        send_held(f, 1);
        if (f->nstatus < MAX_SEEN)
            f->status_epoch[f->nstatus++] = req->completed_epoch;
        while (f->status_copies > 1) { /* the extra copies; the last one below */
            f->status_copies--;
            send_status(f, rid, req->id);
        }
        f->status_copies = 0;
        if (f->hold_status && !f->held_id) {
            f->hold_status = 0;
            f->held_id = req->id;
            zmq_msg_init(&f->held_rid);
            zmq_msg_copy(&f->held_rid, rid);
            return;
        }
        send_status(f, rid, req->id);
        return;
    case KVD__REQUEST__BODY_ALLOC: /* one page more than asked, or ids past the directory */
        a.n_pages = req->alloc->count + 1 <= 4 ? req->alloc->count + 1 : 4;
        if (f->alloc_page >= f->pages || f->honest_alloc)
            a.n_pages = req->alloc->count <= 4 ? req->alloc->count : 4;
        for (size_t i = 0; i < a.n_pages; i++)
            pages[i] = f->alloc_page + (uint32_t)i;
        a.pages = pages;
        rep.body_case = KVD__REPLY__BODY_ALLOC;
        rep.alloc = &a;
        if (f->garbage_alloc) { /* field 0x1fffffff, wire type 7: does not decode */
            f->garbage_alloc = 0;
            send_frame(f, rid, "\xff\xff\xff\xff\x0f", 5);
        }
        if (f->hold_alloc) {
            send_reply_at(f, rid, &rep, 0);
            return;
        }
        break;
    case KVD__REQUEST__BODY_LOOKUP: /* one page, but two pages' worth of tokens matched */
        pages[0] = 5;
        l.pages = pages;
        l.n_pages = 1;
        l.tokens_matched = 2 * f->g.page_tokens;
        for (uint32_t i = 0; f->lookup_pages && i < f->lookup_pages && i < 4; i++)
            pages[i] = (f->lookup_first ? f->lookup_first : 5) + i, l.n_pages = i + 1,
            l.tokens_matched = (i + 1) * f->g.page_tokens;
        rep.body_case = KVD__REPLY__BODY_LOOKUP;
        rep.lookup = &l;
        break;
    case KVD__REQUEST__BODY_SEAL: /* the content "moved" to a page past the directory */
        sl.page = f->seal_honest ? req->seal->page : f->pages;
        if (f->nseal < MAX_SEEN)
            f->seal_prev[f->nseal++] = req->seal->has_prev ? req->seal->prev : KVP_NO_PAGE;
        rep.body_case = KVD__REPLY__BODY_SEAL;
        rep.seal = &sl;
        if (f->seal_to != KVP_NO_PAGE) { /* a dedupe, answered at once or held */
            sl.page = f->seal_to;
            sl.deduplicated = 1;
            f->seal_to = KVP_NO_PAGE;
            if (f->seal_hold) {
                f->seal_hold = 0;
                send_reply_at(f, rid, &rep, HELD_FOR_TEST);
                return;
            }
        }
        break;
    case KVD__REQUEST__BODY_HEARTBEAT: /* an epoch below the hello's */
        hb.epoch = HELLO_EPOCH - 7;
        rep.epoch = HELLO_EPOCH - 7;
        rep.body_case = KVD__REPLY__BODY_HEARTBEAT;
        rep.heartbeat = &hb;
        break;
    case KVD__REQUEST__BODY_RELEASE:
        if (f->release_fail > 0) {
            f->release_fail--;
            rep.status = KVD__STATUS__NOMEM;
            rep.message = "fake: out of memory building the reply";
            break;
        }
        for (size_t i = 0; i < req->release->n_pages && f->nreleased < MAX_SEEN; i++)
            f->released[f->nreleased++] = req->release->pages[i];
        rl.released = (uint32_t)req->release->n_pages;
        rep.body_case = KVD__REPLY__BODY_RELEASE;
        rep.release = &rl;
        break;
    default:
        rep.status = KVD__STATUS__INVALID_ARGUMENT;
        rep.message = "the fake answers hello, status, alloc, lookup, seal, heartbeat, release";
        break;
    }
    send_reply(f, rid, &rep);
}

/* The ROUTER: answer requests until the test sets stop. */
static void *fake_router(void *arg)
{
    fake_t *f = arg;
    while (!f->stop) {
        zmq_pollitem_t it = {f->router, 0, ZMQ_POLLIN, 0};
        send_held(f, 0);
        if (zmq_poll(&it, 1, f->nheld ? 2 : 20) <= 0)
            continue;
        zmq_msg_t rid, pl;
        zmq_msg_init(&rid);
        zmq_msg_init(&pl);
        if (zmq_msg_recv(&rid, f->router, 0) < 0 || zmq_msg_recv(&pl, f->router, 0) < 0)
            abort();
        Kvd__Request *req = kvd__request__unpack(NULL, zmq_msg_size(&pl), zmq_msg_data(&pl));
        if (!req)
            abort();
        send_held(f, 0); /* release_held set before this request was sent: before its reply */
        fake_answer(f, &rid, req);
        kvd__request__free_unpacked(req, NULL);
        zmq_msg_close(&rid);
        zmq_msg_close(&pl);
    }
    if (f->held_id)
        zmq_msg_close(&f->held_rid);
    for (size_t i = 0; i < f->nheld; i++) {
        zmq_msg_close(&f->held[i].rid);
        free(f->held[i].buf);
    }
    return NULL;
}

/* The fd socket: the mode's answer to each peer, until stop. Its own sendmsg rather than
 * kvd/fdpass.c's kvd_fdpass_send, which refuses more than 8 fds: the lie this test needs. */
static void fake_fds_one(fake_t *f, int s)
{
    if (f->mode == SILENT) { /* hold the connection past the client's timeout */
        usleep(1500 * 1000);
        return;
    }
    if (f->mode == FDS_REFUSE) /* what kvd does for a pid with no session: close */
        return;
    const uint64_t pb = kv_page_bytes(&f->g, KV_FMT_FP8);
    int fds[9], n = f->mode == TOO_MANY ? 9 : 2;
    fds[0] = memfd_of("fake-dir", (size_t)f->pages * sizeof(kv_dir_entry_t));
    for (int i = 1; i < n; i++)
        fds[i] = memfd_of("fake-pool", (size_t)f->pages * pb);
    uint8_t hdr[16];
    memcpy(hdr, f->mode == BAD_MAGIC ? "KVDFDS02" : "KVDFDS01", 8);
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
}

static void *fake_fds(void *arg)
{
    fake_t *f = arg;
    while (!f->stop && f->listen_fd >= 0) {
        struct pollfd p = {.fd = f->listen_fd, .events = POLLIN};
        if (poll(&p, 1, 20) <= 0)
            continue;
        int s = accept4(f->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (s < 0)
            continue;
        fake_fds_one(f, s);
        close(s);
    }
    return NULL;
}

/* FDS_DIED: the fd socket belongs to a process of its own (SO_PEERCRED names the process that
 * called listen()), which accepts one connection and exits with nothing sent, as a daemon
 * killed mid-handover does. */
static void fake_fds_die(fake_t *f)
{
    close(f->listen_fd);
    f->listen_fd = -1;
    unlink(f->fds_path);
    int ready[2];
    assert_int_equal(pipe(ready), 0);
    f->fds_child = fork();
    assert_true(f->fds_child >= 0);
    if (f->fds_child == 0) { /* async-signal-safe calls only: the parent has threads */
        int l = socket(AF_UNIX, SOCK_STREAM, 0);
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        memcpy(sa.sun_path, f->fds_path, strlen(f->fds_path) + 1);
        if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(l, 4) != 0)
            _exit(1);
        if (write(ready[1], "r", 1) != 1)
            _exit(1);
        accept(l, NULL, NULL);
        _exit(0); /* the kernel closes the connection: EOF, nothing sent */
    }
    char b;
    close(ready[1]);
    assert_int_equal(read(ready[0], &b, 1), 1);
    close(ready[0]);
}

static void fake_start(fake_t *f, int mode)
{
    memset(f, 0, sizeof *f);
    f->mode = mode;
    f->seal_to = KVP_NO_PAGE;
    f->g = (kv_geom_t){1, 1, 64, 16, 1};
    f->pages = 8;
    itest_tmpdir(f->dir, sizeof f->dir, "kvd-it-fake");
    snprintf(f->ep, sizeof f->ep, "ipc://%s/kvd.sock", f->dir);
    snprintf(f->fds_path, sizeof f->fds_path, "%s/kvd.sock.fds", f->dir);
    f->ctx = zmq_ctx_new();
    f->router = zmq_socket(f->ctx, ZMQ_ROUTER);
    int linger = 0, hwm = 0; /* status_copies: a ROUTER drops what goes over its HWM */
    zmq_setsockopt(f->router, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(f->router, ZMQ_SNDHWM, &hwm, sizeof hwm);
    assert_int_equal(zmq_bind(f->router, f->ep), 0);
    f->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", f->fds_path);
    assert_int_equal(bind(f->listen_fd, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_int_equal(listen(f->listen_fd, 4), 0);
    if (mode == FDS_DIED)
        fake_fds_die(f);
}

static void fake_run(fake_t *f)
{
    assert_int_equal(pthread_create(&f->zt, NULL, fake_router, f), 0);
    assert_int_equal(pthread_create(&f->ft, NULL, fake_fds, f), 0);
}

static void fake_stop(fake_t *f)
{
    f->stop = 1;
    pthread_join(f->zt, NULL);
    pthread_join(f->ft, NULL);
    if (f->listen_fd >= 0)
        close(f->listen_fd);
    if (f->fds_child > 0)
        waitpid(f->fds_child, NULL, 0);
    zmq_close(f->router);
    zmq_ctx_term(f->ctx);
    itest_rmtree(f->dir);
}

/* One hello of a fresh client against a fresh fake in `mode`; returns its status. No fd of
 * this process outlives the client and the fake (SCM_RIGHTS fds on every error path). */
static kv_err_t hello_against(int mode, char *msg, size_t cap)
{
    const int fds0 = open_fds();
    fake_t f;
    fake_start(&f, mode);
    fake_run(&f);
    kvc_t *c = NULL;
    assert_int_equal(kvc_connect(&c, f.ep, 1000), KV_ERR_OK);
    kv_err_t e = kvc_hello(c, NULL, "fault", 1);
    snprintf(msg, cap, "%s", kvc_errmsg(c));
    if (e != KV_ERR_OK) {
        assert_int_equal(kvc_session_id(c), 0);
        assert_null(kvc_directory(c));
        assert_int_equal(kvc_dir_entries(c), 0);
        assert_int_equal(kvc_pool_pages(c, KV_FMT_FP8), 0);
    } else {
        assert_non_null(kvc_pool_base(c, KV_FMT_FP8));
    }
    kvc_close(&c);
    fake_stop(&f);
    if (open_fds() != fds0)
        fail_msg("mode %d: %d fds open after the client and the fake closed, %d before", mode,
                 open_fds(), fds0);
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
    expect(BAD_MAGIC, KV_ERR_MALFORMED, "not a KVDFDS01 header");
    expect(NO_DIR, KV_ERR_MALFORMED, "no directory");
    expect(NO_FP8, KV_ERR_MALFORMED, "no FP8 pool");
    expect(SESSION_0, KV_ERR_MALFORMED, "session 0");
    expect(FDS_DIED, KV_ERR_UNAVAILABLE, "exited during the fd handover");
    expect(FDS_REFUSE, KV_ERR_PERMISSION_DENIED, "knows no session of our pid");
}

/* A timed-out fd handover with stale SCM_RIGHTS-looking bytes in the control buffer: the fd
 * they name is not ours to close. */
static void test_stale_cmsg_after_timeout(void **state)
{
    (void)state;
    g_stale_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    assert_true(g_stale_fd >= 0);
    char msg[512];
    const kv_err_t e = hello_against(SILENT, msg, sizeof msg);
    const int fd = g_stale_fd, still_open = fcntl(fd, F_GETFD) != -1;
    g_stale_fd = -1;
    if (!still_open)
        fail_msg("fd %d, named only by stale bytes of a failed recvmsg, was closed", fd);
    close(fd);
    assert_int_equal(e, KV_ERR_TIMEOUT);
}

/* The released pages the fake recorded, as "a,b,c". */
static void released_str(const fake_t *f, char *out, size_t cap)
{
    size_t o = 0;
    out[0] = '\0';
    for (size_t i = 0; i < f->nreleased && o < cap; i++)
        o += (size_t)snprintf(out + o, cap - o, "%s%u", i ? "," : "", f->released[i]);
}

/* The pages f was asked to release, in order, are exactly `want` ("3,4,5"). */
static void assert_released(const fake_t *f, const char *want)
{
    char rel[128];
    released_str(f, rel, sizeof rel);
    print_message("released: %s\n", rel);
    assert_string_equal(rel, want);
}

/* After a good hello, replies that lie about pages, tokens and epochs. */
static void test_reply_lies(void **state)
{
    (void)state;
    const int fds0 = open_fds();
    fake_t f;
    fake_start(&f, GOOD);
    f.alloc_page = 3;
    fake_run(&f);
    kvc_t *c = NULL;
    assert_int_equal(kvc_connect(&c, f.ep, 1000), KV_ERR_OK);
    assert_int_equal(kvc_hello(c, NULL, "liar", 1), KV_ERR_OK);
    assert_int_equal(kvc_epoch(c), HELLO_EPOCH);

    /* alloc of 1 answered with pages 3 and 4: refused, and both references given back */
    uint32_t pg[4] = {0};
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, pg), KV_ERR_MALFORMED);
    print_message("alloc: %s\n", kvc_errmsg(c));
    assert_non_null(strstr(kvc_errmsg(c), "alloc of 1 returned 2 pages"));
    /* lookup of 2 pages' tokens answered with page 5 and 32 tokens matched */
    uint32_t tok[32] = {0}, matched = 99;
    size_t np = 99;
    const kv_err_t le = kvc_lookup(c, tok, 32, NULL, 0, 0, pg, 4, &np, &matched);
    print_message("lookup: %d, %zu pages, %u tokens matched: %s\n", (int)le, np, matched,
                  kvc_errmsg(c));
    assert_int_equal(le, KV_ERR_MALFORMED);
    assert_int_equal(np, 0);
    /* an alloc whose page lies past the 8-entry directory */
    f.alloc_page = 8;
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, pg), KV_ERR_MALFORMED);
    print_message("alloc: %s\n", kvc_errmsg(c));
    assert_non_null(strstr(kvc_errmsg(c), "past the 8-entry directory"));

    /* a seal whose content "moved" to a page past the directory */
    uint32_t out = 99;
    assert_int_equal(kvc_seal(c, 1, KVP_NO_PAGE, tok, 16, NULL, 0, &out), KV_ERR_MALFORMED);
    assert_int_equal(out, 99);

    /* an epoch that goes back */
    assert_int_equal(kvc_heartbeat(c, 0), KV_ERR_OK);
    assert_int_equal(kvc_epoch(c), HELLO_EPOCH);

    /* one request sent twice, the declared safe epoch raised in between; the fake holds the
     * first one's reply back until the next hello (below) */
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__StatusReq st = KVD__STATUS_REQ__INIT;
    req.body_case = KVD__REQUEST__BODY_STATUS;
    req.status = &st;
    f.hold_status = 1; /* the router reads it only for a request sent after this line */
    kvc_set_safe_epoch(c, 4);
    uint64_t held = 0;
    assert_int_equal(kvc_send(c, &req, &held), KV_ERR_OK);
    kvc_set_safe_epoch(c, 6);
    Kvd__Reply *rep = NULL;
    assert_int_equal(kvc_call(c, &req, &rep), KV_ERR_OK);
    kvc_reply_free(&rep);

    /* the held reply comes after the second hello's: it is from before, dropped */
    assert_int_equal(kvc_hello(c, NULL, "liar", 1), KV_ERR_OK);
    const kv_err_t e = kvc_recv_any(c, &rep);
    if (e != KV_ERR_TIMEOUT)
        fail_msg("kvc_recv_any after the second hello: %d (reply id %llu; %llu was sent "
                 "before it)",
                 (int)e, rep ? (unsigned long long)rep->id : 0ull, (unsigned long long)held);
    assert_int_equal(kvc_daemon_restarted(c), 0);
    kvc_close(&c);
    fake_stop(&f);

    assert_released(&f, "3,4,5,8");
    assert_int_equal(f.nstatus, 2);
    assert_int_equal(f.status_epoch[0], 4);
    assert_int_equal(f.status_epoch[1], 6);
    if (open_fds() != fds0)
        fail_msg("%d fds open after the client and the fake closed, %d before", open_fds(),
                 fds0);
}

/* A client of f with a short timeout, said hello (retried: the fd handover shares the
 * timeout, and the machine may be loaded). */
static kvc_t *fast_client(fake_t *f, int timeout_ms)
{
    kvc_t *c = NULL;
    assert_int_equal(kvc_connect(&c, f->ep, timeout_ms), KV_ERR_OK);
    kv_err_t e = KV_ERR_TIMEOUT;
    for (int i = 0; i < 20 && e == KV_ERR_TIMEOUT; i++)
        e = kvc_hello(c, NULL, "fast", 1);
    assert_int_equal(e, KV_ERR_OK);
    return c;
}

/* A call answered in order after everything sent before it (so the fake has seen those). */
static void sync_with(kvc_t *c)
{
    kv_err_t e = KV_ERR_TIMEOUT;
    for (int i = 0; i < 20 && e == KV_ERR_TIMEOUT; i++)
        e = kvc_heartbeat(c, 0);
    assert_int_equal(e, KV_ERR_OK);
}

/* Round 2, item 1: 70 allocs time out, and their replies come after all of them. Each reply's
 * page is released: the late list held 64 and forgot the oldest, whose reply was then kept as
 * an unclaimed one, its reference never released (64 releases, not 70). */
static void test_late_list_unbounded(void **state)
{
    (void)state;
    enum { N = 70 };
    fake_t f;
    fake_start(&f, GOOD);
    f.honest_alloc = 1;
    f.alloc_page = 2;
    fake_run(&f);
    kvc_t *c = fast_client(&f, 30);
    f.hold_alloc = 1; /* read by the router for requests sent after this line */
    uint32_t pg[1];
    for (int i = 0; i < N; i++)
        assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, pg), KV_ERR_TIMEOUT);
    /* a status request brings the 70 replies first; its own reply comes after them */
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__StatusReq st = KVD__STATUS_REQ__INIT;
    req.body_case = KVD__REQUEST__BODY_STATUS;
    req.status = &st;
    Kvd__Reply *rep = NULL;
    kvc_call(c, &req, &rep); /* OK or, on a slow machine, TIMEOUT: the replies come anyway */
    kvc_reply_free(&rep);
    sync_with(c); /* its reply comes after the 70: their releases are sent by then... */
    sync_with(c); /* ...and read by the fake before this one */
    kvc_close(&c);
    fake_stop(&f);
    print_message("%zu of %d late alloc replies released\n", f.nreleased, N);
    assert_int_equal(f.nreleased, N);
    for (size_t i = 0; i < f.nreleased; i++)
        assert_int_equal(f.released[i], 2);
}

/* Round 2, item 2: a seal of page 2 times out, and its reply comes later: a dedupe to page 6,
 * where the daemon moved our reference. A seal naming 2 as prev and a release of 2 must name
 * 6 (they named 2: the release would fail at a real daemon, and 6's reference leak); both wait
 * for the seal's reply, which arrives while they do: the fake sends it only once the first
 * seal has timed out, and the wait for it has the whole timeout (1 s; it comes within the
 * router's 2 ms poll). Once an alloc returns 2 again, 2 is 2. */
static void test_seal_timeout_dedupe(void **state)
{
    (void)state;
    fake_t f;
    fake_start(&f, GOOD);
    f.honest_alloc = 1;
    f.alloc_page = 2;
    f.seal_honest = 1;
    fake_run(&f);
    kvc_t *c = fast_client(&f, 1000);
    uint32_t tok[16] = {0}, out = 99, pg[2] = {1, 2};
    f.seal_to = 6;
    f.seal_hold = 1;
    assert_int_equal(kvc_seal(c, 2, KVP_NO_PAGE, tok, 16, NULL, 0, &out), KV_ERR_TIMEOUT);
    assert_int_equal(out, 99);
    release_held(&f); /* the seal's reply comes now: while the next call waits for it */
    assert_int_equal(kvc_seal(c, 3, 2, tok, 16, NULL, 0, &out), KV_ERR_OK);
    assert_int_equal(out, 3);
    assert_int_equal(kvc_release(c, pg, 2), KV_ERR_OK);
    /* page 2 reused: an alloc names it again, and a release of it is a release of it */
    uint32_t again = 0;
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, &again), KV_ERR_OK);
    assert_int_equal(again, 2);
    assert_int_equal(kvc_release(c, &again, 1), KV_ERR_OK);
    kvc_close(&c);
    fake_stop(&f);
    print_message("prev of the second seal: %u\n", f.seal_prev[1]);
    assert_int_equal(f.nseal, 2);
    assert_int_equal(f.seal_prev[1], 6);
    assert_released(&f, "1,6,2");
}

/* The start of the tests below: a client of f whose seal of page 2 timed out and whose late
 * reply, a dedupe to page 6, has come (during a heartbeat, before its reply): libkvc sends 6
 * where the caller names its old page 2. No timing but the seal's own timeout. */
static kvc_t *moved_2_to_6(fake_t *f)
{
    fake_start(f, GOOD);
    f->honest_alloc = 1;
    f->seal_honest = 1;
    fake_run(f);
    kvc_t *c = fast_client(f, 300);
    uint32_t tok[16] = {0}, out = 99;
    f->seal_to = 6;
    f->seal_hold = 1;
    assert_int_equal(kvc_seal(c, 2, KVP_NO_PAGE, tok, 16, NULL, 0, &out), KV_ERR_TIMEOUT);
    release_held(f); /* before the heartbeat's reply: the move is known after sync_with */
    sync_with(c);
    return c;
}

/* Round 3 (the moved-page review), item (a): a move is forgotten when a SEAL reply names the
 * reused id. After 2 moved to 6 and the caller released its old 2 (sent as 6), a seal of page
 * 7 deduplicates onto page 2, a live page again, now held by the caller. Its release and the
 * prev of the next seal must name 2 (they named 6: only alloc and lookup replies ended a
 * move, so the new 2 leaked, 6 lost a reference it did not hold, and the seal's parent hash
 * was 6's). */
static void test_moved_forgot_by_seal(void **state)
{
    (void)state;
    fake_t f;
    kvc_t *c = moved_2_to_6(&f);
    uint32_t tok[16] = {0}, out = 99, old = 2;
    assert_int_equal(kvc_release(c, &old, 1), KV_ERR_OK); /* the old 2: sent as 6 */
    f.seal_to = 2; /* answered at once: an OK seal reply naming 2 */
    assert_int_equal(kvc_seal(c, 7, KVP_NO_PAGE, tok, 16, NULL, 0, &out), KV_ERR_OK);
    assert_int_equal(out, 2);
    assert_int_equal(kvc_seal(c, 3, out, tok, 16, NULL, 0, &out), KV_ERR_OK);
    assert_int_equal(out, 3);
    old = 2;
    assert_int_equal(kvc_release(c, &old, 1), KV_ERR_OK); /* the new 2 */
    kvc_close(&c);
    fake_stop(&f);
    print_message("prev of the third seal: %u\n", f.seal_prev[2]);
    assert_int_equal(f.nseal, 3);
    assert_int_equal(f.seal_prev[2], 2);
    assert_released(&f, "6,2");
}

/* Round 3, item (b): a move is NOT forgotten for a reply the caller never receives. After 2
 * moved to 6, an alloc times out and its late reply names page 2, which libkvc releases
 * itself (the caller never saw it). The caller's release of its old 2 must still name 6 (it
 * named 2: 2 released twice, and the reference on 6 leaked). */
static void test_moved_kept_by_late_alloc(void **state)
{
    (void)state;
    fake_t f;
    kvc_t *c = moved_2_to_6(&f);
    f.alloc_page = 2;
    f.hold_alloc = 1; /* its reply waits for the next status request */
    uint32_t pg[1] = {99};
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, pg), KV_ERR_TIMEOUT);
    f.hold_alloc = 0;
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__StatusReq st = KVD__STATUS_REQ__INIT;
    req.body_case = KVD__REQUEST__BODY_STATUS;
    req.status = &st;
    Kvd__Reply *rep = NULL;
    /* the late alloc reply comes before the status reply: its release of 2 is sent */
    assert_int_equal(kvc_call(c, &req, &rep), KV_ERR_OK);
    kvc_reply_free(&rep);
    uint32_t old = 2;
    assert_int_equal(kvc_release(c, &old, 1), KV_ERR_OK);
    kvc_close(&c);
    fake_stop(&f);
    assert_released(&f, "2,6");
}

/* Round 3, item (b): a PEEK lookup naming the id grants nothing either, typed or pipelined:
 * the caller's old 2 is still 6 after each (it was 2 after the first: kvc_reply_status
 * forgot the move for any lookup reply). A lookup that takes references does grant 2: then
 * 2 is 2. */
static void test_moved_kept_by_peek(void **state)
{
    (void)state;
    fake_t f;
    kvc_t *c = moved_2_to_6(&f);
    f.lookup_pages = 1;
    f.lookup_first = 2;
    uint32_t tok[16] = {0}, pg[1] = {99}, matched = 0, old = 2;
    size_t np = 0;
    assert_int_equal(kvc_lookup(c, tok, 16, NULL, 0, 1, pg, 1, &np, &matched), KV_ERR_OK);
    assert_int_equal(np, 1);
    assert_int_equal(pg[0], 2);
    assert_int_equal(kvc_release(c, &old, 1), KV_ERR_OK); /* 6 */
    uint64_t id = 0;
    Kvd__Reply *rep = NULL;
    assert_int_equal(kvc_lookup_send(c, tok, 16, 1, &id), KV_ERR_OK);
    assert_int_equal(kvc_recv(c, id, &rep), KV_ERR_OK);
    assert_int_equal(rep->lookup->pages[0], 2);
    kvc_reply_free(&rep);
    assert_int_equal(kvc_release(c, &old, 1), KV_ERR_OK); /* 6 */
    assert_int_equal(kvc_lookup(c, tok, 16, NULL, 0, 0, pg, 1, &np, &matched), KV_ERR_OK);
    assert_int_equal(pg[0], 2);
    assert_int_equal(kvc_release(c, &old, 1), KV_ERR_OK); /* the new 2 */
    kvc_close(&c);
    fake_stop(&f);
    assert_released(&f, "6,6,2");
}

/* Round 2, item 3: a frame that does not decode comes before an alloc's reply. The alloc
 * fails (MALFORMED), and its reply, arriving during the next call, is released: it was kept
 * as an unclaimed reply for ever, with its page's reference. */
static void test_undecodable_frame(void **state)
{
    (void)state;
    fake_t f;
    fake_start(&f, GOOD);
    f.honest_alloc = 1;
    f.alloc_page = 4;
    fake_run(&f);
    kvc_t *c = fast_client(&f, 1000);
    f.garbage_alloc = 1;
    uint32_t pg[1];
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, pg), KV_ERR_MALFORMED);
    assert_non_null(strstr(kvc_errmsg(c), "did not decode"));
    sync_with(c); /* receives the alloc's reply, sends its release */
    sync_with(c); /* the fake has read the release */
    kvc_close(&c);
    fake_stop(&f);
    assert_released(&f, "4");
}

/* Round 2, item 3: a reply of another protocol version is refused, naming both versions (it
 * was read as version 1). */
static void test_reply_version(void **state)
{
    (void)state;
    fake_t f;
    fake_start(&f, GOOD);
    fake_run(&f);
    kvc_t *c = fast_client(&f, 1000);
    f.reply_version = 2;
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__StatusReq st = KVD__STATUS_REQ__INIT;
    req.body_case = KVD__REQUEST__BODY_STATUS;
    req.status = &st;
    Kvd__Reply *rep = NULL;
    assert_int_equal(kvc_call(c, &req, &rep), KV_ERR_VERSION_MISMATCH);
    assert_null(rep);
    print_message("%s\n", kvc_errmsg(c));
    assert_non_null(strstr(kvc_errmsg(c), "protocol version 2"));
    assert_non_null(strstr(kvc_errmsg(c), "speaks version 1"));
    assert_int_equal(kvc_call(c, &req, &rep), KV_ERR_OK); /* the next reply is version 1 */
    kvc_reply_free(&rep);
    kvc_close(&c);
    fake_stop(&f);
}

/* Round 2, item 3: one request answered 70 000 times. The replies nobody claims are bounded
 * (65 536): the call that meets the next one fails, explained (they piled up unbounded). */
static void test_stash_bound(void **state)
{
    (void)state;
    fake_t f;
    fake_start(&f, GOOD);
    fake_run(&f);
    kvc_t *c = fast_client(&f, 5000);
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__StatusReq st = KVD__STATUS_REQ__INIT;
    req.body_case = KVD__REQUEST__BODY_STATUS;
    req.status = &st;
    f.status_copies = 70000;
    uint64_t id;
    assert_int_equal(kvc_send(c, &req, &id), KV_ERR_OK);
    const kv_err_t e = kvc_heartbeat(c, 0);
    print_message("heartbeat: %d: %s\n", (int)e, kvc_errmsg(c));
    assert_int_equal(e, KV_ERR_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(kvc_errmsg(c), "65536 replies are already waiting"));
    Kvd__Reply *rep = NULL; /* the request's own reply is still there to be claimed */
    assert_int_equal(kvc_recv(c, id, &rep), KV_ERR_OK);
    kvc_reply_free(&rep);
    kvc_close(&c);
    fake_stop(&f);
}

/* Round 2, item 4: a lookup returns 3 pages for a cap of 1, and the release of the 2 beyond
 * the cap fails (NOMEM: not applied). The call fails and all 3 are given back (page 5, the one
 * within the cap, was neither returned nor released). */
static void test_lookup_cap_release_fails(void **state)
{
    (void)state;
    fake_t f;
    fake_start(&f, GOOD);
    f.lookup_pages = 3;
    fake_run(&f);
    kvc_t *c = fast_client(&f, 1000);
    f.release_fail = 1; /* the first one, of the 2 pages beyond the cap */
    uint32_t tok[48] = {0}, pg[1] = {99}, matched = 99;
    size_t np = 99;
    const kv_err_t e = kvc_lookup(c, tok, 48, NULL, 0, 0, pg, 1, &np, &matched);
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kvc_errmsg(c));
    print_message("lookup: %d: %s\n", (int)e, msg);
    sync_with(c);
    kvc_close(&c);
    fake_stop(&f);
    assert_released(&f, "5,6,7");
    assert_int_equal(e, KV_ERR_NOMEM);
    assert_int_equal(np, 0);
    assert_non_null(strstr(msg, "all the pages were given back"));
}

/* What a caller holds after kvc_close(&c) (or a failed kvc_connect) is NULL: a second close
 * is a no-op, every call is INVALID_ARGUMENT and every accessor 0 / NULL, not a crash. */
static void test_calls_after_close(void **state)
{
    (void)state;
    char dir[64], ep[96];
    itest_tmpdir(dir, sizeof dir, "kvd-it-closed");
    snprintf(ep, sizeof ep, "ipc://%s/kvd.sock", dir);
    kvc_t *c = NULL;
    assert_int_equal(kvc_connect(&c, ep, 200), KV_ERR_OK);
    kvc_close(&c);
    assert_null(c);
    kvc_close(&c);
    assert_int_equal(kvc_connect(&c, NULL, 200), KV_ERR_INVALID_ARGUMENT);
    assert_null(c);
    const kv_err_t bad = KV_ERR_INVALID_ARGUMENT;
    uint32_t pg[2] = {0}, tok[16] = {0}, matched = 0;
    uint64_t id = 0, seq = 0;
    size_t np = 0;
    Kvd__Request req = KVD__REQUEST__INIT;
    Kvd__StatusReq st = KVD__STATUS_REQ__INIT;
    req.body_case = KVD__REQUEST__BODY_STATUS;
    req.status = &st;
    Kvd__Reply *rep = NULL;
    assert_int_equal(kvc_hello(c, NULL, "closed", 1), bad);
    assert_int_equal(kvc_rehello(c), bad);
    assert_int_equal(kvc_send(c, &req, &id), bad);
    assert_int_equal(kvc_send_raw(c, "x", 1), bad);
    assert_int_equal(kvc_recv(c, 1, &rep), bad);
    assert_int_equal(kvc_recv_any(c, &rep), bad);
    assert_int_equal(kvc_call(c, &req, &rep), bad);
    assert_null(rep);
    assert_int_equal(kvc_alloc(c, KV_FMT_FP8, 1, pg), bad);
    assert_int_equal(kvc_alloc_send(c, KV_FMT_FP8, 1, &id), bad);
    assert_int_equal(kvc_alloc_recv(c, 1, 1, pg), bad);
    assert_int_equal(kvc_seal(c, 0, KVP_NO_PAGE, tok, 16, NULL, 0, pg), bad);
    assert_int_equal(kvc_lookup(c, tok, 16, NULL, 0, 0, pg, 2, &np, &matched), bad);
    assert_int_equal(kvc_lookup_send(c, tok, 16, 0, &id), bad);
    assert_int_equal(kvc_release(c, pg, 1), bad);
    assert_int_equal(kvc_release_send(c, pg, 1, &id), bad);
    assert_int_equal(kvc_seq_open(c, "t", &seq), bad);
    assert_int_equal(kvc_seq_append(c, 1, pg, 1), bad);
    assert_int_equal(kvc_seq_close(c, 1), bad);
    assert_int_equal(kvc_heartbeat(c, 0), bad);
    assert_int_equal(kvc_goodbye(c, NULL), bad);
    kvc_set_safe_epoch(c, 1);
    assert_non_null(strstr(kvc_errmsg(c), "kvc_close"));
    assert_int_equal(kvc_daemon_restarted(c), 0);
    assert_int_equal(kvc_session_id(c), 0);
    assert_int_equal(kvc_pid_seen(c), 0);
    assert_int_equal(kvc_epoch(c), 0);
    assert_int_equal(kvc_instance(c), 0);
    assert_string_equal(kvc_events_endpoint(c), "");
    assert_null(kvc_geom(c));
    assert_int_equal(kvc_pool_pages(c, KV_FMT_FP8), 0);
    assert_int_equal(kvc_page_bytes(c, KV_FMT_FP8), 0);
    assert_null(kvc_pool_base(c, KV_FMT_FP8));
    assert_null((const void *)kvc_directory(c));
    assert_int_equal(kvc_dir_entries(c), 0);
    assert_string_equal(kvc_backend(c), "host");
    assert_int_equal(kvc_on_device(c), 0);
    kv_pools_t pools;
    memset(&pools, 0xff, sizeof pools);
    kvc_pools(c, &pools);
    assert_null(pools.base[KV_FMT_FP8]);
    assert_int_equal(pools.pages[KV_FMT_FP8], 0);
    assert_null(kvc_page_ptr(c, 0));
    itest_rmtree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kvc_faults),
        cmocka_unit_test(test_stale_cmsg_after_timeout),
        cmocka_unit_test(test_reply_lies),
        cmocka_unit_test(test_calls_after_close),
        cmocka_unit_test(test_late_list_unbounded),
        cmocka_unit_test(test_seal_timeout_dedupe),
        cmocka_unit_test(test_moved_forgot_by_seal),
        cmocka_unit_test(test_moved_kept_by_late_alloc),
        cmocka_unit_test(test_moved_kept_by_peek),
        cmocka_unit_test(test_undecodable_frame),
        cmocka_unit_test(test_reply_version),
        cmocka_unit_test(test_stash_bound),
        cmocka_unit_test(test_lookup_cap_release_fails),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
