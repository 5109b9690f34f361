#include "worker/script_model.h"

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "worker/torch_util.h"

namespace aloe::worker {
namespace {

uint32_t IntAttribute(const torch::jit::Module& module, const char* name) {
  if (!module.hasattr(name)) return 0;
  const c10::IValue value = module.attr(name);
  if (!value.isInt() || value.toInt() <= 0 || value.toInt() > UINT32_MAX) return 0;
  return static_cast<uint32_t>(value.toInt());
}

std::string Shape(c10::IntArrayRef sizes) {
  return absl::StrCat("[", absl::StrJoin(sizes, ","), "]");
}

}  // namespace

absl::StatusOr<std::unique_ptr<ScriptModel>> LoadScriptModel(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path, ": no such TorchScript file"));
  }
  auto model = std::make_unique<ScriptModel>();
  model->path = path;
  try {
    model->module = torch::jit::load(path, torch::kCPU);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": not a TorchScript module (save one with torch.jit.script(m).save(path)): ",
        LibTorchError("loading", e).message()));
  }
  try {
    const c10::optional<torch::jit::Method> forward = model->module.find_method("forward");
    if (!forward.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": the module has no forward method"));
    }
    const auto& arguments = forward->function().getSchema().arguments();
    const size_t inputs = arguments.empty() ? 0 : arguments.size() - 1;  // minus self
    if (inputs == 1) {
      model->output = v1::MODEL_OUTPUT_LOGITS;
    } else if (inputs == 2) {
      model->output = v1::MODEL_OUTPUT_LOSS;
    } else {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: forward takes %d arguments; expected forward(inputs) -> logits [B,T,V] or "
          "forward(inputs, targets) -> loss",
          path, inputs));
    }
    for (const auto& p : model->module.named_parameters(/*recurse=*/true)) {
      if (p.value.scalar_type() != torch::kFloat32) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: parameter \"%s\" is %s; ALOE trains float32 parameters", path,
                            p.name, std::string(c10::toString(p.value.scalar_type()))));
      }
      ParameterShape shape;
      shape.name = p.name;
      shape.shape.assign(p.value.sizes().begin(), p.value.sizes().end());
      model->shapes.push_back(std::move(shape));
      model->tensors.push_back(p.value);
    }
    model->vocab_size = IntAttribute(model->module, "vocab_size");
    model->seq_len = IntAttribute(model->module, "seq_len");
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", LibTorchError("inspecting the module", e).message()));
  }
  if (model->shapes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": the module has no parameters"));
  }
  for (v1::LayerSpec& layer : GroupIntoLayers(model->shapes)) {
    *model->architecture.add_layers() = std::move(layer);
  }
  model->architecture.set_output(model->output);
  model->architecture.set_fingerprint(ModelFingerprint(model->architecture));
  return model;
}

torch::Tensor ScriptLoss(ScriptModel& model, const torch::Tensor& tokens, int64_t vocab_size) {
  const int64_t batch = tokens.size(0);
  const int64_t t = tokens.size(1) - 1;
  const torch::Tensor inputs = tokens.slice(1, 0, t).contiguous();
  const torch::Tensor targets = tokens.slice(1, 1, t + 1).contiguous();
  if (model.output == v1::MODEL_OUTPUT_LOSS) {
    const c10::IValue out = model.module.forward({inputs, targets});
    if (!out.isTensor() || out.toTensor().numel() != 1) {
      throw std::runtime_error("forward(inputs, targets) must return the loss as one number");
    }
    return out.toTensor().reshape({});
  }
  const c10::IValue out = model.module.forward({inputs});
  if (!out.isTensor()) throw std::runtime_error("forward(inputs) must return a logits tensor");
  const torch::Tensor logits = out.toTensor();
  if (logits.dim() != 3 || logits.size(0) != batch || logits.size(1) != t ||
      logits.size(2) != vocab_size) {
    throw std::runtime_error(absl::StrFormat(
        "forward(inputs) returned %s logits for inputs [%d,%d]; expected [%d,%d,%d] (vocab_size "
        "%d)",
        Shape(logits.sizes()), batch, t, batch, t, vocab_size, vocab_size));
  }
  return torch::nn::functional::cross_entropy(logits.reshape({-1, vocab_size}),
                                              targets.reshape({-1}));
}

