/* kvl_server.c - the responder: one thread per accepted connection serves
 * READ, WRITE and NOTIFY requests straight from/into registered memory. A
 * peer that breaks the protocol or asks for memory it may not touch gets an
 * error frame naming why, a logged event, and a closed connection; nobody
 * else notices. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kvl_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* next and done are guarded by e->conns_mu. e, addr and thread are set by the
 * listener before the connection is listed; everything else belongs to the
 * connection's thread alone, and the reaper frees it only after joining. */
struct kvl__conn {
  kvl__conn *next;  /* e->conns list */
  kvl_engine *e;
  int fd;           /* closed by its thread under conns_mu, so an eviction never hits a reused number */
  int done;         /* the thread has ended: the reaper may join it */
  int pending;      /* still in its handshake (conns_mu) */
  pthread_t thread;
  char addr[64];
  char name[KVL_MAX_NAME + 1];
  uint8_t *body;
  size_t cap;
  uint32_t *crcs;
  size_t crc_cap;
  uint64_t *addrs; /* same-host reads */
  size_t addr_cap;
  struct iovec iov[KVL__IOV_MAX + 2]; /* + response header + checksum trailer */
};

/* Between requests a connection keeps at most KVL__CONN_KEEP bytes of each buffer: with thousands of
 * connections served, each one's largest request must not stay allocated for its life. */
static void trim(kvl__conn *c) {
  if (c->cap > KVL__CONN_KEEP) free(c->body), c->body = NULL, c->cap = 0;
  if (c->crc_cap > KVL__CONN_KEEP) free(c->crcs), c->crcs = NULL, c->crc_cap = 0;
  if (c->addr_cap > KVL__CONN_KEEP) free(c->addrs), c->addrs = NULL, c->addr_cap = 0;
}

static int reply(kvl__conn *c, uint8_t type, uint32_t seq, int status, uint32_t index, uint64_t total,
                 const char *msg) {
  kvl__status st;
  memset(&st, 0, sizeof st);
  st.status = status;
  st.index = index;
  st.total = total;
  if (msg) snprintf(st.msg, sizeof st.msg, "%s", msg);
  return kvl__send_status(c->fd, type, seq, &st, kvl__now_ms() + c->e->cfg.op_timeout_ms, &c->e->closing);
}

/* CRC of each descriptor in [first, first+n), resolved to iov; by the
 * request's deadline (descriptors may overlap: a peer can ask for terabytes). */
static int crc_descs(kvl__conn *c, uint32_t first, uint32_t n, uint64_t deadline, uint32_t *out) {
  kvl__regions_resolve(&c->e->regions, c->body, first, n, c->iov);
  for (uint32_t i = 0; i < n; i++) {
    uint32_t crc = 0;
    int rc = kvl__crc_until(&crc, c->iov[i].iov_base, c->iov[i].iov_len, deadline, &c->e->closing);
    if (rc) return rc;
    kvl__put_u32((uint8_t *)&out[first + i], crc);
  }
  return 0;
}

static uint32_t chunk(uint32_t count, uint32_t first) {
  return count - first < KVL__IOV_MAX ? count - first : KVL__IOV_MAX;
}

/* READ: the response header, the data straight from registered memory and
 * the checksums go out as one gathered send per chunk of descriptors. */
static int send_read_data(kvl__conn *c, const kvl__hdr *h, uint32_t count, uint64_t total, int crc, uint64_t deadline) {
  kvl_engine *e = c->e;
  uint8_t rh[KVL__HDR_LEN + KVL__STATUS_MAX];
  kvl__status st;
  memset(&st, 0, sizeof st);
  st.total = total;
  size_t blen = kvl__status_encode(rh + KVL__HDR_LEN, &st);
  kvl__hdr_encode(rh, KVL__T_READ_RESP, 0, h->seq, (uint32_t)blen);
  for (uint32_t first = 0; crc && first < count; first += KVL__IOV_MAX) {
    int rc = crc_descs(c, first, chunk(count, first), deadline, c->crcs);
    if (rc) return rc;
  }
  for (uint32_t first = 0; first < count; first += KVL__IOV_MAX) {
    uint32_t n = chunk(count, first);
    int k = 0;
    if (first == 0) c->iov[k++] = (struct iovec){rh, KVL__HDR_LEN + blen};
    kvl__regions_resolve(&e->regions, c->body, first, n, c->iov + k);
    k += (int)n;
    if (crc && first + n == count) c->iov[k++] = (struct iovec){c->crcs, (size_t)count * 4};
    int rc = kvl__sendv(c->fd, c->iov, k, deadline, &e->closing);
    if (rc) return rc;
  }
  return 0;
}

