#include <iostream>

#include "report.h"

int main() {
  // crc32("123456789") is the standard CRC-32 check value cbf43926.
  std::cout << "buildvault-ccache-e2e: " << Report("123456789") << std::endl;
  return 0;
}
