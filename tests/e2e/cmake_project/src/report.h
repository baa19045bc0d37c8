#ifndef BUILDVAULT_CCACHE_E2E_REPORT_H_
#define BUILDVAULT_CCACHE_E2E_REPORT_H_
#include <string>
std::string Report(const std::string& text);
#endif
