/* kvl.h - public C interface of the kvlink transport engine.
 *
 * Conventions (one for the whole library):
 *   0                 success
 *   KVL_INPROGRESS    (positive) the operation has not finished yet
 *   KVL_FINISHED      (positive) kvl_batch_cancel: nothing left to cancel
 *   negative KVL_E*   failure; kvl_err_name()/kvl_strerror() describe it
 * The engine owns its threads; none of them ever calls back into the caller.
 * Every blocking call is bounded by a timeout.
 */
#ifndef KVL_H
#define KVL_H

#include <stddef.h>
#include <stdint.h>

#define KVL_PROTOCOL_VERSION 1
#define KVL_INPROGRESS 1
#define KVL_FINISHED 2

/* X(name, value, message): the one table of error codes. */
#define KVL_ERRNO_MAP(X)                                                        \
  X(EINVAL, -1, "invalid argument")                                             \
  X(ENOMEM, -2, "out of memory")                                                \
  X(ESYS, -3, "system call failed")                                             \
  X(ETIMEDOUT, -4, "operation timed out")                                       \
  X(ECANCELED, -5, "operation canceled")                                        \
  X(ECONNECT, -6, "could not connect to peer")                                  \
  X(EPEERCLOSED, -7, "peer closed the connection")                              \
  X(EAUTH, -8, "authentication failed")                                         \
  X(EVERSION, -9, "protocol version mismatch")                                  \
  X(EPROTO, -10, "malformed frame")                                             \
  X(EACCESS, -11, "region access denied")                                       \
  X(ERANGE, -12, "request outside region bounds")                               \
  X(ENOREGION, -13, "unknown region")                                           \
  X(ECRC, -14, "checksum mismatch")                                             \
  X(EBUSY, -15, "resource busy")                                                \
  X(ECLOSED, -16, "engine closed")                                              \
  X(EINSECURE, -17, "refusing unauthenticated listener on non-loopback address") \
  X(ETOOBIG, -18, "length exceeds limit")                                       \
  X(ENOPEER, -19, "unknown peer")                                               \
  X(EFULL, -20, "queue full")                                                   \
  X(EREMOTE, -21, "peer reported an error")                                     \
  X(ELOCAL, -22, "same-host access not possible")                              \
  X(EPEERCHANGED, -23, "another engine answers at the peer's address")

enum {
#define KVL__ERR_ENUM(name, val, msg) KVL_##name = val,
  KVL_ERRNO_MAP(KVL__ERR_ENUM)
#undef KVL__ERR_ENUM
};

/* Region access flags: what peers may do with a registered region. */
#define KVL_ACCESS_NONE 0u
#define KVL_ACCESS_READ 1u
#define KVL_ACCESS_WRITE 2u

/* Batch operations. */
#define KVL_OP_READ 1  /* pull remote bytes into local memory */
#define KVL_OP_WRITE 2 /* push local bytes into remote memory */

/* Limits that bound everything a peer can make us allocate. */
#define KVL_MAX_NAME 64
#define KVL_MAX_NOTIFY 4096
#define KVL_MAX_DESC_PER_MSG 65536
#define KVL_MAX_STREAMS 16
#define KVL_MAX_REGIONS 4096
#define KVL_MAX_PEERS 4096     /* the largest peer table (kvl_config.max_peers) */
#define KVL_DEFAULT_PEERS 1024 /* the peer table's size when max_peers is 0 */
#define KVL_MAX_EVENT_MSG 200

typedef struct kvl_engine kvl_engine;
typedef struct kvl_batch kvl_batch;

typedef struct kvl_config {
  const char *listen_host;   /* NULL: initiator only, no listener */
  uint16_t listen_port;      /* 0: ephemeral */
  const uint8_t *token;      /* pre-shared token; NULL for none */
  size_t token_len;
  const char *name;          /* engine name sent to peers (<= KVL_MAX_NAME) */
  int streams;               /* TCP connections per peer, 1..KVL_MAX_STREAMS */
  int crc;                   /* verify CRC32C of every descriptor we receive */
  int allow_insecure;        /* permit a token-less listener off loopback */
  uint32_t op_timeout_ms;    /* default deadline of one batch */
  uint32_t connect_timeout_ms;
  uint32_t handshake_timeout_ms;
  uint32_t max_conns;        /* accepted connections served at once */
  int same_host;             /* 0 off, 1 auto (probe; TCP if refused), 2 require */
  uint32_t max_peers;        /* peer table size, 1..KVL_MAX_PEERS (0: KVL_DEFAULT_PEERS) */
} kvl_config;

typedef struct kvl_stats {
  uint64_t bytes_read;       /* pulled by our READ batches */
  uint64_t bytes_written;    /* pushed by our WRITE batches */
  uint64_t bytes_served;     /* sent or received for peers */
  uint64_t batches_ok;
  uint64_t batches_failed;
  uint64_t conns_accepted;
  uint64_t conns_rejected;   /* auth, version, protocol errors, over limit */
  uint64_t notifs_dropped;
  uint64_t events_dropped;
  uint64_t parts_inline;     /* run by the waiting thread (no hand-off) */
  uint64_t bytes_local;      /* of bytes_read, copied same-host (process_vm_readv) */
  uint64_t peers_freed;      /* retired (restarted) or evicted (idle, to make room) peers freed */
  uint32_t server_conns;     /* currently open accepted connections */
  uint32_t regions;
  uint32_t peers;            /* in the peer table (at most max_peers) */
} kvl_stats;

