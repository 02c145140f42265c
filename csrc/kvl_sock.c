/* kvl_sock.c - TCP helpers: listen, connect with a deadline, and send/receive
 * loops in which no call blocks longer than KVL__SLICE_MS, so every wait is
 * bounded by its deadline and by engine shutdown. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kvl_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

uint64_t kvl__now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

uint64_t kvl__now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static int is_loopback_addr(const struct sockaddr *sa) {
  if (sa->sa_family == AF_INET) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
    return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
  }
  if (sa->sa_family == AF_INET6) {
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)sa;
    return IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr);
  }
  return 0;
}

/* Every connection: no Nagle; blocking calls wake each slice (deadlines, closing); and TCP keepalive, so a
 * peer's connection idle between requests (a decode rank keeps its peers) is neither forgotten by a NAT or
 * firewall on the path (a request sent into a dropped flow would wait for its whole deadline) nor kept
 * open for long when the other host vanished without a word. */
void kvl__sock_tune(int fd) {
  int one = 1, idle = KVL__KEEPALIVE_IDLE_S, intvl = KVL__KEEPALIVE_INTVL_S, cnt = KVL__KEEPALIVE_CNT;
  struct timeval tv = {0, KVL__SLICE_MS * 1000};
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
}

int kvl__listen(const char *host, uint16_t port, int *fd_out, uint16_t *port_out, int *is_loopback) {
  struct addrinfo hints, *res = NULL;
  char ports[8];
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  snprintf(ports, sizeof ports, "%u", port);
  if (getaddrinfo(host, ports, &hints, &res) != 0 || !res) return KVL_EINVAL;
  int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    return KVL_ESYS;
  }
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  *is_loopback = is_loopback_addr(res->ai_addr);
  if (bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
    freeaddrinfo(res);
    close(fd);
    return KVL_ESYS;
  }
  freeaddrinfo(res);
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  getsockname(fd, (struct sockaddr *)&ss, &sl);
  *port_out = ntohs(ss.ss_family == AF_INET ? ((struct sockaddr_in *)&ss)->sin_port
                                            : ((struct sockaddr_in6 *)&ss)->sin6_port);
  *fd_out = fd;
  return 0;
}

int kvl__connect(const char *host, uint16_t port, uint32_t timeout_ms, const int *closing, int *fd_out) {
  struct addrinfo hints, *res = NULL;
  char ports[8];
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  snprintf(ports, sizeof ports, "%u", port);
  if (getaddrinfo(host, ports, &hints, &res) != 0 || !res) return KVL_EINVAL;
  int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    return KVL_ESYS;
  }
  int rc = connect(fd, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  if (rc != 0 && errno != EINPROGRESS) {
    close(fd);
    return KVL_ECONNECT;
  }
  if (rc != 0) {
    struct pollfd p = {fd, POLLOUT, 0};
    int err = 0, got = 0;
    socklen_t el = sizeof err;
    uint64_t deadline = kvl__now_ms() + timeout_ms;
    while (!got) { /* in slices: closing ends the wait too */
      if ((rc = kvl__waited_too_long(deadline, closing)) != 0) {
        close(fd);
        return rc;
      }
      uint64_t left = deadline - kvl__now_ms();
      got = poll(&p, 1, (int)(left < KVL__SLICE_MS ? left : KVL__SLICE_MS)) == 1;
    }
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0 || err != 0) {
      close(fd);
      return KVL_ECONNECT;
    }
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  kvl__sock_tune(fd);
  *fd_out = fd;
  return 0;
}

void kvl__peer_str(int fd, char *buf, size_t cap) {
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  char h[INET6_ADDRSTRLEN] = "?";
  unsigned port = 0;
  if (getpeername(fd, (struct sockaddr *)&ss, &sl) == 0) {
    if (ss.ss_family == AF_INET) {
      inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, h, sizeof h);
      port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
    } else if (ss.ss_family == AF_INET6) {
      inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, h, sizeof h);
      port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
  }
  snprintf(buf, cap, "%s:%u", h, port);
}

