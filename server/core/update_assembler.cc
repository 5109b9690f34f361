#include "server/core/update_assembler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_format.h"
#include "common/low_rank_wire.h"
#include "common/model_spec.h"
#include "common/push_wire.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "kernels/cpu/outer_kernels.h"

namespace aloe::server {
namespace {

// Index of the first element of `values` with |x| > kMaxPushMagnitude, or values.size().
// Values are finite here (the decoders reject NaN/Inf).
size_t FirstOversized(absl::Span<const float> values) {
  bool all_small = true;
  for (float v : values) all_small &= std::fabs(v) <= kMaxPushMagnitude;
  if (all_small) return values.size();
  for (size_t i = 0; i < values.size(); ++i) {
    if (!(std::fabs(values[i]) <= kMaxPushMagnitude)) return i;
  }
  return values.size();
}

}  // namespace

PendingUpdate UpdateOfHeader(const v1::PushHeader& header) {
  PendingUpdate update;
  update.worker_id = header.worker_id();
  update.task_id = header.task_id();
  update.update_id = header.update_id();
  update.base_version = header.base_version();
  update.steps_done = header.steps_done();
  update.tokens_learned = header.tokens_learned();
  update.train_loss = header.train_loss();
  update.compute_seconds = header.compute_seconds();
  update.want_next_task = header.want_next_task();
  update.group = header.group();
  update.task_continues = header.task_continues();
  update.observed_ranks.assign(header.observed_ranks().begin(), header.observed_ranks().end());
  return update;
}

UpdateAssembler::UpdateAssembler(const v1::ModelSpec& spec, const v1::PushHeader& header,
                                 std::optional<uint32_t> only_shard,
                                 std::shared_ptr<FloatBufferPool> buffers, bool sum_squares,
                                 absl::Span<const uint32_t> layer_groups)
    : spec_(spec),
      filled_(spec.layers_size(), 0),
      only_shard_(only_shard),
      layer_groups_(layer_groups.begin(), layer_groups.end()),
      group_(header.group()),
      buffers_(std::move(buffers)),
      squares_(sum_squares ? spec.layers_size() : 0, 0.0) {
  update_ = UpdateOfHeader(header);
  update_.layers.resize(spec.layers_size());
  bytes_by_layer_.assign(spec.layers_size(), 0);
  if (header.codec() != v1::CODEC_UNSPECIFIED) default_codec_ = header.codec();
  if (header.slices() > 1) {
    update_.slice = header.slice();
    update_.slices = header.slices();
  }
  end_.resize(spec.layers_size());
  for (int l = 0; l < spec.layers_size(); ++l) {
    const auto [first, last] =
        SliceRange(spec.layers(l).num_elements(), update_.slices, update_.slice);
    filled_[l] = first;
    // Another shard's layer, or another group's: nothing expected here.
    end_[l] = Expected(l) ? last : first;
  }
}

bool UpdateAssembler::Expected(int layer) const {
  if (only_shard_ && spec_.layers(layer).shard() != *only_shard_) return false;
  return layer_groups_.empty() ||
         (static_cast<size_t>(layer) < layer_groups_.size() && layer_groups_[layer] == group_);
}

absl::Status UpdateAssembler::AddChunk(uint32_t layer_id, uint64_t offset, std::string_view payload,
                                       v1::Codec codec) {
  return AddChunk(layer_id, offset, absl::MakeConstSpan(&payload, 1), codec);
}

absl::Status UpdateAssembler::CheckLayer(uint32_t layer_id) const {
  if (layer_id >= static_cast<uint32_t>(spec_.layers_size())) {
    return absl::InvalidArgumentError(absl::StrFormat("unknown layer %d (the model has %d layers)",
                                                      layer_id, spec_.layers_size()));
  }
  const v1::LayerSpec& layer = spec_.layers(layer_id);
  if (only_shard_ && layer.shard() != *only_shard_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "layer %d (%s) belongs to shard process %d, but this push went to shard process %d",
        layer_id, layer.name(), layer.shard(), *only_shard_));
  }
  if (!Expected(static_cast<int>(layer_id))) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "layer %d (%s) belongs to layer group %d, but this push carries layer group %d", layer_id,
        layer.name(), layer_id < layer_groups_.size() ? layer_groups_[layer_id] : 0, group_));
  }
  return absl::OkStatus();
}

