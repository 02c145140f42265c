/* cffi declarations of csrc/kvl_baseline.h (the benchmark yardsticks), read by kvlink/_build_ffi.py. */
struct kvl_rawtcp;
int kvl_rawtcp_serve(const char *host, uint16_t port, const void *buf, uint64_t len, const char *info,
                     struct kvl_rawtcp **out, uint16_t *port_out);
void kvl_rawtcp_stop(struct kvl_rawtcp *r);
int kvl_rawtcp_connect(const char *host, uint16_t port, int *fd_out);
int kvl_rawtcp_fetch(int fd, uint64_t n, void *dst, uint64_t cap, uint64_t *got);
void kvl_rawtcp_close(int fd);
void kvl_memcpy_blocks(const uint64_t *dst, const uint64_t *src, uint64_t len, size_t n);
