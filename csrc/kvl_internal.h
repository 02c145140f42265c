/* kvl_internal.h - types shared by the engine's C files; not part of the API.
 * Internal symbols carry the kvl__ prefix.
 *
 * The files form layers, each calling only into layers below it (checked by
 * tests/transport/test_c_layers.py):
 *   kvl_engine.c                      the public entry points, on top
 *   kvl_client.c  kvl_server.c        requester streams, responder threads
 *   kvl_local.c                       the same-host path of both
 *   kvl_request.c                     one request on a requester stream
 *   kvl_batch.c kvl_region.c kvl_auth.c kvl_crc32c.c
 *   kvl_events.c kvl_notifs.c kvl_sock.c kvl_proto.c kvl_sha256.c kvl_err.c
 *   kvl_owner.c
 *
 * Lock comments: "mu" names the lock of the struct the field is in; "set
 * before publication" means written once before another thread can see the
 * object (through a lock or a thread start) and read-only afterwards. */
#ifndef KVL_INTERNAL_H
#define KVL_INTERNAL_H

#include "kvl.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <time.h>

typedef struct {
  const void *p;
  size_t n;
} kvl__bytes;

/* Every condition variable here waits on CLOCK_MONOTONIC. */
static inline void kvl__cond_init(pthread_cond_t *cv) {
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(cv, &ca);
  pthread_condattr_destroy(&ca);
}

/* Grow a scratch buffer to at least need bytes (per batch or connection,
 * never per descriptor). */
static inline int kvl__grow(void **p, size_t *cap, size_t need) {
  if (need <= *cap) return 0;
  void *n = realloc(*p, need);
  if (!n) return KVL_ENOMEM;
  *p = n;
  *cap = need;
  return 0;
}

/* ---- time (kvl_sock.c), crypto (kvl_sha256.c, kvl_auth.c) -------------- */
uint64_t kvl__now_ms(void);
uint64_t kvl__now_us(void); /* CLOCK_MONOTONIC, like every condition variable here */
void kvl__sha256(const void *data, size_t len, uint8_t out[32]);
void kvl__hmac_sha256(const uint8_t *key, size_t key_len, const kvl__bytes *parts, int nparts, uint8_t out[32]);
int kvl__ct_equal(const uint8_t *a, const uint8_t *b, size_t n);
int kvl__random(uint8_t *p, size_t n); /* getrandom, kvl_auth.c */

/* ---- wire format (kvl_proto.c; documented in docs/protocol.md) ---------- */
#define KVL__MAGIC 0x4B4C564Bu /* bytes 'K' 'V' 'L' 'K' */
#define KVL__HDR_LEN 16
#define KVL__NONCE_LEN 32
#define KVL__MAC_LEN 32
#define KVL__WDESC_LEN 24
#define KVL__F_CRC 0x1u

enum {
  KVL__T_HELLO = 1,
  KVL__T_CHALLENGE = 2,
  KVL__T_AUTH = 3,
  KVL__T_WELCOME = 4,
  KVL__T_READ_REQ = 5,
  KVL__T_READ_RESP = 6,
  KVL__T_WRITE_REQ = 7,
  KVL__T_WRITE_RESP = 8,
  KVL__T_NOTIFY = 9,
  KVL__T_NOTIFY_ACK = 10,
  KVL__T_ERROR = 15,
  KVL__T_LPROBE = 16,      /* same-host path, see kvl_local.c */
  KVL__T_LPROBE_RESP = 17,
  KVL__T_LREAD_REQ = 18,
  KVL__T_LREAD_RESP = 19,
  KVL__T_LDONE = 20,
  KVL__T_LDONE_ACK = 21,
};
#define KVL__BOOT_ID_LEN 36
#define KVL__PROBE_BODY (4 + 4 + KVL__BOOT_ID_LEN + KVL__NONCE_LEN + 8)
#define KVL__LOCAL_MIN_BYTES (64u * 1024u) /* smaller READs stay on TCP: fewer round trips */
#define KVL__LOCAL_MIN_AVG 4096u           /* so do tiny descriptors: the kernel walks pages per iovec */

typedef struct {
  uint8_t version, type;
  uint16_t flags;
  uint32_t seq, body_len;
} kvl__hdr;

