/* kvl_auth.c - connection set-up. Both sides prove they hold the pre-shared
 * token without sending it: each answers the other's random nonce with
 * HMAC-SHA256(token, label || client nonce || server nonce), the labels
 * differing by direction so one side's answer cannot be replayed as the
 * other's. Both sides also check the protocol version of every frame.
 *
 *   client -> HELLO     nonce_c, has-token, name
 *   server -> CHALLENGE nonce_s, mac_s, has-token, name
 *   client -> AUTH      mac_c
 *   server -> WELCOME   (or ERROR with the reason, then close)
 */
#include "kvl_internal.h"

#include <stdio.h>
#include <string.h>
#include <sys/random.h>

static const char LABEL_SERVER[] = "kvlink-v1 server proof";
static const char LABEL_CLIENT[] = "kvlink-v1 client proof";

int kvl__random(uint8_t *p, size_t n) {
  while (n > 0) {
    ssize_t r = getrandom(p, n, 0);
    if (r < 0) return KVL_ESYS;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

static void proof(const kvl_engine *e, const char *label, const uint8_t *nc, const uint8_t *ns, uint8_t out[32]) {
  kvl__bytes parts[3] = {{label, strlen(label)}, {nc, KVL__NONCE_LEN}, {ns, KVL__NONCE_LEN}};
  kvl__hmac_sha256(e->token, e->cfg.token_len, parts, 3, out);
}

/* Read one whole frame whose body fits in cap. */
static int recv_frame(kvl_engine *e, int fd, kvl__hdr *h, uint8_t *body, size_t cap, uint64_t deadline, char *why,
                      size_t wcap) {
  uint8_t hb[KVL__HDR_LEN];
  int rc = kvl__recv_all(fd, hb, sizeof hb, deadline, &e->closing);
  if (rc) {
    snprintf(why, wcap, "%s during handshake", kvl_strerror(rc));
    return rc;
  }
  if ((rc = kvl__hdr_decode(hb, h, why, wcap)) != 0) return rc;
  if (h->body_len > cap) {
    snprintf(why, wcap, "handshake frame type %u with %u-byte body", h->type, h->body_len);
    return KVL_EPROTO;
  }
  rc = kvl__recv_all(fd, body, h->body_len, deadline, &e->closing);
  if (rc) snprintf(why, wcap, "%s during handshake", kvl_strerror(rc));
  return rc;
}

static int send_frame(kvl_engine *e, int fd, uint8_t type, const uint8_t *body, size_t len, uint64_t deadline) {
  uint8_t hb[KVL__HDR_LEN];
  kvl__hdr_encode(hb, type, 0, 0, (uint32_t)len);
  struct iovec v[2] = {{hb, sizeof hb}, {(void *)body, len}};
  return kvl__sendv(fd, v, 2, deadline, &e->closing);
}

int kvl__send_status(int fd, uint8_t type, uint32_t seq, const kvl__status *st, uint64_t deadline, const int *closing) {
  uint8_t buf[KVL__HDR_LEN + KVL__STATUS_MAX];
  size_t n = kvl__status_encode(buf + KVL__HDR_LEN, st);
  kvl__hdr_encode(buf, type, 0, seq, (uint32_t)n);
  return kvl__send_all(fd, buf, KVL__HDR_LEN + n, deadline, closing);
}

/* Tell the peer why we hang up (best effort), and return code. */
static int refuse(kvl_engine *e, int fd, int code, const char *why, uint64_t deadline) {
  kvl__status st;
  memset(&st, 0, sizeof st);
  st.status = code;
  snprintf(st.msg, sizeof st.msg, "%s", why);
  kvl__send_status(fd, KVL__T_ERROR, 0, &st, deadline, &e->closing);
  return code;
}

/* An ERROR frame from the peer: its code and message become ours. */
static int peer_error(const uint8_t *body, uint32_t len, char *why, size_t cap) {
  kvl__status st;
  int rc = kvl__status_decode(body, len, &st, why, cap);
  if (rc) return rc;
  snprintf(why, cap, "peer refused: %s", st.msg);
  return st.status < 0 ? st.status : KVL_EPROTO;
}

int kvl__handshake_client(kvl_engine *e, int fd, uint64_t limit_ms, char *peer_name, char *why, size_t cap) {
  uint64_t deadline = kvl__now_ms() + e->cfg.handshake_timeout_ms;
  if (limit_ms && limit_ms < deadline) deadline = limit_ms;
  uint8_t body[KVL__STATUS_MAX + KVL__NONCE_LEN + KVL__MAC_LEN + 2 + KVL_MAX_NAME];
  kvl__hello me, them;
  kvl__hdr h;
  int rc;
  memset(&me, 0, sizeof me);
  if ((rc = kvl__random(me.nonce, sizeof me.nonce)) != 0) return rc;
  me.auth = e->token ? 1 : 0;
  snprintf(me.name, sizeof me.name, "%s", e->name);
  size_t n = kvl__hello_encode(body, KVL__T_HELLO, &me);
  if ((rc = send_frame(e, fd, KVL__T_HELLO, body, n, deadline)) != 0) {
    snprintf(why, cap, "sending hello: %s", kvl_strerror(rc));
    return rc;
  }
  if ((rc = recv_frame(e, fd, &h, body, sizeof body, deadline, why, cap)) != 0) return rc;
  if (h.type == KVL__T_ERROR) return peer_error(body, h.body_len, why, cap);
  if (h.type != KVL__T_CHALLENGE) {
    snprintf(why, cap, "expected challenge, got frame type %u", h.type);
    return KVL_EPROTO;
  }
  if ((rc = kvl__hello_decode(body, h.body_len, h.type, &them, why, cap)) != 0) return rc;
  if (them.auth != me.auth) {
    snprintf(why, cap, "%s", me.auth ? "peer has no token configured" : "peer requires a token");
    return KVL_EAUTH;
  }
  uint8_t mac[KVL__MAC_LEN] = {0};
  if (e->token) {
    proof(e, LABEL_SERVER, me.nonce, them.nonce, mac);
    if (!kvl__ct_equal(mac, them.mac, KVL__MAC_LEN)) {
      snprintf(why, cap, "peer failed to prove the token");
      return KVL_EAUTH;
    }
    proof(e, LABEL_CLIENT, me.nonce, them.nonce, mac);
  }
  if ((rc = send_frame(e, fd, KVL__T_AUTH, mac, sizeof mac, deadline)) != 0) {
    snprintf(why, cap, "sending proof: %s", kvl_strerror(rc));
    return rc;
  }
  if ((rc = recv_frame(e, fd, &h, body, sizeof body, deadline, why, cap)) != 0) return rc;
  if (h.type == KVL__T_ERROR) return peer_error(body, h.body_len, why, cap);
  if (h.type != KVL__T_WELCOME) {
    snprintf(why, cap, "expected welcome, got frame type %u", h.type);
    return KVL_EPROTO;
  }
  snprintf(peer_name, KVL_MAX_NAME + 1, "%s", them.name);
  return 0;
}

int kvl__handshake_server(kvl_engine *e, int fd, char *peer_name, char *why, size_t cap, int (*admit)(void *),
                          void *arg) {
  uint64_t deadline = kvl__now_ms() + e->cfg.handshake_timeout_ms;
  uint8_t body[KVL__NONCE_LEN + KVL__MAC_LEN + 2 + KVL_MAX_NAME];
  kvl__hello me, them;
  kvl__hdr h;
  int rc;
  if ((rc = recv_frame(e, fd, &h, body, sizeof body, deadline, why, cap)) != 0) {
    if (rc == KVL_EVERSION || rc == KVL_EPROTO) refuse(e, fd, rc, why, deadline);
    return rc;
  }
  if (h.type != KVL__T_HELLO) {
    snprintf(why, cap, "expected hello, got frame type %u", h.type);
    return refuse(e, fd, KVL_EPROTO, why, deadline);
  }
  if ((rc = kvl__hello_decode(body, h.body_len, h.type, &them, why, cap)) != 0) return refuse(e, fd, rc, why, deadline);
  memset(&me, 0, sizeof me);
  me.auth = e->token ? 1 : 0;
  if (them.auth != me.auth) {
    snprintf(why, cap, "%s", me.auth ? "token required" : "this engine has no token configured");
    return refuse(e, fd, KVL_EAUTH, why, deadline);
  }
  if ((rc = kvl__random(me.nonce, sizeof me.nonce)) != 0) return rc;
  if (e->token) proof(e, LABEL_SERVER, them.nonce, me.nonce, me.mac);
  snprintf(me.name, sizeof me.name, "%s", e->name);
  size_t n = kvl__hello_encode(body, KVL__T_CHALLENGE, &me);
  if ((rc = send_frame(e, fd, KVL__T_CHALLENGE, body, n, deadline)) != 0) {
    snprintf(why, cap, "sending challenge: %s", kvl_strerror(rc));
    return rc;
  }
  if ((rc = recv_frame(e, fd, &h, body, sizeof body, deadline, why, cap)) != 0) return rc;
  if (h.type != KVL__T_AUTH) {
    snprintf(why, cap, "expected proof, got frame type %u", h.type);
    return refuse(e, fd, KVL_EPROTO, why, deadline);
  }
  if (e->token) {
    uint8_t want[KVL__MAC_LEN];
    proof(e, LABEL_CLIENT, them.nonce, me.nonce, want);
    if (!kvl__ct_equal(want, body, KVL__MAC_LEN)) {
      snprintf(why, cap, "wrong token");
      return refuse(e, fd, KVL_EAUTH, why, deadline);
    }
  }
  if (admit && !admit(arg)) { /* its socket is already shut down: nothing reaches the peer */
    snprintf(why, cap, "dropped before its welcome: too many handshakes at once");
    return KVL_EBUSY;
  }
  if ((rc = send_frame(e, fd, KVL__T_WELCOME, NULL, 0, deadline)) != 0) {
    snprintf(why, cap, "sending welcome: %s", kvl_strerror(rc));
    return rc;
  }
  snprintf(peer_name, KVL_MAX_NAME + 1, "%s", them.name);
  return 0;
}
