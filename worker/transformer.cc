#include "worker/transformer.h"

#include <torch/version.h>

#include <atomic>
#include <cmath>
#include <exception>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "worker/linear_cross_entropy.h"
#include "worker/torch_util.h"
#include "worker/trainer.h"

// LibTorch 2.x has fused attention (scaled_dot_product_attention); Debian's LibTorch 1.13 runs
// the three-step form.
#if TORCH_VERSION_MAJOR >= 2
#define ALOE_FUSED_ATTENTION 1
#else
#define ALOE_FUSED_ATTENTION 0
#endif
// cuDNN's fused attention is one of them from LibTorch 2.4 on.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define ALOE_CUDNN_ATTENTION 1
#else
#define ALOE_CUDNN_ATTENTION 0
#endif

namespace aloe::worker {
namespace {

template <typename Shape>
std::string ShapeString(const Shape& shape) {
  return absl::StrFormat("[%s]", absl::StrJoin(shape.begin(), shape.end(), ","));
}

constexpr std::pair<AttentionKernel, const char*> kAttentionKernels[] = {
    {AttentionKernel::kAuto, "auto"},   {AttentionKernel::kFlash, "flash"},
    {AttentionKernel::kCudnn, "cudnn"}, {AttentionKernel::kEfficient, "efficient"},
    {AttentionKernel::kMath, "math"},
};

std::atomic<AttentionKernel> g_attention{AttentionKernel::kAuto};

}  // namespace

absl::StatusOr<AttentionKernel> ParseAttentionKernel(const std::string& name) {
  for (const auto& [kernel, known] : kAttentionKernels) {
    if (name == known) return kernel;
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "attention kernel must be auto, flash, cudnn, efficient or math, got \"%s\"", name));
}

const char* AttentionKernelName(AttentionKernel kernel) {
  for (const auto& [known, name] : kAttentionKernels) {
    if (kernel == known) return name;
  }
  return "unknown";
}

absl::Status SetAttentionKernel(AttentionKernel kernel) {
  const char* name = AttentionKernelName(kernel);
#if !ALOE_FUSED_ATTENTION
  if (kernel != AttentionKernel::kAuto && kernel != AttentionKernel::kMath) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "attention kernel %s: LibTorch %d.%d has no fused attention (it runs the unfused form: "
        "auto or math); build against LibTorch 2.x",
        name, TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR));
  }
#else
  if (!ALOE_CUDNN_ATTENTION && kernel == AttentionKernel::kCudnn) {
    return absl::FailedPreconditionError(
        absl::StrFormat("attention kernel cudnn needs LibTorch >= 2.4; this one is %d.%d",
                        TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR));
  }
  const torch::Device device = TrainingDevice();
  if ((kernel == AttentionKernel::kCudnn || kernel == AttentionKernel::kEfficient) &&
      !device.is_cuda()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "attention kernel %s runs on a GPU; the training device is %s", name, device.str()));
  }
  try {
    const bool all = kernel == AttentionKernel::kAuto;
    at::Context& context = at::globalContext();
    context.setSDPUseFlash(all || kernel == AttentionKernel::kFlash);
    context.setSDPUseMemEfficient(all || kernel == AttentionKernel::kEfficient);
    context.setSDPUseMath(all || kernel == AttentionKernel::kMath);
#if ALOE_CUDNN_ATTENTION
    context.setSDPUseCuDNN(all || kernel == AttentionKernel::kCudnn);
#endif
  } catch (const std::exception& e) {
    return LibTorchError("choosing the attention kernel", e);
  }
#endif
  g_attention.store(kernel, std::memory_order_relaxed);
  return absl::OkStatus();
}

AttentionKernel CurrentAttentionKernel() { return g_attention.load(std::memory_order_relaxed); }

absl::Status CheckAttentionKernelRuns(const v1::TransformerConfig& config,
                                      const torch::Device& device) {
  const AttentionKernel kernel = CurrentAttentionKernel();
  if (!ALOE_FUSED_ATTENTION || kernel == AttentionKernel::kAuto) return absl::OkStatus();
#if ALOE_FUSED_ATTENTION
  const torch::ScalarType dtype = TrainerAutocastBf16() ? torch::kBFloat16 : torch::kFloat32;
  const int64_t heads = config.num_heads();
  const int64_t head_dim = config.d_model() / heads;
  try {
    torch::AutoGradMode grad(true);
    // The layout of CausalSelfAttentionImpl::forward's q, k and v: views of one [B, T, 3, H,
    // head_dim] projection. Constant values: the probe draws nothing from LibTorch's generators.
    const torch::Tensor projected =
        torch::full({1, 8, 3, heads, head_dim}, 0.5, torch::TensorOptions().device(device))
            .to(dtype)
            .set_requires_grad(true);
    const torch::Tensor qkv = projected.permute({2, 0, 3, 1, 4});
    at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], /*attn_mask=*/{},
                                     /*dropout_p=*/0.0, /*is_causal=*/true)
        .sum()
        .backward();
  } catch (const std::exception& e) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "attention kernel %s cannot run %d heads of %d on %s in %s: %s",
        AttentionKernelName(kernel), heads, head_dim, device.str(), c10::toString(dtype),
        LibTorchError("scaled_dot_product_attention", e).message()));
  }
