// Tiling data of moe_gating: shared by its host code, its kernel and its generated adapter.
#pragma once
#include <cstdint>
namespace moe_gating {
struct TilingData {
  int64_t block_m = 64;
  int64_t block_n = 128;
  int64_t stages = 2;
};
constexpr int64_t kTilingVersion = 1;
}  // namespace moe_gating
