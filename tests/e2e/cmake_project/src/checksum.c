#include "checksum.h"

uint32_t demo_crc32(const void* data, size_t len) {
  const unsigned char* p = (const unsigned char*)data;
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < len; i++) {
    crc = demo_table_entry((crc ^ p[i]) & 0xFFu) ^ (crc >> 8);
  }
  return crc ^ 0xFFFFFFFFu;
}