#endif
  return absl::OkStatus();
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(int64_t d_model, int64_t num_heads)
    : num_heads_(num_heads), head_dim_(d_model / num_heads) {
  // Registration order fixes named_parameters() order: qkv.{weight,bias}, proj.{weight,bias}.
  qkv_ = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
  proj_ = register_module("proj", torch::nn::Linear(d_model, d_model));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x,
                                               const torch::Tensor& causal_mask) {
  const int64_t batch = x.size(0);
  const int64_t time = x.size(1);
  const int64_t d_model = x.size(2);
  // [B, T, 3d] -> [3, B, H, T, head_dim]
  torch::Tensor qkv =
      qkv_(x).view({batch, time, 3, num_heads_, head_dim_}).permute({2, 0, 3, 1, 4});
#if ALOE_FUSED_ATTENTION
  // softmax(q k^T / sqrt(head_dim) + causal mask) v in one fused kernel that never materialises
  // the T x T scores (FlashAttention on a GPU in bf16): the same function up to rounding.
  torch::Tensor y = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], /*attn_mask=*/{},
                                                     /*dropout_p=*/0.0, /*is_causal=*/true);
#else
  // The 1/sqrt(head_dim) scale is applied to q (T x head_dim) rather than to the scores (T x T).
  torch::Tensor q = qkv[0] * (1.0 / std::sqrt(static_cast<double>(head_dim_)));
  torch::Tensor k = qkv[1];
  torch::Tensor v = qkv[2];
  torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1));  // [B, H, T, T]
  scores = scores.masked_fill(causal_mask, -std::numeric_limits<float>::infinity());
  torch::Tensor y = torch::matmul(torch::softmax(scores, -1), v);  // [B, H, T, head_dim]
#endif
  y = y.transpose(1, 2).reshape({batch, time, d_model});
  return proj_(y);
}

MlpImpl::MlpImpl(int64_t d_model, int64_t hidden) {
  fc1_ = register_module("fc1", torch::nn::Linear(d_model, hidden));
  fc2_ = register_module("fc2", torch::nn::Linear(hidden, d_model));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) { return fc2_(torch::gelu(fc1_(x))); }

BlockImpl::BlockImpl(int64_t d_model, int64_t num_heads, int64_t hidden) {
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  attn_ = register_module("attn", CausalSelfAttention(d_model, num_heads));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  mlp_ = register_module("mlp", Mlp(d_model, hidden));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& causal_mask) {
  torch::Tensor h = x + attn_(ln1_(x), causal_mask);
  return h + mlp_(ln2_(h));
}

TransformerLMImpl::TransformerLMImpl(const v1::TransformerConfig& config) : config_(config) {
  const int64_t vocab = config.vocab_size();
  const int64_t d = config.d_model();
  const int64_t hidden = static_cast<int64_t>(config.ffn_mult()) * d;
  tok_emb_ = register_module("tok_emb", torch::nn::Embedding(vocab, d));
  pos_emb_ = register_module("pos_emb", torch::nn::Embedding(config.seq_len(), d));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (uint32_t i = 0; i < config.num_layers(); ++i) {
    block_list_.push_back(Block(d, config.num_heads(), hidden));
    blocks_->push_back(block_list_.back());
  }
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  head_ =
      register_module("head", torch::nn::Linear(torch::nn::LinearOptions(d, vocab).bias(false)));
}

torch::Tensor TransformerLMImpl::forward(const torch::Tensor& tokens) {
  return head_(Hidden(tokens));
}

torch::Tensor TransformerLMImpl::Hidden(const torch::Tensor& tokens) {
  const int64_t time = tokens.size(1);
  torch::Tensor positions =
      torch::arange(time, torch::TensorOptions().dtype(torch::kInt64).device(tokens.device()));
  torch::Tensor x = tok_emb_(tokens) + pos_emb_(positions);
#if ALOE_FUSED_ATTENTION
  const torch::Tensor causal_mask;  // the fused attention masks by itself
#else
  const torch::Tensor causal_mask =
      torch::ones({time, time}, torch::TensorOptions().dtype(torch::kBool).device(tokens.device()))
          .triu(1);
#endif
  for (Block& block : block_list_) x = block(x, causal_mask);
  return ln_f_(x);
}

