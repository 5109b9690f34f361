#include "common/allocator.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace aloe {

void KeepLargeBuffersInHeap(char** argv) {
#if defined(__GLIBC__)
  const char* current = std::getenv("GLIBC_TUNABLES");
  if (current == nullptr || std::strstr(current, "glibc.malloc.trim_threshold") == nullptr) {
    std::string tunables = kMallocTunables;
    if (current != nullptr && *current != '\0') tunables += std::string(":") + current;
    if (setenv("GLIBC_TUNABLES", tunables.c_str(), 1) == 0) {
      execv("/proc/self/exe", argv);  // returns only on failure
    }
  }
  // Already applied by the tunables, or the fallback (the main arena at least).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's maximum on 64-bit
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
#else
  (void)argv;
#endif
}

}  // namespace aloe
