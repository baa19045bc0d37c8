#include "op_common.h"
namespace ops {
std::map<std::string, OpInfo>& registry() {
  static std::map<std::string, OpInfo> r;
  return r;
}
}  // namespace ops
