/* kvl_notifs.c - received notifications: a FIFO that responder threads push
 * each NOTIFY body onto (with the sender's engine name) and the caller pops
 * with kvl_notif_next. It is bounded by count (KVL__NOTIF_MAX) and by payload
 * bytes (KVL__NOTIF_MAX_BYTES: a peer may send 4 KiB each); a push beyond
 * that is refused, counted as dropped, and the sender is told the queue is
 * full. It has its own lock. */
#include "kvl_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kvl__notif {
  kvl__notif *next;
  char from[KVL_MAX_NAME + 1];
  size_t len;
  uint8_t data[];
};

void kvl__notifs_init(kvl__notifs *q) {
  memset(q, 0, sizeof *q);
  pthread_mutex_init(&q->mu, NULL);
}

void kvl__notifs_destroy(kvl__notifs *q) {
  while (q->head) {
    kvl__notif *n = q->head;
    q->head = n->next;
    free(n);
  }
  q->tail = NULL;
  pthread_mutex_destroy(&q->mu);
}

int kvl__notifs_push(kvl__notifs *q, const char *from, const uint8_t *data, size_t len) {
  kvl__notif *n = malloc(sizeof *n + len);
  if (!n) return KVL_ENOMEM;
  n->next = NULL;
  snprintf(n->from, sizeof n->from, "%s", from);
  n->len = len;
  memcpy(n->data, data, len);
  pthread_mutex_lock(&q->mu);
  if (q->count >= KVL__NOTIF_MAX || q->bytes + len > KVL__NOTIF_MAX_BYTES) {
    q->dropped++;
    pthread_mutex_unlock(&q->mu);
    free(n);
    return KVL_EFULL;
  }
  if (q->tail) q->tail->next = n;
  else q->head = n;
  q->tail = n;
  q->count++;
  q->bytes += len;
  pthread_mutex_unlock(&q->mu);
  return 0;
}

int kvl__notifs_pop(kvl__notifs *q, char *from, size_t from_cap, void *buf, size_t cap, size_t *len_out) {
  pthread_mutex_lock(&q->mu);
  kvl__notif *n = q->head;
  if (n && n->len > cap) { /* leave it queued: the caller may retry with room */
    pthread_mutex_unlock(&q->mu);
    return KVL_EINVAL;
  }
  if (n) {
    q->head = n->next;
    if (!q->head) q->tail = NULL;
    q->count--;
    q->bytes -= n->len;
  }
  pthread_mutex_unlock(&q->mu);
  if (!n) return 0;
  snprintf(from, from_cap, "%s", n->from);
  memcpy(buf, n->data, n->len);
  *len_out = n->len;
  free(n);
  return 1;
}

uint64_t kvl__notifs_dropped(kvl__notifs *q) {
  pthread_mutex_lock(&q->mu);
  uint64_t n = q->dropped;
  pthread_mutex_unlock(&q->mu);
  return n;
}
