// Vendored third-party formatting library (stand-in). Knows nothing about SOCs.
#pragma once
#include <string>
#include <vector>
namespace tinyfmt {
std::string join(const std::vector<std::string>& parts, const std::string& sep);
std::string shape(const std::vector<long>& dims);
}  // namespace tinyfmt
