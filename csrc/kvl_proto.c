/* kvl_proto.c - the frame codec. Pure functions over byte buffers: no
 * sockets, no allocation, every length checked against its bound before it
 * is used. The format is documented in docs/protocol.md. */
#include "kvl_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void kvl__put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
void kvl__put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
uint32_t kvl__get_u32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
uint64_t kvl__get_u64(const uint8_t *p) { return (uint64_t)kvl__get_u32(p) | (uint64_t)kvl__get_u32(p + 4) << 32; }

__attribute__((format(printf, 4, 5))) static int fail(char *why, size_t cap, int code, const char *fmt, ...) {
  if (why && cap) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, cap, fmt, ap);
    va_end(ap);
  }
  return code;
}

/* Smallest and largest body each frame type may carry. */
static int body_bounds(uint8_t type, uint32_t *lo, uint32_t *hi) {
  switch (type) {
  case KVL__T_HELLO: *lo = KVL__NONCE_LEN + 2; *hi = KVL__NONCE_LEN + 2 + KVL_MAX_NAME; return 0;
  case KVL__T_CHALLENGE:
    *lo = KVL__NONCE_LEN + KVL__MAC_LEN + 2; *hi = *lo + KVL_MAX_NAME; return 0;
  case KVL__T_AUTH: *lo = *hi = KVL__MAC_LEN; return 0;
  case KVL__T_WELCOME: *lo = *hi = 0; return 0;
  case KVL__T_READ_REQ:
  case KVL__T_WRITE_REQ:
    *lo = 8 + KVL__WDESC_LEN; *hi = 8 + (uint32_t)KVL__WDESC_LEN * KVL_MAX_DESC_PER_MSG; return 0;
  case KVL__T_READ_RESP:
  case KVL__T_WRITE_RESP:
  case KVL__T_NOTIFY_ACK:
  case KVL__T_ERROR: *lo = KVL__STATUS_MAX - KVL_MAX_EVENT_MSG; *hi = KVL__STATUS_MAX; return 0;
  case KVL__T_NOTIFY: *lo = 1; *hi = KVL_MAX_NOTIFY; return 0;
  case KVL__T_LPROBE:
  case KVL__T_LDONE: *lo = *hi = 0; return 0;
  case KVL__T_LPROBE_RESP: *lo = *hi = KVL__PROBE_BODY; return 0;
  case KVL__T_LREAD_REQ:
    *lo = 8 + KVL__WDESC_LEN; *hi = 8 + (uint32_t)KVL__WDESC_LEN * KVL_MAX_DESC_PER_MSG; return 0;
  case KVL__T_LREAD_RESP:
  case KVL__T_LDONE_ACK: *lo = KVL__STATUS_MAX - KVL_MAX_EVENT_MSG; *hi = KVL__STATUS_MAX; return 0;
  default: return -1;
  }
}

void kvl__hdr_encode(uint8_t out[KVL__HDR_LEN], uint8_t type, uint16_t flags, uint32_t seq, uint32_t body_len) {
  kvl__put_u32(out, KVL__MAGIC);
  out[4] = KVL_PROTOCOL_VERSION;
  out[5] = type;
  out[6] = (uint8_t)flags;
  out[7] = (uint8_t)(flags >> 8);
  kvl__put_u32(out + 8, seq);
  kvl__put_u32(out + 12, body_len);
}

int kvl__hdr_decode(const uint8_t in[KVL__HDR_LEN], kvl__hdr *h, char *why, size_t cap) {
  uint32_t magic = kvl__get_u32(in), lo, hi;
  if (magic != KVL__MAGIC) return fail(why, cap, KVL_EPROTO, "bad magic 0x%08x", magic);
  h->version = in[4];
  h->type = in[5];
  h->flags = (uint16_t)(in[6] | in[7] << 8);
  h->seq = kvl__get_u32(in + 8);
  h->body_len = kvl__get_u32(in + 12);
  if (h->version != KVL_PROTOCOL_VERSION)
    return fail(why, cap, KVL_EVERSION, "protocol version %u, expected %u", h->version, KVL_PROTOCOL_VERSION);
  if (body_bounds(h->type, &lo, &hi) != 0) return fail(why, cap, KVL_EPROTO, "unknown frame type %u", h->type);
  if (h->body_len < lo || h->body_len > hi)
    return fail(why, cap, h->body_len > hi ? KVL_ETOOBIG : KVL_EPROTO, "body length %u outside bounds of frame type %u",
                h->body_len, h->type);
  if (h->flags & ~KVL__F_CRC) return fail(why, cap, KVL_EPROTO, "unknown flags 0x%x", h->flags);
  return 0;
}

size_t kvl__hello_encode(uint8_t *out, uint8_t type, const kvl__hello *h) {
  size_t n = 0, nl = strnlen(h->name, KVL_MAX_NAME);
  memcpy(out, h->nonce, KVL__NONCE_LEN);
  n += KVL__NONCE_LEN;
  if (type == KVL__T_CHALLENGE) {
    memcpy(out + n, h->mac, KVL__MAC_LEN);
    n += KVL__MAC_LEN;
  }
  out[n++] = h->auth;
  out[n++] = (uint8_t)nl;
  memcpy(out + n, h->name, nl);
  return n + nl;
}

