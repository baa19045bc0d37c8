// Registry demo: links every family, the adapters and the third-party library.
#include "op_common.h"
#include "tinyfmt/format.h"
#include <cstdio>
namespace adapters {
int register_flash_attention(int64_t); int register_paged_attention(int64_t);
int register_moe_gating(int64_t); int register_moe_dispatch(int64_t);
int register_grouped_matmul(int64_t);
}
int main() {
  int total = adapters::register_flash_attention(3) + adapters::register_paged_attention(3) +
              adapters::register_moe_gating(3) + adapters::register_moe_dispatch(3) +
              adapters::register_grouped_matmul(3);
  std::printf("%s soc=%s total=%d\n", tinyfmt::join({"csrc-demo", "ok"}, ":").c_str(), ops::soc_name(), total);
  return 0;
}