/* WRITE: receive straight into registered memory, then check the checksums.
 * Returns KVL_ECRC with *bad set on a mismatch (the stream stays in sync). */
static int recv_write_data(kvl__conn *c, uint32_t count, int crc, uint64_t deadline, uint32_t *bad) {
  kvl_engine *e = c->e;
  for (uint32_t first = 0; first < count; first += KVL__IOV_MAX) {
    uint32_t n = chunk(count, first);
    kvl__regions_resolve(&e->regions, c->body, first, n, c->iov);
    int rc = kvl__recvv(c->fd, c->iov, (int)n, deadline, &e->closing);
    if (rc) return rc;
  }
  if (!crc) return 0;
  int rc = kvl__recv_all(c->fd, c->crcs, (size_t)count * 4, deadline, &e->closing);
  if (rc) return rc;
  for (uint32_t first = 0; first < count; first += KVL__IOV_MAX) {
    uint32_t n = chunk(count, first);
    kvl__regions_resolve(&e->regions, c->body, first, n, c->iov);
    for (uint32_t i = 0; i < n; i++) {
      uint32_t got = 0;
      if ((rc = kvl__crc_until(&got, c->iov[i].iov_base, c->iov[i].iov_len, deadline, &e->closing)) != 0) return rc;
      if (got != kvl__get_u32((uint8_t *)&c->crcs[first + i])) {
        *bad = first + i;
        return KVL_ECRC;
      }
    }
  }
  return 0;
}

/* A refused WRITE's data is already on its way: swallow (a bounded amount
 * of) it so the peer reads our reason instead of a reset. */
static void drain_refused_write(kvl__conn *c, uint32_t count) {
  uint64_t left = 0, deadline = kvl__now_ms() + c->e->cfg.op_timeout_ms;
  for (uint32_t i = 0; i < count && left < KVL__DRAIN_MAX; i++) {
    kvl__wdesc d;
    kvl__wdesc_get(c->body, i, &d);
    left += d.length < KVL__DRAIN_MAX ? d.length : KVL__DRAIN_MAX;
  }
  if (left > KVL__DRAIN_MAX) left = KVL__DRAIN_MAX;
  uint8_t junk[16384];
  while (left > 0) {
    size_t n = left < sizeof junk ? (size_t)left : sizeof junk;
    if (kvl__recv_all(c->fd, junk, n, deadline, &c->e->closing) != 0) return;
    left -= n;
  }
}

/* Returns 0 to keep serving, a negative code to hang up (with why filled). */
static int serve_data(kvl__conn *c, const kvl__hdr *h, char *why, size_t cap) {
  kvl_engine *e = c->e;
  int is_read = h->type == KVL__T_READ_REQ;
  uint8_t resp = is_read ? KVL__T_READ_RESP : KVL__T_WRITE_RESP;
  uint32_t count, bad = 0;
  int rc = kvl__descs_check(c->body, h->body_len, &count, why, cap);
  if (rc) {
    reply(c, resp, h->seq, rc, 0, 0, why);
    return rc;
  }
  rc = kvl__regions_acquire(&e->regions, c->body, count, is_read ? KVL_ACCESS_READ : KVL_ACCESS_WRITE, &bad, why, cap);
  if (rc) {
    reply(c, resp, h->seq, rc, bad, 0, why);
    if (!is_read) drain_refused_write(c, count);
    return rc;
  }
  int crc = (h->flags & KVL__F_CRC) != 0;
  uint64_t total = 0, deadline = kvl__now_ms() + e->cfg.op_timeout_ms;
  for (uint32_t i = 0; i < count; i++) {
    kvl__wdesc d;
    kvl__wdesc_get(c->body, i, &d);
    total += d.length;
  }
  if (crc && kvl__grow((void **)&c->crcs, &c->crc_cap, (size_t)count * 4) != 0) {
    kvl__regions_release(&e->regions, c->body, count);
    snprintf(why, cap, "no memory for %u checksums", count);
    return KVL_ENOMEM;
  }
  rc = is_read ? send_read_data(c, h, count, total, crc, deadline) : recv_write_data(c, count, crc, deadline, &bad);
  kvl__regions_release(&e->regions, c->body, count);
  if (rc == KVL_ECRC) {
    snprintf(why, cap, "checksum mismatch in written descriptor %u", bad);
    return reply(c, resp, h->seq, rc, bad, total, why); /* the stream is in sync: keep serving */
  }
  if (rc) {
    snprintf(why, cap, "%s while %s %llu bytes", kvl_strerror(rc), is_read ? "sending" : "receiving",
             (unsigned long long)total);
    return rc;
  }
  KVL__STAT_ADD(e, bytes_served, total);
  return is_read ? 0 : reply(c, resp, h->seq, 0, 0, total, NULL);
}

