#include "lib/greet/greet.h"
#include "lib/base/base.h"
namespace greet {
std::string Greeting() {
  return "buildvault-e2e: hello " + base::Fmt("sum", base::Add(2, 3)) + " " +
         base::Fmt("product", base::Mul(6, 7));
}
}  // namespace greet
