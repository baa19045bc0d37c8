// Shared by every operator's host code.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>
#ifndef SOC
#error "SOC must be defined (-DSOC=...)"
#endif
#define OP_STR2(x) #x
#define OP_STR(x) OP_STR2(x)
namespace ops {
struct TensorDesc { std::vector<long> dims; std::string dtype; };
struct OpInfo { std::string name; std::string family; std::string soc; int64_t workspace; };
inline const char* soc_name() { return OP_STR(SOC); }
std::map<std::string, OpInfo>& registry();
}  // namespace ops
