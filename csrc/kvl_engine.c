/* kvl_engine.c - the engine object and the public entry points: the
 * configuration, the listener thread, peers, and the calls that hand work to
 * the files below it (streams, batches, the responder, the queues the caller
 * drains). It sits on top: nothing else in csrc/ calls into it. It owns every
 * thread it starts and joins them all in kvl_engine_destroy. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kvl_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

void kvl_config_init(kvl_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->streams = 2;
  cfg->op_timeout_ms = 30000;
  cfg->connect_timeout_ms = 5000;
  cfg->handshake_timeout_ms = 5000;
  cfg->max_conns = 4096;
  cfg->max_peers = KVL_DEFAULT_PEERS;
}

static void *listener_main(void *arg) {
  kvl_engine *e = arg;
  int starved = 0; /* accept is failing for want of a resource: logged once, then backed off */
  while (!__atomic_load_n(&e->closing, __ATOMIC_ACQUIRE)) {
    struct pollfd p = {e->listen_fd, POLLIN, 0};
    int r = poll(&p, 1, KVL__SLICE_MS);
    kvl__server_reap(e, 0);
    if (r <= 0) continue;
    int fd = accept4(e->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      if (err == EINTR || err == ECONNABORTED || err == EAGAIN || err == EWOULDBLOCK) continue;
      /* EMFILE, ENFILE, ENOMEM, ENOBUFS: the connection stays in the backlog and poll reports it at once;
       * without a pause the thread spins and floods the event ring. */
      if (!starved)
        kvl__event_log(&e->events, KVL_ESYS, "accept: %s; backing off until it succeeds", strerror(err));
      starved = 1;
      struct timespec ts = {0, (long)KVL__SLICE_MS * 1000000L};
      nanosleep(&ts, NULL);
      continue;
    }
    starved = 0;
    kvl__server_accept(e, fd);
  }
  return NULL;
}

static int config_ok(const kvl_config *cfg) {
  if (cfg->streams < 1 || cfg->streams > KVL_MAX_STREAMS || cfg->op_timeout_ms == 0 || cfg->connect_timeout_ms == 0 ||
      cfg->handshake_timeout_ms == 0 || cfg->max_conns == 0 || cfg->max_peers > KVL_MAX_PEERS ||
      (cfg->token && (cfg->token_len == 0 || cfg->token_len > 1024)) ||
      (cfg->name && strlen(cfg->name) > KVL_MAX_NAME) || (cfg->listen_host && strlen(cfg->listen_host) >= 256) ||
      cfg->same_host < 0 || cfg->same_host > 2)
    return 0;
  for (const char *c = cfg->name; c && *c; c++)
    if (*c < 0x20 || *c > 0x7e) return 0;
  return 1;
}

/* This kernel's boot id, read once for the same-host probe; zeros (which no
 * peer matches) where it cannot be read. */
static void read_boot_id(uint8_t out[KVL__BOOT_ID_LEN]) {
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (!f) return;
  if (fread(out, 1, KVL__BOOT_ID_LEN, f) != KVL__BOOT_ID_LEN) memset(out, 0, KVL__BOOT_ID_LEN);
  fclose(f);
}

/* The one way an engine is taken apart, shared by kvl_engine_create's unwind
 * and kvl_engine_destroy: every step is safe on a field create did not reach
 * (listen_fd -1, token NULL), and no thread of the engine runs any more. */
static void engine_free(kvl_engine *e) {
  if (e->listen_fd >= 0) close(e->listen_fd);
  kvl__notifs_destroy(&e->notifs);
  kvl__events_destroy(&e->events);
  kvl__regions_destroy(&e->regions);
  pthread_mutex_destroy(&e->conns_mu);
  pthread_mutex_destroy(&e->mu);
  free(e->token);
  free(e);
}

