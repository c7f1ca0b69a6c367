/* kvc.h — libkvc: the client side of the kvd control protocol.
 *
 * What an engine worker (or kvctl) does with it:
 *
 *     kvc_t *c;
 *     kvc_connect(&c, "ipc:///run/kvd/kvd.sock", 5000);   // DEALER socket, no I/O yet
 *     kvc_hello(c, "default", "worker-0");                 // session + fds + mmap
 *     kvc_alloc(c, KV_FMT_FP8, 4, pages);                  // typed, synchronous
 *     uint8_t *p = kvc_page_ptr(c, pages[0]);              // write KV in place
 *     kvc_seal(c, pages[0], KVP_NO_PAGE, tokens, n, NULL, 0, &sealed);
 *     kvc_close(&c);
 *
 * Pipelining: kvc_send() any number of requests (each gets an id), then kvc_recv(id) in any
 * order; replies that arrive for other ids are kept until asked for. The typed calls are
 * send + recv of one request.
 *
 * Errors: every call returns a kv_err_t (proto/kv_err.h); kvc_errmsg() is the daemon's human
 * message for the last failed call (or libkvc's own, for TIMEOUT / UNAVAILABLE /
 * PERMISSION_DENIED detected locally). A peer the daemon's ZAP handler refuses gets
 * PERMISSION_DENIED from the first call, detected through the socket monitor's
 * HANDSHAKE_FAILED_AUTH event rather than a timeout. A TIMEOUT means the outcome is unknown:
 * the daemon may have applied the request (and may even have dropped the reply of a client
 * that left reply_hwm replies unread, docs/daemon.md "Memory bounds"); what a late reply
 * grants (pages of an alloc or a lookup) libkvc releases itself.
 *
 * Memory: after kvc_hello() the pools are mapped READ-WRITE (the engine writes pages in place)
 * and the page directory READ-ONLY (only the daemon writes it). Mappings live until
 * kvc_close() or the next kvc_hello / kvc_rehello. On the cuda backends, unmapping first waits
 * for the whole primary context (every kernel of the process, not only this client's: libkvc
 * cannot tell which of them read the pools), and libkvc leaves the calling thread's current
 * context as it found it (kvc_cuda.c). Closing the connection does NOT free the
 * session's pages: the daemon reclaims them when this process exits (DESIGN.md, "Ownership").
 *
 * Daemon restarts: the connection survives a restart of the daemon on the same endpoint
 * (ZeroMQ reconnects every 100 ms). The first reply from the new daemon instance makes every
 * call return KV_ERR_NO_SESSION with "daemon restarted (instance X → Y): call kvc_rehello; page
 * ids from before are invalid", and kvc_daemon_restarted() 1, until the caller runs
 * kvc_rehello(). There is no hidden retry: the engine must drop its block tables first.
 *
 * Thread rule: one kvc_t per thread (ZeroMQ sockets are not thread-safe).
 */
#ifndef KVC_H
#define KVC_H

#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

#include "kv_err.h"
#include "kv_format.h"
#include "kvproto.h"

typedef struct kvc_s kvc_t;

/* Create the DEALER socket and connect (asynchronous in ZeroMQ: errors surface on the first
 * call). timeout_ms bounds every wait of a later call (≤ 0: 5000): a reply, and in kvc_hello
 * also the fd socket's connect and its message, so a hello may take up to three of them.
 * INVALID_ARGUMENT for a NULL out or endpoint. */
kv_err_t kvc_connect(kvc_t **out, const char *endpoint, int timeout_ms);
/* Why no daemon can answer at an ipc:// endpoint right now, for a tool to say at once what
 * ZeroMQ would only show as a timeout (it connects before anyone binds): UNAVAILABLE (no
 * socket file, a file that is no socket, or a socket nothing listens on, which a kvd that did
 * not stop cleanly leaves) or PERMISSION_DENIED (a directory above it or the socket itself out
 * of this uid's reach), with the reason, naming the path, in why. KV_ERR_OK when somebody may
 * answer, and for other schemes. A probe, not a session: a daemon may still come or go. */
kv_err_t kvc_endpoint_probe(const char *endpoint, char *why, size_t cap);
/* The text of s (up to NUL or max bytes) as the inside of a JSON string, to out: quote and
 * backslash escaped, control characters as \u00XX, and only whole UTF-8 sequences (a stray
 * byte, or a character cut by max or by a "%.Ns" that built s, is dropped). For the tools'
 * JSON output (kvctl --json, kvbench). */
