// Device kernel of paged_attention (compiled for the host here; per SOC in the real tree).
#include "paged_attention_tiling.h"
#include "kernel_utils.h"
#include <array>
#include <cstring>
namespace paged_attention {
int64_t kernel_blocks(int64_t rows) {
  TilingData t;
#if defined(SOC_IS_910B)
  const int64_t cores = kernel::core_count();
#else
  const int64_t cores = 4;
#endif
  return kernel::ceil_div(kernel::align_up(rows, t.block_m), t.block_m * cores);
}
}  // namespace paged_attention
