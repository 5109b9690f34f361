// Process-wide malloc tuning for code that allocates and frees buffers of megabytes per round
// (training steps, pushed and pulled model layers).
#pragma once

namespace aloe {

// Keeps buffers of up to 32 MiB in the malloc heap instead of fresh mmap'ed pages, and lets up
// to 256 MiB of freed memory stay there: sets glibc's mmap threshold to 32 MiB (its maximum on
// 64-bit) and the trim threshold to 256 MiB. Without it every large buffer is page-faulted and
// zero-filled by the kernel again each time: on a VM a page fault costs microseconds, and a
// 16 MiB push then costs more in faults than in copying. Call once from main() before the
// buffers are allocated. No-op on non-glibc platforms.
void KeepLargeBuffersInHeap();

}  // namespace aloe