int kvl__hello_decode(const uint8_t *body, size_t len, uint8_t type, kvl__hello *h, char *why, size_t cap) {
  size_t n = KVL__NONCE_LEN + (type == KVL__T_CHALLENGE ? KVL__MAC_LEN : 0);
  if (len < n + 2) return fail(why, cap, KVL_EPROTO, "hello body too short (%zu bytes)", len);
  memcpy(h->nonce, body, KVL__NONCE_LEN);
  memset(h->mac, 0, sizeof h->mac);
  if (type == KVL__T_CHALLENGE) memcpy(h->mac, body + KVL__NONCE_LEN, KVL__MAC_LEN);
  h->auth = body[n];
  size_t nl = body[n + 1];
  if (h->auth > 1) return fail(why, cap, KVL_EPROTO, "bad auth mode %u", h->auth);
  if (nl > KVL_MAX_NAME || n + 2 + nl != len)
    return fail(why, cap, KVL_EPROTO, "name length %zu does not match body length %zu", nl, len);
  for (size_t i = 0; i < nl; i++) {
    uint8_t c = body[n + 2 + i];
    if (c < 0x20 || c > 0x7e) return fail(why, cap, KVL_EPROTO, "non-printable byte 0x%02x in name", c);
  }
  memcpy(h->name, body + n + 2, nl);
  h->name[nl] = 0;
  return 0;
}

size_t kvl__status_encode(uint8_t *out, const kvl__status *s) {
  size_t ml = strnlen(s->msg, KVL_MAX_EVENT_MSG);
  kvl__put_u32(out, (uint32_t)s->status);
  kvl__put_u32(out + 4, s->index);
  kvl__put_u64(out + 8, s->total);
  out[16] = (uint8_t)ml;
  out[17] = (uint8_t)(ml >> 8);
  memcpy(out + 18, s->msg, ml);
  return 18 + ml;
}

int kvl__status_decode(const uint8_t *body, size_t len, kvl__status *s, char *why, size_t cap) {
  if (len < 18) return fail(why, cap, KVL_EPROTO, "status body too short (%zu bytes)", len);
  s->status = (int32_t)kvl__get_u32(body);
  s->index = kvl__get_u32(body + 4);
  s->total = kvl__get_u64(body + 8);
  size_t ml = (size_t)body[16] | (size_t)body[17] << 8;
  if (ml > KVL_MAX_EVENT_MSG || 18 + ml != len)
    return fail(why, cap, KVL_EPROTO, "message length %zu does not match body length %zu", ml, len);
  if (s->status > 0) return fail(why, cap, KVL_EPROTO, "positive status %d", (int)s->status);
  memcpy(s->msg, body + 18, ml);
  s->msg[ml] = 0;
  for (size_t i = 0; i < ml; i++)
    if ((unsigned char)s->msg[i] < 0x20) s->msg[i] = '?';
  return 0;
}

int kvl__descs_check(const uint8_t *body, size_t len, uint32_t *count, char *why, size_t cap) {
  if (len < 8) return fail(why, cap, KVL_EPROTO, "descriptor body too short (%zu bytes)", len);
  uint32_t n = kvl__get_u32(body);
  if (n == 0 || n > KVL_MAX_DESC_PER_MSG)
    return fail(why, cap, KVL_ETOOBIG, "descriptor count %u outside 1..%u", n, KVL_MAX_DESC_PER_MSG);
  if ((uint64_t)n * KVL__WDESC_LEN + 8 != len)
    return fail(why, cap, KVL_EPROTO, "descriptor count %u does not match body length %zu", n, len);
  for (uint32_t i = 0; i < n; i++) {
    kvl__wdesc d;
    kvl__wdesc_get(body, i, &d);
    if (d.length == 0) return fail(why, cap, KVL_EPROTO, "descriptor %u has length 0", i);
  }
  *count = n;
  return 0;
}

void kvl__wdesc_get(const uint8_t *body, uint32_t i, kvl__wdesc *d) {
  const uint8_t *p = body + 8 + (size_t)i * KVL__WDESC_LEN;
  d->region = kvl__get_u32(p);
  d->offset = kvl__get_u64(p + 8);
  d->length = kvl__get_u64(p + 16);
}

void kvl__wdesc_put(uint8_t *body, uint32_t i, const kvl__wdesc *d) {
  uint8_t *p = body + 8 + (size_t)i * KVL__WDESC_LEN;
  kvl__put_u32(p, d->region);
  kvl__put_u32(p + 4, 0);
  kvl__put_u64(p + 8, d->offset);
  kvl__put_u64(p + 16, d->length);
}

int kvl_proto_check(const uint8_t *buf, size_t len, char *why, size_t why_cap) {
  kvl__hdr h;
  if (why && why_cap) why[0] = 0;
  if (len < KVL__HDR_LEN) return KVL_INPROGRESS;
  int rc = kvl__hdr_decode(buf, &h, why, why_cap);
  if (rc) return rc;
  if (len - KVL__HDR_LEN < h.body_len) return KVL_INPROGRESS;
  const uint8_t *body = buf + KVL__HDR_LEN;
  switch (h.type) {
  case KVL__T_HELLO:
  case KVL__T_CHALLENGE: {
    kvl__hello hello;
    return kvl__hello_decode(body, h.body_len, h.type, &hello, why, why_cap);
  }
  case KVL__T_READ_REQ:
  case KVL__T_WRITE_REQ:
  case KVL__T_LREAD_REQ: {
    uint32_t n;
    return kvl__descs_check(body, h.body_len, &n, why, why_cap);
  }
  case KVL__T_READ_RESP:
  case KVL__T_WRITE_RESP:
  case KVL__T_NOTIFY_ACK:
  case KVL__T_LREAD_RESP:
  case KVL__T_LDONE_ACK:
  case KVL__T_ERROR: {
    kvl__status st;
    return kvl__status_decode(body, h.body_len, &st, why, why_cap);
  }
  default: return 0; /* AUTH, WELCOME, NOTIFY: fixed or opaque bodies */
  }
}