int kvl_engine_create(const kvl_config *cfg, kvl_engine **out) {
  if (!cfg || !out || !config_ok(cfg)) return KVL_EINVAL;
  kvl_engine *e = calloc(1, sizeof *e);
  if (!e) return KVL_ENOMEM;
  /* From here on everything engine_free undoes exists: each failure below
   * takes the one unwind path at the end. */
  e->listen_fd = -1;
  pthread_mutex_init(&e->mu, NULL);
  pthread_mutex_init(&e->conns_mu, NULL);
  kvl__events_init(&e->events);
  kvl__notifs_init(&e->notifs);
  kvl__regions_init(&e->regions);
  e->cfg = *cfg; /* its strings are replaced by owned copies below */
  if (!e->cfg.max_peers) e->cfg.max_peers = KVL_DEFAULT_PEERS;
  snprintf(e->name, sizeof e->name, "%s", cfg->name ? cfg->name : "");
  e->cfg.name = e->name;
  e->cfg.listen_host = NULL;
  e->cfg.token = NULL;
  int rc = 0;
  if (cfg->token) {
    if (!(e->token = malloc(cfg->token_len))) {
      rc = KVL_ENOMEM;
      goto fail;
    }
    memcpy(e->token, cfg->token, cfg->token_len);
    e->cfg.token = e->token;
  }
  if (kvl__random(e->cookie, sizeof e->cookie) != 0) {
    rc = KVL_ESYS;
    goto fail;
  }
  read_boot_id(e->boot_id);
  if (cfg->listen_host) {
    int loop = 0;
    snprintf(e->listen_host, sizeof e->listen_host, "%s", cfg->listen_host);
    e->cfg.listen_host = e->listen_host;
    if ((rc = kvl__listen(cfg->listen_host, cfg->listen_port, &e->listen_fd, &e->port, &loop)) != 0) goto fail;
    if (!loop && !e->token && !cfg->allow_insecure) {
      rc = KVL_EINSECURE;
      goto fail;
    }
    if (pthread_create(&e->listener, NULL, listener_main, e) != 0) {
      rc = KVL_ESYS;
      goto fail;
    }
    e->has_listener = 1;
  }
  *out = e;
  return 0;
fail:
  engine_free(e);
  return rc;
}

int kvl_engine_port(const kvl_engine *e) { return e->has_listener ? e->port : 0; }

/* Stop a peer's stream threads (each closes its own connection) and free it;
 * also undoes a peer whose connect failed before any thread started. */
static void peer_free(kvl__peer *p) {
  for (int k = 0; k < p->nstreams; k++) kvl__stream_stop(&p->streams[k]);
  for (int k = 0; k < p->nstreams; k++) {
    kvl__stream *s = &p->streams[k];
    if (s->fd >= 0) close(s->fd);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
  }
  free(p);
}

void kvl_engine_stop(kvl_engine *e) {
  if (e) __atomic_store_n(&e->closing, 1, __ATOMIC_RELEASE);
}

void kvl_engine_destroy(kvl_engine *e) {
  if (!e) return;
  kvl_engine_stop(e);
  if (e->has_listener) pthread_join(e->listener, NULL);
  for (uint32_t i = 0; i < e->cfg.max_peers; i++) /* fails what is queued, joins */
    if (e->peers[i]) peer_free(e->peers[i]);
  while (e->graves) {
    kvl__peer *p = e->graves;
    e->graves = p->next_grave;
    peer_free(p);
  }
  kvl__server_reap(e, 1);
  engine_free(e);
}

void kvl_engine_stats(kvl_engine *e, kvl_stats *out) {
  memset(out, 0, sizeof *out);
#define KVL__LOAD(field) out->field = __atomic_load_n(&e->stats.field, __ATOMIC_RELAXED)
  KVL__LOAD(bytes_read);
  KVL__LOAD(bytes_written);
  KVL__LOAD(bytes_served);
  KVL__LOAD(batches_ok);
  KVL__LOAD(batches_failed);
  KVL__LOAD(conns_accepted);
  KVL__LOAD(conns_rejected);
  KVL__LOAD(parts_inline);
  KVL__LOAD(bytes_local);
  KVL__LOAD(peers_freed);
#undef KVL__LOAD
  pthread_mutex_lock(&e->mu);
  for (uint32_t i = 0; i < e->cfg.max_peers; i++) out->peers += e->peers[i] != NULL;
  pthread_mutex_unlock(&e->mu);
  out->notifs_dropped = kvl__notifs_dropped(&e->notifs);
  out->events_dropped = kvl__events_dropped(&e->events);
  out->server_conns = kvl__server_conns(e);
  out->regions = kvl__regions_count(&e->regions);
}

int kvl_event_next(kvl_engine *e, int *code, char *msg, size_t cap) {
  return kvl__events_pop(&e->events, code, msg, cap);
}

int kvl_notif_next(kvl_engine *e, char *from, size_t from_cap, void *buf, size_t cap, size_t *len_out) {
  return kvl__notifs_pop(&e->notifs, from, from_cap, buf, cap, len_out);
}

