/* kvl_region.c - the table of registered memory regions. A region id packs
 * a slot index (low KVL__IDX_BITS) and a generation (the rest), so an id
 * from an unregistered region never reaches memory that a later
 * registration reuses the slot for. Slots are handed out in turn, so a
 * slot's generation moves once per KVL_MAX_REGIONS registrations: an id
 * comes back only after about 2^31 of them. Peers pin the regions they
 * access (inflight) for the duration of one request; removal refuses new
 * accesses at once and waits for the pins to drop. */
#include "kvl_internal.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define KVL__IDX_BITS 13 /* slot index + 1: 1..KVL_MAX_REGIONS */
#define KVL__GEN_MAX ((1u << (32 - KVL__IDX_BITS)) - 1)
_Static_assert(KVL_MAX_REGIONS < (1u << KVL__IDX_BITS), "region slot index must fit its bits");

static uint32_t make_id(uint32_t idx, uint32_t gen) { return gen << KVL__IDX_BITS | (idx + 1); }
static uint32_t slot_of(uint32_t id) { return (id & ((1u << KVL__IDX_BITS) - 1)) - 1; } /* of a live id */

/* The slot of a live id, or NULL. Called with t->mu held. */
static kvl__region *lookup(kvl__regions *t, uint32_t id) {
  uint32_t idx = id & ((1u << KVL__IDX_BITS) - 1);
  if (idx == 0 || idx > KVL_MAX_REGIONS) return NULL;
  kvl__region *r = &t->slot[idx - 1];
  if (r->state == 0 || r->gen != id >> KVL__IDX_BITS) return NULL;
  return r;
}

void kvl__regions_init(kvl__regions *t) {
  memset(t, 0, sizeof *t);
  pthread_mutex_init(&t->mu, NULL);
  kvl__cond_init(&t->drained);
  for (uint32_t i = 0; i < KVL_MAX_REGIONS; i++) t->slot[i].gen = 1;
}

void kvl__regions_destroy(kvl__regions *t) {
  pthread_mutex_destroy(&t->mu);
  pthread_cond_destroy(&t->drained);
}

int kvl__regions_add(kvl__regions *t, uint64_t addr, uint64_t len, uint32_t access, uint32_t *id) {
  if (len == 0 || addr == 0 || addr + len < addr || (access & ~(KVL_ACCESS_READ | KVL_ACCESS_WRITE)))
    return KVL_EINVAL;
  pthread_mutex_lock(&t->mu);
  for (uint32_t k = 0; k < KVL_MAX_REGIONS; k++) {
    uint32_t i = (t->next + k) % KVL_MAX_REGIONS;
    kvl__region *r = &t->slot[i];
    if (r->state != 0) continue;
    t->next = (i + 1) % KVL_MAX_REGIONS;
    r->addr = addr;
    r->len = len;
    r->access = access;
    r->inflight = 0;
    r->state = 1;
    t->count++;
    *id = make_id(i, r->gen);
    pthread_mutex_unlock(&t->mu);
    return 0;
  }
  pthread_mutex_unlock(&t->mu);
  return KVL_EFULL;
}

int kvl__regions_remove(kvl__regions *t, uint32_t id, uint32_t timeout_ms) {
  struct timespec until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  until.tv_sec += timeout_ms / 1000;
  until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
  pthread_mutex_lock(&t->mu);
  kvl__region *r = lookup(t, id);
  if (!r) {
    pthread_mutex_unlock(&t->mu);
    return KVL_ENOREGION;
  }
  uint32_t gen = r->gen;
  r->state = 2; /* from now on lookups refuse it */
  while (r->inflight > 0) {
    if (pthread_cond_timedwait(&t->drained, &t->mu, &until) == ETIMEDOUT && r->gen == gen && r->inflight > 0) {
      pthread_mutex_unlock(&t->mu);
      return KVL_EBUSY; /* still draining; the id stays refused */
    }
    if (r->gen != gen) { /* a concurrent remove of the same id drained and freed it (the slot may be reused) */
      pthread_mutex_unlock(&t->mu);
      return 0;
    }
  }
  r->state = 0;
  r->gen = r->gen == KVL__GEN_MAX ? 1 : r->gen + 1;
  t->count--;
  pthread_mutex_unlock(&t->mu);
  return 0;
}

static void unpin(kvl__regions *t, const uint8_t *body, uint32_t count) {
  for (uint32_t i = 0; i < count; i++) {
    kvl__wdesc d;
    kvl__wdesc_get(body, i, &d);
    kvl__region *r = &t->slot[slot_of(d.region)];
    if (--r->inflight == 0 && r->state == 2) pthread_cond_broadcast(&t->drained);
  }
}

int kvl__regions_acquire(kvl__regions *t, const uint8_t *body, uint32_t count, uint32_t need, uint32_t *bad,
                         char *why, size_t cap) {
  int rc = 0;
  uint32_t i;
  pthread_mutex_lock(&t->mu);
  for (i = 0; i < count; i++) {
    kvl__wdesc d;
    kvl__wdesc_get(body, i, &d);
    kvl__region *r = lookup(t, d.region);
    if (!r || r->state != 1) {
      snprintf(why, cap, "descriptor %u names unknown region 0x%x", i, d.region);
      rc = KVL_ENOREGION;
      break;
    }
    if ((r->access & need) != need) {
      snprintf(why, cap, "descriptor %u: region 0x%x does not permit %s", i, d.region,
               need == KVL_ACCESS_READ ? "READ" : "WRITE");
      rc = KVL_EACCESS;
      break;
    }
    /* overflow-safe: offset + length <= len */
    if (d.offset > r->len || d.length > r->len - d.offset) {
      snprintf(why, cap, "descriptor %u: offset %llu + length %llu beyond region 0x%x of %llu bytes", i,
               (unsigned long long)d.offset, (unsigned long long)d.length, d.region, (unsigned long long)r->len);
      rc = KVL_ERANGE;
      break;
    }
    r->inflight++;
  }
  if (rc) {
    unpin(t, body, i);
    *bad = i;
  }
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int kvl__regions_resolve(kvl__regions *t, const uint8_t *body, uint32_t first, uint32_t n, struct iovec *out) {
  /* The regions are pinned, so their address and length cannot change. */
  for (uint32_t i = 0; i < n; i++) {
    kvl__wdesc d;
    kvl__wdesc_get(body, first + i, &d);
    const kvl__region *r = &t->slot[slot_of(d.region)];
    out[i].iov_base = (void *)(uintptr_t)(r->addr + d.offset);
    out[i].iov_len = (size_t)d.length;
  }
  return 0;
}

void kvl__regions_release(kvl__regions *t, const uint8_t *body, uint32_t count) {
  pthread_mutex_lock(&t->mu);
  unpin(t, body, count);
  pthread_mutex_unlock(&t->mu);
}

uint32_t kvl__regions_count(kvl__regions *t) {
  pthread_mutex_lock(&t->mu);
  uint32_t n = t->count;
  pthread_mutex_unlock(&t->mu);
  return n;
}