absl::StatusOr<v1::TransformerConfig> ScriptDataShape(uint32_t vocab_size, uint32_t seq_len) {
  if (vocab_size < 2 || seq_len < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "vocab_size must be >= 2 and seq_len >= 1, got %d and %d", vocab_size, seq_len));
  }
  v1::TransformerConfig shape;
  shape.set_vocab_size(vocab_size);
  shape.set_seq_len(seq_len);
  return shape;
}

absl::StatusOr<std::vector<torch::Tensor>> ParametersInSpecOrder(const ScriptModel& model,
                                                                 const v1::ModelSpec& spec) {
  std::vector<torch::Tensor> params;
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < model.shapes.size(); ++i) by_name[model.shapes[i].name] = i;
  size_t matched = 0;
  for (const v1::LayerSpec& layer : spec.layers()) {
    for (const v1::TensorSpec& t : layer.tensors()) {
      auto it = by_name.find(t.name());
      const std::vector<int64_t> want(t.shape().begin(), t.shape().end());
      if (it == by_name.end() || model.shapes[it->second].shape != want) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "%s has no parameter \"%s\" of shape [%s] (server layer \"%s\"); %s", model.path,
            t.name(), absl::StrJoin(want, ","), layer.name(),
            it == by_name.end()
                ? "the module is not the one the server's model was imported from"
                : absl::StrCat("it is [", absl::StrJoin(model.shapes[it->second].shape, ","),
                               "]")));
      }
      params.push_back(model.tensors[it->second]);
      ++matched;
    }
  }
  if (matched != model.shapes.size()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s has %d parameters, the server's model %d: not the module it was imported from",
        model.path, model.shapes.size(), matched));
  }
  return params;
}

absl::Status MoveScriptModel(ScriptModel& model, const torch::Device& device) {
  if (device.is_cpu()) return absl::OkStatus();
  try {
    model.module.to(device);
    model.tensors.clear();
    for (const auto& p : model.module.named_parameters(/*recurse=*/true)) {
      model.tensors.push_back(p.value);
    }
  } catch (const std::exception& e) {
    return LibTorchError(absl::StrCat("moving ", model.path, " to ", device.str()).c_str(), e);
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ImportedModel> ImportScriptModel(ScriptModel& model, uint32_t vocab_size,
                                                    uint32_t seq_len) {
  v1::ImportedModel out = model.architecture;
  out.set_format(kImportedModelFormat);
  out.set_source(std::filesystem::path(model.path).filename().string());
  out.set_vocab_size(vocab_size);
  out.set_seq_len(seq_len);
  if (vocab_size < 2 || seq_len < 1 || seq_len > kMaxImportedSeqLen) {
    return absl::InvalidArgumentError(
        absl::StrFormat("vocab_size must be >= 2 and seq_len in [1, %d]; got %d and %d",
                        kMaxImportedSeqLen, vocab_size, seq_len));
  }
  try {
    torch::NoGradGuard no_grad;
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < model.shapes.size(); ++i) index[model.shapes[i].name] = i;
    for (const v1::LayerSpec& layer : out.layers()) {
      std::string* bytes = out.add_layer_params();
      bytes->reserve(layer.num_elements() * sizeof(float));
      for (const v1::TensorSpec& t : layer.tensors()) {
        const torch::Tensor p =
            model.tensors[index.at(t.name())].detach().to(torch::kCPU).contiguous();
        AppendFloats(absl::MakeConstSpan(p.data_ptr<float>(), p.numel()), bytes);
      }
    }
    // One forward pass on a batch of valid token ids: the module must accept the data.
    const bool training = model.module.is_training();
    model.module.eval();
    const torch::Tensor tokens =
        torch::arange(2 * (static_cast<int64_t>(seq_len) + 1), torch::kInt64)
            .remainder(static_cast<int64_t>(vocab_size))
            .reshape({2, static_cast<int64_t>(seq_len) + 1});
    const double loss = ScriptLoss(model, tokens, vocab_size).item<double>();
    model.module.train(training);
    if (!std::isfinite(loss)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: the loss of a test batch is %g (must be finite)", model.path, loss));
    }
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(model.path, ": a test forward pass on [2, ", seq_len,
                     "] token ids failed: ", LibTorchError("forward", e).message()));
  }
  ALOE_RETURN_IF_ERROR(ValidateImportedModel(out));
  return out;
}

}  // namespace aloe::worker
