/* Declarations cffi binds (a subset of csrc/kvl.h). Numbers come from the
 * compiler through "...", never copied. */
#define KVL_PROTOCOL_VERSION ...
#define KVL_INPROGRESS ...
#define KVL_FINISHED ...
#define KVL_ACCESS_NONE ...
#define KVL_ACCESS_READ ...
#define KVL_ACCESS_WRITE ...
#define KVL_OP_READ ...
#define KVL_OP_WRITE ...
#define KVL_MAX_NAME ...
#define KVL_MAX_NOTIFY ...
#define KVL_MAX_STREAMS ...
#define KVL_MAX_PEERS ...
#define KVL_DEFAULT_PEERS ...
#define KVL_MAX_EVENT_MSG ...
#define KVL_MAX_DESC_PER_MSG ...

static const int KVL_EINVAL, KVL_ENOMEM, KVL_ESYS, KVL_ETIMEDOUT, KVL_ECANCELED,
    KVL_ECONNECT, KVL_EPEERCLOSED, KVL_EAUTH, KVL_EVERSION, KVL_EPROTO, KVL_EACCESS,
    KVL_ERANGE, KVL_ENOREGION, KVL_ECRC, KVL_EBUSY, KVL_ECLOSED, KVL_EINSECURE,
    KVL_ETOOBIG, KVL_ENOPEER, KVL_EFULL, KVL_EREMOTE, KVL_ELOCAL, KVL_EPEERCHANGED;

typedef struct kvl_engine kvl_engine;
typedef struct kvl_batch kvl_batch;

typedef struct kvl_config {
  const char *listen_host;
  uint16_t listen_port;
  const uint8_t *token;
  size_t token_len;
  const char *name;
  int streams;
  int crc;
  int allow_insecure;
  uint32_t op_timeout_ms;
  uint32_t connect_timeout_ms;
  uint32_t handshake_timeout_ms;
  uint32_t max_conns;
  int same_host;
  uint32_t max_peers;
} kvl_config;

typedef struct kvl_stats {
  uint64_t bytes_read;
  uint64_t bytes_written;
  uint64_t bytes_served;
  uint64_t batches_ok;
  uint64_t batches_failed;
  uint64_t conns_accepted;
  uint64_t conns_rejected;
  uint64_t notifs_dropped;
  uint64_t events_dropped;
  uint64_t parts_inline;
  uint64_t bytes_local;
  uint64_t peers_freed;
  uint32_t server_conns;
  uint32_t regions;
  uint32_t peers;
} kvl_stats;

const char *kvl_err_name(int code);
const char *kvl_strerror(int code);
const char *kvl_last_message(void);

void kvl_config_init(kvl_config *cfg);
int kvl_engine_create(const kvl_config *cfg, kvl_engine **out);
int kvl_engine_port(const kvl_engine *e);
void kvl_engine_stop(kvl_engine *e);
void kvl_engine_destroy(kvl_engine *e);
void kvl_engine_stats(kvl_engine *e, kvl_stats *out);

int kvl_region_register(kvl_engine *e, uint64_t addr, uint64_t len, uint32_t access, uint32_t *id_out);
int kvl_region_unregister(kvl_engine *e, uint32_t id, uint32_t timeout_ms);

int kvl_peer_connect(kvl_engine *e, const char *host, uint16_t port, uint32_t *peer_out);
int kvl_peer_connect_as(kvl_engine *e, const char *host, uint16_t port, const char *expect, uint32_t *peer_out);
int kvl_peer_name(kvl_engine *e, uint32_t peer, char *buf, size_t cap);
int kvl_peer_stale(kvl_engine *e, uint32_t peer);
int kvl_peer_local(kvl_engine *e, uint32_t peer, char *why, size_t cap);

int kvl_submit(kvl_engine *e, uint32_t peer, int op, const uint64_t *local_addrs,
               const uint32_t *remote_regions, size_t n_regions, const uint64_t *remote_offsets,
               const uint64_t *lengths, size_t n_lengths, size_t n, uint32_t timeout_ms,
               kvl_batch **out);
int kvl_batch_poll(kvl_batch *b);
int kvl_batch_wait(kvl_batch *b, uint32_t timeout_ms);
int kvl_batch_cancel(kvl_batch *b);
const char *kvl_batch_message(kvl_batch *b);
size_t kvl_batch_descriptors(kvl_batch *b);
void kvl_batch_release(kvl_batch *b);

int kvl_notify(kvl_engine *e, uint32_t peer, const void *data, size_t len, uint32_t timeout_ms);
int kvl_notif_next(kvl_engine *e, char *from, size_t from_cap, void *buf, size_t cap, size_t *len_out);
int kvl_event_next(kvl_engine *e, int *code, char *msg, size_t cap);

int kvl_proto_check(const uint8_t *buf, size_t len, char *why, size_t why_cap);
uint32_t kvl_crc32c(uint32_t crc, const void *data, size_t len);
