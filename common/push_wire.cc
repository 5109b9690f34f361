#include "common/push_wire.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"

namespace aloe {
namespace {

// PushChunk's field numbers (proto/aloe.proto).
constexpr uint32_t kHeaderField = 1;
constexpr uint32_t kLayerIdField = 2;
constexpr uint32_t kOffsetField = 3;
constexpr uint32_t kDataField = 4;
constexpr uint32_t kCodecField = 5;

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

// A cursor over the pieces of one message.
class PieceReader {
 public:
  explicit PieceReader(absl::Span<const std::string_view> pieces) : pieces_(pieces) {
    for (std::string_view p : pieces) remaining_ += p.size();
    Settle();
  }

  size_t remaining() const { return remaining_; }

  bool ReadByte(uint8_t* b) {
    if (remaining_ == 0) return false;
    *b = static_cast<uint8_t>(pieces_[piece_][pos_]);
    Advance(1);
    return true;
  }

  // A base-128 varint of at most max_bytes bytes; bits beyond 64 are dropped. Protobuf reads
  // field values with up to 10 bytes, tags and lengths with up to 5.
  bool ReadVarint(int max_bytes, uint64_t* value) {
    uint64_t v = 0;
    for (int i = 0; i < max_bytes; ++i) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      v |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) {
        *value = v;
        return true;
      }
    }
    return false;
  }

