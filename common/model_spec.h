// The parameter layout of ALOE's decoder-only pre-LN transformer LM, shared by server and
// worker without LibTorch. A layer is the unit of transfer and of (outer) optimizer state: one
// flat float32 buffer holding its tensors concatenated in spec order, row-major. The worker's
// LibTorch module (worker/transformer.h) must expose exactly these tensors, with the same names,
// shapes and order; LocalTrainer::Create checks it.
//
// Layers, for L = num_layers, d = d_model, V = vocab_size, S = seq_len, f = ffn_mult * d:
//   0      "embed":    tok_emb.weight [V,d], pos_emb.weight [S,d]
//   1..L   "blocks.i": ln1.{weight [d], bias [d]}, attn.qkv.{weight [3d,d], bias [3d]},
//                      attn.proj.{weight [d,d], bias [d]}, ln2.{weight, bias},
//                      mlp.fc1.{weight [f,d], bias [f]}, mlp.fc2.{weight [d,f], bias [d]}
//   L+1    "head":     ln_f.weight [d], ln_f.bias [d], head.weight [V,d] (no bias)
// Initialisation (GPT-2 style): weights N(0, init_std^2), the residual output projections
// (attn.proj, mlp.fc2) N(0, (init_std / sqrt(2L))^2), biases 0, LayerNorm gains 1.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "proto/aloe.pb.h"

namespace aloe {

// Sets every zero field of `c` to its default: vocab_size 256, seq_len 128, d_model 256,
// num_layers 4, num_heads 4, ffn_mult 4, init_std 0.02.
void FillTransformerDefaults(v1::TransformerConfig* c);

// Bounds on what a config may describe: the server allocates the whole model (and its optimizer
// state) at startup, so an absurd size must be a config error, not an allocation failure.
inline constexpr uint32_t kMaxTransformerBlocks = 4096;
inline constexpr double kMaxModelParameters = 1e12;

// Returns kInvalidArgument, naming the field as "model.<field>", unless every size field is > 0,
// init_std is finite and > 0, num_heads divides d_model, num_layers <= kMaxTransformerBlocks
// and the model has at most kMaxModelParameters parameters.
absl::Status ValidateTransformerConfig(const v1::TransformerConfig& c);

// The number of parameters of the model configured by `c` (the layout in the file comment),
// computed in double so that any config can be sized without overflow.
double TransformerParameters(const v1::TransformerConfig& c);

// Describes the parameters of the model configured by `c` (layout in the file comment), with
// num_elements filled and each layer's `shard` set to one of `num_shards` (0 is treated as 1)
// by greedy byte balancing: layers in decreasing size (ties: lower id first) each go to the
// currently least-loaded one (ties: lower index). Deterministic. What the values are depends on
// the caller (proto/model.proto LayerSpec.shard): the apply groups of a single-process server,
// or the shard processes of a layer-sharded one.
// Precondition: ValidateTransformerConfig(c) is OK.
v1::ModelSpec BuildTransformerSpec(const v1::TransformerConfig& c, uint32_t num_shards);

// Sets spec->num_shards to max(num_shards, 1) and every layer's `shard` (its apply group or
// shard process) by the greedy byte balancing described above. Deterministic.
void AssignShards(uint32_t num_shards, v1::ModelSpec* spec);

// Sum of num_elements over the layers of `spec`.
uint64_t TotalElements(const v1::ModelSpec& spec);

// Training FLOPs per predicted token (forward and backward), the usual estimate 6 N + 12 L d T:
// N counts the parameters of the matrix products (every tensor of `spec` but the built-in
// transformer's token and position embeddings, which are looked up, not multiplied), and 12 L d T
// the attention scores and their weighted sums of `model`'s L blocks of width d over T tokens.
// For an imported model (`model` has no blocks: only vocab_size and seq_len) the structure is
// unknown: N counts every parameter and the attention term is 0.
double TrainingFlopsPerToken(const v1::ModelSpec& spec, const v1::TransformerConfig& model);

// Initial parameters for `spec`: one flat buffer per layer, each tensor drawn according to its
// InitKind (INIT_NORMAL: N(0, init_std^2); INIT_UNSPECIFIED is treated as zeros). Deterministic
// for a given (spec, seed) and standard library: layer l draws from its own std::mt19937_64
// seeded with a mix of (seed, l), so a layer's values do not depend on the other layers.
// only_shard_process >= 0: only the layers with shard == only_shard_process are drawn, the
// others are empty (that shard process of a layer-sharded server); kAllLayers draws every
// layer.
inline constexpr int64_t kAllLayers = -1;
std::vector<std::vector<float>> InitializeParameters(const v1::ModelSpec& spec, uint64_t seed,
                                                     int64_t only_shard_process = kAllLayers);

// The most slices a layer may be cut into (FSDP ranks of one node).
inline constexpr uint32_t kMaxSlices = 1024;

// Element range [first, second) of slice `slice` of `slices` of a layer of `elements` elements:
// slices of ceil(elements / slices) elements, the last ones shorter or empty. The rule shared by
// FSDP ranks (worker/fsdp.h), sliced pulls and sliced pushes (proto PullRequest, PushHeader).
// Precondition: slice < slices.
std::pair<uint64_t, uint64_t> SliceRange(uint64_t elements, uint32_t slices, uint32_t slice);

// kInvalidArgument unless slice < slices <= kMaxSlices, or slices is 0 or 1 (whole layers) and
// slice is 0: a slice request or push header from the wire.
absl::Status CheckSlice(uint32_t slice, uint32_t slices);

}  // namespace aloe