/* The connection leaves the handshake's pending count, unless make_room dropped it first: 0 then. Called
 * before the welcome is sent (as the handshake's admit) and after a failed handshake, so a connection is
 * either dropped before its peer is welcomed or never dropped: a welcomed peer's first request does not
 * find its connection shut down. */
static int leave_pending(void *arg) {
  kvl__conn *c = arg;
  pthread_mutex_lock(&c->e->conns_mu);
  int was = c->pending;
  if (was) {
    c->pending = 0;
    c->e->npending--;
  }
  pthread_mutex_unlock(&c->e->conns_mu);
  return was;
}

static void *conn_main(void *arg) {
  kvl__conn *c = arg;
  kvl_engine *e = c->e;
  char why[KVL_MAX_EVENT_MSG + 1] = "";
  kvl__sock_tune(c->fd);
  int rc = kvl__handshake_server(e, c->fd, c->name, why, sizeof why, leave_pending, c);
  if (rc) leave_pending(c);
  if (rc) {
    KVL__STAT_ADD(e, conns_rejected, 1);
    kvl__event_log(&e->events, rc, "refused connection from %s: %s", c->addr, why);
    goto out;
  }
  for (;;) {
    uint8_t hb[KVL__HDR_LEN];
    kvl__hdr h;
    int orderly;
    if ((rc = kvl__recv_header(c->fd, hb, e->cfg.op_timeout_ms, &e->closing, &orderly)) != 0) {
      if (orderly) rc = 0; /* the peer hung up between frames */
      else snprintf(why, sizeof why, "%s inside a frame header", kvl_strerror(rc));
      break;
    }
    uint64_t deadline = kvl__now_ms() + e->cfg.op_timeout_ms;
    if ((rc = kvl__hdr_decode(hb, &h, why, sizeof why)) != 0) {
      reply(c, KVL__T_ERROR, 0, rc, 0, 0, why);
      break;
    }
    if (kvl__grow((void **)&c->body, &c->cap, h.body_len) != 0) {
      rc = KVL_ENOMEM;
      snprintf(why, sizeof why, "no memory for a %u-byte body", h.body_len);
      break;
    }
    if ((rc = kvl__recv_all(c->fd, c->body, h.body_len, deadline, &e->closing)) != 0) {
      snprintf(why, sizeof why, "%s inside a %u-byte frame body", kvl_strerror(rc), h.body_len);
      break;
    }
    if (h.type == KVL__T_READ_REQ || h.type == KVL__T_WRITE_REQ) {
      if ((rc = serve_data(c, &h, why, sizeof why)) != 0) break;
    } else if (h.type == KVL__T_LPROBE) {
      if ((rc = kvl__local_serve_probe(e, c->fd, h.seq)) != 0) break;
    } else if (h.type == KVL__T_LREAD_REQ) {
      if ((rc = kvl__local_serve_read(e, c->fd, &h, c->body, &c->addrs, &c->addr_cap, why, sizeof why)) != 0) break;
    } else if (h.type == KVL__T_NOTIFY) {
      int st = kvl__notifs_push(&e->notifs, c->name, c->body, h.body_len);
      if ((rc = reply(c, KVL__T_NOTIFY_ACK, h.seq, st, 0, 0, st ? "notification queue full" : NULL)) != 0) break;
    } else {
      rc = KVL_EPROTO;
      snprintf(why, sizeof why, "unexpected frame type %u after handshake", h.type);
      reply(c, KVL__T_ERROR, h.seq, rc, 0, 0, why);
      break;
    }
    trim(c);
  }
  if (rc && rc != KVL_ECLOSED && rc != KVL_EPEERCLOSED) {
    KVL__STAT_ADD(e, conns_rejected, 1);
    kvl__event_log(&e->events, rc, "disconnected %s (%s): %s", c->addr, c->name[0] ? c->name : "?", why);
  } else if (rc == KVL_EPEERCLOSED && why[0]) {
    kvl__event_log(&e->events, rc, "peer %s (%s) went away: %s", c->addr, c->name[0] ? c->name : "?", why);
  }
out:
  pthread_mutex_lock(&e->conns_mu);
  close(c->fd);
  c->fd = -1;
  c->done = 1;
  pthread_mutex_unlock(&e->conns_mu);
  return NULL;
}

