/* kvl_local.c - the same-host path. When both engines run on one host, a
 * READ copies straight from the peer's registered memory into ours with one
 * process_vm_readv, after the usual authenticated handshake:
 *
 *   requester -> LREAD_REQ  descriptors (as READ_REQ)
 *   responder -> LREAD_RESP status; then one u64 address per descriptor
 *                (validated and pinned exactly like a READ)
 *   requester    process_vm_readv(...)
 *   requester -> LDONE
 *   responder -> LDONE_ACK  status (ok only if the pins were held throughout)
 *
 * Whether the path works is probed at connect (LPROBE): same boot id, a
 * 32-byte random cookie in the responder's memory read back intact, and the
 * kernel's word that the pid named holds this connection's other end
 * (kvl_owner.c: a peer could relay another engine's answer). Where
 * the kernel or container forbids it (ptrace rules, pid namespaces, another
 * host), the probe says why and the peer stays on TCP. Raw addresses stay
 * inside the C engine. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kvl_internal.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#define LOCAL_CHUNK_BYTES (8u << 20) /* bounds how long cancel waits for a copy */

/* ---- responder ------------------------------------------------------------ */

int kvl__local_serve_probe(kvl_engine *e, int fd, uint32_t seq) {
  uint8_t out[KVL__HDR_LEN + KVL__PROBE_BODY];
  uint8_t *b = out + KVL__HDR_LEN;
  kvl__hdr_encode(out, KVL__T_LPROBE_RESP, 0, seq, KVL__PROBE_BODY);
  if (!e->cfg.same_host) { /* off: no pid, cookie or address leaves this engine; the requester uses TCP */
    memset(b, 0, KVL__PROBE_BODY);
    kvl__put_u32(b, (uint32_t)KVL_EACCESS);
    return kvl__send_all(fd, out, sizeof out, kvl__now_ms() + e->cfg.op_timeout_ms, &e->closing);
  }
  kvl__put_u32(b, 0);
  kvl__put_u32(b + 4, (uint32_t)getpid());
  memcpy(b + 8, e->boot_id, KVL__BOOT_ID_LEN);
  memcpy(b + 8 + KVL__BOOT_ID_LEN, e->cookie, KVL__NONCE_LEN);
  kvl__put_u64(b + 8 + KVL__BOOT_ID_LEN + KVL__NONCE_LEN, (uint64_t)(uintptr_t)e->cookie);
  return kvl__send_all(fd, out, sizeof out, kvl__now_ms() + e->cfg.op_timeout_ms, &e->closing);
}

int kvl__local_serve_read(kvl_engine *e, int fd, const kvl__hdr *h, const uint8_t *body, uint64_t **addrs,
                          size_t *cap, char *why, size_t wcap) {
  uint32_t count, bad = 0;
  uint64_t deadline = kvl__now_ms() + e->cfg.op_timeout_ms;
  kvl__status st;
  memset(&st, 0, sizeof st);
  int rc = kvl__descs_check(body, h->body_len, &count, why, wcap);
  if (rc == 0 && !e->cfg.same_host) {
    rc = KVL_EACCESS;
    snprintf(why, wcap, "same-host reads are off on this engine (same_host=off)");
  }
  if (rc == 0) rc = kvl__regions_acquire(&e->regions, body, count, KVL_ACCESS_READ, &bad, why, wcap);
  if (rc) {
    st.status = rc;
    st.index = bad;
    snprintf(st.msg, sizeof st.msg, "%s", why);
    kvl__send_status(fd, KVL__T_LREAD_RESP, h->seq, &st, deadline, &e->closing);
    return rc;
  }
  if (kvl__grow((void **)addrs, cap, (size_t)count * 8) != 0) {
    kvl__regions_release(&e->regions, body, count);
    snprintf(why, wcap, "no memory for %u addresses", count);
    return KVL_ENOMEM;
  }
  struct iovec one;
  for (uint32_t i = 0; i < count; i++) {
    kvl__regions_resolve(&e->regions, body, i, 1, &one);
    kvl__put_u64((uint8_t *)&(*addrs)[i], (uint64_t)(uintptr_t)one.iov_base);
  }
  rc = kvl__send_status(fd, KVL__T_LREAD_RESP, h->seq, &st, deadline, &e->closing);
  if (rc == 0) rc = kvl__send_all(fd, *addrs, (size_t)count * 8, deadline, &e->closing);
  /* The peer copies now; the regions stay pinned until it says it is done. */
  uint8_t hb[KVL__HDR_LEN];
  kvl__hdr done;
  if (rc == 0) rc = kvl__recv_all(fd, hb, sizeof hb, deadline, &e->closing);
  if (rc == 0) rc = kvl__hdr_decode(hb, &done, why, wcap);
  if (rc == 0 && done.type != KVL__T_LDONE) {
    snprintf(why, wcap, "expected LDONE, got frame type %u", done.type);
    rc = KVL_EPROTO;
  }
  kvl__regions_release(&e->regions, body, count);
  if (rc) {
    if (!why[0]) snprintf(why, wcap, "%s during a same-host read", kvl_strerror(rc));
    return rc; /* no ack: the peer fails the batch */
  }
  uint64_t total = 0;
  for (uint32_t i = 0; i < count; i++) {
    kvl__wdesc d;
    kvl__wdesc_get(body, i, &d);
    total += d.length;
  }
  KVL__STAT_ADD(e, bytes_served, total);
  return kvl__send_status(fd, KVL__T_LDONE_ACK, done.seq, &st, deadline, &e->closing);
}

