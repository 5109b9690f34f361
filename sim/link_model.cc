#include "sim/link_model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/low_rank.h"
#include "common/low_rank_wire.h"
#include "common/tensor_codec.h"
#include "kernels/cpu/codec_kernels.h"

namespace aloe::sim {
namespace {

constexpr double kBytesPerMbit = 1e6 / 8;

// A rate in Mbit/s ("inf" allowed) as bytes/s; false unless > 0.
bool ParseRate(absl::string_view text, double* bytes_per_second) {
  text = absl::StripAsciiWhitespace(text);
  if (text == "inf") {
    *bytes_per_second = std::numeric_limits<double>::infinity();
    return true;
  }
  double mbit = 0;
  if (!absl::SimpleAtod(text, &mbit) || !std::isfinite(mbit) || !(mbit > 0)) return false;
  *bytes_per_second = mbit * kBytesPerMbit;
  return true;
}

// The layers at `indices` (empty = all of them).
std::vector<const v1::LayerSpec*> Selected(const v1::ModelSpec& spec,
                                           absl::Span<const size_t> indices) {
  std::vector<const v1::LayerSpec*> layers;
  if (indices.empty()) {
    for (const v1::LayerSpec& layer : spec.layers()) layers.push_back(&layer);
  } else {
    for (size_t i : indices) layers.push_back(&spec.layers(static_cast<int>(i)));
  }
  return layers;
}

// Payload bytes of n values in `codec`, in the chunks the worker sends them in.
uint64_t EncodedBytes(v1::Codec codec, uint64_t n, const BlockSizes& blocks) {
  const size_t block = blocks.Of(codec);
  uint64_t bytes = 0;
  for (auto [begin, end] : ChunkRanges(n, MaxChunkElements(codec, block))) {
    const size_t count = end - begin;
    switch (codec) {
      case v1::CODEC_BF16:
        bytes += kernels::Bf16EncodedSize(count);
        break;
      case v1::CODEC_INT8_BLOCKWISE:
        bytes += kernels::Int8EncodedSize(count, block);
        break;
      case v1::CODEC_INT4_BLOCKWISE:
        bytes += kernels::Int4EncodedSize(count, block);
        break;
      default:
        bytes += count * sizeof(float);
        break;
    }
  }
  return bytes;
}

// Payload bytes of a CODEC_LOWRANK layer at its configured rank, tensor by tensor as
// LowRankPushEncoder::EncodeLayer decides. A compressed tensor counts the chunks that
// EncodeLowRankFactors makes of factors of its shape (their size does not depend on the
// values: zeros stand in); should that refuse the rank, its (rows + cols) r values.
uint64_t LowRankLayerBytes(const v1::LayerSpec& layer, const v1::TransportConfig& transport,
                           const BlockSizes& blocks) {
  uint32_t configured = 0;
  v1::Codec factor_codec = v1::CODEC_FP32;
  for (const v1::LayerCodec& o : transport.layer_codecs()) {
    if (o.layer() != layer.name()) continue;
    configured = o.rank();
    if (o.factor_codec() != v1::CODEC_UNSPECIFIED) factor_codec = o.factor_codec();
  }
  const v1::Codec fallback = LowRankFallbackCodec(factor_codec);
  uint64_t bytes = 0;
  for (const v1::TensorSpec& tensor : layer.tensors()) {
    uint64_t n = 1;
    for (int64_t d : tensor.shape()) n *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
    const auto shape = LowRankMatrixShape(tensor);
    const uint32_t rank = shape ? std::min({configured, shape->first, shape->second}) : 0;
    if (rank == 0 || LowRankFactorFloats(shape->first, shape->second, rank) >= n) {
      bytes += EncodedBytes(fallback, n, blocks);
      continue;
    }
    LowRankFactors zeros;
    zeros.rows = shape->first;
    zeros.cols = shape->second;
    zeros.rank = rank;
    zeros.p.assign(static_cast<size_t>(zeros.rows) * rank, 0.0f);
    zeros.q.assign(static_cast<size_t>(zeros.cols) * rank, 0.0f);
    absl::StatusOr<LowRankEncoding> encoding =
        EncodeLowRankFactors(zeros, 0, factor_codec, blocks.Of(factor_codec), kMaxChunkBytes);
    if (!encoding.ok()) {
      bytes +=
          EncodedBytes(factor_codec, LowRankFactorFloats(zeros.rows, zeros.cols, rank), blocks);
      continue;
    }
    for (const LowRankChunk& chunk : encoding->chunks) bytes += chunk.payload.size();
  }
  return bytes;
}

}  // namespace

absl::StatusOr<std::vector<LinkSpec>> ParseLinks(const std::string& text) {
  std::vector<LinkSpec> links;
  if (absl::StripAsciiWhitespace(text).empty()) return links;
  for (absl::string_view raw : absl::StrSplit(text, ',')) {
    const absl::string_view item = absl::StripAsciiWhitespace(raw);
    const std::string what = absl::StrCat("link '", item, "'");
    const size_t colon = item.find(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": expected RATE_MBIT:LATENCY_MS or UP_MBIT/DOWN_MBIT:LATENCY_MS"));
    }
    const absl::string_view rates = item.substr(0, colon);
    const absl::string_view latency = absl::StripAsciiWhitespace(item.substr(colon + 1));
    LinkSpec link;
    const size_t slash = rates.find('/');
    const absl::string_view up = rates.substr(0, slash);
    const absl::string_view down = slash == absl::string_view::npos ? up : rates.substr(slash + 1);
    if (!ParseRate(up, &link.up_bytes_per_second) ||
        !ParseRate(down, &link.down_bytes_per_second)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": rates must be Mbit/s > 0 or 'inf', got '", rates, "'"));
    }
    double ms = 0;
    if (!absl::SimpleAtod(latency, &ms) || !std::isfinite(ms) || ms < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the latency must be finite milliseconds >= 0, got '", latency, "'"));
    }
    link.latency_seconds = ms / 1000;
    links.push_back(link);
  }
  return links;
}

