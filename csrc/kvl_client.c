/* kvl_client.c - the requester: each peer has `streams` TCP connections,
 * each with one worker thread that takes parts of batches from its queue,
 * sends the whole descriptor list in one frame and receives the data
 * straight into the destinations (READ), or streams the sources out (WRITE).
 * A failed connection is closed and reopened on the next part, as is one
 * found closed while idle (before its request is sent, so that part goes on). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kvl_internal.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Why the stream threads of p are to exit: KVL_ECLOSED (the engine closes),
 * the peer's stop code (retired or evicted: kvl_engine.c), or 0. */
static int stopping(const kvl__peer *p) {
  if (__atomic_load_n(&p->e->closing, __ATOMIC_ACQUIRE)) return KVL_ECLOSED;
  return __atomic_load_n(&p->stop_rc, __ATOMIC_ACQUIRE);
}

static const char *stop_why(const kvl__peer *p) {
  return __atomic_load_n(&p->stop_rc, __ATOMIC_ACQUIRE) == KVL_EPEERCHANGED
             ? "peer retired: another engine answers at its address"
             : "peer closed to make room for another";
}

static int reconnect(kvl__stream *s, uint64_t deadline, char *why, size_t cap) {
  kvl__peer *p = s->peer;
  kvl_engine *e = p->e;
  uint64_t now = kvl__now_ms();
  uint32_t t = e->cfg.connect_timeout_ms;
  if (deadline > now && deadline - now < t) t = (uint32_t)(deadline - now);
  int fd, rc = kvl__connect(p->host, p->port, t, &e->closing, &fd);
  if (rc) {
    snprintf(why, cap, "connecting to %s:%u: %s", p->host, p->port, kvl_strerror(rc));
    return rc == KVL_ETIMEDOUT ? KVL_ETIMEDOUT : KVL_ECONNECT;
  }
  char name[KVL_MAX_NAME + 1];
  if ((rc = kvl__handshake_client(e, fd, deadline, name, why, cap)) != 0) { /* within the batch's time */
    close(fd);
    return rc;
  }
  if (strcmp(name, p->name) != 0) {
    /* A restarted process at the same address: its region ids name other memory. The peer is retired
     * (every later part on it fails here too); kvl_peer_connect opens a new one for the new engine. */
    __atomic_store_n(&p->changed, 1, __ATOMIC_RELEASE);
    snprintf(why, cap, "%s:%u now answers as engine \"%s\", not \"%s\"", p->host, p->port, name, p->name);
    close(fd);
    return KVL_EPEERCHANGED;
  }
  if (p->local.ok) { /* same-host READs copy from the pid probed at connect: still that process? */
    kvl__local_peer now;
    if ((rc = kvl__local_probe(e, fd, deadline, &now)) != 0) {
      snprintf(why, cap, "same-host probe of %s:%u: %s", p->host, p->port, now.why);
      close(fd);
      if (rc != KVL_ELOCAL) return rc;
      /* Refused outright: a kvlink without the path answers there now, so not the process probed. Retired:
       * a connect opens a new peer, read over TCP under auto. */
      __atomic_store_n(&p->changed, 1, __ATOMIC_RELEASE);
      return KVL_EPEERCHANGED;
    }
    if (!now.ok || now.pid != p->local.pid) {
      /* Another process under the same name (a restart): its memory is not the one probed. Retired. */
      __atomic_store_n(&p->changed, 1, __ATOMIC_RELEASE);
      snprintf(why, cap, "%s:%u (\"%s\") is no longer process %d (%s)", p->host, p->port, name, p->local.pid,
               now.ok ? "another pid answers" : now.why);
      close(fd);
      return KVL_EPEERCHANGED;
    }
  }
  s->fd = fd;
  return 0;
}

