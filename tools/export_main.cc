// aloe-export: a version of a job's global model as safetensors (tools/export.h).
#include <cstdio>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "tools/export.h"
#include "worker/client.h"

ABSL_FLAG(std::string, config, "", "With --checkpoint: the job's server config (its model)");
ABSL_FLAG(std::string, checkpoint, "",
          "A one-process server's checkpoint file, or its checkpoint directory (the newest whole "
          "checkpoint there)");
ABSL_FLAG(std::string, server, "",
          "Or a running aloe-server (host:port of a single-process server or of a layer-sharded "
          "job's coordinator): export its global model as it is now");
ABSL_FLAG(std::string, version, "latest",
          "With --server: latest, or the version N to export (the current one, or an older one "
          "the server still holds for tasks)");
ABSL_FLAG(std::string, out, "model.safetensors", "The safetensors file to write");
ABSL_FLAG(std::string, names, "gpt2",
          "gpt2: the built-in transformer's tensors under GPT-2-style names (nanoGPT's GPT "
          "module: transformer.h.0.attn.c_attn.weight, ...); spec: the model spec's names");
ABSL_FLAG(std::string, config_json, "",
          "Also write a config.json of the built-in transformer here (GPT-2-style keys)");
ABSL_FLAG(std::string, token_file, "",
          "With --server: file whose first line is an access token of the server");
ABSL_FLAG(std::string, tls_ca_file, "", "PEM CA that signed the server certificate (enables TLS)");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM client certificate chain (mutual TLS)");
ABSL_FLAG(std::string, tls_key_file, "", "PEM client private key (mutual TLS)");
ABSL_FLAG(std::string, tls_server_name, "", "Name to verify in the server certificate");

int main(int argc, char** argv) {
  aloe::SetUsage(
      "aloe-export --config SERVER.textproto --checkpoint DIR|FILE [--out model.safetensors]\n"
      "aloe-export --server HOST:PORT [--version N|latest] [--out model.safetensors]\n"
      "Writes the global model of a job's checkpoint, or of a running server, as a safetensors\n"
      "file (float32), which PyTorch (safetensors.torch.load_file) and nanoGPT-style code read;\n"
      "ServerConfig.init_file starts a job from such a file. From a server it joins as an\n"
      "observer (no task, not a trainer), pulls the version (from the shard processes of a\n"
      "layer-sharded job) and leaves; --token_file and --tls_* as for aloe-worker.");
  absl::ParseCommandLine(argc, argv);
  const std::string names = absl::GetFlag(FLAGS_names);
  if (names != "gpt2" && names != "spec") {
    ALOE_LOG_ERROR("export", "--names must be gpt2 or spec, got \"%s\"", names);
    return 1;
  }
  std::optional<uint64_t> version;
  if (const std::string v = absl::GetFlag(FLAGS_version); v != "latest") {
    uint64_t n = 0;
    if (!absl::SimpleAtoi(v, &n)) {
      ALOE_LOG_ERROR("export", "--version must be latest or a version number, got \"%s\"", v);
      return 1;
    }
    version = n;
  }
  aloe::worker::ClientOptions server;
  server.address = absl::GetFlag(FLAGS_server);
  if (absl::Status s = aloe::worker::LoadClientFiles(
          {absl::GetFlag(FLAGS_token_file), absl::GetFlag(FLAGS_tls_ca_file),
           absl::GetFlag(FLAGS_tls_cert_file), absl::GetFlag(FLAGS_tls_key_file)},
          &server);
      !s.ok()) {
    ALOE_LOG_ERROR("export", "%s", s.ToString());
    return 1;
  }
  server.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  absl::StatusOr<aloe::ExportResult> result =
      aloe::ExportModel({.config = absl::GetFlag(FLAGS_config),
                         .checkpoint = absl::GetFlag(FLAGS_checkpoint),
                         .server = server,
                         .version = version,
                         .out = absl::GetFlag(FLAGS_out),
                         .gpt2_names = names == "gpt2",
                         .config_json = absl::GetFlag(FLAGS_config_json)});
  if (!result.ok()) {
    ALOE_LOG_ERROR("export", "%s", result.status().ToString());
    return 1;
  }
  std::printf("exported version %llu of %s: %zu tensors, %llu bytes -> %s\n",
              static_cast<unsigned long long>(result->version), result->source.c_str(),
              result->tensors, static_cast<unsigned long long>(result->bytes),
              absl::GetFlag(FLAGS_out).c_str());
  return 0;
}
