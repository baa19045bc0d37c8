#ifndef BUILDVAULT_E2E_BASE_H_
#define BUILDVAULT_E2E_BASE_H_
#include <string>
namespace base {
int Add(int a, int b);
int Mul(int a, int b);
std::string Fmt(const std::string& label, int value);
}  // namespace base
#endif