typedef struct { /* HELLO and CHALLENGE */
  uint8_t nonce[KVL__NONCE_LEN];
  uint8_t mac[KVL__MAC_LEN]; /* CHALLENGE only */
  uint8_t auth;              /* 1 if the sender holds a token */
  char name[KVL_MAX_NAME + 1];
} kvl__hello;

typedef struct { /* READ_RESP, WRITE_RESP, NOTIFY_ACK, ERROR */
  int32_t status;
  uint32_t index; /* offending descriptor, if any */
  uint64_t total; /* data bytes that follow (READ_RESP) */
  char msg[KVL_MAX_EVENT_MSG + 1];
} kvl__status;

typedef struct { /* one descriptor as it crosses the wire */
  uint32_t region;
  uint64_t offset, length;
} kvl__wdesc;

void kvl__put_u32(uint8_t *p, uint32_t v);
void kvl__put_u64(uint8_t *p, uint64_t v);
uint32_t kvl__get_u32(const uint8_t *p);
uint64_t kvl__get_u64(const uint8_t *p);

void kvl__hdr_encode(uint8_t out[KVL__HDR_LEN], uint8_t type, uint16_t flags, uint32_t seq, uint32_t body_len);
int kvl__hdr_decode(const uint8_t in[KVL__HDR_LEN], kvl__hdr *h, char *why, size_t cap);
size_t kvl__hello_encode(uint8_t *out, uint8_t type, const kvl__hello *h); /* body only */
int kvl__hello_decode(const uint8_t *body, size_t len, uint8_t type, kvl__hello *h, char *why, size_t cap);
size_t kvl__status_encode(uint8_t *out, const kvl__status *s);
int kvl__status_decode(const uint8_t *body, size_t len, kvl__status *s, char *why, size_t cap);
/* READ_REQ/WRITE_REQ body: u32 count, u32 reserved, count x wdesc. */
int kvl__descs_check(const uint8_t *body, size_t len, uint32_t *count, char *why, size_t cap);
void kvl__wdesc_get(const uint8_t *body, uint32_t i, kvl__wdesc *d);
void kvl__wdesc_put(uint8_t *body, uint32_t i, const kvl__wdesc *d);
#define KVL__STATUS_MAX (4 + 4 + 8 + 2 + KVL_MAX_EVENT_MSG)

/* ---- sockets (kvl_sock.c) ------------------------------------------------ */
#define KVL__SLICE_MS 100 /* longest a socket call blocks before re-checking */
#define KVL__IOV_MAX 1024
#define KVL__DRAIN_MAX (256ull << 20) /* most bytes of a refused WRITE we swallow */
int kvl__listen(const char *host, uint16_t port, int *fd_out, uint16_t *port_out, int *is_loopback);
int kvl__connect(const char *host, uint16_t port, uint32_t timeout_ms, const int *closing, int *fd_out);
void kvl__sock_tune(int fd);
/* TCP keepalive of every connection: the first probe after this long idle (well inside the 350 s and up
 * idle timeouts of common NATs and load balancers), then one every interval; the peer is declared gone
 * after that many unanswered. */
#define KVL__KEEPALIVE_IDLE_S 60
#define KVL__KEEPALIVE_INTVL_S 10
#define KVL__KEEPALIVE_CNT 3
/* A responder: connections in their handshake at once (at most a quarter of max_conns, and this many: each
 * holds a thread until it authenticates or its handshake times out), and the buffer bytes a connection
 * keeps between requests. */
#define KVL__PENDING_MAX 128u
#define KVL__CONN_KEEP (256u << 10)
void kvl__peer_str(int fd, char *buf, size_t cap);
/* Send/receive every byte of iov before deadline (0: none); closing is polled
 * between slices. iov is consumed. */
int kvl__sendv(int fd, struct iovec *iov, int n, uint64_t deadline, const int *closing);
int kvl__recvv(int fd, struct iovec *iov, int n, uint64_t deadline, const int *closing);
/* Wait without deadline until fd is readable (or closed), polling closing. */
int kvl__wait_readable(int fd, const int *closing);
/* Receive a frame header, waiting without deadline for its first byte and
 * with `timeout_ms` for the rest. KVL_EPEERCLOSED with *orderly=1 means the
 * peer closed between frames. */