/* Fill s->iov with descriptors [from, from+n) of the part. */
static int part_iov(kvl__stream *s, const kvl__part *pt, uint32_t from, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) {
    const kvl__desc *d = &pt->batch->desc[pt->first + from + i];
    s->iov[i].iov_base = (void *)(uintptr_t)d->local;
    s->iov[i].iov_len = (size_t)d->length;
  }
  return (int)n;
}

/* CRC of a descriptor's local memory, one slice at a time, each bracketed
 * like a receive: once kvl_batch_cancel returns nothing reads the memory. */
static int local_crc(kvl_batch *b, const kvl__desc *d, const int *closing, uint32_t *out) {
  const uint8_t *p = (const uint8_t *)(uintptr_t)d->local;
  uint64_t left = d->length;
  *out = 0;
  while (left > 0) {
    size_t n = left < KVL__CRC_SLICE ? (size_t)left : KVL__CRC_SLICE;
    int rc = kvl__batch_enter_io(b);
    if (rc) return rc;
    rc = kvl__crc_until(out, p, n, b->deadline_ms, closing);
    kvl__batch_leave_io(b);
    if (rc) return rc;
    p += n;
    left -= n;
  }
  return 0;
}

static int run_read(kvl__stream *s, kvl__part *pt, char *why, size_t cap) {
  kvl_batch *b = pt->batch;
  kvl_engine *e = s->peer->e;
  uint64_t dl = b->deadline_ms, want = kvl__part_bytes(pt);
  if (s->peer->local.ok && want >= KVL__LOCAL_MIN_BYTES && want / pt->count >= KVL__LOCAL_MIN_AVG)
    return kvl__local_read(s, pt, why, cap);
  kvl__status st;
  int rc = kvl__send_request(s, pt, KVL__T_READ_REQ, dl);
  if (rc) {
    snprintf(why, cap, "%s sending a READ request to %s", kvl_strerror(rc), s->peer->name);
    return rc;
  }
  if ((rc = kvl__recv_status(s, KVL__T_READ_RESP, s->seq, &st, dl, why, cap)) != 0) return rc;
  if (st.total != want) {
    snprintf(why, cap, "peer announced %llu bytes, expected %llu", (unsigned long long)st.total,
             (unsigned long long)want);
    return KVL_EPROTO;
  }
  for (uint32_t from = 0; from < pt->count; from += KVL__IOV_MAX) {
    uint32_t n = pt->count - from < KVL__IOV_MAX ? pt->count - from : KVL__IOV_MAX;
    int niov = part_iov(s, pt, from, n);
    if ((rc = kvl__batch_enter_io(b)) != 0) {
      snprintf(why, cap, "batch finished while receiving");
      return rc;
    }
    rc = kvl__recvv(s->fd, s->iov, niov, dl, &e->closing);
    kvl__batch_leave_io(b);
    if (rc) {
      snprintf(why, cap, "%s receiving %llu bytes from %s", kvl_strerror(rc), (unsigned long long)want,
               s->peer->name);
      return rc;
    }
  }
  if (e->cfg.crc) {
    if (kvl__grow((void **)&s->crcs, &s->crc_cap, (size_t)pt->count * 4) != 0) return KVL_ENOMEM;
    if ((rc = kvl__recv_all(s->fd, s->crcs, (size_t)pt->count * 4, dl, &e->closing)) != 0) {
      snprintf(why, cap, "%s receiving checksums from %s", kvl_strerror(rc), s->peer->name);
      return rc;
    }
    for (uint32_t i = 0; i < pt->count; i++) {
      const kvl__desc *d = &b->desc[pt->first + i];
      uint32_t got;
      if ((rc = local_crc(b, d, &e->closing, &got)) != 0) {
        snprintf(why, cap, "%s checking the checksums from %s", kvl_strerror(rc), s->peer->name);
        return rc;
      }
      if (got != kvl__get_u32((const uint8_t *)&s->crcs[i])) {
        snprintf(why, cap, "checksum mismatch in descriptor %u (region 0x%x offset %llu, %llu bytes)",
                 pt->first + i, d->region, (unsigned long long)d->offset, (unsigned long long)d->length);
        return KVL_ECRC;
      }
    }
  }
  KVL__STAT_ADD(e, bytes_read, want);
  return 0;
}

