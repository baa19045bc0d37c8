// Tiling data of grouped_matmul: shared by its host code, its kernel and its generated adapter.
#pragma once
#include <cstdint>
namespace grouped_matmul {
struct TilingData {
  int64_t block_m = 64;
  int64_t block_n = 128;
  int64_t stages = 2;
};
constexpr int64_t kTilingVersion = 1;
}  // namespace grouped_matmul