const char *kvl_err_name(int code);
/* Detail of the last failed kvl_peer_connect/kvl_submit/kvl_notify made by
 * the calling thread (empty if none). */
const char *kvl_last_message(void);
const char *kvl_strerror(int code);

void kvl_config_init(kvl_config *cfg);
int kvl_engine_create(const kvl_config *cfg, kvl_engine **out);
int kvl_engine_port(const kvl_engine *e);
/* Makes calls under way in other threads (a connect, a notify, a wait for
 * a region) give up soon with KVL_ECLOSED, and new ones fail at once; the
 * engine is still valid until kvl_engine_destroy. */
void kvl_engine_stop(kvl_engine *e);
/* Fails every batch in flight with KVL_ECLOSED, closes every connection and
 * joins every thread. No call on e may be under way in another thread.
 * Batches stay valid until kvl_batch_release. */
void kvl_engine_destroy(kvl_engine *e);
void kvl_engine_stats(kvl_engine *e, kvl_stats *out);

int kvl_region_register(kvl_engine *e, uint64_t addr, uint64_t len, uint32_t access, uint32_t *id_out);
/* Refuses new remote accesses at once, then waits for those in flight. */
int kvl_region_unregister(kvl_engine *e, uint32_t id, uint32_t timeout_ms);

/* The live peer at host:port, connected first if there is none. A peer id
 * is never reused: a peer retired (its address answers as another engine)
 * is freed once nothing uses it, and with max_peers in the table the
 * least recently used idle peer is closed to make room; calls naming a
 * freed peer's id fail (KVL_EPEERCHANGED, KVL_ENOPEER). KVL_EFULL: every
 * peer is busy. */
int kvl_peer_connect(kvl_engine *e, const char *host, uint16_t port, uint32_t *peer_out);
/* kvl_peer_connect, for the engine named expect only (NULL: any). A peer in
 * the table under another name is not returned: the address is asked again,
 * and if it now answers as another engine than that peer's, the peer is
 * retired (its process left the address). KVL_EPEERCHANGED if the address
 * answers as another engine than expect; nothing is kept of that connect. */
int kvl_peer_connect_as(kvl_engine *e, const char *host, uint16_t port, const char *expect, uint32_t *peer_out);
/* Name the peer announced during the handshake. */
int kvl_peer_name(kvl_engine *e, uint32_t peer, char *buf, size_t cap);
/* 1 if the peer may no longer be the process it named: retired, or one of
 * its connections was closed by the other end while idle (its process
 * ended, or the path dropped it); else 0. Nothing is sent. A caller that
 * keeps peers asks before it uses one again and, if 1, connects anew,
 * naming the engine it expects (kvl_peer_connect_as). */
int kvl_peer_stale(kvl_engine *e, uint32_t peer);
/* 1 if READs from this peer copy its memory directly (same host), else 0;
 * why says which, and why not. */
int kvl_peer_local(kvl_engine *e, uint32_t peer, char *why, size_t cap);

/* Submit a batch. The arrays are copied; remote_regions and lengths may be
 * given one value for all (stride 0) by passing n_regions/n_lengths = 1.
 * timeout_ms 0 means the engine's op_timeout_ms. */
int kvl_submit(kvl_engine *e, uint32_t peer, int op, const uint64_t *local_addrs,
               const uint32_t *remote_regions, size_t n_regions, const uint64_t *remote_offsets,
               const uint64_t *lengths, size_t n_lengths, size_t n, uint32_t timeout_ms,
               kvl_batch **out);
int kvl_batch_poll(kvl_batch *b);
/* On timeout the batch is canceled and KVL_ETIMEDOUT returned. */
int kvl_batch_wait(kvl_batch *b, uint32_t timeout_ms);
/* Stop a batch. Whatever it returns, once it returns the engine never writes
 * into the batch's memory again (it waits for a receive in progress to end).
 *   0             this call stopped the running batch: from now on
 *                 kvl_batch_poll/kvl_batch_wait report KVL_ECANCELED.
 *   KVL_FINISHED  the batch had already finished (done, failed, timed out
 *                 or canceled) before this call, which changed nothing:
 *                 kvl_batch_poll/kvl_batch_wait report that outcome, and a
 *                 batch that was done holds all its bytes.
 *   KVL_EINVAL    b is NULL. */
int kvl_batch_cancel(kvl_batch *b);
/* Message of a failed batch (valid until release). */
const char *kvl_batch_message(kvl_batch *b);
size_t kvl_batch_descriptors(kvl_batch *b); /* after coalescing */
/* Drops the caller's handle; a batch still running is canceled first (as by
 * kvl_batch_cancel), so its memory may be freed once this returns. */
void kvl_batch_release(kvl_batch *b);

int kvl_notify(kvl_engine *e, uint32_t peer, const void *data, size_t len, uint32_t timeout_ms);
/* Pops one received notification: returns 1 and fills the buffers, 0 if none. */
int kvl_notif_next(kvl_engine *e, char *from, size_t from_cap, void *buf, size_t cap, size_t *len_out);
/* Pops one logged event (a disconnected peer and why, ...): 1 if one, 0 if none. */
int kvl_event_next(kvl_engine *e, int *code, char *msg, size_t cap);

/* Pure frame decoder over a byte buffer (no socket): 0 if it holds one whole
 * valid frame, KVL_INPROGRESS if more bytes are needed, else a negative code
 * with the reason written to why. Used by the engine and fuzzed by the tests. */
int kvl_proto_check(const uint8_t *buf, size_t len, char *why, size_t why_cap);

uint32_t kvl_crc32c(uint32_t crc, const void *data, size_t len);

#endif
