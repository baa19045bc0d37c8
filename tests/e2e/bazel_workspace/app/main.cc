#include <iostream>
#include "lib/greet/greet.h"
int main() {
  std::cout << greet::Greeting() << std::endl;
  return 0;
}
