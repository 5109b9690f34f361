#include "common/safetensors.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/byte_io.h"
#include "common/durable_file.h"
#include "common/status_macros.h"

namespace aloe {
namespace {

constexpr char kMetadata[] = "__metadata__";
// A header larger than this is not a model file (the format's own readers refuse 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

void AppendJsonString(std::string_view s, std::string* out) {
  out->push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(out, "\\u%04x", static_cast<unsigned char>(c));
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

// The bytes of a tensor of `shape` (dimensions >= 0) and `width`-byte elements; false when
// that does not fit 64 bits.
bool TensorBytes(const std::vector<int64_t>& shape, uint64_t width, uint64_t* bytes) {
  *bytes = 0;
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return true;
  uint64_t n = width;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  *bytes = n;
  return true;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1;
  const uint32_t exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ff;
  float value;
  if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -24);  // zero or subnormal
  } else if (exponent == 31) {
    value = mantissa == 0 ? INFINITY : NAN;
  } else {
    value = std::ldexp(static_cast<float>(mantissa | 0x400), static_cast<int>(exponent) - 25);
  }
  return sign ? -value : value;
}

// A whole number >= 0 of a JSON value, or -1.
int64_t WholeNumber(const google::protobuf::Value& v) {
  if (v.kind_case() != google::protobuf::Value::kNumberValue) return -1;
  const double d = v.number_value();
  if (!(d >= 0) || d > 9007199254740992.0 || d != std::floor(d)) return -1;
  return static_cast<int64_t>(d);
}

}  // namespace

std::string EncodeSafetensors(absl::Span<const SafetensorsTensor> tensors,
                              const std::map<std::string, std::string>& metadata) {
  std::string header = "{";
  if (!metadata.empty()) {
    AppendJsonString(kMetadata, &header);
    header += ":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) header += ',';
      first = false;
      AppendJsonString(key, &header);
      header += ':';
      AppendJsonString(value, &header);
    }
    header += '}';
  }
  uint64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    if (header.size() > 1) header += ',';
    AppendJsonString(t.name, &header);
    const uint64_t bytes = t.values.size() * sizeof(float);
    absl::StrAppendFormat(&header, R"(:{"dtype":"F32","shape":[%s],"data_offsets":[%d,%d]})",
                          absl::StrJoin(t.shape, ","), offset, offset + bytes);
    offset += bytes;
  }
  header += '}';
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + header.size() + offset);
  AppendPod<uint64_t>(header.size(), &out);
  out += header;
  for (const SafetensorsTensor& t : tensors) {
    out.append(reinterpret_cast<const char*>(t.values.data()), t.values.size() * sizeof(float));
  }
  return out;
}

absl::Status WriteSafetensors(const std::string& path, absl::Span<const SafetensorsTensor> tensors,
                              const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  for (const SafetensorsTensor& t : tensors) {
    if (t.name == kMetadata || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: tensor name \"%s\" is reserved or used twice", path, t.name));
    }
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: tensor %s has a negative dimension", path, t.name));
      }
    }
    uint64_t elements = 0;
    if (!TensorBytes(t.shape, 1, &elements) || elements != t.values.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: tensor %s has %d values for shape [%s]", path, t.name,
                          t.values.size(), absl::StrJoin(t.shape, ", ")));
    }
  }
  return WriteFileAtomically(path, EncodeSafetensors(tensors, metadata));
}

