#include "report.h"

#include <iomanip>
#include <sstream>

#include "checksum.h"

std::string Report(const std::string& text) {
  std::ostringstream out;
  out << "crc32(" << text << ")=" << std::hex << std::setw(8) << std::setfill('0')
      << demo_crc32(text.data(), text.size());
  return out.str();
}
