/* kvl_owner.c - whether a process holds the other end of a TCP connection,
 * on the kernel's word rather than the peer's.
 *
 * The same-host path copies from the pid its peer names. A peer could name
 * another engine's pid (and relay that engine's probe answer), and the
 * requester would then copy from memory that engine never offered. So the
 * requester looks the connection up in the named process's network namespace
 * (/proc/PID/net/tcp and tcp6: the entry whose local end is our peer address
 * and whose remote end is our own address gives the socket's inode) and
 * checks that one of that process's descriptors is that socket
 * (/proc/PID/fd). Reading /proc/PID/fd needs the access process_vm_readv
 * needs anyway. Where the two views of the connection differ (NAT between
 * network namespaces), the answer is "not shown" and the peer stays on TCP. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kvl_internal.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

typedef struct { /* an endpoint as IPv6 (IPv4 mapped), port in host order */
  uint8_t addr[16];
  unsigned port;
} endpoint;

static int endpoint_of(const struct sockaddr_storage *ss, endpoint *ep) {
  memset(ep, 0, sizeof *ep);
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
    ep->addr[10] = ep->addr[11] = 0xff;
    memcpy(ep->addr + 12, &a->sin_addr, 4);
    ep->port = ntohs(a->sin_port);
    return 0;
  }
  if (ss->ss_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
    memcpy(ep->addr, &a->sin6_addr, 16);
    ep->port = ntohs(a->sin6_port);
    return 0;
  }
  return -1;
}

/* "0100007F:1F90" (tcp) or 32 hex digits ":port" (tcp6): the kernel prints
 * each 32-bit word of the address as a number in host byte order. */
static int parse_endpoint(const char *s, endpoint *ep) {
  const char *colon = strchr(s, ':');
  size_t digits = colon ? (size_t)(colon - s) : 0;
  if (digits != 8 && digits != 32) return -1;
  memset(ep, 0, sizeof *ep);
  uint8_t *dst = ep->addr;
  if (digits == 8) {
    ep->addr[10] = ep->addr[11] = 0xff;
    dst = ep->addr + 12;
  }
  for (size_t w = 0; w < digits / 8; w++) {
    char word[9];
    memcpy(word, s + 8 * w, 8);
    word[8] = 0;
    char *end;
    uint32_t v = (uint32_t)strtoul(word, &end, 16);
    if (*end) return -1;
    memcpy(dst + 4 * w, &v, 4);
  }
  char *end;
  unsigned long port = strtoul(colon + 1, &end, 16);
  if (end == colon + 1 || port > 0xffff) return -1;
  ep->port = (unsigned)port;
  return 0;
}

static int same_endpoint(const endpoint *a, const endpoint *b) {
  return a->port == b->port && memcmp(a->addr, b->addr, 16) == 0;
}

#define TABLE_BUF (1u << 20) /* read in one go: a table read in pieces may skip entries while sockets churn */
#define ATTEMPTS 3           /* and looked at again before the answer is "not held" */

/* The inode of the socket in table `path` whose ends are (local, remote); 0 if none. */
static unsigned long find_inode(const char *path, const endpoint *local, const endpoint *remote) {
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  char *buf = malloc(TABLE_BUF);
  if (buf) setvbuf(f, buf, _IOFBF, TABLE_BUF);
  char line[512], l[80], r[80];
  unsigned long inode = 0, found = 0;
  if (!fgets(line, sizeof line, f)) line[0] = 0; /* the header */
  while (!found && fgets(line, sizeof line, f)) {
    /* sl local rem st tx:rx tr:when retrnsmt uid timeout inode */
    if (sscanf(line, " %*s %79s %79s %*s %*s %*s %*s %*s %*s %lu", l, r, &inode) != 3) continue;
    endpoint el, er;
    if (parse_endpoint(l, &el) || parse_endpoint(r, &er)) continue;
    if (inode && same_endpoint(&el, local) && same_endpoint(&er, remote)) found = inode;
  }
  fclose(f);
  free(buf);
  return found;
}

/* Whether one of pid's descriptors is socket `inode`; -1 if they cannot be listed (errno set). */
static int holds_inode(int pid, unsigned long inode) {
  char path[64], want[48];
  snprintf(want, sizeof want, "socket:[%lu]", inode);
  snprintf(path, sizeof path, "/proc/%d/fd", pid);
  DIR *d = opendir(path);
  if (!d) return -1;
  int held = 0;
  struct dirent *de;
  while (!held && (de = readdir(d)) != NULL) {
    if (de->d_name[0] == '.') continue;
    char link[300], got[64];
    snprintf(link, sizeof link, "/proc/%d/fd/%s", pid, de->d_name);
    ssize_t n = readlink(link, got, sizeof got - 1);
    if (n <= 0) continue;
    got[n] = 0;
    held = strcmp(got, want) == 0;
  }
  closedir(d);
  return held;
}

int kvl__holds_peer_end(int pid, int fd, char *why, size_t cap) {
  struct sockaddr_storage me, them;
  socklen_t lme = sizeof me, lthem = sizeof them;
  endpoint ours, theirs;
  if (getsockname(fd, (struct sockaddr *)&me, &lme) != 0 || getpeername(fd, (struct sockaddr *)&them, &lthem) != 0 ||
      endpoint_of(&me, &ours) != 0 || endpoint_of(&them, &theirs) != 0) {
    snprintf(why, cap, "this connection's addresses are unknown (%s)", strerror(errno));
    return 0;
  }
  for (int attempt = 0; attempt < ATTEMPTS; attempt++) {
    char path[64];
    unsigned long inode = 0;
    static const char *const tables[] = {"tcp", "tcp6"};
    for (int t = 0; t < 2 && !inode; t++) {
      snprintf(path, sizeof path, "/proc/%d/net/%s", pid, tables[t]);
      inode = find_inode(path, &theirs, &ours);
    }
    if (!inode) {
      snprintf(why, cap, "pid %d's network namespace has no end of this connection (another pid, or NAT)", pid);
      continue;
    }
    int held = holds_inode(pid, inode);
    if (held < 0) {
      snprintf(why, cap, "cannot list pid %d's descriptors: %s", pid, strerror(errno));
      return 0;
    }
    if (held) return 1;
    snprintf(why, cap, "pid %d does not hold the other end of this connection", pid);
  }
  return 0;
}