void kvc_json_chars(FILE *out, const char *s, size_t max);
/* Close the socket, unmap, free; *c = NULL. NULL-safe, so a second close is a no-op. Any other
 * call on the NULL it leaves (or on a NULL from a failed kvc_connect) returns
 * KV_ERR_INVALID_ARGUMENT, and the accessors 0 / NULL / "" ("host" for kvc_backend). */
void kvc_close(kvc_t **c);
/* The daemon's (or libkvc's) message for the last failed call; "" after success. */
const char *kvc_errmsg(const kvc_t *c);

/* Hello: open a session, receive the fds over the side socket and map them. namespace_ NULL:
 * the daemon's namespace. map = 0 skips the fd handover (kvctl never maps). A second hello on
 * the same kvc_t first drops everything the previous one gave (as kvc_rehello does). The
 * reply is checked: MALFORMED for session id 0, an invalid geometry, a page or the directory
 * that would lie outside its mapping, no directory or no FP8 pool (map = 1), or an fd handover
 * that is not "KVDFDS01" + a session id; PERMISSION_DENIED when the fd socket closes with
 * nothing sent (our pid owns no session there), UNAVAILABLE when it closed that way because
 * the daemon exited during the handover (its pidfd, watched for up to 100 ms, says so). On
 * failure the kvc_t holds no session
 * (kvc_session_id() == 0) and may hello again; a session the daemon opened for this
 * connection stays until the process exits, and that next hello gets it back. */
kv_err_t kvc_hello(kvc_t *c, const char *namespace_, const char *client_name, int map);
/* After a daemon restart (kvc_daemon_restarted() == 1, calls fail with NO_SESSION): unmap and
 * close the old pools and directory, drop replies still waiting from before, hello again with
 * the namespace, client name and map flag of the last kvc_hello, and map the new pools. After
 * it kvc_instance() is the new daemon's and the pool / directory addresses are new (kernels
 * must take them again). Page ids, sequences, references and the safe epoch from before are
 * gone — the old daemon's sessions died with it; cached content is still found by lookup when
 * the daemon reloaded a snapshot (docs/snapshot.md). Also the remedy when a connection was
 * re-established to the same daemon (docs/protocol.md "Daemon restarts"). FAILED_PRECONDITION
 * before any kvc_hello; on failure the client has no session and may call it again. */
kv_err_t kvc_rehello(kvc_t *c);
/* 1 when a reply showed that the daemon restarted since the last hello. */
int kvc_daemon_restarted(const kvc_t *c);
uint64_t kvc_session_id(const kvc_t *c);
uint32_t kvc_pid_seen(const kvc_t *c); /* the pid the daemon saw for us */
uint64_t kvc_epoch(const kvc_t *c);    /* latest daemon epoch seen */
uint64_t kvc_instance(const kvc_t *c); /* daemon instance id (changes on restart) */
/* Where the daemon publishes index events (HelloRep.events_endpoint, docs/protocol.md "Index
 * events"); "" when events are off. Borrowed, valid until the next hello. */
const char *kvc_events_endpoint(const kvc_t *c);
const kv_geom_t *kvc_geom(const kvc_t *c);
/* The daemon's request bounds when it answered the last hello (HelloRep.max_alloc,
 * max_tokens): the most pages one alloc may ask (kvc_alloc's n) and the most tokens one
 * lookup may carry. 0: not told (a daemon older than these fields, or no hello). A hint for
 * sizing requests, not a promise: an operator may lower either later (`kvctl config set`), and
 * the daemon then refuses a larger request with INVALID_ARGUMENT, having done nothing. */
uint32_t kvc_max_alloc(const kvc_t *c);
uint32_t kvc_max_tokens(const kvc_t *c);
uint32_t kvc_pool_pages(const kvc_t *c, kv_fmt_t f);
uint64_t kvc_page_bytes(const kvc_t *c, kv_fmt_t f);
uint8_t *kvc_pool_base(const kvc_t *c, kv_fmt_t f);
const volatile kv_dir_entry_t *kvc_directory(const kvc_t *c);
uint32_t kvc_dir_entries(const kvc_t *c);
/* Backend named in the hello reply: "host", "cuda" or "cuda-ipc" (legacy handles). On the
 * cuda backends kvc_pool_base, kvc_pools and kvc_directory return DEVICE addresses in this
 * process's CUDA context (primary context of the runtime's current device, chosen before
 * kvc_hello), ready for the kvkern_cuda launchers; kvc_page_ptr returns a device address too
 * (it reads the directory entry with an 8-byte device-to-host copy). */
