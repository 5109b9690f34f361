#include "server/core/pseudo_gradient_penalty.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/byte_io.h"
#include "common/config.h"
#include "common/status_macros.h"
#include "kernels/cpu/outer_kernels.h"

namespace aloe::server {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "state blobs are little-endian");

// State blob layout (little-endian, no padding):
//   char[4]  "APGP" (ALOE pseudo-gradient penalty)
//   uint32   format version (kStateFormatVersion)
//   uint64   number of modules M
//   M times: uint64 number of streams S, then S times
//            {uint64 stream, uint64 count, float64 mu, float64 sigma}, streams ascending.
constexpr char kStateMagic[4] = {'A', 'P', 'G', 'P'};
constexpr uint32_t kStateFormatVersion = 1;
constexpr size_t kEntryBytes = 2 * sizeof(uint64_t) + 2 * sizeof(double);

// Folds a non-anomalous norm into the statistics, paper 000 Eq. 1. The paper does not say how
// mu and sigma start. atorch (OnlineDynamicEWMA) starts from mu = sigma = 0, so mu approaches a
// constant norm G only as 1 - (1-alpha)^n: 91% of G after its default 120 warmup norms, with
// sigma ~ 0.28 G made of that ramp alone; with a warmup of 2 every later norm has z ~ 5, is
// flagged, and since flagged norms never update the statistics the stream stays flagged forever.
// We let the first norm set mu = G, sigma = 0 (the EMA of one observation), and apply Eq. 1 from
// the second on, so the statistics describe the norms actually seen.
void Fold(double g, double alpha, PenaltyEmaStats* s) {
  if (s->count == 0) {
    s->mu = g;
    s->sigma = 0;
  } else {
    const double mu = alpha * g + (1 - alpha) * s->mu;
    const double d = g - mu;
    s->sigma = std::sqrt((1 - alpha) * s->sigma * s->sigma + alpha * d * d);
    s->mu = mu;
  }
  ++s->count;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PseudoGradientPenalty>> PseudoGradientPenalty::Create(
    const v1::PenaltyConfig& config, size_t num_modules) {
  // The loader's own check (common/config.h), so a config built in code meets the same ranges.
  ALOE_RETURN_IF_ERROR(ValidatePenaltyConfig(config));
  return std::unique_ptr<PseudoGradientPenalty>(new PseudoGradientPenalty(config, num_modules));
}

absl::StatusOr<PenaltyModuleReport> PseudoGradientPenalty::Weigh(size_t module,
                                                                 absl::Span<const uint64_t> streams,
                                                                 absl::Span<const double> norms) {
  if (module >= modules_.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("penalty: module %d of a model with %d modules", module, modules_.size()));
  }
  if (streams.empty() || streams.size() != norms.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "penalty: module %d needs >= 1 update and one norm each (got %d streams, %d norms)", module,
        streams.size(), norms.size()));
  }
  for (size_t i = 0; i < norms.size(); ++i) {
    if (!(norms[i] >= 0) || !std::isfinite(norms[i])) {
      return absl::InvalidArgumentError(
          absl::StrFormat("penalty: module %d update %d has norm %g (must be finite and >= 0)",
                          module, i, norms[i]));
    }
  }
  std::map<uint64_t, PenaltyEmaStats>& table = modules_[module];
  const double alpha = config_.ema_alpha();
  const uint64_t warmup = std::max<uint64_t>(config_.warmup(), 1);

  PenaltyModuleReport report;
  report.updates.resize(norms.size());
  // Alg. 2 lines 2-5: every z-test sees the statistics from before this set.
  for (size_t i = 0; i < norms.size(); ++i) {
    PenaltyUpdateReport& r = report.updates[i];
    r.stream = streams[i];
    r.norm = norms[i];
    auto it = table.find(streams[i]);
    if (it == table.end()) continue;  // first norm of this stream: nothing to compare with
    const PenaltyEmaStats& s = it->second;
    if (s.sigma > 0) r.z_score = (norms[i] - s.mu) / s.sigma;
    r.anomalous = s.count >= warmup && r.z_score > config_.z_threshold();
  }
  // Eq. 1, skipped for anomalous norms (G = +inf).
  for (const PenaltyUpdateReport& r : report.updates) {
    if (!r.anomalous) Fold(r.norm, alpha, &table[r.stream]);
  }
  // Eq. 2 as a softmax shifted by the smallest finite G: every exponent is <= 0 and the smallest
  // contributes exp(0) = 1, so the sum is in [1, k] and nothing overflows; a huge G underflows to
  // weight 0, as it should. Anomalous updates (G = +inf) get exactly 0. (Alg. 2 line 7 tests
  // gamma == sum_k exp(-G_k) == 0, which in floating point also fires when all norms merely
  // exceed ~745; we roll back only when every update is anomalous, as the text of Sec. 3.2 says.)
  double min_norm = std::numeric_limits<double>::infinity();
  for (const PenaltyUpdateReport& r : report.updates) {
    if (!r.anomalous) min_norm = std::min(min_norm, r.norm);
  }
  if (std::isinf(min_norm)) {
    report.rollback = true;  // Alg. 2 lines 7-8
    return report;
  }
  const double inv_t = 1.0 / static_cast<double>(config_.temperature());
  double sum = 0;
  for (PenaltyUpdateReport& r : report.updates) {
    if (r.anomalous) continue;
    r.weight = std::exp(-(r.norm - min_norm) * inv_t);
    sum += r.weight;
  }
  for (PenaltyUpdateReport& r : report.updates) r.weight /= sum;
  return report;
}