/* Drop n consumed bytes from the front of an iovec array. */
static int iov_advance(struct iovec **iov, int *n, size_t done) {
  while (*n > 0 && done >= (*iov)->iov_len) {
    done -= (*iov)->iov_len;
    (*iov)++;
    (*n)--;
  }
  if (*n > 0) {
    (*iov)->iov_base = (char *)(*iov)->iov_base + done;
    (*iov)->iov_len -= done;
  }
  return *n;
}

int kvl__waited_too_long(uint64_t deadline, const int *closing) {
  if (closing && __atomic_load_n(closing, __ATOMIC_ACQUIRE)) return KVL_ECLOSED;
  if (deadline && kvl__now_ms() >= deadline) return KVL_ETIMEDOUT;
  return 0;
}

int kvl__sendv(int fd, struct iovec *iov, int n, uint64_t deadline, const int *closing) {
  while (n > 0 && iov->iov_len == 0) iov++, n--;
  while (n > 0) {
    struct msghdr m;
    memset(&m, 0, sizeof m);
    m.msg_iov = iov;
    m.msg_iovlen = (size_t)(n > KVL__IOV_MAX ? KVL__IOV_MAX : n);
    ssize_t r = sendmsg(fd, &m, MSG_NOSIGNAL);
    if (r > 0) {
      iov_advance(&iov, &n, (size_t)r);
      continue;
    }
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      int rc = kvl__waited_too_long(deadline, closing);
      if (rc) return rc;
      continue;
    }
    return KVL_EPEERCLOSED;
  }
  return 0;
}

int kvl__wait_readable(int fd, const int *closing) {
  for (;;) {
    struct pollfd p = {fd, POLLIN, 0};
    int r = poll(&p, 1, KVL__SLICE_MS);
    if (closing && __atomic_load_n(closing, __ATOMIC_ACQUIRE)) return KVL_ECLOSED;
    if (r > 0) return 0; /* data, EOF or error: the next receive tells which */
    if (r < 0 && errno != EINTR) return KVL_ESYS;
  }
}

int kvl__recvv(int fd, struct iovec *iov, int n, uint64_t deadline, const int *closing) {
  while (n > 0 && iov->iov_len == 0) iov++, n--;
  while (n > 0) {
    struct msghdr m;
    memset(&m, 0, sizeof m);
    m.msg_iov = iov;
    m.msg_iovlen = (size_t)(n > KVL__IOV_MAX ? KVL__IOV_MAX : n);
    ssize_t r = recvmsg(fd, &m, MSG_WAITALL);
    if (r > 0) {
      iov_advance(&iov, &n, (size_t)r);
      continue;
    }
    if (r == 0) return KVL_EPEERCLOSED;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      int rc = kvl__waited_too_long(deadline, closing);
      if (rc) return rc;
      continue;
    }
    return KVL_EPEERCLOSED;
  }
  return 0;
}

int kvl__recv_header(int fd, uint8_t *hb, uint32_t timeout_ms, const int *closing, int *orderly) {
  size_t got = 0;
  uint64_t deadline = 0;
  *orderly = 0;
  while (got < KVL__HDR_LEN) {
    ssize_t r = recv(fd, hb + got, KVL__HDR_LEN - got, MSG_WAITALL);
    if (r > 0) {
      if (got == 0) deadline = kvl__now_ms() + timeout_ms;
      got += (size_t)r;
      continue;
    }
    if (r == 0) {
      *orderly = got == 0;
      return KVL_EPEERCLOSED;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return KVL_EPEERCLOSED;
    int rc = kvl__waited_too_long(got ? deadline : 0, closing);
    if (rc) return rc;
  }
  return 0;
}

int kvl__send_all(int fd, const void *p, size_t len, uint64_t deadline, const int *closing) {
  struct iovec v = {(void *)p, len};
  return kvl__sendv(fd, &v, 1, deadline, closing);
}

int kvl__recv_all(int fd, void *p, size_t len, uint64_t deadline, const int *closing) {
  struct iovec v = {p, len};
  return kvl__recvv(fd, &v, 1, deadline, closing);
}