absl::Status UpdateAssembler::CheckRange(uint32_t layer_id, uint64_t offset, uint64_t count) const {
  const v1::LayerSpec& layer = spec_.layers(layer_id);
  if (offset != filled_[layer_id]) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer %d (%s): chunk at offset %d, expected offset %d", layer_id,
                        layer.name(), offset, filled_[layer_id]));
  }
  if (offset + count > end_[layer_id]) {
    if (update_.slices > 1) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "layer %d (%s): wrong size: chunk [%d, %d) exceeds slice %d of %d, which ends at %d",
          layer_id, layer.name(), offset, offset + count, update_.slice, update_.slices,
          end_[layer_id]));
    }
    return absl::InvalidArgumentError(
        absl::StrFormat("layer %d (%s): wrong size: chunk [%d, %d) exceeds the layer's %d elements",
                        layer_id, layer.name(), offset, offset + count, layer.num_elements()));
  }
  return absl::OkStatus();
}

std::vector<float>& UpdateAssembler::Buffer(uint32_t layer_id) {
  std::vector<float>& buffer = update_.layers[layer_id];
  if (buffer.empty()) {
    // Unsliced, the chunks cover the whole layer: a recycled buffer is overwritten in full.
    const uint64_t n = spec_.layers(layer_id).num_elements();
    buffer = buffers_ != nullptr && update_.slices <= 1 ? buffers_->Take(n) : std::vector<float>(n);
  }
  return buffer;
}

absl::Status UpdateAssembler::AddFp32Read(
    uint32_t layer_id, uint64_t offset, uint64_t count, absl::Span<char> bounce,
    absl::FunctionRef<absl::Status(char* to, size_t bytes)> read) {
  ALOE_RETURN_IF_ERROR(CheckLayer(layer_id));
  ALOE_RETURN_IF_ERROR(CheckRange(layer_id, offset, count));
  const uint64_t piece = bounce.size() / sizeof(float);
  if (count > 0 && piece == 0) {
    return absl::InternalError("AddFp32Read: a bounce buffer smaller than one float");
  }
  float* const layer = Buffer(layer_id).data();
  for (uint64_t done = 0; done < count;) {
    const uint64_t n = std::min(piece, count - done);
    ALOE_RETURN_IF_ERROR(read(bounce.data(), n * sizeof(float)));
    const absl::Span<float> out = absl::MakeSpan(layer + offset + done, n);
    if (!kernels::StreamWithinMagnitude(bounce.data(), out.data(), n, kMaxPushMagnitude)) {
      const v1::LayerSpec& spec = spec_.layers(layer_id);
      for (size_t i = 0; i < out.size(); ++i) {
        if (!std::isfinite(out[i])) {
          return absl::InvalidArgumentError(
              absl::StrFormat("layer %d (%s) at offset %d: non-finite value %f at element %d",
                              layer_id, spec.name(), offset, out[i], done + i));
        }
      }
      const size_t i = FirstOversized(out);
      return absl::InvalidArgumentError(absl::StrFormat(
          "layer %d (%s): value %g at element %d exceeds the pseudo-gradient magnitude limit %g",
          layer_id, spec.name(), out[i], offset + done + i, kMaxPushMagnitude));
    }
    if (!squares_.empty()) squares_[layer_id] += kernels::SquaredL2NormOfBytes(bounce.data(), n);
    done += n;
  }
  filled_[layer_id] += count;
  bytes_received_ += count * sizeof(float);
  bytes_by_codec_[v1::CODEC_FP32] += count * sizeof(float);
  bytes_by_layer_[layer_id] += count * sizeof(float);
  return absl::OkStatus();
}

