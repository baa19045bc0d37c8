#include "lib/base/base.h"
namespace base {
int Mul(int a, int b) { return a * b; }
}  // namespace base