static int run_write(kvl__stream *s, kvl__part *pt, char *why, size_t cap) {
  kvl_batch *b = pt->batch;
  kvl_engine *e = s->peer->e;
  uint64_t dl = b->deadline_ms, want = kvl__part_bytes(pt);
  kvl__status st;
  int rc = kvl__send_request(s, pt, KVL__T_WRITE_REQ, dl);
  for (uint32_t from = 0; rc == 0 && from < pt->count; from += KVL__IOV_MAX) {
    uint32_t n = pt->count - from < KVL__IOV_MAX ? pt->count - from : KVL__IOV_MAX;
    if (kvl_batch_poll(b) != KVL_INPROGRESS) return KVL_ECANCELED;
    rc = kvl__sendv(s->fd, s->iov, part_iov(s, pt, from, n), dl, &e->closing);
  }
  if (rc == 0 && e->cfg.crc) {
    if (kvl__grow((void **)&s->crcs, &s->crc_cap, (size_t)pt->count * 4) != 0) return KVL_ENOMEM;
    uint32_t crc = 0;
    for (uint32_t i = 0; rc == 0 && i < pt->count; i++) {
      if ((rc = local_crc(b, &b->desc[pt->first + i], &e->closing, &crc)) == 0)
        kvl__put_u32((uint8_t *)&s->crcs[i], crc);
    }
    if (rc == 0) rc = kvl__send_all(s->fd, s->crcs, (size_t)pt->count * 4, dl, &e->closing);
  }
  if (rc == KVL_EPEERCLOSED) { /* a refusal arrives before the hang-up: prefer its reason */
    int r2 = kvl__recv_status(s, KVL__T_WRITE_RESP, s->seq, &st, kvl__now_ms() + 1000, why, cap);
    if (r2 != 0 && r2 != KVL_EPEERCLOSED && r2 != KVL_ETIMEDOUT) return r2;
  }
  if (rc) {
    snprintf(why, cap, "%s sending %llu bytes to %s", kvl_strerror(rc), (unsigned long long)want, s->peer->name);
    return rc;
  }
  if ((rc = kvl__recv_status(s, KVL__T_WRITE_RESP, s->seq, &st, dl, why, cap)) != 0) return rc;
  KVL__STAT_ADD(e, bytes_written, want);
  return 0;
}

static int run_notify(kvl__stream *s, kvl__part *pt, char *why, size_t cap) {
  kvl_batch *b = pt->batch;
  kvl_engine *e = s->peer->e;
  uint8_t hb[KVL__HDR_LEN];
  kvl__status st;
  kvl__hdr_encode(hb, KVL__T_NOTIFY, 0, ++s->seq, (uint32_t)b->payload_len);
  struct iovec v[2] = {{hb, sizeof hb}, {(void *)b->payload, b->payload_len}};
  int rc = kvl__sendv(s->fd, v, 2, b->deadline_ms, &e->closing);
  if (rc) {
    snprintf(why, cap, "%s sending a notification to %s", kvl_strerror(rc), s->peer->name);
    return rc;
  }
  return kvl__recv_status(s, KVL__T_NOTIFY_ACK, s->seq, &st, b->deadline_ms, why, cap);
}

/* Between requests the peer never sends: an idle connection with something to read, or an error, was
 * closed or reset (the peer's process ended, keepalive found the path gone, a middlebox dropped it). */