int kvl_region_register(kvl_engine *e, uint64_t addr, uint64_t len, uint32_t access, uint32_t *id_out) {
  return kvl__regions_add(&e->regions, addr, len, access, id_out);
}

int kvl_region_unregister(kvl_engine *e, uint32_t id, uint32_t timeout_ms) {
  return kvl__regions_remove(&e->regions, id, timeout_ms);
}

/* Thread-local detail of the last failed call, read by the binding. */
static __thread char last_msg[KVL_MAX_EVENT_MSG + 1];
const char *kvl_last_message(void) { return last_msg; }

/* The peer an id names, held (refs) until peer_drop; NULL with *rc and
 * last_msg saying why when the id names no live peer. */
static kvl__peer *peer_hold(kvl_engine *e, uint32_t id, int *rc) {
  uint32_t slot = KVL__PEER_SLOT(id), gen = KVL__PEER_GEN(id);
  kvl__peer *p = NULL;
  *rc = KVL_ENOPEER;
  pthread_mutex_lock(&e->mu);
  if (e->peers[slot] && e->peers[slot]->id == id) (p = e->peers[slot])->refs++;
  int issued = gen < e->gens[slot];
  int known = gen + 1 == e->gens[slot]; /* the slot's last peer: what became of it is kept */
  if (!p && known) *rc = e->gone[slot];
  pthread_mutex_unlock(&e->mu);
  if (p || !issued) return p;
  if (*rc == KVL_EPEERCHANGED)
    snprintf(last_msg, sizeof last_msg, "peer %u was retired: another engine answers at its address", id);
  else
    snprintf(last_msg, sizeof last_msg, "peer %u was closed (%s): connect again", id,
             known ? "idle, to make room for another" : "retired or idle");
  return NULL;
}

static void peer_drop(kvl_engine *e, kvl__peer *p) {
  pthread_mutex_lock(&e->mu);
  p->refs--;
  pthread_mutex_unlock(&e->mu);
}

/* The live peer at host:port, or NULL (e->mu held). A retired one is not reused. */
static kvl__peer *find_peer(kvl_engine *e, const char *host, uint16_t port) {
  for (uint32_t i = 0; i < e->cfg.max_peers; i++) {
    kvl__peer *p = e->peers[i];
    if (p && p->port == port && strcmp(p->host, host) == 0 && !__atomic_load_n(&p->changed, __ATOMIC_ACQUIRE)) {
      p->used_us = kvl__now_us(); /* the caller is about to use it: not the one to evict next */
      return p;
    }
  }
  return NULL;
}

/* Tell a peer's stream threads to exit once idle, queued parts failing with
 * rc (e->mu held, refs 0: nothing can queue on it any more). */
static void peer_stop(kvl__peer *p, int rc) {
  __atomic_store_n(&p->stop_rc, rc, __ATOMIC_RELEASE);
  for (int k = 0; k < p->nstreams; k++) {
    pthread_mutex_lock(&p->streams[k].mu);
    pthread_cond_broadcast(&p->streams[k].cv);
    pthread_mutex_unlock(&p->streams[k].mu);
  }
}

/* Idle: no call holds it, no part queued or running on it; when it was last
 * used (e->mu held). */
static int peer_idle(kvl__peer *p, uint64_t *last_us) {
  int idle = p->refs == 0;
  *last_us = p->used_us;
  for (int k = 0; k < p->nstreams && idle; k++) {
    kvl__stream *s = &p->streams[k];
    pthread_mutex_lock(&s->mu);
    idle = !s->busy && !s->head;
    if (s->last_active_us > *last_us) *last_us = s->last_active_us;
    pthread_mutex_unlock(&s->mu);
  }
  return idle;
}

/* The peer in slot leaves the table (e->mu held): stopped, it waits in the
 * graveyard until its threads have exited, for take_slot or destroy to free. */
static void slot_free(kvl_engine *e, uint32_t slot, int why) {
  kvl__peer *p = e->peers[slot];
  peer_stop(p, why);
  p->next_grave = e->graves;
  e->graves = p;
  e->peers[slot] = NULL;
  e->gens[slot]++;
  e->gone[slot] = why;
  KVL__STAT_ADD(e, peers_freed, 1);
}

