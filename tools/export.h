// aloe-export (tools/export_main.cc): a version of a job's global model as a safetensors file
// (common/safetensors_model.h), with a config.json for the built-in transformer, for the
// PyTorch code people already have. The model comes from a checkpoint or from a running server.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "worker/client.h"

namespace aloe {

struct ExportOptions {
  // A checkpoint: the job's server config (its model) and a checkpoint file, or a directory
  // (its newest whole checkpoint).
  std::string config;
  std::string checkpoint;
  // Or a running server (a single-process server or a layer-sharded job's coordinator) at
  // server.address, with its token and TLS settings. "" = export a checkpoint.
  worker::ClientOptions server;
  // From a server: the version to export; nullopt = the latest.
  std::optional<uint64_t> version;
  std::string out;  // the safetensors file to write
  // GPT-2-style names for the built-in transformer's tensors (nanoGPT's GPT); false: spec names.
  bool gpt2_names = true;
  std::string config_json;  // where to write config.json ("" = none); built-in transformer only
};

struct ExportResult {
  uint64_t version = 0;  // of the model written
  std::string source;    // the checkpoint file, or "aloe-server at ADDRESS"
  size_t tensors = 0;
  uint64_t bytes = 0;  // of the safetensors file
};

// Writes the model of a checkpoint or of a running server. Nothing is written on error.
//
// From a checkpoint (a one-process server's): kInvalidArgument naming the flag for missing
// options, a config_json for an imported model, or a checkpoint whose layers do not fit the
// config's model; kFailedPrecondition for a layer-sharded job's coordinator checkpoint (its
// layers are in the shard processes' checkpoints: aloe-reshard it to one process first); the
// config's and checkpoint store's errors.
//
// From a server: joins it as an observer (ROLE_OBSERVER: no task, not a trainer), pulls the
// version from it or, layer-sharded, from the shard process of each layer, and leaves.
// kInvalidArgument when both or neither of checkpoint and server.address are given, or for a
// config_json of an imported model; kFailedPrecondition naming the version and the server's
// current one for a version it has not reached, and the server's answer (naming the versions it
// holds) for one it no longer holds; the server's other errors (kUnavailable when it cannot be
// reached), each naming its address.
//
// Either way kUnavailable when writing fails.
absl::StatusOr<ExportResult> ExportModel(const ExportOptions& options);

}  // namespace aloe
