/* kvl_baseline.c - the yardsticks `kvlink bench` measures the engine
 * against: a raw single-connection TCP request/response (the client asks
 * for N bytes, the server streams N bytes of its buffer back with one send,
 * no framing, no auth) and a plain memcpy of the same blocks. Benchmark-only
 * code, built into its own extension module (see kvl_baseline.h); the engine
 * neither uses nor contains it. */
#include "kvl_baseline.h"
#include "kvl_internal.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define RAW_INFO 0ull
#define RAW_RSS (~0ull)

struct kvl_rawtcp {
  int fd;
  int closing;
  const uint8_t *buf;
  uint64_t len;
  char info[1024];
  pthread_t thread;
};

static uint64_t rss_bytes(void) {
  long pages = 0, rss = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (f) {
    if (fscanf(f, "%ld %ld", &pages, &rss) != 2) rss = 0;
    fclose(f);
  }
  return (uint64_t)rss * (uint64_t)sysconf(_SC_PAGESIZE);
}

static void serve_client(struct kvl_rawtcp *r, int fd) {
  kvl__sock_tune(fd);
  for (;;) {
    uint8_t q[8];
    if (kvl__wait_readable(fd, &r->closing) != 0) return;
    if (kvl__recv_all(fd, q, 8, kvl__now_ms() + 5000, &r->closing) != 0) return;
    uint64_t n = kvl__get_u64(q);
    if (n == RAW_INFO || n == RAW_RSS) {
      uint8_t hdr[8];
      const void *p = r->info;
      uint64_t v = rss_bytes();
      size_t len = n == RAW_INFO ? strlen(r->info) : 8;
      if (n == RAW_RSS) p = &v;
      kvl__put_u64(hdr, len);
      if (kvl__send_all(fd, hdr, 8, kvl__now_ms() + 5000, &r->closing) ||
          kvl__send_all(fd, p, len, kvl__now_ms() + 5000, &r->closing))
        return;
      continue;
    }
    if (n > r->len) return;
    if (kvl__send_all(fd, r->buf, (size_t)n, kvl__now_ms() + 60000, &r->closing) != 0) return;
  }
}

static void *raw_main(void *arg) {
  struct kvl_rawtcp *r = arg;
  while (!__atomic_load_n(&r->closing, __ATOMIC_ACQUIRE)) {
    struct pollfd p = {r->fd, POLLIN, 0};
    if (poll(&p, 1, KVL__SLICE_MS) <= 0) continue;
    int fd = accept(r->fd, NULL, NULL);
    if (fd < 0) continue;
    serve_client(r, fd); /* one client at a time: it is a single-connection yardstick */
    close(fd);
  }
  return NULL;
}

int kvl_rawtcp_serve(const char *host, uint16_t port, const void *buf, uint64_t len, const char *info,
                     struct kvl_rawtcp **out, uint16_t *port_out) {
  struct kvl_rawtcp *r = calloc(1, sizeof *r);
  int loop;
  if (!r) return KVL_ENOMEM;
  r->buf = buf;
  r->len = len;
  snprintf(r->info, sizeof r->info, "%s", info ? info : "");
  int rc = kvl__listen(host, port, &r->fd, port_out, &loop);
  if (rc == 0 && pthread_create(&r->thread, NULL, raw_main, r) != 0) {
    close(r->fd);
    rc = KVL_ESYS;
  }
  if (rc) {
    free(r);
    return rc;
  }
  *out = r;
  return 0;
}

void kvl_rawtcp_stop(struct kvl_rawtcp *r) {
  __atomic_store_n(&r->closing, 1, __ATOMIC_RELEASE);
  pthread_join(r->thread, NULL);
  close(r->fd);
  free(r);
}

int kvl_rawtcp_connect(const char *host, uint16_t port, int *fd_out) { return kvl__connect(host, port, 5000, NULL, fd_out); }

/* Ask for n bytes (or RAW_INFO/RAW_RSS) and receive the answer into dst. */
int kvl_rawtcp_fetch(int fd, uint64_t n, void *dst, uint64_t cap, uint64_t *got) {
  uint8_t q[8];
  kvl__put_u64(q, n);
  int rc = kvl__send_all(fd, q, 8, kvl__now_ms() + 5000, NULL);
  if (rc) return rc;
  if (n == RAW_INFO || n == RAW_RSS) {
    if ((rc = kvl__recv_all(fd, q, 8, kvl__now_ms() + 5000, NULL)) != 0) return rc;
    n = kvl__get_u64(q);
  }
  if (n > cap) return KVL_ETOOBIG;
  *got = n;
  return kvl__recv_all(fd, dst, (size_t)n, kvl__now_ms() + 60000, NULL);
}

void kvl_rawtcp_close(int fd) { close(fd); }

/* memcpy of n blocks between given addresses: the local-copy yardstick. */
void kvl_memcpy_blocks(const uint64_t *dst, const uint64_t *src, uint64_t len, size_t n) {
  for (size_t i = 0; i < n; i++) memcpy((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], (size_t)len);
}