/* A free slot for a new peer, or -1 (e->mu held). On the way: retired peers
 * no call holds leave the table, and with no slot free the least recently
 * used idle peer is evicted (a prefill that went away leaves its peer idle
 * for good). Peers in the graveyard whose threads have all exited are
 * moved to reaped, to be freed (joined: at once) without the lock. */
static int take_slot(kvl_engine *e, kvl__peer **reaped) {
  for (kvl__peer **g = &e->graves; *g;) {
    kvl__peer *p = *g;
    if (__atomic_load_n(&p->running, __ATOMIC_ACQUIRE) > 0) {
      g = &p->next_grave;
      continue;
    }
    *g = p->next_grave;
    p->next_grave = *reaped;
    *reaped = p;
  }
  int free_slot = -1;
  for (uint32_t k = 0; k < e->cfg.max_peers; k++) {
    /* From the slot after the last one taken: a freed peer's slot is taken again as late as can be, so
     * its id's fate (gone) is told for the next max_peers connects, not overwritten at the next. */
    uint32_t i = (e->last_slot + 1 + k) % e->cfg.max_peers;
    kvl__peer *p = e->peers[i];
    if (p && p->refs == 0 && __atomic_load_n(&p->changed, __ATOMIC_ACQUIRE))
      slot_free(e, i, KVL_EPEERCHANGED); /* its queued parts fail; a running one ends by its deadline */
    if (!e->peers[i] && free_slot < 0 && e->gens[i] < KVL__PEER_GENS) free_slot = (int)i;
  }
  if (free_slot >= 0) return free_slot;
  int victim = -1;
  uint64_t oldest = UINT64_MAX, last;
  for (uint32_t i = 0; i < e->cfg.max_peers; i++)
    if (e->peers[i] && e->gens[i] + 1 < KVL__PEER_GENS && peer_idle(e->peers[i], &last) && last < oldest)
      victim = (int)i, oldest = last;
  if (victim >= 0) slot_free(e, (uint32_t)victim, KVL_ENOPEER);
  return victim;
}

/* Connect and authenticate stream k of a peer being connected; the first
 * names the peer, every other must hear the same name. */
static int open_stream(kvl__peer *p, int k, int first) {
  kvl_engine *e = p->e;
  kvl__stream *s = &p->streams[k];
  int rc = kvl__connect(p->host, p->port, e->cfg.connect_timeout_ms, &e->closing, &s->fd);
  if (rc) {
    snprintf(last_msg, sizeof last_msg, "connecting to %s:%u: %s", p->host, p->port, kvl_strerror(rc));
    return rc;
  }
  char name[KVL_MAX_NAME + 1];
  rc = kvl__handshake_client(e, s->fd, 0, name, last_msg, sizeof last_msg);
  if (rc == 0 && first) {
    memcpy(p->name, name, sizeof name);
    pthread_mutex_lock(&e->mu);
    p->heard = ++e->heard;
    pthread_mutex_unlock(&e->mu);
  } else if (rc == 0 && strcmp(name, p->name) != 0) {
    snprintf(last_msg, sizeof last_msg, "%s:%u answered as engine \"%s\", then \"%s\"", p->host, p->port, p->name,
             name);
    rc = KVL_EPEERCHANGED;
  }
  return rc;
}

int kvl_peer_connect(kvl_engine *e, const char *host, uint16_t port, uint32_t *peer_out) {
  return kvl_peer_connect_as(e, host, port, NULL, peer_out);
}

/* Connects without holding an engine lock (a silent peer delays only its own
 * callers); two concurrent connects to one address both handshake, and the
 * second to finish uses the first's peer. */