/* ---- requester -------------------------------------------------------------- */

int kvl__local_probe(kvl_engine *e, int fd, uint64_t limit_ms, kvl__local_peer *lp) {
  lp->ok = 0;
  lp->pid = 0;
  lp->why[0] = 0;
  uint8_t hb[KVL__HDR_LEN], body[KVL__PROBE_BODY];
  kvl__hdr h;
  uint64_t deadline = kvl__now_ms() + e->cfg.handshake_timeout_ms;
  if (limit_ms && limit_ms < deadline) deadline = limit_ms;
  kvl__hdr_encode(hb, KVL__T_LPROBE, 0, 0, 0);
  int rc = kvl__send_all(fd, hb, sizeof hb, deadline, &e->closing);
  if (rc == 0) rc = kvl__recv_all(fd, hb, sizeof hb, deadline, &e->closing);
  if (rc == 0) rc = kvl__hdr_decode(hb, &h, lp->why, sizeof lp->why);
  if (rc == 0 && h.type == KVL__T_ERROR) {
    /* An engine older than the same-host path refuses the frame, then closes the connection. */
    snprintf(lp->why, sizeof lp->why, "peer refused the same-host probe (a kvlink without the same-host path)");
    return KVL_ELOCAL;
  }
  if (rc == 0 && (h.type != KVL__T_LPROBE_RESP || h.body_len != KVL__PROBE_BODY)) {
    snprintf(lp->why, sizeof lp->why, "peer answered the same-host probe with frame type %u", h.type);
    rc = KVL_EPROTO;
  }
  if (rc == 0) rc = kvl__recv_all(fd, body, sizeof body, deadline, &e->closing);
  if (rc) {
    if (!lp->why[0]) snprintf(lp->why, sizeof lp->why, "probe: %s", kvl_strerror(rc));
    return rc; /* the connection is unusable: the caller fails the connect */
  }
  if (kvl__get_u32(body) != 0) {
    snprintf(lp->why, sizeof lp->why, "peer does not serve same-host reads (its same_host is off)");
    return 0;
  }
  pid_t pid = (pid_t)kvl__get_u32(body + 4);
  const uint8_t *cookie = body + 8 + KVL__BOOT_ID_LEN;
  uint64_t addr = kvl__get_u64(body + 8 + KVL__BOOT_ID_LEN + KVL__NONCE_LEN);
  if (memcmp(body + 8, e->boot_id, KVL__BOOT_ID_LEN) != 0) {
    snprintf(lp->why, sizeof lp->why, "peer runs on another host (boot id differs)");
    return 0;
  }
  uint8_t got[KVL__NONCE_LEN];
  struct iovec l = {got, sizeof got}, r = {(void *)(uintptr_t)addr, sizeof got};
  ssize_t n = process_vm_readv(pid, &l, 1, &r, 1, 0);
  if (n != (ssize_t)sizeof got) {
    snprintf(lp->why, sizeof lp->why, "process_vm_readv of peer pid %d refused: %s", (int)pid,
             n < 0 ? strerror(errno) : "short read");
    return 0;
  }
  if (memcmp(got, cookie, sizeof got) != 0) {
    snprintf(lp->why, sizeof lp->why, "pid %d is not the peer (another pid namespace?)", (int)pid);
    return 0;
  }
  char held_why[KVL_MAX_EVENT_MSG / 2];
  if (!kvl__holds_peer_end((int)pid, fd, held_why, sizeof held_why)) { /* a relayed probe names another engine */
    snprintf(lp->why, sizeof lp->why, "not copying from pid %d: %s", (int)pid, held_why);
    return 0;
  }
  lp->pid = pid;
  lp->ok = 1;
  snprintf(lp->why, sizeof lp->why, "same host: copying from pid %d with process_vm_readv", (int)pid);
  return 0;
}

