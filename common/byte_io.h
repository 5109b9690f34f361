// Little-endian plain-old-data (de)serialisation for the binary state blobs and file headers
// (optimizer state, penalty statistics, checkpoints). The host is little-endian (checked in
// common/tensor_codec.cc), so a memcpy is the wire format.
#pragma once

#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

namespace aloe {

// Appends the bytes of value to *out.
template <typename T>
void AppendPod(T value, std::string* out) {
  static_assert(std::is_trivially_copyable_v<T>);
  out->append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// Reads a T from the front of *in and advances it; false (nothing consumed) when too short.
template <typename T>
bool ReadPod(std::string_view* in, T* value) {
  static_assert(std::is_trivially_copyable_v<T>);
  if (in->size() < sizeof(T)) return false;
  std::memcpy(value, in->data(), sizeof(T));
  in->remove_prefix(sizeof(T));
  return true;
}

}  // namespace aloe