const char *kvc_backend(const kvc_t *c);
int kvc_on_device(const kvc_t *c); /* 1 when the mappings are device memory */
/* Pool bases and page counts in this process's mapping, as the kernels take them. */
void kvc_pools(const kvc_t *c, kv_pools_t *out);
/* Address of logical page `page` in this process's mapping, resolved through the directory;
 * NULL when unmapped, out of range or not valid. */
uint8_t *kvc_page_ptr(const kvc_t *c, uint32_t page);

/* Epochs (core.h, "Epochs"): every call carries the client's safe epoch D. By default libkvc
 * reports the latest epoch it has seen, which is right for a client with no asynchronous
 * kernels (kvctl, tests, CPU engines). An engine with GPU kernels in flight calls this with
 * min(tag of its oldest in-flight kernel, kvc_epoch()) instead; from then on libkvc reports
 * only what the engine declared. */
void kvc_set_safe_epoch(kvc_t *c, uint64_t safe_epoch);

/* ---- pipelining -------------------------------------------------------------------------- */
/* Fill version and a fresh id into req, pack and send. req stays owned by the caller and may
 * be sent again: completed_epoch, when 0, is filled in the packed bytes only (the safe epoch
 * of each send). INVALID_ARGUMENT, nothing sent, when the packed request is over the daemon's
 * max_msg_bytes (told at hello): the daemon would drop it unanswered with the connection, and
 * the session with it. Every typed call goes through here. */
kv_err_t kvc_send(kvc_t *c, Kvd__Request *req, uint64_t *id);
/* Wait for the reply to id. On KV_ERR_OK or on a daemon error status, *rep is the reply (free
 * with kvc_reply_free) and the return value is its status; on a local failure *rep is NULL:
 * TIMEOUT, MALFORMED (a frame that did not decode: its request is unknown, so it fails the
 * call that met it), VERSION_MISMATCH (a reply in another protocol version, both named),
 * PERMISSION_DENIED, RESOURCE_EXHAUSTED (65 536 replies already wait unclaimed: the one that
 * came is dropped, an alloc's pages released). After a local failure here the caller may
 * wait for id again. After one of a synchronous call (kvc_call and the typed calls below)
 * nobody can: its reply is dropped when it comes, however many such calls wait, and the
 * pages an alloc or a lookup without peek took are released then (for a seal see
 * kvc_seal). Replies to ids no kvc_send gave out yet are dropped on arrival. */
kv_err_t kvc_recv(kvc_t *c, uint64_t id, Kvd__Reply **rep);
/* Send raw bytes as one request (tests of malformed input); take its reply with kvc_recv_any
 * (kvc_recv drops replies to ids kvc_send has not given out). */
kv_err_t kvc_send_raw(kvc_t *c, const void *buf, size_t len);
/* Wait for the next reply whatever its id (replies to requests sent before the last hello are
 * dropped, as kvc_recv drops them). */
kv_err_t kvc_recv_any(kvc_t *c, Kvd__Reply **rep);
kv_err_t kvc_call(kvc_t *c, Kvd__Request *req, Kvd__Reply **rep);
void kvc_reply_free(Kvd__Reply **rep);

/* ---- typed calls (synchronous) ----------------------------------------------------------- */
/* pages[n] receives logical ids, each with one reference held by this session. MALFORMED when
 * the reply holds another count or an id past the directory: the pages it named are released
 * (kvc_alloc_recv the same). */