int kvl__recv_header(int fd, uint8_t *hb, uint32_t timeout_ms, const int *closing, int *orderly);
int kvl__send_all(int fd, const void *p, size_t len, uint64_t deadline, const int *closing);
/* KVL_ECLOSED once closing is set, KVL_ETIMEDOUT past deadline (0: none), else 0. */
int kvl__waited_too_long(uint64_t deadline, const int *closing);
/* Continue *crc (CRC32C) over len bytes at p, a slice of KVL__CRC_SLICE at a
 * time, giving up between slices past deadline or once closing is set: a
 * peer's descriptors may ask for terabytes of checksums. */
#define KVL__CRC_SLICE (1u << 20)
int kvl__crc_until(uint32_t *crc, const void *p, size_t len, uint64_t deadline, const int *closing); /* kvl_crc32c.c */
int kvl__recv_all(int fd, void *p, size_t len, uint64_t deadline, const int *closing);

/* ---- regions (kvl_region.c) -------------------------------------------- */
typedef struct {
  uint64_t addr, len; /* regions' mu; also read without it by kvl__regions_resolve while pinned */
  uint32_t access;
  uint32_t gen; /* 1..KVL__GEN_MAX (kvl_region.c) */
  uint8_t state; /* 0 free, 1 active, 2 draining */
  uint64_t inflight; /* pins held by requests being served */
} kvl__region;

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t drained;
  uint32_t count;                    /* mu */
  uint32_t next;                     /* mu: the slot the next registration tries first (in turn) */
  kvl__region slot[KVL_MAX_REGIONS]; /* mu */
} kvl__regions;

void kvl__regions_init(kvl__regions *t);
void kvl__regions_destroy(kvl__regions *t);
int kvl__regions_add(kvl__regions *t, uint64_t addr, uint64_t len, uint32_t access, uint32_t *id);
int kvl__regions_remove(kvl__regions *t, uint32_t id, uint32_t timeout_ms);
/* Validate all descriptors and pin their regions; on failure *bad is the
 * index of the refused descriptor and nothing stays pinned. */
int kvl__regions_acquire(kvl__regions *t, const uint8_t *body, uint32_t count, uint32_t need, uint32_t *bad,
                         char *why, size_t cap);
int kvl__regions_resolve(kvl__regions *t, const uint8_t *body, uint32_t first, uint32_t n, struct iovec *out);
void kvl__regions_release(kvl__regions *t, const uint8_t *body, uint32_t count);
uint32_t kvl__regions_count(kvl__regions *t);

/* ---- queues the caller drains (kvl_events.c, kvl_notifs.c) ---------------- */
#define KVL__EVENTS 128
typedef struct {
  int code;
  char msg[KVL_MAX_EVENT_MSG + 1];
} kvl__event;

typedef struct { /* a ring that keeps the newest KVL__EVENTS */
  pthread_mutex_t mu;
  kvl__event ring[KVL__EVENTS]; /* mu */
  uint32_t head, count;         /* mu */
  uint64_t dropped;             /* mu */
} kvl__events;

