/* kvl_batch.c - batches: building them from descriptor arrays (coalescing
 * and striping), and their completion state. A batch is visibly finished
 * only when no worker is inside a receive into its memory (active_io == 0),
 * which is what makes "after cancel, timeout or failure returns, nothing is
 * written into the destination again" hold. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kvl_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define KVL__MIN_STRIPE (512u * 1024u) /* smaller batches stay on one stream */
#define KVL__MAX_BATCH_BYTES (1ull << 60)  /* far beyond any batch; sums stay clear of 64-bit wrap */

static void timespec_at(struct timespec *ts, uint64_t ms_from_now) {
  clock_gettime(CLOCK_MONOTONIC, ts);
  ts->tv_sec += (time_t)(ms_from_now / 1000);
  ts->tv_nsec += (long)(ms_from_now % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) ts->tv_sec++, ts->tv_nsec -= 1000000000L;
}

void kvl__batch_fail_locked(kvl_batch *b, int err, const char *msg) {
  if (b->state != KVL__B_RUNNING) return;
  b->state = KVL__B_FAILED;
  b->err = err;
  snprintf(b->msg, sizeof b->msg, "%s", msg && msg[0] ? msg : kvl_strerror(err));
  /* Wake workers blocked on our sockets; they see the state and stop. */
  for (uint32_t i = 0; i < b->parts_total; i++)
    if (b->parts[i].running_on) shutdown(b->parts[i].running_on->fd, SHUT_RDWR);
  pthread_cond_broadcast(&b->cv);
}

void kvl__batch_unref(kvl_batch *b) {
  pthread_mutex_lock(&b->mu);
  int left = --b->refs;
  pthread_mutex_unlock(&b->mu);
  if (left) return;
  pthread_mutex_destroy(&b->mu);
  pthread_cond_destroy(&b->cv);
  free(b->desc);
  free(b);
}

void kvl__part_finish(kvl__part *pt, int rc, const char *msg) {
  kvl_batch *b = pt->batch;
  kvl_engine *e = pt->engine;
  pthread_mutex_lock(&b->mu);
  if (rc == 0) {
    if (++b->parts_done == b->parts_total && b->state == KVL__B_RUNNING) {
      b->state = KVL__B_DONE;
      pthread_cond_broadcast(&b->cv);
    }
  } else {
    kvl__batch_fail_locked(b, rc, msg);
  }
  int last = ++b->parts_finished == b->parts_total;
  int ok = b->state == KVL__B_DONE;
  pthread_mutex_unlock(&b->mu);
  if (last) {
    if (ok) KVL__STAT_ADD(e, batches_ok, 1);
    else KVL__STAT_ADD(e, batches_failed, 1);
  }
  kvl__batch_unref(b);
}

static int visible(const kvl_batch *b) { return b->state != KVL__B_RUNNING && b->active_io == 0; }
static int outcome(const kvl_batch *b) { return b->state == KVL__B_DONE ? 0 : b->err; }

int kvl_batch_poll(kvl_batch *b) {
  pthread_mutex_lock(&b->mu);
  int rc = visible(b) ? outcome(b) : KVL_INPROGRESS;
  pthread_mutex_unlock(&b->mu);
  return rc;
}

int kvl__batch_wait(kvl_batch *b, uint32_t timeout_ms) {
  struct timespec until;
  timespec_at(&until, timeout_ms);
  pthread_mutex_lock(&b->mu);
  while (!visible(b)) {
    if (b->state == KVL__B_RUNNING) {
      if (pthread_cond_timedwait(&b->cv, &b->mu, &until) == ETIMEDOUT && b->state == KVL__B_RUNNING) {
        char msg[96];
        snprintf(msg, sizeof msg, "batch not finished within %u ms; canceled", timeout_ms);
        kvl__batch_fail_locked(b, KVL_ETIMEDOUT, msg);
      }
    } else {
      pthread_cond_wait(&b->cv, &b->mu); /* a receive is ending: bounded */
    }
  }
  int rc = outcome(b);
  pthread_mutex_unlock(&b->mu);
  return rc;
}

int kvl_batch_cancel(kvl_batch *b) {
  if (!b) return KVL_EINVAL;
  pthread_mutex_lock(&b->mu);
  int stopped = b->state == KVL__B_RUNNING; /* else its outcome was decided before this call */
  kvl__batch_fail_locked(b, KVL_ECANCELED, "canceled by the caller");
  while (b->active_io > 0) pthread_cond_wait(&b->cv, &b->mu); /* a receive is ending: bounded */
  pthread_mutex_unlock(&b->mu);
  return stopped ? 0 : KVL_FINISHED;
}

const char *kvl_batch_message(kvl_batch *b) { return b->msg; }
size_t kvl_batch_descriptors(kvl_batch *b) { return b->ndesc; }
void kvl_batch_release(kvl_batch *b) {
  if (!b) return;
  kvl_batch_cancel(b); /* still running: stopped, so nothing lands in its memory once the caller lets it go */
  kvl__batch_unref(b);
}

int kvl__batch_enter_io(kvl_batch *b) {
  pthread_mutex_lock(&b->mu);
  int ok = b->state == KVL__B_RUNNING;
  if (ok) b->active_io++;
  pthread_mutex_unlock(&b->mu);
  return ok ? 0 : KVL_ECANCELED;
}