kv_err_t kvc_alloc(kvc_t *c, kv_fmt_t f, uint32_t n, uint32_t *pages);
/* kvc_alloc of n pages that are the first of `reserve` this client is about to allocate in
 * this and its next calls (an allocation larger than the daemon's max_alloc, in chunks;
 * AllocReq.reserve, docs/protocol.md). When reserve > n the daemon first checks that the pool
 * could provide all `reserve` pages now (free, freeable and evictable cache entries) and, when
 * it could not, answers RESOURCE_EXHAUSTED naming the numbers, with nothing allocated and no
 * cache entry evicted: a chunked allocation that would fail costs no cached prefix. A check,
 * not a reservation: a later chunk may still fail when another client took the pages in
 * between. reserve 0 or n: kvc_alloc. INVALID_ARGUMENT (the daemon's) for 0 < reserve < n or
 * reserve > 2^31 (KVP_MAX_RESERVE). A daemon older than the field ignores it (no check). */
kv_err_t kvc_alloc_reserve(kvc_t *c, kv_fmt_t f, uint32_t n, uint32_t reserve, uint32_t *pages);
/* prev = KVP_NO_PAGE for the first page. tokens[n] with n == page_tokens. *out_page is the page
 * that holds the content now (the request's page, or a cached duplicate; see SealRep);
 * MALFORMED when the reply names one past the directory.
 * A seal that fails without its reply (TIMEOUT) may still be applied, and if it is a dedupe
 * the daemon moves this session's references on `page` to the cached page Q. libkvc learns Q
 * from the late reply and from then on sends Q where the caller names `page` in kvc_release,
 * kvc_release_send, kvc_seq_append and the prev of kvc_seal, until a reply the caller receives
 * grants it `page` again (the id reused: an alloc, a lookup without peek, a seal's page; not a
 * peek, nor a late reply libkvc releases itself). Each of those calls first waits (up to the
 * timeout) for that reply when it names `page` before the reply came; TIMEOUT, nothing sent,
 * when it does not come (a second call no longer waits). Kernels must not read `page` after
 * such a TIMEOUT: it may be retired; release it (or seq_close) and look the tokens up again. */
kv_err_t kvc_seal(kvc_t *c, uint32_t page, uint32_t prev, const uint32_t *tokens, size_t n,
                  const void *extra, size_t extra_len, uint32_t *out_page);
/* pages[cap] receives the matched pages (referenced unless peek); *npages their count;
 * *tokens_matched never exceeds the tokens of the pages returned. MALFORMED (the reply's pages
 * released unless peek, *npages 0) when the reply names more pages than n tokens fill, more
 * tokens than its pages hold, or an id past the directory. Matched pages beyond cap are
 * released before returning; when that release fails, so does the call (*npages 0), and the
 * pages it would have returned are released too (all of them unless the failed release may
 * still be applied: a TIMEOUT). */
kv_err_t kvc_lookup(kvc_t *c, const uint32_t *tokens, size_t n, const void *extra,
                    size_t extra_len, int peek, uint32_t *pages, size_t cap, size_t *npages,
                    uint32_t *tokens_matched);
kv_err_t kvc_release(kvc_t *c, const uint32_t *pages, size_t n);
kv_err_t kvc_seq_open(kvc_t *c, const char *tag, uint64_t *seq);
kv_err_t kvc_seq_append(kvc_t *c, uint64_t seq, const uint32_t *pages, size_t n);
kv_err_t kvc_seq_close(kvc_t *c, uint64_t seq);
kv_err_t kvc_heartbeat(kvc_t *c, uint64_t completed_epoch);
/* End the session now, as the process's exit would (GoodbyeReq): its references are dropped,
 * its sequences closed, and it stops holding back page recycling. Call it only when no kernel
 * this client launched on the pools is still in flight (synchronize first). The mappings stay;
 * calls that need a session fail with NO_SESSION until kvc_hello. *released (may be NULL): the
 * request references the session held. kvc_close does not say goodbye: it cannot know whether
 * kernels are still running. */
kv_err_t kvc_goodbye(kvc_t *c, uint64_t *released);

/* Pipelined halves of the hot calls. */
kv_err_t kvc_alloc_send(kvc_t *c, kv_fmt_t f, uint32_t n, uint64_t *id);
kv_err_t kvc_alloc_recv(kvc_t *c, uint64_t id, uint32_t n, uint32_t *pages);
kv_err_t kvc_release_send(kvc_t *c, const uint32_t *pages, size_t n, uint64_t *id);
kv_err_t kvc_lookup_send(kvc_t *c, const uint32_t *tokens, size_t n, int peek, uint64_t *id);

#endif /* KVC_H */
