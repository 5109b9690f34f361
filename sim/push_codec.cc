#include "sim/push_codec.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "kernels/cpu/outer_kernels.h"
#include "server/core/update_assembler.h"
#include "sim/link_model.h"

namespace aloe::sim {
namespace {

struct Chunk {
  uint32_t layer = 0;
  EncodedChunk encoded;
};

}  // namespace

WorkerPushCodec::WorkerPushCodec(const v1::ModelSpec& spec, const v1::TransportConfig& transport)
    : spec_(spec), transport_(transport), blocks_(TransportBlockSizes(transport)) {
  for (const v1::LayerSpec& layer : spec_.layers()) {
    const v1::Codec codec = LayerPushCodec(transport_, layer);
    codecs_.push_back(codec);
    if (codec != v1::CODEC_FP32) exact_ = false;
  }
  Reset();
}

void WorkerPushCodec::Reset() {
  residual_.assign(spec_.layers_size(), {});
  low_rank_ = std::make_unique<LowRankPushEncoder>();
  low_rank_->Configure(transport_, spec_);
}

void WorkerPushCodec::SetTaskRanks(const v1::Task& task) {
  if (task.tensor_ranks_size() == 0) return;
  low_rank_->SetTaskRanks(task.task_id(), std::vector<v1::TensorRank>(task.tensor_ranks().begin(),
                                                                      task.tensor_ranks().end()));
}

EncodedPush WorkerPushCodec::Encode(server::PendingUpdate& update,
                                    absl::Span<const uint32_t> layer_groups) {
  EncodedPush push;
  std::vector<size_t> pushed;
  for (size_t l = 0; l < update.layers.size(); ++l) {
    if (!update.layers[l].empty()) pushed.push_back(l);
  }
  if (exact_) {
    for (size_t l : pushed) push.bytes += update.layers[l].size() * sizeof(float);
    return push;
  }
  const bool feedback = transport_.error_feedback();
  // The worker's side: residuals in, chunks and new residuals out (worker/client.cc PushLayers).
  std::vector<Chunk> chunks;
  std::vector<std::vector<float>> residual(update.layers.size());
  std::vector<v1::TensorRank> observed;
  absl::Status status;
  for (size_t l : pushed) {
    std::vector<float>& values = update.layers[l];
    if (feedback && residual_[l].size() == values.size()) {
      kernels::WeightedAccumulate(residual_[l].data(), 1.0f, values.data(), values.size());
    }
    if (feedback) residual[l].resize(values.size());
    float* const r = feedback ? residual[l].data() : nullptr;
    const v1::Codec codec = codecs_[l];
    if (codec == v1::CODEC_LOWRANK) {
      std::vector<EncodedChunk> encoded;
      status = low_rank_->EncodeLayer(static_cast<uint32_t>(l), update.task_id, values, r, &encoded,
                                      kMaxChunkBytes, &observed);
      for (EncodedChunk& e : encoded) chunks.push_back(Chunk{static_cast<uint32_t>(l), e});
    } else {
      const size_t block = blocks_.Of(codec);
      for (auto [begin, end] : ChunkRanges(values.size(), MaxChunkElements(codec, block))) {
        Chunk& chunk = chunks.emplace_back();
        chunk.layer = static_cast<uint32_t>(l);
        chunk.encoded.offset = begin;
        chunk.encoded.codec = codec;
        const absl::Span<const float> part =
            absl::MakeConstSpan(values).subspan(begin, end - begin);
        if (codec == v1::CODEC_FP32) {
          AppendFloats(part, &chunk.encoded.payload);
          if (r != nullptr) std::fill(r + begin, r + end, 0.0f);
        } else {
          status = EncodeChunk(codec, part, block, &chunk.encoded.payload,
                               r != nullptr ? r + begin : nullptr);
        }
        if (!status.ok()) break;
      }
    }
    if (!status.ok()) {
      push.status = absl::InvalidArgumentError(
          absl::StrFormat("encoding layer %d failed: %s", l, status.message()));
      push.bytes = PushBytes(spec_, transport_, pushed);
      return push;
    }
  }
  if (feedback) {
    for (size_t l : pushed) residual_[l] = std::move(residual[l]);
  }
  // The server's side: every chunk through the assembler, as a push stream delivers them.
  v1::PushHeader header;
  header.set_codec(v1::CODEC_FP32);
  header.set_group(update.group);
  server::UpdateAssembler assembler(spec_, header, std::nullopt, nullptr, false, layer_groups);
  for (const Chunk& c : chunks) {
    push.bytes += c.encoded.payload.size();
    if (!push.status.ok()) continue;
    push.status = assembler.AddChunk(c.layer, c.encoded.offset, c.encoded.payload, c.encoded.codec);
  }
  if (!push.status.ok()) return push;
  absl::StatusOr<server::PendingUpdate> decoded = std::move(assembler).Finish();
  if (!decoded.ok()) {
    push.status = decoded.status();
    return push;
  }
  for (size_t l : pushed) update.layers[l] = std::move(decoded->layers[l]);
  update.observed_ranks = std::move(observed);
  return push;
}

}  // namespace aloe::sim