torch::Tensor TransformerLMImpl::Loss(const torch::Tensor& tokens) {
  const int64_t time = tokens.size(1) - 1;
  torch::Tensor targets = tokens.narrow(1, 1, time).reshape({-1});
  const bool fused = fused_loss_ == FusedLoss::kOn ||
                     (fused_loss_ == FusedLoss::kAuto &&
                      (tokens.is_cuda() || config_.vocab_size() >= kFusedLossCpuVocab));
  if (fused) {
    const torch::Tensor hidden = Hidden(tokens.narrow(1, 0, time));
    return LinearCrossEntropy(hidden.reshape({-1, hidden.size(-1)}), head_->weight, targets,
                              LinearCrossEntropyChunkRows(config_.vocab_size()));
  }
  torch::Tensor logits = forward(tokens.narrow(1, 0, time));
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets);
}

absl::Status CheckParametersMatchSpec(const torch::nn::Module& module, const v1::ModelSpec& spec) {
  try {
    const auto params = module.named_parameters(/*recurse=*/true);
    size_t index = 0;
    for (const v1::LayerSpec& layer : spec.layers()) {
      for (const v1::TensorSpec& t : layer.tensors()) {
        if (index >= params.size()) {
          return absl::FailedPreconditionError(absl::StrFormat(
              "model has %d parameters but spec layer \"%s\" expects tensor \"%s\" %s",
              params.size(), layer.name(), t.name(), ShapeString(t.shape())));
        }
        const auto& p = params[index];
        const std::vector<int64_t> want(t.shape().begin(), t.shape().end());
        if (p.key() != t.name() || p.value().sizes() != c10::IntArrayRef(want)) {
          return absl::FailedPreconditionError(absl::StrFormat(
              "model parameter %d is \"%s\" %s but spec layer \"%s\" expects \"%s\" %s", index,
              p.key(), ShapeString(p.value().sizes()), layer.name(), t.name(), ShapeString(want)));
        }
        if (p.value().scalar_type() != torch::kFloat32) {
          return absl::FailedPreconditionError(
              absl::StrFormat("model parameter \"%s\" is not float32", p.key()));
        }
        ++index;
      }
    }
    if (index != params.size()) {
      return absl::FailedPreconditionError(
          absl::StrFormat("model parameter %d \"%s\" is not in the spec (spec has %d tensors)",
                          index, params[index].key(), index));
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrFormat("checking model parameters: %s", e.what()));
  }
  return absl::OkStatus();
}

absl::Status CheckLayerSizes(const std::vector<std::vector<float>>& layers,
                             const v1::ModelSpec& spec) {
  if (layers.size() != static_cast<size_t>(spec.layers_size())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("got %d layers, the model spec has %d", layers.size(), spec.layers_size()));
  }
  for (int l = 0; l < spec.layers_size(); ++l) {
    if (layers[l].size() != spec.layers(l).num_elements()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("layer %d \"%s\" has %d elements, the model spec has %d", l,
                          spec.layers(l).name(), layers[l].size(), spec.layers(l).num_elements()));
    }
  }
  return absl::OkStatus();
}

namespace {

// The index in `params` (spec order) of each spec layer's first tensor.
std::vector<size_t> FirstTensorOfLayers(const v1::ModelSpec& spec) {
  std::vector<size_t> first(spec.layers_size());
  size_t index = 0;
  for (int l = 0; l < spec.layers_size(); ++l) {
    first[l] = index;
    index += spec.layers(l).tensors_size();
  }
  return first;
}

// `only`, or every spec layer when empty; kInvalidArgument for an id past the spec.
absl::StatusOr<std::vector<uint32_t>> LayersToCopy(const v1::ModelSpec& spec,
                                                   absl::Span<const uint32_t> only) {
  std::vector<uint32_t> ids(only.begin(), only.end());
  if (ids.empty()) {
    for (int l = 0; l < spec.layers_size(); ++l) ids.push_back(static_cast<uint32_t>(l));
  }
  for (uint32_t l : ids) {
    if (l >= static_cast<uint32_t>(spec.layers_size())) {
      return absl::InvalidArgumentError(
          absl::StrFormat("layer %d: the model spec has %d layers", l, spec.layers_size()));
    }
  }
  return ids;
}

}  // namespace

