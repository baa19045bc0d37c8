#ifndef BUILDVAULT_E2E_GREET_H_
#define BUILDVAULT_E2E_GREET_H_
#include <string>
namespace greet {
std::string Greeting();
}  // namespace greet
#endif
