#pragma once
#include <cstdint>
namespace kernel {
int64_t ceil_div(int64_t a, int64_t b);
int64_t align_up(int64_t a, int64_t b);
int64_t core_count();
}  // namespace kernel
