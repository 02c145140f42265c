/* kvl_request.c - one request on a requester stream: encoding a part's
 * descriptors into a request frame, and receiving the status frame that
 * answers it. Shared by the TCP path (kvl_client.c) and the same-host path
 * (kvl_local.c); the thread holding the stream's claim is the only caller. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kvl_internal.h"

#include <stdio.h>

/* Receive the status frame answering seq; data may follow it. A success
 * carries no message, so header and body usually arrive in one receive. */
int kvl__recv_status(kvl__stream *s, uint8_t type, uint32_t seq, kvl__status *st, uint64_t deadline, char *why,
                     size_t cap) {
  kvl_engine *e = s->peer->e;
  enum { FIXED = KVL__STATUS_MAX - KVL_MAX_EVENT_MSG };
  uint8_t buf[KVL__HDR_LEN + KVL__STATUS_MAX];
  kvl__hdr h;
  int rc = kvl__recv_all(s->fd, buf, KVL__HDR_LEN + FIXED, deadline, &e->closing);
  if (rc) {
    snprintf(why, cap, "%s waiting for the response from %s", kvl_strerror(rc), s->peer->name);
    return rc;
  }
  if ((rc = kvl__hdr_decode(buf, &h, why, cap)) != 0) return rc;
  if ((h.type != type && h.type != KVL__T_ERROR) || h.body_len < FIXED || h.body_len > KVL__STATUS_MAX) {
    snprintf(why, cap, "expected frame type %u, got %u", type, h.type);
    return KVL_EPROTO;
  }
  rc = kvl__recv_all(s->fd, buf + KVL__HDR_LEN + FIXED, h.body_len - FIXED, deadline, &e->closing);
  if (rc) {
    snprintf(why, cap, "%s inside a response", kvl_strerror(rc));
    return rc;
  }
  if ((rc = kvl__status_decode(buf + KVL__HDR_LEN, h.body_len, st, why, cap)) != 0) return rc;
  if (h.type == KVL__T_ERROR || st->status < 0) {
    snprintf(why, cap, "peer %s refused: %s", s->peer->name, st->msg[0] ? st->msg : kvl_strerror(st->status));
    return st->status < 0 ? st->status : KVL_EREMOTE;
  }
  if (h.seq != seq) {
    snprintf(why, cap, "response to request %u, expected %u", h.seq, seq);
    return KVL_EPROTO;
  }
  return 0;
}

int kvl__send_request(kvl__stream *s, kvl__part *pt, uint8_t type, uint64_t deadline) {
  kvl_batch *b = pt->batch;
  kvl_engine *e = s->peer->e;
  size_t body = 8 + (size_t)pt->count * KVL__WDESC_LEN;
  if (kvl__grow((void **)&s->buf, &s->cap, KVL__HDR_LEN + body) != 0) return KVL_ENOMEM;
  kvl__hdr_encode(s->buf, type, e->cfg.crc ? KVL__F_CRC : 0, ++s->seq, (uint32_t)body);
  kvl__put_u32(s->buf + KVL__HDR_LEN, pt->count);
  kvl__put_u32(s->buf + KVL__HDR_LEN + 4, 0);
  for (uint32_t i = 0; i < pt->count; i++) {
    const kvl__desc *d = &b->desc[pt->first + i];
    kvl__wdesc w = {d->region, d->offset, d->length};
    kvl__wdesc_put(s->buf + KVL__HDR_LEN, i, &w);
  }
  return kvl__send_all(s->fd, s->buf, KVL__HDR_LEN + body, deadline, &e->closing);
}

uint64_t kvl__part_bytes(const kvl__part *pt) {
  uint64_t t = 0;
  for (uint32_t i = 0; i < pt->count; i++) t += pt->batch->desc[pt->first + i].length;
  return t;
}