uint64_t PullBytes(const v1::ModelSpec& spec, absl::Span<const size_t> layers) {
  uint64_t elements = 0;
  for (const v1::LayerSpec* layer : Selected(spec, layers)) elements += layer->num_elements();
  return elements * sizeof(float);
}

v1::Codec LayerPushCodec(const v1::TransportConfig& transport, const v1::LayerSpec& layer) {
  v1::Codec codec = transport.codec();
  for (const v1::LayerCodec& o : transport.layer_codecs()) {
    if (o.layer() == layer.name()) codec = o.codec();
  }
  return codec == v1::CODEC_UNSPECIFIED ? v1::CODEC_FP32 : codec;
}

uint64_t PushBytes(const v1::ModelSpec& spec, const v1::TransportConfig& transport,
                   absl::Span<const size_t> layers) {
  const BlockSizes blocks = TransportBlockSizes(transport);
  uint64_t bytes = 0;
  for (const v1::LayerSpec* selected : Selected(spec, layers)) {
    const v1::LayerSpec& layer = *selected;
    const v1::Codec codec = LayerPushCodec(transport, layer);
    if (codec == v1::CODEC_LOWRANK) {
      bytes += LowRankLayerBytes(layer, transport, blocks);
      continue;
    }
    bytes += EncodedBytes(codec, layer.num_elements(), blocks);
  }
  return bytes;
}

Link::Link(double bytes_per_second, double latency_seconds)
    : bytes_per_second_(bytes_per_second), latency_(absl::Seconds(latency_seconds)) {
  prefix_.push_back(0);
}

absl::Duration Link::Enqueue(uint64_t bytes, absl::Duration at, Link* shared) {
  const absl::Duration sending = absl::Seconds(static_cast<double>(bytes) / bytes_per_second_);
  absl::Duration arrival = std::max(at, busy_until_) + latency_ + sending;
  if (shared != nullptr) arrival = std::max(arrival, shared->Enqueue(bytes, at));
  busy_until_ = arrival;
  bytes_ += bytes;
  transfers_.push_back(
      Transfer{absl::ToDoubleSeconds(arrival - sending), absl::ToDoubleSeconds(arrival), bytes});
  prefix_.push_back(prefix_.back() + static_cast<double>(bytes));
  return arrival;
}

double Link::ReceivedBy(double x, bool before) const {
  // Transfers are disjoint and in time order (FIFO): those ending at or before x (before x) are
  // whole; at most the next one is partly received.
  const auto it = before ? std::lower_bound(transfers_.begin(), transfers_.end(), x,
                                            [](const Transfer& t, double v) { return t.end < v; })
                         : std::upper_bound(transfers_.begin(), transfers_.end(), x,
                                            [](double v, const Transfer& t) { return v < t.end; });
  const size_t whole = static_cast<size_t>(it - transfers_.begin());
  double received = prefix_[whole];
  if (it != transfers_.end() && it->begin < x && it->begin < it->end) {
    received += static_cast<double>(it->bytes) * (x - it->begin) / (it->end - it->begin);
  }
  return received;
}

double Link::PeakBytesPerSecond(absl::Duration window) const {
  const double w = absl::ToDoubleSeconds(window);
  if (transfers_.empty() || !(w > 0)) return 0;
  // The received bytes in [t, t + w] are piecewise linear in t between the points where t or
  // t + w meets a transfer's begin or end, and a closed window keeps its ends' instant
  // transfers: the maximum is at one of those points.
  // Each window is formed from the exact point it starts or ends at, so that rounding in
  // t + w - w cannot drop an instant transfer there.
  double peak = 0;
  const auto window_bytes = [this](double lo, double hi) {
    return ReceivedBy(hi, /*before=*/false) - ReceivedBy(lo, /*before=*/true);
  };
  for (const Transfer& t : transfers_) {
    for (double x : {t.begin, t.end}) {
      peak = std::max({peak, window_bytes(x, x + w), window_bytes(x - w, x)});
    }
  }
  return peak / w;
}

}  // namespace aloe::sim