absl::Status UpdateAssembler::AddChunk(uint32_t layer_id, uint64_t offset,
                                       absl::Span<const std::string_view> pieces, v1::Codec codec) {
  ALOE_RETURN_IF_ERROR(CheckLayer(layer_id));
  const v1::LayerSpec& layer = spec_.layers(layer_id);
  if (codec == v1::CODEC_UNSPECIFIED) codec = default_codec_;
  if (!v1::Codec_IsValid(codec)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer %d (%s): unknown codec %d", layer_id, layer.name(), codec));
  }
  const bool fp32 = codec == v1::CODEC_FP32;
  size_t size = 0;
  for (std::string_view p : pieces) size += p.size();
  // float32 in pieces is decoded from them; anything else in pieces is joined first.
  const bool in_pieces = pieces.size() > 1 && fp32 && size % sizeof(float) == 0;
  std::string joined;
  std::string_view payload = pieces.size() == 1 ? pieces[0] : std::string_view();
  auto join = [&] {
    joined.reserve(size);
    for (std::string_view p : pieces) joined.append(p);
    payload = joined;
  };
  if (pieces.size() > 1 && !in_pieces) join();
  uint64_t count = size / sizeof(float);
  if (!in_pieces) {
    absl::StatusOr<size_t> elements = EncodedElementCount(codec, payload);
    if (!elements.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("layer %d (%s): %s %s", layer_id,
                                                        layer.name(), v1::Codec_Name(codec),
                                                        elements.status().message()));
    }
    count = *elements;
  }
  ALOE_RETURN_IF_ERROR(CheckRange(layer_id, offset, count));
  if (codec == v1::CODEC_LOWRANK) {
    // The factors' matrix must be the spec's tensor at the place the chunk claims.
    if (absl::Status s = CheckLowRankChunkInLayer(layer, offset, payload); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("layer %d (%s): %s", layer_id, layer.name(), s.message()));
    }
  }
  const absl::Span<float> out = absl::MakeSpan(Buffer(layer_id).data() + offset, count);
  // float32 (the common case): decode, finiteness and magnitude in one pass, streamed into the
  // staged update (as AddFp32Read); the slow path below runs only for other codecs and to name
  // what a refused chunk got wrong.
  double squares = 0;  // of this chunk, measured from its received bytes while they are in cache
  auto stream = [&](const char* in, float* to, size_t n) {
    if (!kernels::StreamWithinMagnitude(in, to, n, kMaxPushMagnitude)) return false;
    if (!squares_.empty()) squares += kernels::SquaredL2NormOfBytes(in, n);
    return true;
  };
  const bool decoded = fp32 && (in_pieces ? ForEachFloatRun(pieces, out.data(), stream)
                                          : stream(payload.data(), out.data(), count));
  if (!decoded) {
    if (in_pieces) join();
    absl::Status s = DecodeChunk(codec, payload, out);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("layer %d (%s) at offset %d: %s", layer_id,
                                                        layer.name(), offset, s.message()));
    }
    if (const size_t i = FirstOversized(out); i != out.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "layer %d (%s): value %g at element %d exceeds the pseudo-gradient magnitude limit %g",
          layer_id, layer.name(), out[i], offset + i, kMaxPushMagnitude));
    }
    // Decoded through the cache (bf16, int8, int4): still there.
    if (!squares_.empty()) squares = kernels::SquaredL2Norm(out.data(), out.size());
  }
  if (!squares_.empty()) squares_[layer_id] += squares;
  filled_[layer_id] += count;
  bytes_received_ += size;
  bytes_by_codec_[codec] += size;
  bytes_by_layer_[layer_id] += size;
  return absl::OkStatus();
}

absl::StatusOr<PendingUpdate> UpdateAssembler::Finish() && {
  for (int i = 0; i < spec_.layers_size(); ++i) {
    if (filled_[i] != end_[i]) {
      const uint64_t first =
          SliceRange(spec_.layers(i).num_elements(), update_.slices, update_.slice).first;
      return absl::InvalidArgumentError(
          absl::StrFormat("layer %d (%s) incomplete: received %d of %d elements", i,
                          spec_.layers(i).name(), filled_[i] - first, end_[i] - first));
    }
    // A layer with nothing to send in this slice still gets its (zero) buffer; another shard's
    // or another group's layer stays empty.
    if (!Expected(i)) continue;
    if (update_.layers[i].empty()) update_.layers[i].resize(spec_.layers(i).num_elements());
  }
  update_.layer_squares = std::move(squares_);
  return std::move(update_);
}

}  // namespace aloe::server