/* Room for one more connection: connections still in their handshake are at
 * most a quarter of max_conns (and KVL__PENDING_MAX), and when that many wait (or every slot is
 * taken) the one that has waited longest is dropped. So sockets that connect
 * and say nothing (no token needed for that) cannot keep authenticated peers
 * out: they only ever hold the pending quarter, each for less time than a
 * handshake takes to complete. Called with conns_mu held; 0 if the engine is
 * full of authenticated connections. */
static int make_room(kvl_engine *e, char *dropped, size_t cap) {
  uint32_t pending_max = e->cfg.max_conns / 4 ? e->cfg.max_conns / 4 : 1;
  if (pending_max > KVL__PENDING_MAX) pending_max = KVL__PENDING_MAX;
  if (e->npending < pending_max && e->nconns < e->cfg.max_conns) return 1;
  kvl__conn *oldest = NULL;
  for (kvl__conn *c = e->conns; c; c = c->next) /* newest first: the last one found waited longest */
    if (c->pending && !c->done && c->fd >= 0) oldest = c;
  if (!oldest) return e->nconns < e->cfg.max_conns;
  shutdown(oldest->fd, SHUT_RDWR); /* its handshake fails at once; its thread ends as usual */
  oldest->pending = 0;
  e->npending--;
  snprintf(dropped, cap, "%s", oldest->addr);
  return 1;
}

void kvl__server_accept(kvl_engine *e, int fd) {
  char addr[64];
  kvl__peer_str(fd, addr, sizeof addr);
  char dropped[64] = "";
  pthread_mutex_lock(&e->conns_mu);
  int full = !make_room(e, dropped, sizeof dropped);
  pthread_mutex_unlock(&e->conns_mu);
  if (dropped[0]) {
    KVL__STAT_ADD(e, conns_rejected, 1);
    kvl__event_log(&e->events, KVL_EBUSY, "dropped connection from %s, still in its handshake, for one from %s: "
                   "too many handshakes at once", dropped, addr);
  }
  kvl__conn *c = full ? NULL : calloc(1, sizeof *c);
  if (!c) {
    KVL__STAT_ADD(e, conns_rejected, 1);
    kvl__event_log(&e->events, full ? KVL_EBUSY : KVL_ENOMEM, "refused connection from %s: %s", addr,
                   full ? "too many connections" : "out of memory");
    close(fd);
    return;
  }
  c->e = e;
  c->fd = fd;
  snprintf(c->addr, sizeof c->addr, "%s", addr);
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setstacksize(&at, 512 * 1024);
  pthread_mutex_lock(&e->conns_mu);
  if (pthread_create(&c->thread, &at, conn_main, c) != 0) {
    pthread_mutex_unlock(&e->conns_mu);
    pthread_attr_destroy(&at);
    kvl__event_log(&e->events, KVL_ESYS, "refused connection from %s: cannot start a thread", addr);
    close(fd);
    free(c);
    return;
  }
  c->next = e->conns;
  e->conns = c;
  e->nconns++;
  c->pending = 1;
  e->npending++;
  KVL__STAT_ADD(e, conns_accepted, 1);
  pthread_mutex_unlock(&e->conns_mu);
  pthread_attr_destroy(&at);
}

void kvl__server_reap(kvl_engine *e, int all) {
  for (;;) {
    kvl__conn *dead = NULL;
    pthread_mutex_lock(&e->conns_mu);
    for (kvl__conn **pp = &e->conns; *pp; pp = &(*pp)->next) {
      if ((*pp)->done || all) {
        dead = *pp;
        *pp = dead->next;
        e->nconns--;
        break;
      }
    }
    pthread_mutex_unlock(&e->conns_mu);
    if (!dead) return;
    pthread_join(dead->thread, NULL);
    free(dead->body);
    free(dead->crcs);
    free(dead->addrs);
    free(dead);
  }
}

uint32_t kvl__server_conns(kvl_engine *e) {
  pthread_mutex_lock(&e->conns_mu);
  uint32_t n = 0;
  for (kvl__conn *c = e->conns; c; c = c->next) n += !c->done;
  pthread_mutex_unlock(&e->conns_mu);
  return n;
}
