// libFuzzer target for the push decoder: the bytes of one input describe a Push stream (a
// header codec and slicing, then chunk records: layer id, offset, codec, payload) that is fed to
// an UpdateAssembler over a small fixed ModelSpec, then Finish. Built with ASan + UBSan
// (tests/fuzz/CMakeLists.txt), so an out-of-bounds write or undefined behaviour is a crash.
//
// Oracle, checked on every input (a violation aborts, which libFuzzer reports as a crash):
//   - Every AddChunk is accepted exactly when an independent model of the contract says so:
//     known layer, offset == the next expected element (the start of the layer's slice, then
//     the elements received so far), a known codec, a well-framed payload that fits the layer
//     (its slice), and values that the scalar reference decoders
//     (kernels::reference) decode to finite numbers with |x| <= kMaxPushMagnitude.
//     Rejections are kInvalidArgument with a message naming the layer.
//   - Finish succeeds exactly when every layer (slice) is complete; the accepted update has
//     exactly the spec's layer sizes, only finite values within the limit, bit-identical to
//     what the reference decoders produced for the accepted chunks (zeros outside the slice),
//     and the header's fields, slice and slices included.
//   - The slices of every layer are contiguous, in order, and cover it exactly once.
//   - CODEC_LOWRANK chunks (codec 7 with the raw value 5; seeds in make_push_seeds.py) are
//     accepted exactly when an independent reading of their header and factors fits the spec's
//     tensor at their place, and decode to the reference product bit for bit.
//   - Unsliced pushes decode into recycled buffers pre-filled with NaN (FloatBufferPool, as a
//     server's staging does), so an element the accepted chunks left uncovered fails the above.
//
// Input format (little-endian; reading past the end yields zero bytes, so every input is
// valid; tests/fuzz/make_push_seeds.py writes the seeds):
//   u8 header codec (as a signed byte: negative and > 4 are unknown codec values)
//   u8 slices (0 and 1 = an unsliced push), u8 slice (taken modulo slices: the service checks
//      slice < slices <= kMaxSlices before it builds an assembler)
//   records until the input ends, each:
//     u8 op: bits 0-1 layer (0-2 = that layer, 3 = a raw u32 layer id follows)
//            bit  2   offset (0 = the expected offset, 1 = a raw u64 offset follows)
//            bits 3-5 codec (0-4 = that Codec value, 5-6 = 0-1, 7 = a raw i32 follows)
//            bits 6-7 payload kind:
//              0 raw:       u16 length (at most kMaxRawBytes), then that many payload bytes
//              1 blockwise: u32 block size, u16 n (at most kMaxElements), u8 corruption,
//                           then ceil(n / B) f32 scales and the levels: n int8 values, or
//                           ceil(n / 2) bytes of int4 pairs when the record's codec is
//                           CODEC_INT4_BLOCKWISE. A framed buffer with arbitrary scales;
//                           corruption 1 = bad magic, 2 = n + 1 in the header, 3 = drop the
//                           last byte, 4 = one extra byte, 5 = (int4, odd n) a padding nibble
//              2 encoded:   u16 count (at most kMaxElements), u16 block size, count raw f32
//                           values, encoded with EncodeChunk (with a residual buffer); the raw
//                           bytes when it fails
//              3 fill fp32: u16 count (at most kMaxElements), f32 value: count copies as
//                           float32 bytes
// Counts and lengths above the limits are clamped to them: the largest layer has 257 elements,
// so anything longer is simply oversized, and generating 64K-element chunks made every input
// cost milliseconds under ASan (about 300 executions per second instead of thousands).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "common/buffer_pool.h"
#include "common/model_spec.h"
#include "common/tensor_codec.h"
#include "kernels/cpu/codec_kernels.h"
#include "proto/aloe.pb.h"
#include "server/core/update_assembler.h"
#include "tests/fuzz/fuzz_check.h"