  // The next n bytes as views (empty pieces dropped), or false when fewer remain.
  bool Take(size_t n, std::vector<std::string_view>* out) {
    if (n > remaining_) return false;
    while (n > 0) {
      const std::string_view p = pieces_[piece_];
      const size_t take = std::min(n, p.size() - pos_);
      if (out != nullptr) out->push_back(p.substr(pos_, take));
      Advance(take);
      n -= take;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    pos_ += n;
    remaining_ -= n;
    Settle();
  }
  // Moves past exhausted and empty pieces.
  void Settle() {
    while (piece_ < pieces_.size() && pos_ == pieces_[piece_].size()) {
      ++piece_;
      pos_ = 0;
    }
  }

  absl::Span<const std::string_view> pieces_;
  size_t piece_ = 0;
  size_t pos_ = 0;
  size_t remaining_ = 0;
};

absl::Status Malformed(std::string_view what, uint32_t field) {
  return absl::InvalidArgumentError(
      absl::StrFormat("malformed push message: %s (field %d)", what, field));
}

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

void AppendTag(uint32_t field, WireType type, std::string* out) {
  AppendVarint((uint64_t{field} << 3) | type, out);
}

// Reads every field of one message from `pieces` and hands it to on_field(field, wire type,
// value (varints, lengths), bytes (length-delimited fields, as views)); stops at the first
// error, its own or on_field's.
template <typename OnField>
absl::Status ScanFields(absl::Span<const std::string_view> pieces, OnField on_field) {
  PieceReader in(pieces);
  std::vector<std::string_view> bytes;
  while (in.remaining() > 0) {
    uint64_t wide_tag;
    if (!in.ReadVarint(5, &wide_tag)) return Malformed("bad tag", 0);
    const auto tag = static_cast<uint32_t>(wide_tag);  // bits beyond 32 dropped, as protobuf does
    const uint32_t field = tag >> 3;
    const uint32_t type = tag & 7;
    if (field == 0) return Malformed("field number 0", 0);
    uint64_t value = 0;
    bytes.clear();
    switch (type) {
      case kVarint:
        if (!in.ReadVarint(10, &value)) return Malformed("bad varint", field);
        break;
      case kFixed64:
        if (!in.Take(8, nullptr)) return Malformed("truncated fixed64", field);
        break;
      case kFixed32:
        if (!in.Take(4, nullptr)) return Malformed("truncated fixed32", field);
        break;
      case kLengthDelimited:
        // Lengths of 2^31 and more are refused, as protobuf does.
        if (!in.ReadVarint(5, &value) || value > INT32_MAX || !in.Take(value, &bytes)) {
          return Malformed("truncated length-delimited field", field);
        }
        break;
      default:
        return Malformed(absl::StrFormat("wire type %d", type), field);
    }
    if (absl::Status s = on_field(field, type, value, bytes); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParsePushChunk(absl::Span<const std::string_view> pieces, PushChunkView* out) {
  *out = PushChunkView();
  return ScanFields(pieces, [&](uint32_t field, uint32_t type, uint64_t value,
                                const std::vector<std::string_view>& bytes) {
    if (field == kHeaderField && type == kLengthDelimited) {
      std::string header;
      header.reserve(value);
      for (std::string_view b : bytes) header.append(b);
      if (!out->header.MergeFromString(header)) return Malformed("bad header", field);
      out->has_header = true;
    } else if (field == kDataField && type == kLengthDelimited) {
      out->data = bytes;
      out->data_size = value;
    } else if (field == kLayerIdField && type == kVarint) {
      out->layer_id = static_cast<uint32_t>(value);
    } else if (field == kOffsetField && type == kVarint) {
      out->offset = value;
    } else if (field == kCodecField && type == kVarint) {
      out->codec = static_cast<int32_t>(static_cast<uint32_t>(value));
    }
    return absl::OkStatus();
  });
}

absl::Status ParseParamChunk(absl::Span<const std::string_view> pieces, ParamChunkView* out) {
  *out = ParamChunkView();
  // ParamChunk: version 1, layer_id 2, offset 3, layer_elements 4, data 5, group_version 6
  // (proto/aloe.proto).
  return ScanFields(pieces, [&](uint32_t field, uint32_t type, uint64_t value,
                                const std::vector<std::string_view>& bytes) {
    if (type == kVarint) {
      switch (field) {
        case 1:
          out->version = value;
          break;
        case 2:
          out->layer_id = static_cast<uint32_t>(value);
          break;
        case 3:
          out->offset = value;
          break;
        case 4:
          out->layer_elements = value;
          break;
        case 6:
          out->group_version = value;
          break;
        default:
          break;  // unknown
      }
    } else if (field == 5 && type == kLengthDelimited) {
      out->data = bytes;
      out->data_size = value;
    }
    return absl::OkStatus();
  });
}

std::string PushChunkPrefix(const v1::PushHeader* header, uint32_t layer_id, uint64_t offset,
                            v1::Codec codec, size_t data_size) {
  std::string out;
  if (header != nullptr) {
    const std::string h = header->SerializeAsString();
    AppendTag(kHeaderField, kLengthDelimited, &out);
    AppendVarint(h.size(), &out);
    out += h;
  }
  if (layer_id != 0) {
    AppendTag(kLayerIdField, kVarint, &out);
    AppendVarint(layer_id, &out);
  }
  if (offset != 0) {
    AppendTag(kOffsetField, kVarint, &out);
    AppendVarint(offset, &out);
  }
  if (codec != 0) {
    // int32 fields are sign-extended to 64 bits on the wire.
    AppendTag(kCodecField, kVarint, &out);
    AppendVarint(static_cast<uint64_t>(static_cast<int64_t>(codec)), &out);
  }
  if (data_size != 0) {
    AppendTag(kDataField, kLengthDelimited, &out);
    AppendVarint(data_size, &out);
  }
  return out;
}

std::string ParamChunkPrefix(uint64_t version, uint32_t layer_id, uint64_t offset,
                             uint64_t layer_elements, size_t data_size, uint64_t group_version) {
  // ParamChunk: version 1, layer_id 2, offset 3, layer_elements 4, data 5, group_version 6
  // (proto/aloe.proto).
  std::string out;
  const uint64_t varints[] = {version, layer_id, offset, layer_elements};
  for (uint32_t f = 0; f < 4; ++f) {
    if (varints[f] == 0) continue;
    AppendTag(f + 1, kVarint, &out);
    AppendVarint(varints[f], &out);
  }
  if (group_version != 0) {
    AppendTag(6, kVarint, &out);
    AppendVarint(group_version, &out);
  }
  if (data_size != 0) {
    AppendTag(5, kLengthDelimited, &out);
    AppendVarint(data_size, &out);
  }
  return out;
}

}  // namespace aloe
