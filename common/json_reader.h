// A minimal JSON reader for corpus inputs: GPT-2's encoder.json (an object of integer ids) and
// .jsonl records (one object per line, of which one string field is wanted). It reads without
// building a tree and reports errors with the file name and byte offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace aloe {

class JsonReader {
 public:
  // Reads `text`, which starts at byte `base_offset` of file `path` (both only for messages).
  // `path` must outlive the reader.
  JsonReader(const std::string& path, std::string_view text, size_t base_offset = 0)
      : path_(path), text_(text), base_(base_offset) {}

  // -1 at the end of the text.
  int Peek() const { return pos_ < text_.size() ? static_cast<unsigned char>(text_[pos_]) : -1; }
  bool AtEnd() const { return pos_ >= text_.size(); }
  void SkipSpace();
  // Consumes `c` (after no space) or fails naming what was expected.
  absl::Status Expect(char c);
  // A string, its escapes decoded to UTF-8.
  absl::Status ReadString(std::string* out);
  // A non-negative integer that fits 32 bits.
  absl::Status ReadUint(uint32_t* out);
  // Skips any one value: object, array, string, number, true, false or null.
  absl::Status SkipValue();
  // Reads an object, calling `field(key)` with the reader before each value; `field` must
  // consume the value (SkipValue when it does not want it).
  template <typename F>
  absl::Status ReadObject(F&& field);

  // kInvalidArgument "PATH: byte offset N: WHAT" at the current position.
  absl::Status Error(std::string_view what) const;

 private:
  absl::Status ReadHex4(uint32_t* out);
  absl::Status SkipValue(int depth);

  const std::string& path_;
  std::string_view text_;
  const size_t base_;
  size_t pos_ = 0;
};

template <typename F>
absl::Status JsonReader::ReadObject(F&& field) {
  SkipSpace();
  if (absl::Status s = Expect('{'); !s.ok()) return s;
  SkipSpace();
  if (Peek() == '}') {
    ++pos_;
    return absl::OkStatus();
  }
  while (true) {
    SkipSpace();
    std::string key;
    if (absl::Status s = ReadString(&key); !s.ok()) return s;
    SkipSpace();
    if (absl::Status s = Expect(':'); !s.ok()) return s;
    SkipSpace();
    if (absl::Status s = field(key); !s.ok()) return s;
    SkipSpace();
    if (Peek() == ',') {
      ++pos_;
      continue;
    }
    return Expect('}');
  }
}

}  // namespace aloe
