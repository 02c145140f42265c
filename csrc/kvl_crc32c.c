/* kvl_crc32c.c - CRC32C (Castagnoli). Uses the SSE4.2 crc32 instruction when
 * the CPU has it (checked once), else a table. */
#include "kvl_internal.h"

#include <pthread.h>
#include <stdint.h>
#include <string.h>

static uint32_t table[256];
static int have_hw;
static pthread_once_t detect_once = PTHREAD_ONCE_INIT;

static void init_table(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    table[i] = c;
  }
}

static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n) {
  while (n--) crc = table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8; n -= 8;
  }
  uint32_t c32 = (uint32_t)c;
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif

static void detect(void) {
  init_table();
#if defined(__x86_64__)
  __builtin_cpu_init();
  have_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
  have_hw = 0;
#endif
}

uint32_t kvl_crc32c(uint32_t crc, const void *data, size_t len) {
  pthread_once(&detect_once, detect);
  crc = ~crc;
#if defined(__x86_64__)
  if (have_hw) return ~crc_hw(crc, data, len);
#endif
  return ~crc_sw(crc, data, len);
}

int kvl__crc_until(uint32_t *crc, const void *p, size_t len, uint64_t deadline, const int *closing) {
  const uint8_t *q = p;
  while (len > 0) {
    int rc = kvl__waited_too_long(deadline, closing);
    if (rc) return rc;
    size_t n = len < KVL__CRC_SLICE ? len : KVL__CRC_SLICE;
    *crc = kvl_crc32c(*crc, q, n);
    q += n;
    len -= n;
  }
  return 0;
}
