// aloe-import-model: turns a TorchScript module into the imported-model file that aloe-server
// trains (ServerConfig.model_file): its layers, grouped from the module hierarchy, and its
// current parameters as version 0. The server never links LibTorch; workers load the same
// TorchScript file with aloe-worker --torchscript.
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/flags_usage.h"
#include "common/imported_model.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/script_model.h"

ABSL_FLAG(std::string, torchscript, "", "The TorchScript module to import (required)");
ABSL_FLAG(std::string, out, "", "The imported-model file to write (required)");
ABSL_FLAG(int32_t, vocab_size, 0,
          "Token ids are < vocab_size (default: the module's int attribute vocab_size)");
ABSL_FLAG(int32_t, seq_len, 0,
          "Tokens per training sequence (default: the module's int attribute seq_len)");

namespace aloe::worker {
namespace {

absl::Status Main() {
  const std::string in = absl::GetFlag(FLAGS_torchscript);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (in.empty() || out.empty()) {
    return absl::InvalidArgumentError("--torchscript and --out are required (see --help)");
  }
  if (absl::GetFlag(FLAGS_vocab_size) < 0 || absl::GetFlag(FLAGS_seq_len) < 0) {
    return absl::InvalidArgumentError("--vocab_size and --seq_len must be >= 0");
  }
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<ScriptModel> model, LoadScriptModel(in));
  uint32_t vocab = absl::GetFlag(FLAGS_vocab_size);
  uint32_t seq = absl::GetFlag(FLAGS_seq_len);
  if (vocab == 0) vocab = model->vocab_size;
  if (seq == 0) seq = model->seq_len;
  if (vocab == 0 || seq == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        in,
        ": set --vocab_size and --seq_len, or give the module int attributes vocab_size "
        "and seq_len"));
  }
  ALOE_ASSIGN_OR_RETURN(v1::ImportedModel imported, ImportScriptModel(*model, vocab, seq));
  ALOE_RETURN_IF_ERROR(WriteImportedModel(out, imported));
  uint64_t total = 0;
  for (const v1::LayerSpec& layer : imported.layers()) {
    std::printf("  layer %-24s %12llu parameters  (%d tensors)\n", layer.name().c_str(),
                static_cast<unsigned long long>(layer.num_elements()), layer.tensors_size());
    total += layer.num_elements();
  }
  std::printf(
      "imported %s -> %s: %d layers, %llu parameters, output %s, vocab_size %u, seq_len %u, "
      "fingerprint %s\n",
      in.c_str(), out.c_str(), imported.layers_size(), static_cast<unsigned long long>(total),
      v1::ModelOutput_Name(imported.output()).c_str(), vocab, seq, imported.fingerprint().c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace aloe::worker

int main(int argc, char** argv) {
  aloe::SetUsage(
      "aloe-import-model --torchscript model.pt --out model.aloemodel [--vocab_size V] "
      "[--seq_len T]\n"
      "Imports a bring-your-own TorchScript model for aloe-server (config: model_file). Its\n"
      "forward(inputs [B,T] int64) returns logits [B,T,V], or forward(inputs, targets) returns\n"
      "the mean loss. Layers: one per top-level submodule; children of a ModuleList or\n"
      "Sequential are layers of their own. The module's current parameters become version 0.\n"
      "Train it with aloe-worker --torchscript model.pt.");
  absl::ParseCommandLine(argc, argv);
  absl::Status status = aloe::worker::Main();
  if (!status.ok()) {
    ALOE_LOG_ERROR("import", "%s", status.ToString());
    return 1;
  }
  return 0;
}
