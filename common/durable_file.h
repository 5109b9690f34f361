// Files that survive a crash whole or not at all: written to a temporary file beside the target,
// fsynced, renamed over it and the directory fsynced. A reader sees the old file or the new one,
// never a part. With a CRC-32C to tell a file damaged on disk.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace aloe {

// CRC-32C (Castagnoli) of data.
uint32_t Crc32c(std::string_view data);

// Creates `dir` and every missing parent. kUnavailable naming the directory that could not be
// made.
absl::Status MakeDirectories(const std::string& dir);

// Replaces the file at `path` by `contents` so that readers see the old file or the whole new one
// (path + ".tmp", fsync, rename, fsync of the directory). kUnavailable naming the file, the step
// and the system's reason (e.g. "write failed: No space left on device") when a step fails; the
// temporary file is then removed and the old file, if any, is left as it was.
absl::Status WriteFileAtomically(const std::string& path, std::string_view contents);

// The whole file. kNotFound when it does not exist; kUnavailable naming the file when it cannot
// be read.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

}  // namespace aloe