double PseudoGradientPenalty::ClipCoefficient(double aggregated_norm) const {
  return std::min(static_cast<double>(config_.clip_norm()) / (aggregated_norm + kClipEpsilon), 1.0);
}

absl::StatusOr<PenaltyModuleReport> PseudoGradientPenalty::AggregateModule(
    size_t module, absl::Span<const uint64_t> streams,
    absl::Span<const absl::Span<const float>> grads, absl::Span<float> out) {
  if (streams.size() != grads.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("penalty: module %d has %d streams for %d pseudo-gradients", module,
                        streams.size(), grads.size()));
  }
  std::vector<double> norms(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].size() != out.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("penalty: module %d update %d has %d elements, expected %d", module, i,
                          grads[i].size(), out.size()));
    }
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    norms[i] = std::sqrt(kernels::SquaredL2Norm(grads[i].data(), grads[i].size()));
  }
  ALOE_ASSIGN_OR_RETURN(PenaltyModuleReport report, Weigh(module, streams, norms));
  if (report.rollback) return report;

  std::vector<float> weights(report.updates.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    weights[i] = static_cast<float>(report.updates[i].weight);
  }
  WeightedSum(grads, weights, out);
  report.aggregated_norm = std::sqrt(kernels::SquaredL2Norm(out.data(), out.size()));
  report.clip_coefficient = ClipCoefficient(report.aggregated_norm);
  if (report.clip_coefficient < 1.0) {
    kernels::Scale(out.data(), out.size(), static_cast<float>(report.clip_coefficient));
  }
  return report;
}

std::optional<PenaltyEmaStats> PseudoGradientPenalty::Stats(size_t module, uint64_t stream) const {
  if (module >= modules_.size()) return std::nullopt;
  auto it = modules_[module].find(stream);
  if (it == modules_[module].end()) return std::nullopt;
  return it->second;
}

void PseudoGradientPenalty::ForgetStream(uint64_t stream) {
  for (auto& table : modules_) table.erase(stream);
}

void PseudoGradientPenalty::SaveState(std::string* out) const { WriteState(modules_, out); }

void PseudoGradientPenalty::WriteState(const std::vector<ModuleStats>& modules, std::string* out) {
  out->append(kStateMagic, sizeof(kStateMagic));
  AppendPod<uint32_t>(kStateFormatVersion, out);
  AppendPod<uint64_t>(modules.size(), out);
  for (const ModuleStats& table : modules) {
    AppendPod<uint64_t>(table.size(), out);
    for (const auto& [stream, s] : table) {
      AppendPod<uint64_t>(stream, out);
      AppendPod<uint64_t>(s.count, out);
      AppendPod<double>(s.mu, out);
      AppendPod<double>(s.sigma, out);
    }
  }
}

