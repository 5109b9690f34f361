// aloe-export (tools/export_main.cc): a version of a job's global model as a safetensors file
// (common/safetensors_model.h), with a config.json for the built-in transformer, for the
// PyTorch code people already have.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace aloe {

struct ExportOptions {
  std::string config;      // the job's server config (its model)
  std::string checkpoint;  // a checkpoint file, or a directory (its newest whole checkpoint)
  std::string out;         // the safetensors file to write
  // GPT-2-style names for the built-in transformer's tensors (nanoGPT's GPT); false: spec names.
  bool gpt2_names = true;
  std::string config_json;  // where to write config.json ("" = none); built-in transformer only
};

struct ExportResult {
  uint64_t version = 0;    // of the model written
  std::string checkpoint;  // the file it came from
  size_t tensors = 0;
  uint64_t bytes = 0;  // of the safetensors file
};

// Writes the model of a one-process server's checkpoint. kInvalidArgument naming the flag for
// missing options, a config_json for an imported model, or a checkpoint whose layers do not fit
// the config's model; kFailedPrecondition for a layer-sharded job's coordinator checkpoint (its
// layers are in the shard processes' checkpoints: aloe-reshard it to one process first); the
// config's and checkpoint store's errors; kUnavailable when writing fails. Nothing is written
// on error.
absl::StatusOr<ExportResult> ExportModel(const ExportOptions& options);

}  // namespace aloe