absl::Status CopyLayersIntoParameters(const std::vector<std::vector<float>>& layers,
                                      const v1::ModelSpec& spec,
                                      const std::vector<torch::Tensor>& params,
                                      absl::Span<const uint32_t> only) {
  if (only.empty()) ALOE_RETURN_IF_ERROR(CheckLayerSizes(layers, spec));
  ALOE_ASSIGN_OR_RETURN(const std::vector<uint32_t> ids, LayersToCopy(spec, only));
  for (uint32_t l : ids) {
    if (l >= layers.size() || layers[l].size() != spec.layers(l).num_elements()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "layer %d \"%s\" has %d elements, the model spec has %d", l, spec.layers(l).name(),
          l < layers.size() ? layers[l].size() : 0, spec.layers(l).num_elements()));
    }
  }
  const std::vector<size_t> first = FirstTensorOfLayers(spec);
  try {
    torch::NoGradGuard no_grad;
    for (uint32_t l : ids) {
      // from_blob does not copy or write: the const_cast only satisfies its signature.
      float* data = const_cast<float*>(layers[l].data());
      int64_t offset = 0;
      for (int t = 0; t < spec.layers(l).tensors_size(); ++t) {
        const torch::Tensor& p = params[first[l] + t];
        p.copy_(torch::from_blob(data + offset, p.sizes(), torch::kFloat32));
        offset += p.numel();
      }
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrFormat("loading parameters: %s", e.what()));
  }
  return absl::OkStatus();
}

absl::Status LoadParameters(const std::vector<std::vector<float>>& layers,
                            const v1::ModelSpec& spec, torch::nn::Module& module) {
  ALOE_RETURN_IF_ERROR(CheckLayerSizes(layers, spec));
  ALOE_RETURN_IF_ERROR(CheckParametersMatchSpec(module, spec));
  try {
    return CopyLayersIntoParameters(layers, spec, module.parameters(/*recurse=*/true));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrFormat("loading parameters: %s", e.what()));
  }
}

namespace {

// Writes each spec layer of `ids` into (*layers)[l] (resized), one tensor at a time: a flat
// host view of the tensor's place in the buffer is handed to `write(param, view, l, offset)`.
template <typename Write>
absl::Status WriteLayers(const std::vector<torch::Tensor>& params, const v1::ModelSpec& spec,
                         const std::vector<uint32_t>& ids, std::vector<std::vector<float>>* layers,
                         const char* what, Write write) {
  const std::vector<size_t> first = FirstTensorOfLayers(spec);
  try {
    torch::NoGradGuard no_grad;
    layers->resize(spec.layers_size());
    for (uint32_t l : ids) {
      std::vector<float>& out = (*layers)[l];
      out.resize(spec.layers(l).num_elements());
      int64_t offset = 0;
      for (int t = 0; t < spec.layers(l).tensors_size(); ++t) {
        const torch::Tensor p = params[first[l] + t].detach().reshape({-1});
        torch::Tensor view = torch::from_blob(out.data() + offset, {p.numel()}, torch::kFloat32);
        write(p, view, l, offset);
        offset += p.numel();
      }
    }
  } catch (const std::exception& e) {
    return LibTorchError(what, e);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CopyParametersIntoLayers(const std::vector<torch::Tensor>& params,
                                      const v1::ModelSpec& spec,
                                      std::vector<std::vector<float>>* layers,
                                      absl::Span<const uint32_t> only) {
  ALOE_ASSIGN_OR_RETURN(const std::vector<uint32_t> ids, LayersToCopy(spec, only));
  // Straight into the buffer: from a GPU, one copy to the host and no second one.
  return WriteLayers(
      params, spec, ids, layers, "reading parameters",
      [](const torch::Tensor& p, torch::Tensor& view, uint32_t, int64_t) { view.copy_(p); });
}

absl::Status PseudoGradientOfParameters(const std::vector<torch::Tensor>& params,
                                        const v1::ModelSpec& spec,
                                        const std::vector<std::vector<float>>& base,
                                        std::vector<std::vector<float>>* out) {
  if (absl::Status fits = CheckLayerSizes(base, spec); !fits.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("base: ", fits.message()));
  }
  ALOE_ASSIGN_OR_RETURN(const std::vector<uint32_t> ids, LayersToCopy(spec, {}));
  return WriteLayers(
      params, spec, ids, out, "computing the pseudo-gradient",
      [&base](const torch::Tensor& p, torch::Tensor& view, uint32_t l, int64_t offset) {
        // from_blob does not write through `from`: the const_cast only satisfies its signature.
        const torch::Tensor from = torch::from_blob(const_cast<float*>(base[l].data()) + offset,
                                                    {p.numel()}, torch::kFloat32);
        if (p.is_cpu()) {
          at::sub_out(view, from, p);  // one pass: base and parameters in, the difference out
        } else {
          view.copy_(p);
          at::sub_out(view, from, view);
        }
      });
}

}  // namespace aloe::worker
