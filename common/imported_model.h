// Bring-your-own models without LibTorch: the layer grouping of a module's parameters, the model
// fingerprint that server and workers compare, the imported-model file (v1::ImportedModel,
// written by aloe-import-model) and the model a server trains (built-in transformer or file).
//
// Layer grouping: a parameter "a.b.c" belongs to layer "a" (a top-level submodule), except that
// when its second component is a number ("blocks.3.attn.weight": a child of a ModuleList or
// Sequential) it belongs to layer "blocks.3"; parameters of the root module itself (no dot)
// belong to layer "root". Layers appear in the order of their first parameter and hold their
// tensors in parameter order.
//
// File format: the 8 bytes "ALOEMODL", then the serialized v1::ImportedModel (so at most 2 GiB:
// about 500M float32 parameters).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model_spec.h"
#include "proto/aloe.pb.h"

namespace aloe {

inline constexpr char kImportedModelMagic[8] = {'A', 'L', 'O', 'E', 'M', 'O', 'D', 'L'};
inline constexpr uint32_t kImportedModelFormat = 1;
inline constexpr uint32_t kMaxImportedSeqLen = 1 << 20;
inline constexpr uint32_t kMaxImportedLayers = 1 << 16;

// The layer (see the file comment) that parameter `name` belongs to.
std::string LayerNameOf(absl::string_view parameter);

struct ParameterShape {
  std::string name;            // "blocks.0.attn.qkv.weight"
  std::vector<int64_t> shape;  // row-major; {} is a scalar
};

// Groups `parameters` (in the module's named_parameters order) into layers: ids 0.. in order of
// first appearance, tensor names and shapes, num_elements; init and shard left unset.
std::vector<v1::LayerSpec> GroupIntoLayers(const std::vector<ParameterShape>& parameters);

// "byo1-" + 16 hex digits: 64-bit FNV-1a of a canonical text of the output kind and every
// layer's name and tensors' names and shapes: the architecture, which a worker can compute from
// its TorchScript file alone (not vocab_size and seq_len, which describe the data and reach the
// worker from the server, nor the parameter values, the source or the stored fingerprint).
std::string ModelFingerprint(const v1::ImportedModel& model);

// kInvalidArgument naming the first problem unless: format is 1; vocab_size >= 2; seq_len in
// [1, kMaxImportedSeqLen]; output is LOSS or LOGITS; 1..kMaxImportedLayers layers with ids 0..n-1
// and unique non-empty names, each with at least one tensor; tensor names unique across the
// model, every dimension >= 1; num_elements is the sum of the tensors' element counts; at most
// kMaxModelParameters parameters in all; one layer_params entry per layer of 4 x num_elements
// bytes, every value finite; and fingerprint == ModelFingerprint(model).
absl::Status ValidateImportedModel(const v1::ImportedModel& model);

// Writes `model` (which must pass ValidateImportedModel, else kInvalidArgument) to `path`
// atomically. kInternal naming the path on an I/O failure.
absl::Status WriteImportedModel(const std::string& path, const v1::ImportedModel& model);

// Reads and validates an imported-model file. kNotFound when it cannot be opened;
// kInvalidArgument (prefixed with the path) when it is not an imported-model file, is truncated
// or corrupt, or fails ValidateImportedModel.
absl::StatusOr<v1::ImportedModel> ReadImportedModel(const std::string& path);

// The model a server trains: the spec with layers assigned to apply groups or shard processes
// (proto/model.proto LayerSpec.shard), the initial parameters (version 0) and, for an imported
// model, its fingerprint, vocab_size and seq_len.
struct ServerModel {
  v1::ModelSpec spec;
  std::vector<std::vector<float>> initial;
  std::string fingerprint;  // "" for the built-in transformer
  uint32_t vocab_size = 0;
  uint32_t seq_len = 0;
};

// For config.model_file == "": BuildTransformerSpec(config.model(), shards) and
// InitializeParameters(spec, seed). Otherwise reads the file (ReadImportedModel's errors,
// prefixed with "model_file: ") and balances its layers over `shards` (AssignShards). shards =
// shard_processes when the server is sharded across processes (each layer's shard is the
// process that owns it), else apply_groups (each layer's shard is its apply group).
// params_of: whose initial parameters to build: kAllLayers (one process holds them all), a shard
// process index (only the layers it owns; the other entries of `initial` stay empty), or
// kNoLayers (a coordinator: the spec alone, `initial` empty).
inline constexpr int64_t kNoLayers = -2;
absl::StatusOr<ServerModel> LoadServerModel(const v1::ServerConfig& config,
                                            int64_t params_of = kAllLayers);

}  // namespace aloe
