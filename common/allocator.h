// Process-wide malloc tuning for code that allocates and frees buffers of megabytes per round
// (training steps, pushed and pulled model layers).
#pragma once

namespace aloe {

// The malloc settings KeepLargeBuffersInHeap applies, as a GLIBC_TUNABLES value: buffers of up
// to 32 MiB come from the heap instead of fresh mmap'ed pages, and up to 256 MiB of freed memory
// stays in the process.
inline constexpr char kMallocTunables[] =
    "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456";

// Keeps large buffers in the malloc heap, so that a buffer freed after one push (or training
// step) is reused by the next instead of being page-faulted and zero-filled by the kernel again:
// on a VM a page fault costs microseconds, and a 16 MiB push then costs more in faults than in
// copying. glibc applies these settings to every arena only when they come from GLIBC_TUNABLES
// at process start (mallopt after start left gRPC's threads page-faulting: 4 pushers of
// 16.6 MiB updates were accepted at 0.09 GB/s with mallopt, 0.38 GB/s with the tunables, on a
// loaded 2-core VM), so unless GLIBC_TUNABLES already sets a malloc trim threshold this adds
// kMallocTunables to it and re-executes the program (/proc/self/exe, same argv and pid). Call
// first thing in main(), before any thread starts. If the re-execution fails it falls back to
// mallopt. No-op on non-glibc platforms.
// arena_max > 0 also caps the malloc arenas (glibc.malloc.arena_max). A server whose gRPC
// threads come and go gets a new arena per thread otherwise, each keeping freed push buffers of
// its own: a shard process of 17 MB of parameters peaked at 595 MiB with glibc's default of 8
// arenas per core, and stayed within (3 + S) x its parameters with one arena.
void KeepLargeBuffersInHeap(char** argv, int arena_max = 0);

}  // namespace aloe
