// Host side of flash_attention: shape inference and tiling.
#include "op_common.h"
#include "flash_attention_tiling.h"
#include "tinyfmt/format.h"
#include <algorithm>
#include <functional>
#include <numeric>
#include <sstream>
#include <unordered_map>
namespace flash_attention {
int64_t infer_workspace(const ops::TensorDesc& in) {
  TilingData t;
  int64_t elems = std::accumulate(in.dims.begin(), in.dims.end(), int64_t{1}, std::multiplies<int64_t>());
  return (elems / t.block_m + 1) * t.block_n * t.stages;
}
std::string describe(const ops::TensorDesc& in) {
  std::ostringstream s;
  s << "flash_attention@" << ops::soc_name() << " in=" << tinyfmt::shape(in.dims) << " ws=" << infer_workspace(in);
  return s.str();
}
}  // namespace flash_attention
