#include "tinyfmt/format.h"
#include <sstream>
namespace tinyfmt {
std::string shape(const std::vector<long>& dims) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? "," : "") << dims[i];
  out << ']';
  return out.str();
}
}  // namespace tinyfmt