absl::StatusOr<SafetensorsFile> DecodeSafetensors(std::string_view bytes,
                                                  const std::string& source) {
  const auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", what));
  };
  std::string_view in = bytes;
  uint64_t header_bytes = 0;
  if (!ReadPod(&in, &header_bytes)) {
    return bad(absl::StrFormat("truncated at byte %d: no 8-byte header length", bytes.size()));
  }
  if (header_bytes > kMaxHeaderBytes || header_bytes > in.size()) {
    return bad(absl::StrFormat(
        "header length %d at byte 0 runs past the end of the file (%d bytes) or over %d",
        header_bytes, bytes.size(), kMaxHeaderBytes));
  }
  const std::string json(in.substr(0, header_bytes));
  const std::string_view data = in.substr(header_bytes);
  const uint64_t data_start = 8 + header_bytes;
  google::protobuf::Struct header;
  if (const auto parsed = google::protobuf::util::JsonStringToMessage(json, &header);
      !parsed.ok()) {
    return bad(absl::StrFormat("the JSON header (bytes 8 to %d) does not parse: %s", data_start,
                               std::string(parsed.message())));
  }
  SafetensorsFile file;
  struct Entry {
    uint64_t begin, end;
    std::string name, dtype;
    std::vector<int64_t> shape;
  };
  std::vector<Entry> entries;
  for (const auto& [name, value] : header.fields()) {
    if (value.kind_case() != google::protobuf::Value::kStructValue) {
      return bad(absl::StrFormat("header entry \"%s\" is not an object", name));
    }
    const auto& fields = value.struct_value().fields();
    if (name == kMetadata) {
      for (const auto& [key, v] : fields) {
        if (v.kind_case() != google::protobuf::Value::kStringValue) {
          return bad(absl::StrFormat("__metadata__ value of \"%s\" is not a string", key));
        }
        file.metadata[key] = v.string_value();
      }
      continue;
    }
    Entry e;
    e.name = name;
    const auto dtype = fields.find("dtype");
    const auto shape = fields.find("shape");
    const auto offsets = fields.find("data_offsets");
    if (dtype == fields.end() || shape == fields.end() || offsets == fields.end() ||
        dtype->second.kind_case() != google::protobuf::Value::kStringValue ||
        shape->second.kind_case() != google::protobuf::Value::kListValue ||
        offsets->second.kind_case() != google::protobuf::Value::kListValue ||
        offsets->second.list_value().values_size() != 2) {
      return bad(absl::StrFormat(
          "tensor %s: needs a string dtype, a shape list and two data_offsets", name));
    }
    e.dtype = dtype->second.string_value();
    for (const auto& d : shape->second.list_value().values()) {
      const int64_t n = WholeNumber(d);
      if (n < 0) return bad(absl::StrFormat("tensor %s: a dimension is not a whole number", name));
      e.shape.push_back(n);
    }
    const int64_t begin = WholeNumber(offsets->second.list_value().values(0));
    const int64_t end = WholeNumber(offsets->second.list_value().values(1));
    if (begin < 0 || end < begin) {
      return bad(absl::StrFormat("tensor %s: data_offsets are not 0 <= begin <= end", name));
    }
    e.begin = static_cast<uint64_t>(begin);
    e.end = static_cast<uint64_t>(end);
    entries.push_back(std::move(e));
  }
  // Data order. A tensor of no bytes shares its offset with the next one and goes first, so
  // that it does not seem to overlap it; names order the rest of the ties deterministically.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t covered = 0;
  for (const Entry& e : entries) {
    const size_t width = e.dtype == "F32" ? 4 : (e.dtype == "BF16" || e.dtype == "F16") ? 2 : 0;
    if (width == 0) {
      return bad(
          absl::StrFormat("tensor %s: dtype %s (ALOE reads F32, BF16 and F16)", e.name, e.dtype));
    }
    uint64_t bytes_needed = 0;
    if (!TensorBytes(e.shape, width, &bytes_needed)) {
      return bad(absl::StrFormat("tensor %s: shape [%s] of %s needs more than 2^64 bytes", e.name,
                                 absl::StrJoin(e.shape, ", "), e.dtype));
    }
    if (e.end - e.begin != bytes_needed) {
      return bad(
          absl::StrFormat("tensor %s: shape [%s] of %s needs %d bytes, data_offsets "
                          "[%d, %d] hold %d",
                          e.name, absl::StrJoin(e.shape, ", "), e.dtype, bytes_needed, e.begin,
                          e.end, e.end - e.begin));
    }
    const uint64_t n = bytes_needed / width;
    if (e.begin < covered) {
      return bad(absl::StrFormat("tensor %s: its data at byte %d overlaps the tensor before it",
                                 e.name, data_start + e.begin));
    }
    if (e.end > data.size()) {
      return bad(absl::StrFormat("truncated: tensor %s ends at byte %d, the file has %d", e.name,
                                 data_start + e.end, bytes.size()));
    }
    covered = e.end;
    SafetensorsTensor& t = file.tensors.emplace_back();
    t.name = e.name;
    t.shape = e.shape;
    t.values.resize(n);
    const char* p = data.data() + e.begin;
    if (width == 4) {
      // A tensor of no elements has no buffer to copy into: memcpy may not take null.
      if (n > 0) std::memcpy(t.values.data(), p, n * 4);
    } else {
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        if (e.dtype == "BF16") {
          const uint32_t bits = static_cast<uint32_t>(h) << 16;
          std::memcpy(&t.values[i], &bits, 4);
        } else {
          t.values[i] = HalfToFloat(h);
        }
      }
    }
  }
  // Tensors of no bytes that follow one another in data order go by name, whatever their
  // offsets: ALOE's writer puts them at one offset, so that a file reads back in the order it
  // was written.
  auto run = file.tensors.begin();
  while (run != file.tensors.end()) {
    const auto is_empty = [](const SafetensorsTensor& t) { return t.values.empty(); };
    run = std::find_if(run, file.tensors.end(), is_empty);
    const auto run_end = std::find_if_not(run, file.tensors.end(), is_empty);
    std::sort(run, run_end, [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
      return a.name < b.name;
    });
    run = run_end;
  }
  return file;
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  ALOE_ASSIGN_OR_RETURN(const std::string bytes, ReadWholeFile(path));
  return DecodeSafetensors(bytes, path);
}

}  // namespace aloe
