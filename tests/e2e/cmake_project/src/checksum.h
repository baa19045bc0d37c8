#ifndef BUILDVAULT_CCACHE_E2E_CHECKSUM_H_
#define BUILDVAULT_CCACHE_E2E_CHECKSUM_H_
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif
uint32_t demo_crc32(const void* data, size_t len);
uint32_t demo_table_entry(unsigned index);
#ifdef __cplusplus
}
#endif
#endif