void kvl__events_init(kvl__events *q);
void kvl__events_destroy(kvl__events *q);
void kvl__event_log(kvl__events *q, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int kvl__events_pop(kvl__events *q, int *code, char *msg, size_t cap); /* 1 if one, 0 if none */
uint64_t kvl__events_dropped(kvl__events *q);

#define KVL__NOTIF_MAX 65536
#define KVL__NOTIF_MAX_BYTES (16u << 20) /* payload bytes queued, at most */
typedef struct kvl__notif kvl__notif;
typedef struct { /* FIFO of received notifications, at most KVL__NOTIF_MAX and KVL__NOTIF_MAX_BYTES */
  pthread_mutex_t mu;
  kvl__notif *head, *tail; /* mu */
  uint32_t count;          /* mu */
  size_t bytes;            /* mu: payload bytes queued */
  uint64_t dropped;        /* mu */
} kvl__notifs;

void kvl__notifs_init(kvl__notifs *q);
void kvl__notifs_destroy(kvl__notifs *q); /* frees what was never popped */
int kvl__notifs_push(kvl__notifs *q, const char *from, const uint8_t *data, size_t len); /* KVL_EFULL: dropped */
int kvl__notifs_pop(kvl__notifs *q, char *from, size_t from_cap, void *buf, size_t cap, size_t *len_out);
uint64_t kvl__notifs_dropped(kvl__notifs *q);

/* ---- engine internals ---------------------------------------------------- */
typedef struct kvl__stream kvl__stream;
typedef struct kvl__peer kvl__peer;
typedef struct kvl__conn kvl__conn;

typedef struct { /* one descriptor of a batch, after coalescing */
  uint64_t local;
  uint64_t offset, length;
  uint32_t region;
} kvl__desc;

typedef struct kvl__part {
  kvl_batch *batch;         /* batch, engine, first, count: set before publication */
  kvl_engine *engine;
  uint32_t first, count;    /* range in batch->desc */
  kvl__stream *running_on;  /* the stream sending it; batch->mu */
  kvl__stream *queued_on;   /* set at enqueue, before publication */
  int queued;               /* still in the queue; the stream's mu */
  uint64_t grace_until_us;  /* the worker leaves it to a waiter until then; set at enqueue */
  struct kvl__part *next;   /* the stream's mu */
} kvl__part;

enum { KVL__B_RUNNING = 0, KVL__B_DONE = 1, KVL__B_FAILED = 2 };

struct kvl_batch {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int state;           /* KVL__B_*; mu */
  int err;             /* mu */
  int active_io;       /* workers inside a receive into our memory; mu */
  int refs;            /* mu */
  uint32_t parts_done, parts_finished; /* mu */
  /* Set by kvl__batch_build before publication, read-only afterwards: */
  int op;              /* KVL_OP_* or 0 for a notification */
  uint32_t parts_total;
  uint64_t deadline_ms;
  uint64_t total_bytes;
  size_t ndesc;
  kvl__desc *desc;
  kvl__part *parts;
  const void *payload; /* notification */
  size_t payload_len;
  /* Written under mu, once, when the batch fails; read without the lock only
   * once the batch is visibly finished (kvl_batch_message). */
  char msg[KVL_MAX_EVENT_MSG + 1];
};

/* Called with b->mu held: move to FAILED and stop every worker touching b. */
void kvl__batch_fail_locked(kvl_batch *b, int err, const char *msg);
void kvl__batch_unref(kvl_batch *b);
void kvl__part_finish(kvl__part *pt, int rc, const char *msg);
/* Bracket a receive into the batch's memory; enter fails once it finished. */
int kvl__batch_enter_io(kvl_batch *b);
void kvl__batch_leave_io(kvl_batch *b);
/* kvl_batch_wait without the steal (which kvl_engine.c does first). */
int kvl__batch_wait(kvl_batch *b, uint32_t timeout_ms);
int kvl__batch_build(kvl_engine *e, int op, int nstreams, const uint64_t *local, const uint32_t *regions,
                     size_t n_regions, const uint64_t *offsets, const uint64_t *lengths, size_t n_lengths, size_t n,
                     uint64_t deadline, kvl_batch **out, char *why, size_t cap);
int kvl__batch_notify(kvl_engine *e, const void *data, size_t len, uint64_t deadline, kvl_batch **out);

/* A stream is claimed (busy) by one thread at a time, its worker or a waiter
 * that steals a part; the claim is taken and dropped under mu. The fields
 * from fd down belong to the claiming thread and need no lock. */
struct kvl__stream {
  kvl__peer *peer;        /* set before publication */
  int index;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  kvl__part *head, *tail; /* queue; mu */
  int busy;               /* claimed: a thread is running a part on fd; mu */
  int lingering;          /* the worker ticks and needs no signal; mu */
  uint64_t last_active_us; /* last claim; mu */
  pthread_t thread;       /* thread, started: kvl_peer_connect and kvl_engine_destroy */
  int started;
  /* -1 when disconnected. kvl__batch_fail_locked also reads it (under the
   * batch's mu) to shutdown() the socket of a part running_on this stream:
   * the claiming thread neither replaces nor closes fd while running_on is set. */
  int fd;
  uint32_t seq;
  uint8_t *buf;           /* request encoding buffer */
  size_t cap;
  uint32_t *crcs;
  size_t crc_cap;
  uint64_t *addrs;        /* same-host: the peer's addresses of a part */
  size_t addr_cap;
  struct iovec iov[KVL__IOV_MAX];
  struct iovec riov[KVL__IOV_MAX]; /* same-host: remote side */
};

typedef struct {  /* what the same-host probe found (kvl_local.c) */
  int ok;         /* READs copy the peer's memory directly */
  int pid;
  char why[KVL_MAX_EVENT_MSG + 1];
} kvl__local_peer;

/* A peer lives in one slot of the engine's table. Its id carries the slot
 * and the slot's generation, so an id outlives its peer harmlessly: once the
 * peer is freed (retired, or idle and evicted to make room) the id names
 * nothing, never the slot's next occupant. A call that uses a peer holds a
 * reference (refs) from its lookup to the end of its enqueue; a peer leaves
 * the table only at refs 0, so no part is queued on a stopped peer's streams
 * after its threads have failed what was queued. */
#define KVL__PEER_SLOT_BITS 12 /* KVL_MAX_PEERS slots */
_Static_assert((1u << KVL__PEER_SLOT_BITS) >= KVL_MAX_PEERS, "a peer id's slot bits must name every slot");
#define KVL__PEER_SLOT(id) ((id) & ((1u << KVL__PEER_SLOT_BITS) - 1u))
#define KVL__PEER_GEN(id) ((id) >> KVL__PEER_SLOT_BITS)
#define KVL__PEER_GENS (1u << (32 - KVL__PEER_SLOT_BITS)) /* a slot that used them all is never taken again */
struct kvl__peer { /* set by kvl_peer_connect before publication; the fields marked aside, read-only afterwards */
  kvl_engine *e;
  uint32_t id;
  char host[256];
  uint16_t port;
  char name[KVL_MAX_NAME + 1];
  int nstreams;
  uint64_t used_us;  /* last connected or found by a connect; e->mu (eviction: the least recent of this and use) */
  uint64_t heard;    /* when its first handshake named it, in e->heard order (e->mu): which of two names is newer */
  uint32_t rr; /* next stream for a one-part batch (atomic) */
  int changed; /* another engine answered at its address (atomic): retired, a connect opens a new peer */
  int refs;    /* calls using it now; e->mu */
  int stop_rc; /* atomic: 0, or out of the table: what a queued part fails with (its threads exit when idle) */
  int running; /* stream threads not yet exited (atomic) */
  kvl__peer *next_grave; /* out of the table, threads not yet joined: the engine's graves list; e->mu */
  kvl__local_peer local; /* set at connect; a reconnect checks the process is still the one probed */
  kvl__stream streams[KVL_MAX_STREAMS];
};

struct kvl_engine {
  /* Set by kvl_engine_create, read-only until kvl_engine_destroy: */
  kvl_config cfg;       /* strings below are owned copies */
  char name[KVL_MAX_NAME + 1];
  char listen_host[256];
  uint8_t *token;
  uint8_t boot_id[KVL__BOOT_ID_LEN]; /* same-host probe: this kernel's boot id */
  uint8_t cookie[KVL__NONCE_LEN];    /* same-host probe: random bytes peers read back */
  int listen_fd;        /* accepted on by the listener thread only */
  uint16_t port;
  pthread_t listener;
  int has_listener;

  int closing;          /* atomic; set once by destroy */
  kvl__regions regions; /* own lock */
  kvl__events events;   /* own lock */
  kvl__notifs notifs;   /* own lock */

  pthread_mutex_t mu;         /* guards peers, gens, gone and each peer's refs (destroy reads them alone) */
  kvl__peer *peers[KVL_MAX_PEERS]; /* by slot; NULL: free */
  uint32_t gens[KVL_MAX_PEERS];    /* the generation the slot's next peer gets */
  int gone[KVL_MAX_PEERS];         /* why the slot's last peer was freed (KVL_EPEERCHANGED, KVL_ENOPEER) */
  uint32_t last_slot;              /* the slot a peer last took (free slots are taken round the table) */
  uint64_t heard;                  /* handshakes that named a peer being connected, counted (e->mu) */
  kvl__peer *graves;               /* peers out of the table whose threads may still run (kvl_engine.c) */
  pthread_mutex_t conns_mu;   /* guards conns, nconns and each conn's next and done (kvl_server.c) */
  kvl__conn *conns;
  uint32_t nconns;
  uint32_t npending;          /* of nconns, still in their handshake (conns_mu) */

  /* Counters, added to and read with atomics (KVL__STAT_ADD). The dropped
   * counts, server_conns and regions are not kept here: kvl_engine_stats asks
   * the queues, the responder and the region table. */
  kvl_stats stats;
};

#define KVL__STAT_ADD(e, field, v) __atomic_fetch_add(&(e)->stats.field, (v), __ATOMIC_RELAXED)

/* handshake (kvl_auth.c) */
/* limit_ms: an absolute deadline that cuts the handshake timeout short (a batch's on reconnect; 0: none). */
int kvl__handshake_client(kvl_engine *e, int fd, uint64_t limit_ms, char *peer_name, char *why, size_t cap);
/* admit(arg), called once the client has proven itself and before it is welcomed: 0 if the connection was
 * dropped meanwhile (kvl_server.c's make_room), which fails the handshake instead of welcoming a dead one. */
int kvl__handshake_server(kvl_engine *e, int fd, char *peer_name, char *why, size_t cap, int (*admit)(void *),
                          void *arg);
/* accepted connections (kvl_server.c) */
void kvl__server_accept(kvl_engine *e, int fd);
void kvl__server_reap(kvl_engine *e, int all);
uint32_t kvl__server_conns(kvl_engine *e);
/* requester streams (kvl_client.c) */
int kvl__stream_start(kvl__stream *s);
void kvl__stream_stop(kvl__stream *s);
/* Small one-part batches a waiter may run itself (see kvl__stream_steal). */
#define KVL__STEAL_MAX_BYTES (256u * 1024u)
#define KVL__STEAL_GRACE_US 300u
#define KVL__LINGER_US 50000u /* a worker busy this recently ticks ... */
#define KVL__TICK_US 1000u    /* ... this often, instead of sleeping */
void kvl__stream_enqueue(kvl__stream *s, kvl__part *pt, int stealable);
/* Run a single-part batch's part in the calling thread if no worker took it
 * yet, by until_ms at the latest (the batch's deadline is lowered to it). */
void kvl__stream_steal(kvl_batch *b, uint64_t until_ms);
/* 1 if the stream's connection, idle, was closed by the other end (kvl_peer_stale). */
int kvl__stream_idle_closed(kvl__stream *s);
/* one request on a stream, shared with the same-host path (kvl_request.c) */
int kvl__recv_status(kvl__stream *s, uint8_t type, uint32_t seq, kvl__status *st, uint64_t deadline, char *why,
                     size_t cap);
int kvl__send_request(kvl__stream *s, kvl__part *pt, uint8_t type, uint64_t deadline);
uint64_t kvl__part_bytes(const kvl__part *pt);
/* same-host path (kvl_local.c) */
int kvl__local_serve_probe(kvl_engine *e, int fd, uint32_t seq);
int kvl__local_serve_read(kvl_engine *e, int fd, const kvl__hdr *h, const uint8_t *body, uint64_t **addrs,
                          size_t *cap, char *why, size_t wcap);
/* nonzero: the connection is unusable; limit_ms as kvl__handshake_client's */
int kvl__local_probe(kvl_engine *e, int fd, uint64_t limit_ms, kvl__local_peer *lp);
int kvl__local_read(kvl__stream *s, kvl__part *pt, char *why, size_t cap);
/* 1 if process pid holds the other end of TCP connection fd, by the kernel's
 * tables; else 0 and why (kvl_owner.c) */
int kvl__holds_peer_end(int pid, int fd, char *why, size_t cap);
/* send an ERROR-class frame (status body) (kvl_auth.c) */
int kvl__send_status(int fd, uint8_t type, uint32_t seq, const kvl__status *st, uint64_t deadline, const int *closing);

#endif