int kvl_peer_connect_as(kvl_engine *e, const char *host, uint16_t port, const char *expect, uint32_t *peer_out) {
  last_msg[0] = 0;
  if (!host || strlen(host) >= sizeof(((kvl__peer *)0)->host) || port == 0) return KVL_EINVAL;
  if (expect && (!*expect || strlen(expect) > KVL_MAX_NAME)) return KVL_EINVAL;
  if (__atomic_load_n(&e->closing, __ATOMIC_ACQUIRE)) return KVL_ECLOSED;
  int rc = 0;
  pthread_mutex_lock(&e->mu);
  kvl__peer *found = find_peer(e, host, port);
  if (found && (!expect || strcmp(found->name, expect) == 0)) *peer_out = found->id;
  else found = NULL; /* none, or one under another name: perhaps a process gone from the address, ask it */
  pthread_mutex_unlock(&e->mu);
  if (found) return 0;
  kvl__peer *p = calloc(1, sizeof *p);
  if (!p) return KVL_ENOMEM;
  p->e = e;
  snprintf(p->host, sizeof p->host, "%s", host);
  p->port = port;
  p->nstreams = e->cfg.streams;
  for (int k = 0; k < p->nstreams; k++) {
    kvl__stream *s = &p->streams[k];
    s->peer = p;
    s->index = k;
    s->fd = -1;
    pthread_mutex_init(&s->mu, NULL);
    kvl__cond_init(&s->cv);
  }
  for (int k = 0; k < p->nstreams && rc == 0; k++) {
    rc = open_stream(p, k, k == 0);
    if (rc == 0 && k == 0 && expect && strcmp(p->name, expect) != 0) { /* before opening the other streams */
      snprintf(last_msg, sizeof last_msg, "%s:%u answers as engine \"%s\", not \"%s\"", host, port, p->name,
               expect);
      rc = KVL_EPEERCHANGED;
    }
  }
  if (rc == 0 && e->cfg.same_host) {
    rc = kvl__local_probe(e, p->streams[0].fd, 0, &p->local);
    if (rc == KVL_ELOCAL && e->cfg.same_host == 1) { /* auto: an older engine is read over TCP */
      close(p->streams[0].fd);
      p->streams[0].fd = -1;
      rc = open_stream(p, 0, 0); /* it closed the connection the probe used */
    } else {
      if (rc == 0 && !p->local.ok && e->cfg.same_host == 2) rc = KVL_ELOCAL;
      if (rc) snprintf(last_msg, sizeof last_msg, "%s", p->local.why);
    }
  }
  kvl__peer *reaped = NULL; /* stopped peers whose threads have exited: freed below, without the lock */
  pthread_mutex_lock(&e->mu);
  found = p->heard ? find_peer(e, host, port) : NULL;
  if (found && strcmp(found->name, p->name) != 0) {
    if (found->heard < p->heard) {
      /* The address answered as ours after it named the table's peer: that peer's process left the address.
       * Retired: calls naming it fail KVL_EPEERCHANGED, and no connect returns it again. */
      __atomic_store_n(&found->changed, 1, __ATOMIC_RELEASE);
      found = NULL;
    } else if (rc == 0) { /* a connect that heard it after ours: ours named a process gone from the address */
      snprintf(last_msg, sizeof last_msg, "%s:%u answered as engine \"%s\", then \"%s\"", host, port, p->name,
               found->name);
      rc = KVL_EPEERCHANGED;
    }
  }
  if (rc == 0) {
    int slot = -1;
    if (found) {
      *peer_out = found->id; /* another call connected meanwhile, to the same engine: ours goes */
    } else if ((slot = take_slot(e, &reaped)) < 0) {
      rc = KVL_EFULL;
    } else {
      p->id = (uint32_t)slot | e->gens[slot] << KVL__PEER_SLOT_BITS;
      e->last_slot = (uint32_t)slot;
      p->used_us = kvl__now_us();
      for (int k = 0; k < p->nstreams && rc == 0; k++)
        if ((rc = kvl__stream_start(&p->streams[k])) == 0) __atomic_fetch_add(&p->running, 1, __ATOMIC_RELEASE);
      /* Threads that started serve until stopped: keep the peer so they are joined, retired if one failed. */
      if (rc) __atomic_store_n(&p->changed, 1, __ATOMIC_RELEASE);
      *peer_out = p->id;
      e->peers[slot] = p;
      p = NULL;
    }
    if (rc == KVL_EFULL)
      snprintf(last_msg, sizeof last_msg, "too many peers (%u, max_peers), none idle to make room",
               e->cfg.max_peers);
    else if (rc)
      snprintf(last_msg, sizeof last_msg, "cannot start a stream thread");
  }
  pthread_mutex_unlock(&e->mu);
  if (p) peer_free(p);
  while (reaped) {
    kvl__peer *q = reaped;
    reaped = q->next_grave;
    peer_free(q);
  }
  if (rc) {
    const char *why = last_msg[0] ? last_msg : kvl_strerror(rc);
    kvl__event_log(&e->events, rc, "connect to %s:%u failed: %s", host, port, why);
  }
  return rc;
}

int kvl_peer_name(kvl_engine *e, uint32_t peer, char *buf, size_t cap) {
  last_msg[0] = 0;
  int rc;
  kvl__peer *p = peer_hold(e, peer, &rc);
  if (!p) return rc;
  snprintf(buf, cap, "%s", p->name);
  peer_drop(e, p);
  return 0;
}

