// The safetensors file format, as PyTorch, Hugging Face and nanoGPT-style code read and write
// it: u64 little-endian header length N | N bytes of JSON: {"NAME": {"dtype": "F32", "shape":
// [..], "data_offsets": [BEGIN, END]}, ..., "__metadata__": {"KEY": "VALUE"}} | the data, each
// tensor's bytes at [BEGIN, END) of it, row-major, little-endian.
//
// ALOE writes float32 tensors in the order given, the header padded with spaces to a multiple of
// 8 bytes; it reads F32, BF16 and F16 tensors (converted to float32) in any order.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace aloe {

struct SafetensorsTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;  // the product of shape elements
};

// The file's bytes. Precondition: names are unique and not "__metadata__"; values match shapes.
std::string EncodeSafetensors(absl::Span<const SafetensorsTensor> tensors,
                              const std::map<std::string, std::string>& metadata);
// Writes the file atomically (common/durable_file.h). kInvalidArgument for a duplicate or
// reserved name or values that do not match a shape; kUnavailable when writing fails.
absl::Status WriteSafetensors(const std::string& path, absl::Span<const SafetensorsTensor> tensors,
                              const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  // In the order of their data; ties go smaller first, then by name, as does each run of
  // consecutive tensors of no elements.
  std::vector<SafetensorsTensor> tensors;
  std::map<std::string, std::string> metadata;
};

// Parses a file's bytes. kInvalidArgument naming `source`, the tensor and the byte offset for a
// truncated file, a header that is not the format's JSON, an unknown dtype, a shape whose size
// does not match its data_offsets, or data ranges that overlap or lie past the end.
absl::StatusOr<SafetensorsFile> DecodeSafetensors(std::string_view bytes,
                                                  const std::string& source);
// ReadWholeFile's errors (kNotFound for a missing file), then DecodeSafetensors's.
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

}  // namespace aloe