namespace aloe {
namespace {

// Generated chunks hold at most this many elements (4x the largest layer), raw payloads at most
// this many bytes (an int8 header and kMaxElements values and scales fit).
constexpr uint16_t kMaxElements = 1024;
constexpr uint16_t kMaxRawBytes = 8192;

// Three layers: smaller than one int8 block, a few blocks, and more than 256 elements (the
// default int8 block size) so that multi-block and short-last-block layouts occur.
const v1::ModelSpec& Spec() {
  static const v1::ModelSpec* spec = [] {
    auto* s = new v1::ModelSpec;
    const uint64_t sizes[] = {3, 40, 257};
    const char* names[] = {"embed", "blocks.0", "head"};
    // The tensors CODEC_LOWRANK chunks are checked against: a vector, then (but for the first
    // layer) a square matrix.
    const int64_t vectors[] = {3, 4, 1};
    const int64_t matrices[] = {0, 6, 16};
    for (int i = 0; i < 3; ++i) {
      v1::LayerSpec* layer = s->add_layers();
      layer->set_id(i);
      layer->set_name(names[i]);
      layer->set_num_elements(sizes[i]);
      v1::TensorSpec* vector = layer->add_tensors();
      vector->set_name("b");
      vector->add_shape(vectors[i]);
      if (matrices[i] > 0) {
        v1::TensorSpec* matrix = layer->add_tensors();
        matrix->set_name("w");
        matrix->add_shape(matrices[i]);
        matrix->add_shape(matrices[i]);
      }
    }
    s->set_num_shards(1);
    return s;
  }();
  return *spec;
}

// Sequential little-endian reader; zero bytes past the end.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool done() const { return pos_ >= size_; }
  template <typename T>
  T Read() {
    unsigned char buf[sizeof(T)] = {};
    for (size_t i = 0; i < sizeof(T) && pos_ < size_; ++i) buf[i] = data_[pos_++];
    T v;
    std::memcpy(&v, buf, sizeof(T));
    return v;
  }
  std::string Bytes(size_t n) {
    const size_t take = std::min(n, size_ - std::min(pos_, size_));
    std::string out(reinterpret_cast<const char*>(data_ + pos_), take);
    pos_ += take;
    out.resize(n, '\0');
    return out;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// A framed int8 buffer, or an int4 one when `int4`, with arbitrary scales and levels.
std::string BlockwisePayload(Reader& in, bool int4) {
  const uint32_t block = in.Read<uint32_t>();
  const uint16_t n = std::min(in.Read<uint16_t>(), kMaxElements);
  const uint8_t corruption = in.Read<uint8_t>();
  // A block size the codec refuses still gets a framed buffer (the smallest block size's
  // scales), so that the decoder's own block-size check is what rejects it.
  const bool valid = int4 ? kernels::Int4BlockSizeValid(block) : block >= 1 && block <= 65536;
  const size_t b = valid ? block : (int4 ? 2 : 1);
  const size_t blocks = (n + b - 1) / b;
  std::string out(reinterpret_cast<const char*>(int4 ? kernels::kInt4Magic : kernels::kInt8Magic),
                  4);
  uint64_t header_n = n + (corruption == 2 ? 1 : 0);
  out.append(reinterpret_cast<const char*>(&block), 4);
  out.append(reinterpret_cast<const char*>(&header_n), 8);
  out += in.Bytes(4 * blocks);
  out += in.Bytes(int4 ? (n + 1) / 2 : n);
  if (int4 && n % 2 == 1 && out.size() > kernels::kInt4HeaderBytes + 4 * blocks) {
    // The padding nibble is 0 unless corruption 5 asks otherwise.
    out.back() = static_cast<char>((out.back() & 0x0f) | (corruption == 5 ? 0x50 : 0));
  }
  if (corruption == 1) out[3] = 0x02;
  if (corruption == 3 && !out.empty()) out.pop_back();
  if (corruption == 4) out.push_back('\x7f');
  return out;
}

std::string EncodedPayload(Reader& in, v1::Codec codec) {
  const uint16_t count = std::min(in.Read<uint16_t>(), kMaxElements);
  const uint16_t block = in.Read<uint16_t>();
  std::string raw = in.Bytes(4 * size_t{count});
  std::vector<float> values(count);
  if (count > 0) std::memcpy(values.data(), raw.data(), raw.size());
  std::vector<float> residual(count);
  std::string out;
  absl::Status s = EncodeChunk(codec, values, block, &out, residual.data());
  if (!s.ok()) {
    FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument, "EncodeChunk: %s",
               s.ToString().c_str());
    return raw;
  }
  // Error feedback: decode(encode(x)) + residual reproduces x up to one float rounding.
  absl::StatusOr<size_t> n = EncodedElementCount(codec, out);
  FUZZ_CHECK(n.ok() && *n == count, "encoded payload does not describe itself");
  std::vector<float> back(count);
  absl::Status d = DecodeChunk(codec, out, absl::MakeSpan(back));
  FUZZ_CHECK(d.ok(), "cannot decode what EncodeChunk wrote: %s", d.ToString().c_str());
  for (size_t i = 0; i < count; ++i) {
    FUZZ_CHECK(std::isfinite(back[i]) && std::isfinite(residual[i]),
               "encode/decode of finite x[%zu] = %g produced %g (residual %g)", i, values[i],
               back[i], residual[i]);
  }
  return out;
}

std::string FillPayload(Reader& in) {
  const uint16_t count = std::min(in.Read<uint16_t>(), kMaxElements);
  const float value = in.Read<float>();
  std::vector<float> values(count, value);
  std::string out;
  AppendFloats(values, &out);
  return out;
}

// Decodes with the scalar reference kernels into `out`; false when the framing is malformed.
bool ReferenceValues(v1::Codec codec, std::string_view payload, std::vector<float>* out) {
  switch (codec) {
    case v1::CODEC_FP32: {
      if (payload.size() % 4 != 0) return false;
      out->resize(payload.size() / 4);
      if (!out->empty()) std::memcpy(out->data(), payload.data(), payload.size());
      break;
    }
    case v1::CODEC_BF16: {
      if (payload.size() % 2 != 0) return false;
      out->resize(payload.size() / 2);
      if (!kernels::reference::Bf16Decode(payload.data(), payload.size(), out->data(), out->size())
               .ok()) {
        return false;
      }
      break;
    }
    case v1::CODEC_INT8_BLOCKWISE:
    case v1::CODEC_INT4_BLOCKWISE: {
      const bool int4 = codec == v1::CODEC_INT4_BLOCKWISE;
      if (payload.size() < kernels::kInt8HeaderBytes) return false;
      uint64_t n;
      std::memcpy(&n, payload.data() + 8, 8);
      if ((int4 ? n / 2 : n) > payload.size()) return false;
      out->resize(n);
      const absl::Status decoded =
          int4 ? kernels::reference::Int4BlockwiseDecode(payload.data(), payload.size(),
                                                         out->data(), out->size())
               : kernels::reference::Int8BlockwiseDecode(payload.data(), payload.size(),
                                                         out->data(), out->size());
      if (!decoded.ok()) return false;
      break;
    }
    default:
      return false;
  }
  return true;
}

bool WithinLimits(const std::vector<float>& values) {
  for (float v : values) {
    if (!std::isfinite(v) || std::fabs(v) > server::kMaxPushMagnitude) return false;
  }
  return true;
}

// The reference model of AddChunk: decodes into `out` and says whether the chunk must be
// accepted.
bool ReferenceDecode(v1::Codec codec, std::string_view payload, std::vector<float>* out) {
  return ReferenceValues(codec, payload, out) && WithinLimits(*out);
}

// The reference model of a CODEC_LOWRANK chunk at `offset` of `layer` (common/low_rank_wire.h,
// read here on its own): the header's fields in range, the factors of the shapes it names with
// finite values, the tensor at its offset a rows x cols matrix of the spec, the chunk placed at
// its rows; out = P[a:b] Q^T summed in k order from 0, which the library must match bit for bit.
bool ReferenceLowRank(const v1::LayerSpec& layer, uint64_t offset, std::string_view payload,
                      std::vector<float>* out) {
  if (payload.size() < 40) return false;
  auto u32 = [&](size_t at) {
    uint32_t v;
    std::memcpy(&v, payload.data() + at, 4);
    return v;
  };
  uint16_t version, codec;
  uint64_t tensor_offset;
  std::memcpy(&version, payload.data() + 4, 2);
  std::memcpy(&codec, payload.data() + 6, 2);
  std::memcpy(&tensor_offset, payload.data() + 8, 8);
  const uint64_t rows = u32(16), cols = u32(20), rank = u32(24), a = u32(28), b = u32(32);
  const uint64_t q_bytes = u32(36);
  if (u32(0) != 0x4B524C41 || version != 1) return false;
  if (codec != v1::CODEC_FP32 && codec != v1::CODEC_BF16 && codec != v1::CODEC_INT8_BLOCKWISE &&
      codec != v1::CODEC_INT4_BLOCKWISE) {
    return false;
  }
  if (rank == 0 || rank > rows || rank > cols || rank > 4096 || a >= b || b > rows) return false;
  if (q_bytes > payload.size() - 40) return false;
  // The spec's tensor at tensor_offset, and where the rows begin.
  uint64_t at = 0;
  bool found = false;
  for (const v1::TensorSpec& t : layer.tensors()) {
    uint64_t n = 1;
    for (int64_t d : t.shape()) n *= static_cast<uint64_t>(d);
    if (at == tensor_offset) {
      found = t.shape_size() == 2 && static_cast<uint64_t>(t.shape(0)) == rows &&
              static_cast<uint64_t>(t.shape(1)) == cols;
      break;
    }
    at += n;
  }
  if (!found || tensor_offset + a * cols != offset) return false;
  std::vector<float> q, p;
  const v1::Codec factor = static_cast<v1::Codec>(codec);
  if (!ReferenceValues(factor, payload.substr(40, q_bytes), &q) || q.size() != cols * rank ||
      !ReferenceValues(factor, payload.substr(40 + q_bytes), &p) || p.size() != (b - a) * rank) {
    return false;
  }
  for (float v : q) {
    if (!std::isfinite(v)) return false;
  }
  for (float v : p) {
    if (!std::isfinite(v)) return false;
  }
  out->assign((b - a) * cols, 0.0f);
  for (uint64_t i = 0; i < b - a; ++i) {
    for (uint64_t j = 0; j < cols; ++j) {
      float acc = 0.0f;
      for (uint64_t k = 0; k < rank; ++k) acc += p[i * rank + k] * q[j * rank + k];
      (*out)[i * cols + j] = acc;
    }
  }
  return WithinLimits(*out);
}

void CheckRejection(const absl::Status& s, uint32_t layer_id) {
  FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument, "rejection with code %s",
             s.ToString().c_str());
  FUZZ_CHECK(absl::StrContains(s.message(), "layer"), "rejection does not name the layer: %s",
             s.ToString().c_str());
  (void)layer_id;
}

// The elements [first, end) of a layer of n elements that slice `slice` of `slices` carries
// (proto/aloe.proto, PullRequest: ceil(n / slices) elements per slice, the last ones shorter or
// empty), computed here on its own rather than with SliceRange.
struct Range {
  uint64_t first, end;
};
Range ExpectedSlice(uint64_t n, uint32_t slices, uint32_t slice) {
  if (slices <= 1) return {0, n};
  const uint64_t per = n / slices + (n % slices != 0 ? 1 : 0);
  return {std::min(n, per * slice), std::min(n, per * (slice + 1))};
}

void CheckSliceRange(uint64_t n, uint32_t slices) {
  uint64_t next = 0;
  for (uint32_t s = 0; s < slices; ++s) {
    const auto [first, last] = SliceRange(n, slices, s);
    const Range want = ExpectedSlice(n, slices, s);
    FUZZ_CHECK(first == want.first && last == want.end,
               "SliceRange(%llu, %u, %u) = [%llu, %llu), expected [%llu, %llu)",
               static_cast<unsigned long long>(n), slices, s,
               static_cast<unsigned long long>(first), static_cast<unsigned long long>(last),
               static_cast<unsigned long long>(want.first),
               static_cast<unsigned long long>(want.end));
    FUZZ_CHECK(first == next && last >= first, "slice %u of %u does not follow slice %u", s, slices,
               s - 1);
    next = last;
  }
  FUZZ_CHECK(next == n, "the %u slices of %llu elements end at %llu", slices,
             static_cast<unsigned long long>(n), static_cast<unsigned long long>(next));
}

void Run(const uint8_t* data, size_t size) {
  const v1::ModelSpec& spec = Spec();
  const int num_layers = spec.layers_size();
  Reader in(data, size);
  v1::PushHeader header;
  header.set_worker_id(7);
  header.set_task_id(11);
  header.set_update_id(13);
  header.set_base_version(3);
  header.set_steps_done(5);
  header.set_codec(static_cast<v1::Codec>(in.Read<int8_t>()));
  const v1::Codec default_codec =
      header.codec() == v1::CODEC_UNSPECIFIED ? v1::CODEC_FP32 : header.codec();
  const uint8_t slices = in.Read<uint8_t>();
  const uint8_t slice = in.Read<uint8_t>();
  const bool sliced = slices > 1;
  if (sliced) {
    header.set_slices(slices);
    header.set_slice(slice % slices);
  }

  // Recycled buffers full of NaN: an unsliced push writes into them without zeroing, so any
  // element the accepted chunks did not cover would show up in the checks below.
  std::shared_ptr<FloatBufferPool> buffers = FloatBufferPool::Create(1 << 24);
  for (int i = 0; i < num_layers; ++i) {
    buffers->Give(
        std::vector<float>(spec.layers(i).num_elements(), std::numeric_limits<float>::quiet_NaN()));
  }
  server::UpdateAssembler assembler(spec, header, std::nullopt, buffers);
  std::vector<uint64_t> filled(num_layers);
  std::vector<uint64_t> end(num_layers);
  std::vector<std::vector<float>> expected(num_layers);
  for (int i = 0; i < num_layers; ++i) {
    const uint64_t n = spec.layers(i).num_elements();
    if (sliced) CheckSliceRange(n, header.slices());
    const Range range = ExpectedSlice(n, header.slices(), header.slice());
    filled[i] = range.first;
    end[i] = range.end;
    expected[i].resize(n);
  }
  uint64_t accepted_bytes = 0;

  for (int records = 0; !in.done() && records < 4096; ++records) {
    const uint8_t op = in.Read<uint8_t>();
    uint32_t layer_id = op & 3;
    if (layer_id == 3) layer_id = in.Read<uint32_t>();
    const bool known_layer = layer_id < static_cast<uint32_t>(num_layers);
    uint64_t offset = known_layer ? filled[layer_id] : 0;
    if (op & 4) offset = in.Read<uint64_t>();
    int32_t codec_value = (op >> 3) & 7;
    if (codec_value >= 5 && codec_value <= 6) codec_value -= 5;
    if (codec_value == 7) codec_value = in.Read<int32_t>();
    const v1::Codec codec = static_cast<v1::Codec>(codec_value);
    const v1::Codec effective = codec == v1::CODEC_UNSPECIFIED ? default_codec : codec;

    std::string payload;
    switch (op >> 6) {
      case 0:
        payload = in.Bytes(std::min(in.Read<uint16_t>(), kMaxRawBytes));
        break;
      case 1:
        payload = BlockwisePayload(in, effective == v1::CODEC_INT4_BLOCKWISE);
        break;
      case 2:
        payload = EncodedPayload(in, v1::Codec_IsValid(effective) ? effective : v1::CODEC_FP32);
        break;
      default:
        payload = FillPayload(in);
        break;
    }

    std::vector<float> ref;
    bool should_accept = known_layer && v1::Codec_IsValid(effective) &&
                         effective != v1::CODEC_UNSPECIFIED &&
                         (effective == v1::CODEC_LOWRANK
                              ? ReferenceLowRank(spec.layers(layer_id), offset, payload, &ref)
                              : ReferenceDecode(effective, payload, &ref));
    if (should_accept) {
      should_accept = offset == filled[layer_id] && offset + ref.size() <= end[layer_id];
    }
    const absl::Status s = assembler.AddChunk(layer_id, offset, payload, codec);
    FUZZ_CHECK(s.ok() == should_accept,
               "layer %u offset %llu codec %d (effective %d), %zu payload bytes: assembler "
               "says %s, the reference model says %s",
               layer_id, static_cast<unsigned long long>(offset), codec_value,
               static_cast<int>(effective), payload.size(), s.ToString().c_str(),
               should_accept ? "accept" : "reject");
    if (!s.ok()) {
      CheckRejection(s, layer_id);
      continue;
    }
    if (!ref.empty()) {
      std::memcpy(expected[layer_id].data() + offset, ref.data(), ref.size() * sizeof(float));
    }
    filled[layer_id] += ref.size();
    accepted_bytes += payload.size();
    FUZZ_CHECK(assembler.bytes_received() == accepted_bytes, "bytes_received %llu != %llu",
               static_cast<unsigned long long>(assembler.bytes_received()),
               static_cast<unsigned long long>(accepted_bytes));
  }

  bool complete = true;
  for (int i = 0; i < num_layers; ++i) complete &= filled[i] == end[i];
  absl::StatusOr<server::PendingUpdate> update = std::move(assembler).Finish();
  FUZZ_CHECK(update.ok() == complete, "Finish says %s but the layers are %scomplete",
             update.status().ToString().c_str(), complete ? "" : "in");
  if (!update.ok()) {
    CheckRejection(update.status(), 0);
    FUZZ_CHECK(absl::StrContains(update.status().message(), "incomplete"), "%s",
               update.status().ToString().c_str());
    return;
  }
  FUZZ_CHECK(update->worker_id == 7 && update->task_id == 11 && update->update_id == 13 &&
                 update->base_version == 3 && update->steps_done == 5,
             "header fields not carried into the update");
  FUZZ_CHECK(sliced ? update->slices == header.slices() && update->slice == header.slice()
                    : update->slices == 1 && update->slice == 0,
             "update has slice %u of %u, the header %u of %u", update->slice, update->slices,
             header.slice(), header.slices());
  FUZZ_CHECK(update->layers.size() == static_cast<size_t>(num_layers), "%zu layers",
             update->layers.size());
  for (int i = 0; i < num_layers; ++i) {
    const std::vector<float>& got = update->layers[i];
    FUZZ_CHECK(got.size() == spec.layers(i).num_elements(), "layer %d has %zu elements", i,
               got.size());
    for (size_t j = 0; j < got.size(); ++j) {
      FUZZ_CHECK(std::isfinite(got[j]) && std::fabs(got[j]) <= server::kMaxPushMagnitude,
                 "layer %d element %zu is %g", i, j, got[j]);
    }
    FUZZ_CHECK(
        got.empty() || std::memcmp(got.data(), expected[i].data(), got.size() * sizeof(float)) == 0,
        "layer %d differs from the reference decode", i);
  }
}

}  // namespace
}  // namespace aloe

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  aloe::Run(data, size);
  return 0;
}
