/* kvl_events.c - the event log: a bounded ring of (code, message) the engine's
 * threads append to (a refused peer and why, a failed batch, ...) and the
 * caller drains with kvl_event_next. When the caller does not drain it, the
 * oldest events give way to the newest and are counted as dropped. It has its
 * own lock, so logging never waits on anything else in the engine. */
#include "kvl_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void kvl__events_init(kvl__events *q) {
  memset(q, 0, sizeof *q);
  pthread_mutex_init(&q->mu, NULL);
}

void kvl__events_destroy(kvl__events *q) { pthread_mutex_destroy(&q->mu); }

void kvl__event_log(kvl__events *q, int code, const char *fmt, ...) {
  pthread_mutex_lock(&q->mu);
  if (q->count == KVL__EVENTS) { /* keep the newest */
    q->head = (q->head + 1) % KVL__EVENTS;
    q->count--;
    q->dropped++;
  }
  kvl__event *ev = &q->ring[(q->head + q->count) % KVL__EVENTS];
  ev->code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ev->msg, sizeof ev->msg, fmt, ap);
  va_end(ap);
  q->count++;
  pthread_mutex_unlock(&q->mu);
}

int kvl__events_pop(kvl__events *q, int *code, char *msg, size_t cap) {
  pthread_mutex_lock(&q->mu);
  int got = q->count > 0;
  if (got) {
    const kvl__event *ev = &q->ring[q->head];
    *code = ev->code;
    snprintf(msg, cap, "%s", ev->msg);
    q->head = (q->head + 1) % KVL__EVENTS;
    q->count--;
  }
  pthread_mutex_unlock(&q->mu);
  return got;
}

uint64_t kvl__events_dropped(kvl__events *q) {
  pthread_mutex_lock(&q->mu);
  uint64_t n = q->dropped;
  pthread_mutex_unlock(&q->mu);
  return n;
}
