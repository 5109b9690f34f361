// aloe-export: a version of a job's global model as safetensors (tools/export.h).
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "tools/export.h"

ABSL_FLAG(std::string, config, "", "The job's server config (its model)");
ABSL_FLAG(std::string, checkpoint, "",
          "A one-process server's checkpoint file, or its checkpoint directory (the newest whole "
          "checkpoint there)");
ABSL_FLAG(std::string, out, "model.safetensors", "The safetensors file to write");
ABSL_FLAG(std::string, names, "gpt2",
          "gpt2: the built-in transformer's tensors under GPT-2-style names (nanoGPT's GPT "
          "module: transformer.h.0.attn.c_attn.weight, ...); spec: the model spec's names");
ABSL_FLAG(std::string, config_json, "",
          "Also write a config.json of the built-in transformer here (GPT-2-style keys)");

int main(int argc, char** argv) {
  aloe::SetUsage(
      "aloe-export --config SERVER.textproto --checkpoint DIR|FILE [--out model.safetensors]\n"
      "Writes the global model of a job's checkpoint as a safetensors file (float32), which\n"
      "PyTorch (safetensors.torch.load_file) and nanoGPT-style code read; ServerConfig.init_file\n"
      "starts a job from such a file.");
  absl::ParseCommandLine(argc, argv);
  const std::string names = absl::GetFlag(FLAGS_names);
  if (names != "gpt2" && names != "spec") {
    ALOE_LOG_ERROR("export", "--names must be gpt2 or spec, got \"%s\"", names);
    return 1;
  }
  absl::StatusOr<aloe::ExportResult> result =
      aloe::ExportModel({.config = absl::GetFlag(FLAGS_config),
                         .checkpoint = absl::GetFlag(FLAGS_checkpoint),
                         .out = absl::GetFlag(FLAGS_out),
                         .gpt2_names = names == "gpt2",
                         .config_json = absl::GetFlag(FLAGS_config_json)});
  if (!result.ok()) {
    ALOE_LOG_ERROR("export", "%s", result.status().ToString());
    return 1;
  }
  std::printf("exported version %llu of %s: %zu tensors, %llu bytes -> %s\n",
              static_cast<unsigned long long>(result->version), result->checkpoint.c_str(),
              result->tensors, static_cast<unsigned long long>(result->bytes),
              absl::GetFlag(FLAGS_out).c_str());
  return 0;
}
