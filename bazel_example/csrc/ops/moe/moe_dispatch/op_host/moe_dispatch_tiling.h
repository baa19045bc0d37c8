// Tiling data of moe_dispatch: shared by its host code, its kernel and its generated adapter.
#pragma once
#include <cstdint>
namespace moe_dispatch {
struct TilingData {
  int64_t block_m = 128;
  int64_t block_n = 64;
  int64_t stages = 3;
};
constexpr int64_t kTilingVersion = 1;
}  // namespace moe_dispatch
