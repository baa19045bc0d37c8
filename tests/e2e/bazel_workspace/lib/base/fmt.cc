#include "lib/base/base.h"
namespace base {
std::string Fmt(const std::string& label, int value) {
  return label + "=" + std::to_string(value);
}
}  // namespace base
