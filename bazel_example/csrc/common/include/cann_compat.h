// Compatibility shims between CANN releases. Force-included (with an absolute
// -include path) into every generated adapter and included by the shared kernel source.
#pragma once
#define CANN_COMPAT_LEVEL 3
#define OP_CHECK(cond) do { if (!(cond)) return -1; } while (0)
namespace cann_compat {
inline int api_level() { return CANN_COMPAT_LEVEL; }
}  // namespace cann_compat
