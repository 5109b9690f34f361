#include "common/allocator.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace aloe {

void KeepLargeBuffersInHeap(char** argv, int arena_max) {
#if defined(__GLIBC__)
  const char* current = std::getenv("GLIBC_TUNABLES");
  if (current == nullptr || std::strstr(current, "glibc.malloc.trim_threshold") == nullptr) {
    std::string tunables = kMallocTunables;
    if (arena_max > 0) tunables += ":glibc.malloc.arena_max=" + std::to_string(arena_max);
    if (current != nullptr && *current != '\0') tunables += std::string(":") + current;
    if (setenv("GLIBC_TUNABLES", tunables.c_str(), 1) == 0) {
      execv("/proc/self/exe", argv);  // returns only on failure
    }
  }
  // Already applied by the tunables, or the fallback (the main arena at least).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's maximum on 64-bit
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  if (arena_max > 0) mallopt(M_ARENA_MAX, arena_max);
#else
  (void)argv;
  (void)arena_max;
#endif
}

}  // namespace aloe
