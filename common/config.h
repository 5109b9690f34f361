// Server/job configuration: an aloe.v1.ServerConfig read from a text-format protobuf file
// (.textproto, .pbtxt, .txtpb, .conf) or JSON (.json), completed with documented defaults and
// validated. Errors name the field ("outer_optimizer.lr must be > 0, got -1").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/aloe.pb.h"

namespace aloe {

// Parses text (format chosen by the file extension of `path_for_format`) without validating.
// kInvalidArgument with line/column for syntax errors and unknown fields.
absl::StatusOr<v1::ServerConfig> ParseServerConfig(const std::string& text,
                                                   const std::string& path_for_format);

// Reads, parses, fills defaults, validates. kNotFound when the file is missing.
absl::StatusOr<v1::ServerConfig> LoadServerConfig(const std::string& path);

// Fills every zero/empty field that has a documented default (docs/configuration.md). The
// deprecated alias num_shards is copied into an unset apply_groups: code reads apply_groups only.
void FillServerDefaults(v1::ServerConfig* config);

// Checks every field after defaults were filled. kInvalidArgument naming the first bad field
// (naming both num_shards and apply_groups when the alias and the field are set and differ).
// The single source of the valid ranges: components that re-check their part of a config built
// in code call the functions below, which this one calls too.
absl::Status ValidateServerConfig(const v1::ServerConfig& config);

// The fields the outer optimizer of config.type() reads: a known type, lr > 0 and finite,
// staleness_exponent as ValidateStalenessExponent, and by type:
//   OUTER_SGD: nothing more (momentum is ignored);
//   OUTER_NESTEROV and OUTER_OPTIMIZER_UNSPECIFIED (= Nesterov): momentum in [0, 1);
//   OUTER_DELAYED_NESTEROV: momentum in [0, 1), dn_buffer_size N in [1, 1000000],
//     dn_momentum_activation in [0, MaxDnMomentumActivation(N)];
//   OUTER_ADAM: adam_beta1 and adam_beta2 in [0, 1), adam_eps > 0 and finite.
// ValidateServerConfig also checks the fields the type ignores, with the same ranges.
// kInvalidArgument naming the field ("outer_optimizer.lr must be > 0, got -1").
absl::Status ValidateOuterOptimizerConfig(const v1::OuterOptimizerConfig& config);

// outer_optimizer.staleness_exponent is >= 0 and finite (0 = no staleness discount).
absl::Status ValidateStalenessExponent(const v1::OuterOptimizerConfig& config);

// The largest dn_momentum_activation c accepted with buffer size n >= 1: 1/n rounded to the
// nearest float. A config that writes c = 1/N (0.2 for N = 5) parses to that same float, which
// may lie above 1/N in real numbers; the next float up is refused.
float MaxDnMomentumActivation(uint32_t n);

// penalty.ema_alpha in (0, 1]; z_threshold, temperature and clip_norm > 0 and finite. Checked
// whether or not the penalty is enabled. kInvalidArgument naming the field.
absl::Status ValidatePenaltyConfig(const v1::PenaltyConfig& config);

// Every tensor that a CODEC_LOWRANK layer of transport.layer_codecs compresses
// (LowRankTensorRank) can be pushed: the header, its Q at the factor codec and one row of P fit
// in one chunk of max_chunk_bytes (the push's kMaxChunkBytes). Otherwise kInvalidArgument naming
// the layer, the tensor, the rank, the bytes, the limit and the largest rank that fits. Layers
// that `spec` lacks are skipped (the server refuses those names at start).
absl::Status ValidateLowRankLayers(const v1::TransportConfig& transport, const v1::ModelSpec& spec,
                                   size_t max_chunk_bytes);

}  // namespace aloe
