#include "tinyfmt/format.h"
#include <numeric>
#include <sstream>
namespace tinyfmt {
std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::ostringstream out;
  for (size_t i = 0; i < parts.size(); ++i) out << (i ? sep : "") << parts[i];
  return out.str();
}
}  // namespace tinyfmt
