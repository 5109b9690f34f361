#include "tools/export.h"

#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/config.h"
#include "common/durable_file.h"
#include "common/imported_model.h"
#include "common/logging.h"
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

// The exported file (and config.json) of `layers`, one buffer per spec layer, at `version`.
// `imported`: the job trains a bring-your-own model (spec names, no config.json).
absl::StatusOr<ExportResult> WriteModel(const ExportOptions& options, const v1::ModelSpec& spec,
                                        const v1::TransformerConfig& model, bool imported,
                                        const std::vector<std::vector<float>>& layers,
                                        uint64_t version, std::string source) {
  const bool gpt2 = options.gpt2_names && !imported;
  ALOE_ASSIGN_OR_RETURN(const std::vector<SafetensorsTensor> tensors,
                        ModelTensors(spec, layers, gpt2));
  const std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                       {"aloe_version", absl::StrCat(version)},
                                                       {"aloe_names", gpt2 ? "gpt2" : "spec"}};
  ALOE_RETURN_IF_ERROR(WriteSafetensors(options.out, tensors, metadata));
  if (!options.config_json.empty()) {
    if (absl::Status s = WriteFileAtomically(options.config_json, TransformerConfigJson(model));
        !s.ok()) {
      ::unlink(options.out.c_str());
      return s;
    }
  }
  ExportResult result;
  result.version = version;
  result.source = std::move(source);
  result.tensors = tensors.size();
  struct stat st;
  if (::stat(options.out.c_str(), &st) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot stat ", options.out, " after writing it"));
  }
  result.bytes = static_cast<uint64_t>(st.st_size);
  return result;
}

absl::Status ImportedModelHasNoConfigJson(const ExportOptions& options, bool imported) {
  if (imported && !options.config_json.empty()) {
    return absl::InvalidArgumentError(
        "--config_json describes the built-in transformer; this job trains an imported model");
  }
  return absl::OkStatus();
}

absl::StatusOr<ExportResult> ExportCheckpoint(const ExportOptions& options) {
  if (options.config.empty()) return absl::InvalidArgumentError("--config is required");
  if (options.version.has_value()) {
    return absl::InvalidArgumentError("--version goes with --server: a checkpoint holds one");
  }
  ALOE_ASSIGN_OR_RETURN(const v1::ServerConfig config, LoadServerConfig(options.config));
  ALOE_RETURN_IF_ERROR(ImportedModelHasNoConfigJson(options, !config.model_file().empty()));
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
        "its shard processes' checkpoints); export from the running job with --server, or "
        "convert it to one process with aloe-reshard (shard_processes: 0) and export that",
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
  return WriteModel(options, model.spec, config.model(), !config.model_file().empty(), layers,
                    ckpt.version(), loaded.path);
}

// `status` with "aloe-server at ADDRESS: " before its message.
absl::Status AtServer(const std::string& address, const absl::Status& status) {
  return absl::Status(status.code(),
                      absl::StrCat("aloe-server at ", address, ": ", status.message()));
}

absl::StatusOr<ExportResult> ExportLive(const ExportOptions& options) {
  if (!options.config.empty()) {
    return absl::InvalidArgumentError(
        "--config goes with --checkpoint; a running server tells its model itself");
  }
  const std::string& address = options.server.address;
  worker::ClientOptions client_options = options.server;
  client_options.raw_push = false;  // it pushes nothing
  worker::ServerClient client(client_options);
  v1::JoinRequest join;
  join.set_name(absl::StrCat("aloe-export-", ::getpid()));
  join.set_role(v1::ROLE_OBSERVER);
  absl::StatusOr<v1::JoinReply> joined = client.Join(join);
  if (!joined.ok()) {
    if (joined.status().code() == absl::StatusCode::kUnavailable) {
      return absl::UnavailableError(
          absl::StrCat("cannot reach aloe-server at ", address,
                       " (or it is not ready): ", joined.status().message()));
    }
    if (joined.status().code() == absl::StatusCode::kInvalidArgument &&
        absl::StrContains(joined.status().message(), "unknown role")) {
      // A server older than the observer role: it cannot be exported from while it runs.
      return absl::FailedPreconditionError(absl::StrCat(
          "aloe-server at ", address, " refuses the observer role (", joined.status().message(),
          "): it predates export from a live server; export its newest checkpoint instead "
          "(--checkpoint with --config)"));
    }
    return AtServer(address, joined.status());
  }
  // Leaves on every path: the server need not wait out the lease.
  struct LeaveOnExit {
    worker::ServerClient& client;
    uint64_t id;
    ~LeaveOnExit() {
      if (absl::Status s = client.Leave(id); !s.ok()) {
        ALOE_LOG_WARNING("export", "leaving the server: %s", s.ToString());
      }
    }
  } leave{client, joined->worker_id()};

  const bool imported = !joined->model_fingerprint().empty();
  ALOE_RETURN_IF_ERROR(ImportedModelHasNoConfigJson(options, imported));
  if (options.version.has_value() && *options.version > joined->version()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("aloe-server at %s is at version %d: version %d does not exist yet",
                        address, joined->version(), *options.version));
  }
  ALOE_RETURN_IF_ERROR(
      client.SetShards({joined->shard_addresses().begin(), joined->shard_addresses().end()}));
  std::vector<std::vector<float>> layers;
  uint64_t bytes = 0;
  absl::StatusOr<uint64_t> pulled =
      client.Pull(joined->worker_id(), options.version.value_or(0), !options.version.has_value(),
                  joined->model_spec(), &layers, &bytes);
  if (!pulled.ok()) return AtServer(address, pulled.status());
  return WriteModel(options, joined->model_spec(), joined->model(), imported, layers, *pulled,
                    absl::StrCat("aloe-server at ", address));
}

}  // namespace

absl::StatusOr<ExportResult> ExportModel(const ExportOptions& options) {
  if (options.out.empty()) return absl::InvalidArgumentError("--out is required");
  const bool live = !options.server.address.empty();
  if (live == !options.checkpoint.empty()) {
    return absl::InvalidArgumentError("give one of --checkpoint and --server");
  }
  return live ? ExportLive(options) : ExportCheckpoint(options);
}

}  // namespace aloe