absl::StatusOr<std::vector<PseudoGradientPenalty::ModuleStats>> PseudoGradientPenalty::ParseState(
    std::string_view blob) {
  std::string_view in = blob;
  char magic[sizeof(kStateMagic)];
  uint32_t version = 0;
  uint64_t num_modules = 0;
  if (!ReadPod(&in, &magic) || std::memcmp(magic, kStateMagic, sizeof(magic)) != 0) {
    return absl::InvalidArgumentError("penalty state: not a penalty state blob");
  }
  if (!ReadPod(&in, &version) || version != kStateFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrFormat("penalty state: unsupported format version %d", version));
  }
  // Every module takes at least its 8-byte stream count.
  if (!ReadPod(&in, &num_modules) || num_modules > in.size() / sizeof(uint64_t)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "penalty state: %d modules do not fit in %d bytes", num_modules, in.size()));
  }
  std::vector<ModuleStats> modules(num_modules);
  for (size_t m = 0; m < modules.size(); ++m) {
    uint64_t num_streams = 0;
    if (!ReadPod(&in, &num_streams) || num_streams > in.size() / kEntryBytes) {
      return absl::InvalidArgumentError(
          absl::StrFormat("penalty state: module %d is truncated", m));
    }
    for (uint64_t j = 0; j < num_streams; ++j) {
      uint64_t stream = 0;
      PenaltyEmaStats s;
      ReadPod(&in, &stream);
      ReadPod(&in, &s.count);
      ReadPod(&in, &s.mu);
      ReadPod(&in, &s.sigma);
      if (!modules[m].empty() && stream <= modules[m].rbegin()->first) {
        return absl::InvalidArgumentError(
            absl::StrFormat("penalty state: module %d streams are not ascending", m));
      }
      if (s.count == 0 || !(s.mu >= 0) || !std::isfinite(s.mu) || !(s.sigma >= 0) ||
          !std::isfinite(s.sigma)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "penalty state: module %d stream %d has invalid statistics (count %d, mu %g, "
            "sigma %g)",
            m, stream, s.count, s.mu, s.sigma));
      }
      modules[m].emplace_hint(modules[m].end(), stream, s);
    }
  }
  if (!in.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("penalty state: %d trailing bytes", in.size()));
  }
  return modules;
}

absl::Status PseudoGradientPenalty::LoadState(std::string_view blob) {
  ALOE_ASSIGN_OR_RETURN(std::vector<ModuleStats> modules, ParseState(blob));
  if (modules.size() != modules_.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "penalty state: blob has %d modules, this model has %d", modules.size(), modules_.size()));
  }
  modules_ = std::move(modules);
  return absl::OkStatus();
}

absl::StatusOr<LayerStep> PenaltyAggregation::Aggregate(
    size_t layer, absl::Span<const PendingUpdate* const> updates, absl::Span<float> g) {
  if (layer >= reports_.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "penalty aggregation: layer %d of a model with %d modules", layer, reports_.size()));
  }
  std::vector<uint64_t> streams;
  std::vector<absl::Span<const float>> grads;
  streams.reserve(updates.size());
  grads.reserve(updates.size());
  for (const PendingUpdate* u : updates) {
    if (layer >= u->layers.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "penalty aggregation: update of worker %d has no layer %d", u->worker_id, layer));
    }
    streams.push_back(u->worker_id);  // stream = the pushing worker (see the header)
    grads.push_back(u->layers[layer]);
  }
  ALOE_ASSIGN_OR_RETURN(reports_[layer], penalty_.AggregateModule(layer, streams, grads, g));
  return reports_[layer].rollback ? LayerStep::kSkip : LayerStep::kApply;
}

}  // namespace aloe::server
