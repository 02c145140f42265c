/* kvl_baseline.h - the benchmark yardsticks (kvl_baseline.c): a raw TCP
 * request/response server and client, and a memcpy of blocks. They are built
 * into their own extension (kvlink.bench._baseline_c, with kvl_sock.c and
 * kvl_proto.c), never into the engine's. Codes follow kvl.h. */
#ifndef KVL_BASELINE_H
#define KVL_BASELINE_H

#include <stddef.h>
#include <stdint.h>

struct kvl_rawtcp;
int kvl_rawtcp_serve(const char *host, uint16_t port, const void *buf, uint64_t len, const char *info,
                     struct kvl_rawtcp **out, uint16_t *port_out);
void kvl_rawtcp_stop(struct kvl_rawtcp *r);
int kvl_rawtcp_connect(const char *host, uint16_t port, int *fd_out);
int kvl_rawtcp_fetch(int fd, uint64_t n, void *dst, uint64_t cap, uint64_t *got);
void kvl_rawtcp_close(int fd);
void kvl_memcpy_blocks(const uint64_t *dst, const uint64_t *src, uint64_t len, size_t n);

#endif
