#include "lib/base/base.h"
namespace base {
int Add(int a, int b) { return a + b; }
}  // namespace base
