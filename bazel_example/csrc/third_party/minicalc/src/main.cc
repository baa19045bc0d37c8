#include <cstdio>
#include <cstdlib>
#include "ops.h"
int main(int argc, char** argv) {
  int a = argc > 1 ? std::atoi(argv[1]) : 6;
  int b = argc > 2 ? std::atoi(argv[2]) : 7;
  std::printf("minicalc %d %d: add=%d mul=%d\n", a, b, minicalc_add(a, b), minicalc_mul(a, b));
  return 0;
}
