// Bring-your-own models: a TorchScript module (torch.jit.script(...).save(path) in Python)
// trained in place of the built-in transformer. Its forward method is one of
//   forward(inputs: Tensor[B,T] int64, targets: Tensor[B,T] int64) -> Tensor[]  (mean loss)
//   forward(inputs: Tensor[B,T] int64) -> Tensor[B,T,vocab_size]  (logits; the worker takes
//                                                                  the mean cross-entropy)
// chosen by its number of arguments. Every parameter must be float32; buffers (e.g. a causal
// mask) are the module's own and are not synchronised. Dropout follows train()/eval(): on while
// training, off while evaluating. Layers come from the module hierarchy (common/imported_model.h).
//
// Includes <torch/script.h>: only for translation units that need the module itself.
#pragma once

#include <torch/script.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/imported_model.h"
#include "proto/aloe.pb.h"

namespace aloe::worker {

struct ScriptModel {
  std::string path;
  torch::jit::Module module;
  v1::ModelOutput output = v1::MODEL_OUTPUT_UNSPECIFIED;
  std::vector<ParameterShape> shapes;  // named_parameters order
  std::vector<torch::Tensor> tensors;  // the parameters themselves, same order
  // The module's int attributes "vocab_size" and "seq_len" when it has them, else 0.
  uint32_t vocab_size = 0;
  uint32_t seq_len = 0;
  // The architecture as an ImportedModel without parameters, vocab_size or seq_len: layers,
  // output and fingerprint (ModelFingerprint).
  v1::ImportedModel architecture;
};

// Loads and inspects the module at `path`. kNotFound when the file does not exist;
// kInvalidArgument naming the problem when it is not a TorchScript module, has no forward
// method, forward takes other than 1 or 2 tensor arguments, a parameter is not float32, or it
// has no parameters. Does not throw.
absl::StatusOr<std::unique_ptr<ScriptModel>> LoadScriptModel(const std::string& path);

// Mean per-token loss of predicting tokens[:, 1:] from tokens[:, :-1] (tokens: [B, T + 1]
// int64), with autograd when enabled. For a LOGITS model, throws std::runtime_error unless the
// logits are [B, T, vocab_size]; for a LOSS model unless the loss is a single number.
torch::Tensor ScriptLoss(ScriptModel& model, const torch::Tensor& tokens, int64_t vocab_size);

// Moves the module's parameters and buffers to `device` (a no-op for the CPU, where
// LoadScriptModel puts them); model.tensors then hold the moved parameters. kInternal on a
// LibTorch error.
absl::Status MoveScriptModel(ScriptModel& model, const torch::Device& device);

// The data shape a trainer of a module reads (TransformerConfig with vocab_size and seq_len
// only). kInvalidArgument unless vocab_size >= 2 and seq_len >= 1.
absl::StatusOr<v1::TransformerConfig> ScriptDataShape(uint32_t vocab_size, uint32_t seq_len);

// The module's parameter tensors in the order of `spec`'s tensors (matched by name): what a
// trainer steps and copies layers into. kFailedPrecondition naming the parameter when the module
// lacks one of the spec's tensors, has it in another shape, or has parameters the spec lacks
// (it is not the module the server's model was imported from).
absl::StatusOr<std::vector<torch::Tensor>> ParametersInSpecOrder(const ScriptModel& model,
                                                                 const v1::ModelSpec& spec);

// The imported model (common/imported_model.h) of `model` for data of `vocab_size` tokens and
// `seq_len` long sequences, with the module's current parameters as initial parameters. Runs
// one forward pass on a [2, seq_len] batch of token ids (without gradients) and returns
// kInvalidArgument when it fails or its loss is not finite; the result passes
// ValidateImportedModel.
absl::StatusOr<v1::ImportedModel> ImportScriptModel(ScriptModel& model, uint32_t vocab_size,
                                                    uint32_t seq_len);

}  // namespace aloe::worker