int kvl__local_read(kvl__stream *s, kvl__part *pt, char *why, size_t cap) {
  kvl_batch *b = pt->batch;
  kvl__peer *p = s->peer;
  kvl_engine *e = p->e;
  uint64_t dl = b->deadline_ms, want = kvl__part_bytes(pt);
  kvl__status st;
  int rc = kvl__send_request(s, pt, KVL__T_LREAD_REQ, dl);
  if (rc) {
    snprintf(why, cap, "%s sending a same-host READ to %s", kvl_strerror(rc), p->name);
    return rc;
  }
  if ((rc = kvl__recv_status(s, KVL__T_LREAD_RESP, s->seq, &st, dl, why, cap)) != 0) return rc;
  if (kvl__grow((void **)&s->addrs, &s->addr_cap, (size_t)pt->count * 8) != 0) return KVL_ENOMEM;
  if ((rc = kvl__recv_all(s->fd, s->addrs, (size_t)pt->count * 8, dl, &e->closing)) != 0) {
    snprintf(why, cap, "%s receiving addresses from %s", kvl_strerror(rc), p->name);
    return rc;
  }
  /* Copy in chunks of at most KVL__IOV_MAX descriptors and LOCAL_CHUNK_BYTES,
   * each bracketed so that cancel waits for at most one chunk. */
  uint32_t i = 0;
  uint64_t off = 0; /* progress inside descriptor i */
  while (i < pt->count) {
    int n = 0;
    size_t bytes = 0;
    uint32_t j = i;
    uint64_t o = off;
    while (j < pt->count && n < KVL__IOV_MAX && bytes < LOCAL_CHUNK_BYTES) {
      const kvl__desc *d = &b->desc[pt->first + j];
      uint64_t take = d->length - o;
      if (take > LOCAL_CHUNK_BYTES - bytes) take = LOCAL_CHUNK_BYTES - bytes;
      s->iov[n].iov_base = (void *)(uintptr_t)(d->local + o);
      s->iov[n].iov_len = (size_t)take;
      s->riov[n].iov_base = (void *)(uintptr_t)(kvl__get_u64((const uint8_t *)&s->addrs[j]) + o);
      s->riov[n].iov_len = (size_t)take;
      n++;
      bytes += take;
      o += take;
      if (o == d->length) {
        j++;
        o = 0;
      }
    }
    if ((rc = kvl__batch_enter_io(b)) != 0) {
      snprintf(why, cap, "batch finished while copying");
      return rc;
    }
    ssize_t got = process_vm_readv(p->local.pid, s->iov, (unsigned long)n, s->riov, (unsigned long)n, 0);
    int err = errno;
    kvl__batch_leave_io(b);
    if (got != (ssize_t)bytes) {
      snprintf(why, cap, "process_vm_readv from pid %d: %s", (int)p->local.pid,
               got < 0 ? strerror(err) : "short copy");
      return KVL_ESYS;
    }
    i = j;
    off = o;
  }
  uint8_t hb[KVL__HDR_LEN];
  kvl__hdr_encode(hb, KVL__T_LDONE, 0, s->seq, 0);
  if ((rc = kvl__send_all(s->fd, hb, sizeof hb, dl, &e->closing)) != 0) {
    snprintf(why, cap, "%s confirming a same-host READ", kvl_strerror(rc));
    return rc;
  }
  if ((rc = kvl__recv_status(s, KVL__T_LDONE_ACK, s->seq, &st, dl, why, cap)) != 0) return rc;
  KVL__STAT_ADD(e, bytes_read, want);
  KVL__STAT_ADD(e, bytes_local, want);
  return 0;
}
