#include "common/json_reader.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace aloe {
namespace {

// Deeper nesting than this in a corpus record is hostile or broken.
constexpr int kMaxDepth = 256;

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out->push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

}  // namespace

void JsonReader::SkipSpace() {
  while (pos_ < text_.size() && std::strchr(" \t\r\n", text_[pos_]) != nullptr &&
         text_[pos_] != '\0') {
    ++pos_;
  }
}

absl::Status JsonReader::Error(std::string_view what) const {
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: byte offset %d: %s", path_, base_ + pos_, what));
}

absl::Status JsonReader::Expect(char c) {
  if (Peek() != static_cast<unsigned char>(c)) {
    return Error(AtEnd() ? absl::StrFormat("truncated: expected '%c'", c)
                         : absl::StrFormat("expected '%c'", c));
  }
  ++pos_;
  return absl::OkStatus();
}

absl::Status JsonReader::ReadHex4(uint32_t* out) {
  if (pos_ + 4 > text_.size()) return Error("truncated \\u escape");
  *out = 0;
  for (int k = 0; k < 4; ++k) {
    const char c = text_[pos_];
    const int d = c >= '0' && c <= '9'   ? c - '0'
                  : c >= 'a' && c <= 'f' ? c - 'a' + 10
                  : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                         : -1;
    if (d < 0) return Error("bad \\u escape");
    ++pos_;
    *out = (*out << 4) | static_cast<uint32_t>(d);
  }
  return absl::OkStatus();
}

absl::Status JsonReader::ReadString(std::string* out) {
  ALOE_RETURN_IF_ERROR(Expect('"'));
  while (true) {
    if (AtEnd()) return Error("truncated string");
    const char c = text_[pos_];
    if (c == '"') {
      ++pos_;
      return absl::OkStatus();
    }
    if (static_cast<unsigned char>(c) < 0x20) return Error("control character in a string");
    if (c != '\\') {
      out->push_back(c);
      ++pos_;
      continue;
    }
    ++pos_;
    if (AtEnd()) return Error("truncated escape");
    const char e = text_[pos_];
    static constexpr std::string_view kFrom = "\"\\/bfnrt";
    static constexpr std::string_view kTo = "\"\\/\b\f\n\r\t";
    if (const size_t k = kFrom.find(e); k != std::string_view::npos) {
      out->push_back(kTo[k]);
      ++pos_;
      continue;
    }
    if (e != 'u') {
      --pos_;  // at the backslash
      return Error("bad escape");
    }
    ++pos_;
    uint32_t cp = 0;
    ALOE_RETURN_IF_ERROR(ReadHex4(&cp));
    if (cp >= 0xd800 && cp <= 0xdbff) {
      if (pos_ + 1 >= text_.size() || text_[pos_] != '\\' || text_[pos_ + 1] != 'u') {
        return Error("unpaired surrogate");
      }
      pos_ += 2;
      uint32_t low = 0;
      ALOE_RETURN_IF_ERROR(ReadHex4(&low));
      if (low < 0xdc00 || low > 0xdfff) return Error("unpaired surrogate");
      cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
    } else if (cp >= 0xdc00 && cp <= 0xdfff) {
      return Error("unpaired surrogate");
    }
    AppendUtf8(cp, out);
  }
}

absl::Status JsonReader::ReadUint(uint32_t* out) {
  const size_t start = pos_;
  uint64_t v = 0;
  while (!AtEnd() && text_[pos_] >= '0' && text_[pos_] <= '9') {
    v = v * 10 + static_cast<uint64_t>(text_[pos_] - '0');
    if (v > std::numeric_limits<uint32_t>::max()) return Error("integer out of range");
    ++pos_;
  }
  if (pos_ == start) return Error("expected a non-negative integer");
  *out = static_cast<uint32_t>(v);
  return absl::OkStatus();
}

absl::Status JsonReader::SkipValue() { return SkipValue(0); }

absl::Status JsonReader::SkipValue(int depth) {
  if (depth > kMaxDepth) return Error("nested too deeply");
  SkipSpace();
  const int c = Peek();
  if (c == '"') {
    std::string ignored;
    return ReadString(&ignored);
  }
  if (c == '{') return ReadObject([&](const std::string&) { return SkipValue(depth + 1); });
  if (c == '[') {
    ++pos_;
    SkipSpace();
    if (Peek() == ']') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      ALOE_RETURN_IF_ERROR(SkipValue(depth + 1));
      SkipSpace();
      if (Peek() == ',') {
        ++pos_;
        continue;
      }
      return Expect(']');
    }
  }
  for (std::string_view word : {"true", "false", "null"}) {
    if (text_.substr(pos_, word.size()) == word) {
      pos_ += word.size();
      return absl::OkStatus();
    }
  }
  const size_t start = pos_;
  while (!AtEnd() && std::strchr("+-0123456789.eE", text_[pos_]) != nullptr &&
         text_[pos_] != '\0') {
    ++pos_;
  }
  if (pos_ == start) return Error(AtEnd() ? "truncated: expected a value" : "expected a value");
  return absl::OkStatus();
}

}  // namespace aloe
