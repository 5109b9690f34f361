#include "tools/export.h"

#include <sys/stat.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/config.h"
#include "common/durable_file.h"
#include "common/imported_model.h"
#include "common/safetensors.h"
#include "common/safetensors_model.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "server/core/checkpoint_store.h"

namespace aloe {
namespace {

bool IsDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

absl::StatusOr<server::CheckpointStore::Loaded> ReadCheckpoint(const std::string& path) {
  if (!IsDirectory(path)) {
    server::CheckpointStore::Loaded loaded;
    ALOE_ASSIGN_OR_RETURN(loaded.checkpoint,
                          server::CheckpointStore::ReadFile<v1::ServerCheckpoint>(path));
    loaded.path = path;
    return loaded;
  }
  return server::CheckpointStore(path, 1).LoadLatest();
}

}  // namespace

absl::StatusOr<ExportResult> ExportModel(const ExportOptions& options) {
  if (options.config.empty()) return absl::InvalidArgumentError("--config is required");
  if (options.checkpoint.empty()) return absl::InvalidArgumentError("--checkpoint is required");
  if (options.out.empty()) return absl::InvalidArgumentError("--out is required");
  ALOE_ASSIGN_OR_RETURN(const v1::ServerConfig config, LoadServerConfig(options.config));
  if (!options.config_json.empty() && !config.model_file().empty()) {
    return absl::InvalidArgumentError(
        "--config_json describes the built-in transformer; this job trains an imported model");
  }
  // The spec alone, of a one-process server (the layout of the checkpoint read).
  v1::ServerConfig one_process = config;
  one_process.set_shard_processes(0);
  one_process.clear_init_file();
  ALOE_ASSIGN_OR_RETURN(const ServerModel model, LoadServerModel(one_process, kNoLayers));
  ALOE_ASSIGN_OR_RETURN(server::CheckpointStore::Loaded loaded, ReadCheckpoint(options.checkpoint));
  const v1::ServerCheckpoint& ckpt = loaded.checkpoint;
  if (ckpt.layer_params_size() == 0 && model.spec.layers_size() > 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s holds no parameters: a layer-sharded job's coordinator checkpoint (the layers are in "
        "its shard processes' checkpoints); convert it to one process with aloe-reshard "
        "(shard_processes: 0) and export that",
        loaded.path));
  }
  if (ckpt.layer_params_size() != model.spec.layers_size()) {
    return absl::InvalidArgumentError(absl::StrFormat("%s has %d layers, the model of %s has %d",
                                                      loaded.path, ckpt.layer_params_size(),
                                                      options.config, model.spec.layers_size()));
  }
  std::vector<std::vector<float>> layers(model.spec.layers_size());
  for (int l = 0; l < model.spec.layers_size(); ++l) {
    const uint64_t n = model.spec.layers(l).num_elements();
    if (ckpt.layer_params(l).size() != n * sizeof(float)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: layer %s has %d bytes, the model of %s %d", loaded.path, model.spec.layers(l).name(),
          ckpt.layer_params(l).size(), options.config, n * sizeof(float)));
    }
    layers[l].resize(n);
    ALOE_RETURN_IF_ERROR(DecodeFloats(ckpt.layer_params(l), absl::MakeSpan(layers[l])));
  }
  ALOE_ASSIGN_OR_RETURN(
      const std::vector<SafetensorsTensor> tensors,
      ModelTensors(model.spec, layers, options.gpt2_names && config.model_file().empty()));
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"aloe_version", absl::StrCat(ckpt.version())},
      {"aloe_names", options.gpt2_names && config.model_file().empty() ? "gpt2" : "spec"}};
  ALOE_RETURN_IF_ERROR(WriteSafetensors(options.out, tensors, metadata));
  if (!options.config_json.empty()) {
    if (absl::Status s =
            WriteFileAtomically(options.config_json, TransformerConfigJson(config.model()));
        !s.ok()) {
      ::unlink(options.out.c_str());
      return s;
    }
  }
  ExportResult result;
  result.version = ckpt.version();
  result.checkpoint = loaded.path;
  result.tensors = tensors.size();
  ALOE_ASSIGN_OR_RETURN(const std::string written, ReadWholeFile(options.out));
  result.bytes = written.size();
  return result;
}

}  // namespace aloe
