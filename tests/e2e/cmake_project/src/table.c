#include "checksum.h"

/* CRC-32 (IEEE 802.3, reflected) table entry computed on demand. */
uint32_t demo_table_entry(unsigned index) {
  uint32_t c = (uint32_t)index;
  for (int k = 0; k < 8; k++) {
    c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
  }
  return c;
}