int kvl_peer_stale(kvl_engine *e, uint32_t peer) {
  last_msg[0] = 0;
  int rc;
  kvl__peer *p = peer_hold(e, peer, &rc); /* held: not stopped meanwhile, so its workers keep their fds */
  if (!p) return rc;
  int stale = __atomic_load_n(&p->changed, __ATOMIC_ACQUIRE) != 0;
  for (int k = 0; k < p->nstreams && !stale; k++) stale = kvl__stream_idle_closed(&p->streams[k]);
  peer_drop(e, p);
  return stale;
}

int kvl_peer_local(kvl_engine *e, uint32_t peer, char *why, size_t cap) {
  last_msg[0] = 0;
  int rc;
  kvl__peer *p = peer_hold(e, peer, &rc);
  if (!p) return rc;
  snprintf(why, cap, "%s", e->cfg.same_host ? p->local.why : "same-host path off");
  rc = p->local.ok;
  peer_drop(e, p);
  return rc;
}

int kvl_submit(kvl_engine *e, uint32_t peer, int op, const uint64_t *local_addrs, const uint32_t *remote_regions,
               size_t n_regions, const uint64_t *remote_offsets, const uint64_t *lengths, size_t n_lengths, size_t n,
               uint32_t timeout_ms, kvl_batch **out) {
  last_msg[0] = 0;
  if ((op != KVL_OP_READ && op != KVL_OP_WRITE) || n == 0 || !local_addrs || !remote_regions || !remote_offsets ||
      !lengths || (n_regions != 1 && n_regions != n) || (n_lengths != 1 && n_lengths != n) || !out)
    return KVL_EINVAL;
  if (__atomic_load_n(&e->closing, __ATOMIC_ACQUIRE)) return KVL_ECLOSED;
  int rc;
  kvl__peer *p = peer_hold(e, peer, &rc);
  if (!p) return rc;
  uint64_t deadline = kvl__now_ms() + (timeout_ms ? timeout_ms : e->cfg.op_timeout_ms);
  kvl_batch *b;
  rc = kvl__batch_build(e, op, p->nstreams, local_addrs, remote_regions, n_regions, remote_offsets, lengths,
                        n_lengths, n, deadline, &b, last_msg, sizeof last_msg);
  if (rc == 0) {
    uint32_t base = __atomic_fetch_add(&p->rr, 1, __ATOMIC_RELAXED);
    uint32_t np = b->parts_total; /* b may finish (and drop part refs) once enqueued */
    int stealable = np == 1 && b->total_bytes <= KVL__STEAL_MAX_BYTES;
    for (uint32_t i = 0; i < np; i++)
      kvl__stream_enqueue(&p->streams[(base + i) % p->nstreams], &b->parts[i], stealable);
    *out = b;
  }
  peer_drop(e, p); /* queued: a stop now fails the parts, it cannot strand them */
  return rc;
}

int kvl_batch_wait(kvl_batch *b, uint32_t timeout_ms) {
  /* A small batch nobody took yet runs here (cheaper than a hand-off), by the wait's timeout. */
  kvl__stream_steal(b, kvl__now_ms() + timeout_ms);
  return kvl__batch_wait(b, timeout_ms);
}

int kvl_notify(kvl_engine *e, uint32_t peer, const void *data, size_t len, uint32_t timeout_ms) {
  last_msg[0] = 0;
  if (!data || len == 0 || len > KVL_MAX_NOTIFY) return KVL_EINVAL;
  if (__atomic_load_n(&e->closing, __ATOMIC_ACQUIRE)) return KVL_ECLOSED;
  int rc;
  kvl__peer *p = peer_hold(e, peer, &rc);
  if (!p) return rc;
  uint32_t t = timeout_ms ? timeout_ms : e->cfg.op_timeout_ms;
  kvl_batch *b;
  rc = kvl__batch_notify(e, data, len, kvl__now_ms() + t, &b);
  if (rc == 0) kvl__stream_enqueue(&p->streams[0], &b->parts[0], 1);
  peer_drop(e, p);
  if (rc) return rc;
  rc = kvl_batch_wait(b, t + 1000);
  if (rc) snprintf(last_msg, sizeof last_msg, "%s", b->msg);
  kvl_batch_release(b);
  return rc;
}
