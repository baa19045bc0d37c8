// Kept for reference; nothing includes this header any more.
#pragma once
#define LEGACY_TILE 64
