// Reading whole input files for corpus preparation (aloe-corpus and the tokenizers' data).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace aloe {

// The bytes of the file at `path`. kNotFound when it does not exist, kInternal (naming the path
// and the errno text) when it cannot be opened or read.
absl::StatusOr<std::string> ReadTextFile(const std::string& path);

}  // namespace aloe