static int hung_up(int fd) {
  struct pollfd p = {fd, POLLIN | POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0;
}

static void run_part(kvl__stream *s, kvl__part *pt) {
  kvl_batch *b = pt->batch;
  char why[KVL_MAX_EVENT_MSG + 1] = "";
  int rc = 0;
  if (kvl_batch_poll(b) != KVL_INPROGRESS) {
    kvl__part_finish(pt, KVL_ECANCELED, NULL);
    return;
  }
  if (kvl__now_ms() >= b->deadline_ms) {
    snprintf(why, sizeof why, "deadline passed before the request was sent");
    rc = KVL_ETIMEDOUT;
  }
  if (rc == 0 && s->fd >= 0 && hung_up(s->fd)) { /* closed while idle: a new connection, not a failed part */
    close(s->fd);
    s->fd = -1;
  }
  if (rc == 0 && s->fd < 0) rc = reconnect(s, b->deadline_ms, why, sizeof why);
  if (rc == 0) {
    pthread_mutex_lock(&b->mu);
    if (b->state == KVL__B_RUNNING) pt->running_on = s;
    else rc = KVL_ECANCELED;
    pthread_mutex_unlock(&b->mu);
  }
  int sent = rc == 0; /* from here the connection may be mid-frame if the part fails */
  if (rc == 0) {
    rc = b->op == KVL_OP_READ    ? run_read(s, pt, why, sizeof why)
         : b->op == KVL_OP_WRITE ? run_write(s, pt, why, sizeof why)
                                 : run_notify(s, pt, why, sizeof why);
    pthread_mutex_lock(&b->mu);
    pt->running_on = NULL;
    if (rc && b->state != KVL__B_RUNNING) rc = b->err; /* we were stopped: keep the first cause */
    pthread_mutex_unlock(&b->mu);
  }
  if (rc && sent && s->fd >= 0) { /* the stream may be mid-frame: start afresh */
    close(s->fd);
    s->fd = -1;
  }
  if (rc && rc != KVL_ECANCELED && rc != KVL_ECLOSED)
    kvl__event_log(&s->peer->e->events, rc, "batch to %s:%u failed: %s", s->peer->host, s->peer->port, why);
  kvl__part_finish(pt, rc, why);
}

/* Take the head of the queue and claim the stream; called with s->mu held. */
static kvl__part *claim(kvl__stream *s) {
  kvl__part *pt = s->head;
  s->last_active_us = kvl__now_us();
  s->head = pt->next;
  if (!s->head) s->tail = NULL;
  pt->queued = 0;
  s->busy = 1;
  return pt;
}

static void unclaim(kvl__stream *s) {
  pthread_mutex_lock(&s->mu);
  s->busy = 0;
  /* The worker waits for a queued part, or, closing, for the stream to be free
   * (a waiter ran its own part: kvl__stream_steal); without this wake-up
   * engine_destroy would join it forever. */
  if (s->head || stopping(s->peer)) pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

static void *stream_main(void *arg) {
  kvl__stream *s = arg;
  kvl__peer *p = s->peer;
  for (;;) {
    pthread_mutex_lock(&s->mu);
    int closing;
    for (;;) {
      if ((closing = stopping(p)) != 0) break;
      uint64_t now = kvl__now_us(), until;
      if (s->head && !s->busy) {
        /* A small batch's waiter usually arrives within microseconds and runs
         * it itself (kvl__stream_steal); give it that chance first. */
        if (s->head->grace_until_us <= now) break;
        until = s->head->grace_until_us;
      } else if (now - s->last_active_us < KVL__LINGER_US) {
        /* Recently busy: tick instead of sleeping, so that enqueueing a small
         * batch needs no wake-up (it costs more than the transfer). */
        until = now + KVL__TICK_US;
        s->lingering = 1;
      } else {
        pthread_cond_wait(&s->cv, &s->mu);
        continue;
      }
      struct timespec ts = {(time_t)(until / 1000000u), (long)(until % 1000000u) * 1000L};
      pthread_cond_timedwait(&s->cv, &s->mu, &ts);
      s->lingering = 0;
    }
    while (closing && s->busy) pthread_cond_wait(&s->cv, &s->mu); /* a waiter is running a part */
    kvl__part *pt = s->head ? claim(s) : NULL;
    pthread_mutex_unlock(&s->mu);
    if (!pt) break; /* closing and nothing left to fail */
    if (closing) kvl__part_finish(pt, closing, closing == KVL_ECLOSED ? "engine closed" : stop_why(p));
    else run_part(s, pt);
    unclaim(s);
  }
  pthread_mutex_lock(&s->mu); /* kvl__stream_idle_closed reads fd under mu */
  if (s->fd >= 0) close(s->fd);
  s->fd = -1;
  pthread_mutex_unlock(&s->mu);
  __atomic_fetch_sub(&p->running, 1, __ATOMIC_RELEASE); /* the peer may be freed once all are out (and joined) */
  return NULL;
}

/* A waiter that finds its one-part batch still queued runs it itself: a
 * thread hand-off costs more than a small transfer on this path. */
void kvl__stream_steal(kvl_batch *b, uint64_t until_ms) {
  if (b->parts_total != 1) return;
  kvl__part *pt = &b->parts[0];
  /* While b->mu is held an unfinished part's stream cannot be freed: the
   * worker must finish the part (which takes b->mu) before it exits. */
  pthread_mutex_lock(&b->mu);
  int mine = 0;
  kvl__stream *s = pt->queued_on;
  if (s && b->state == KVL__B_RUNNING && b->parts_finished == 0) {
    pthread_mutex_lock(&s->mu);
    mine = pt->queued && s->head == pt && !s->busy && !stopping(s->peer);
    if (mine) claim(s);
    pthread_mutex_unlock(&s->mu);
    if (mine && until_ms < b->deadline_ms) b->deadline_ms = until_ms; /* ours alone now: the waiter's timeout */
  }
  pthread_mutex_unlock(&b->mu);
  if (!mine) return;
  KVL__STAT_ADD(s->peer->e, parts_inline, 1);
  run_part(s, pt);
  unclaim(s);
}

int kvl__stream_idle_closed(kvl__stream *s) {
  /* Unclaimed, nobody replaces or closes fd: only a claim (under mu) or the exiting worker (under mu) does. */
  pthread_mutex_lock(&s->mu);
  int closed = !s->busy && s->fd >= 0 && hung_up(s->fd);
  pthread_mutex_unlock(&s->mu);
  return closed;
}

int kvl__stream_start(kvl__stream *s) {
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setstacksize(&at, 512 * 1024);
  int rc = pthread_create(&s->thread, &at, stream_main, s);
  pthread_attr_destroy(&at);
  if (rc != 0) return KVL_ESYS;
  s->started = 1;
  return 0;
}

void kvl__stream_stop(kvl__stream *s) {
  pthread_mutex_lock(&s->mu);
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  if (s->started) pthread_join(s->thread, NULL);
  s->started = 0;
  free(s->buf);
  free(s->crcs);
  free(s->addrs);
  s->buf = NULL;
  s->crcs = NULL;
  s->addrs = NULL;
}

void kvl__stream_enqueue(kvl__stream *s, kvl__part *pt, int stealable) {
  pt->next = NULL;
  pt->queued_on = s;
  pt->grace_until_us = stealable ? kvl__now_us() + KVL__STEAL_GRACE_US : 0;
  pthread_mutex_lock(&s->mu);
  /* The worker exits once it has seen a stop under this lock with nothing queued, and a stop is never
   * undone: a part enqueued after that (a submit that passed its closing check before the engine began
   * to close) is failed here, not stranded on a queue no thread reads any more. */
  int stop = stopping(s->peer);
  if (!stop) {
    pt->queued = 1;
    if (s->tail) s->tail->next = pt;
    else s->head = pt;
    s->tail = pt;
    if (!stealable || !s->lingering) pthread_cond_signal(&s->cv);
  }
  pthread_mutex_unlock(&s->mu);
  if (stop) kvl__part_finish(pt, stop, stop == KVL_ECLOSED ? "engine closed" : stop_why(s->peer));
}
