#include "common/allocator.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace aloe {

void KeepLargeBuffersInHeap() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's maximum on 64-bit
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
}

}  // namespace aloe