void kvl__batch_leave_io(kvl_batch *b) {
  pthread_mutex_lock(&b->mu);
  if (--b->active_io == 0 && b->state != KVL__B_RUNNING) pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
}

/* Build a batch: copy descriptors, merging neighbours that are contiguous on
 * both sides, then cut them into parts of about equal bytes, one per stream
 * (splitting a descriptor at a cut), each within KVL_MAX_DESC_PER_MSG. */
int kvl__batch_build(kvl_engine *e, int op, int nstreams, const uint64_t *local, const uint32_t *regions,
                     size_t n_regions, const uint64_t *offsets, const uint64_t *lengths, size_t n_lengths, size_t n,
                     uint64_t deadline, kvl_batch **out, char *why, size_t cap) {
  size_t m = 0;
  uint64_t total = 0;
  kvl__desc *tmp = malloc(n * sizeof *tmp);
  if (!tmp) return KVL_ENOMEM;
  for (size_t i = 0; i < n; i++) {
    uint32_t r = regions[n_regions == 1 ? 0 : i];
    uint64_t len = lengths[n_lengths == 1 ? 0 : i];
    if (len == 0 || local[i] == 0 || local[i] + len < local[i] || offsets[i] + len < offsets[i]) {
      snprintf(why, cap, "descriptor %zu: %s", i,
               len == 0 ? "length 0" : local[i] == 0 ? "local address 0" : "offset + length overflows");
      free(tmp);
      return KVL_EINVAL;
    }
    if (len > KVL__MAX_BATCH_BYTES - total) { /* also keeps the stripe arithmetic below from wrapping */
      snprintf(why, cap, "descriptor %zu: the batch's lengths add up to more than 2^60 bytes", i);
      free(tmp);
      return KVL_ETOOBIG;
    }
    total += len;
    if (m > 0) {
      kvl__desc *p = &tmp[m - 1];
      if (p->region == r && p->local + p->length == local[i] && p->offset + p->length == offsets[i]) {
        p->length += len;
        continue;
      }
    }
    tmp[m].local = local[i];
    tmp[m].region = r;
    tmp[m].offset = offsets[i];
    tmp[m].length = len;
    m++;
  }
  uint64_t stripes = total >= (uint64_t)KVL__MIN_STRIPE * 2 ? total / KVL__MIN_STRIPE : 1;
  uint32_t want = stripes > (uint64_t)nstreams ? (uint32_t)nstreams : (uint32_t)stripes; /* >= 1 */
  uint64_t per = (total + want - 1) / want;
  size_t max_parts = want + m / KVL_MAX_DESC_PER_MSG + 2;
  kvl_batch *b = calloc(1, sizeof *b + max_parts * sizeof(kvl__part));
  kvl__desc *d = malloc((m + want + 1) * sizeof *d);
  if (!b || !d) {
    free(tmp);
    free(b);
    free(d);
    return KVL_ENOMEM;
  }
  b->parts = (kvl__part *)(b + 1);
  b->desc = d;
  size_t nd = 0;
  uint32_t np = 0;
  uint64_t acc = 0; /* bytes in the current part */
  b->parts[0].first = 0;
  for (size_t i = 0; i < m; i++) {
    kvl__desc cur = tmp[i];
    while (cur.length > 0) {
      uint64_t take = cur.length;
      if (want > 1 && np + 1 < want && acc + take > per) take = per - acc;
      d[nd] = cur;
      d[nd].length = take;
      nd++;
      acc += take;
      cur.local += take;
      cur.offset += take;
      cur.length -= take;
      uint32_t in_part = (uint32_t)(nd - b->parts[np].first);
      int cut = (want > 1 && np + 1 < want && acc >= per) || in_part == KVL_MAX_DESC_PER_MSG;
      if (cut && (cur.length > 0 || i + 1 < m)) {
        b->parts[np].count = in_part;
        np++;
        b->parts[np].first = (uint32_t)nd;
        if (acc >= per) acc = 0;
      }
    }
  }
  b->parts[np].count = (uint32_t)(nd - b->parts[np].first);
  np++;
  free(tmp);
  pthread_mutex_init(&b->mu, NULL);
  kvl__cond_init(&b->cv);
  b->op = op;
  b->ndesc = nd;
  b->total_bytes = total;
  b->parts_total = np;
  b->deadline_ms = deadline;
  b->refs = 1 + (int)np;
  for (uint32_t i = 0; i < np; i++) {
    b->parts[i].batch = b;
    b->parts[i].engine = e;
  }
  *out = b;
  return 0;
}

int kvl__batch_notify(kvl_engine *e, const void *data, size_t len, uint64_t deadline, kvl_batch **out) {
  kvl_batch *b = calloc(1, sizeof *b + sizeof(kvl__part) + len);
  if (!b) return KVL_ENOMEM;
  b->parts = (kvl__part *)(b + 1);
  memcpy(b->parts + 1, data, len);
  b->payload = b->parts + 1;
  b->payload_len = len;
  pthread_mutex_init(&b->mu, NULL);
  kvl__cond_init(&b->cv);
  b->parts_total = 1;
  b->deadline_ms = deadline;
  b->refs = 2;
  b->parts[0].batch = b;
  b->parts[0].engine = e;
  *out = b;
  return 0;
}
