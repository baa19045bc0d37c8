// Shared kernel source, compiled once for the target SOC.
#include "cann_compat.h"
#include "kernel_utils.h"
#include <algorithm>
#include <array>
namespace kernel {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t align_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
int64_t core_count() {
#if defined(SOC_IS_910B)
  return 24 + cann_compat::api_level() * 0;
#else
  return 8;
#endif
}
}  // namespace kernel
