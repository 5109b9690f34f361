// The decoder-only pre-LN transformer language model that aloe-worker trains, as a LibTorch
// module. Its named_parameters() are exactly the tensors of BuildTransformerSpec
// (common/model_spec.h): same names, shapes and order, so a spec layer's flat buffer maps onto
// consecutive parameters. Works with LibTorch 1.13 (Debian) and 2.x: on 1.13 attention is an
// explicit masked softmax, on 2.x the fused scaled_dot_product_attention (the same function up to
// rounding; FlashAttention on a GPU in bf16).
//
// Includes <torch/torch.h>: include this header only from the few translation units that need
// the module itself (the trainer, the bare-LibTorch benchmark, tests).
#pragma once

#include <torch/torch.h>

#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "proto/aloe.pb.h"

namespace aloe::worker {

// Causal multi-head self-attention: qkv = W_qkv x + b; per head
// softmax(q k^T / sqrt(head_dim) + M) v with M = -inf above the diagonal; out = W_proj y + b.
class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  CausalSelfAttentionImpl(int64_t d_model, int64_t num_heads);
  // x: [B, T, d]; causal_mask: [T, T] bool, true where attention is forbidden (j > i); unused
  // (may be undefined) on LibTorch 2.x, whose fused attention masks by itself.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& causal_mask);

 private:
  int64_t num_heads_;
  int64_t head_dim_;
  torch::nn::Linear qkv_{nullptr};
  torch::nn::Linear proj_{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

// Position-wise MLP: fc2(gelu(fc1(x))), hidden width ffn_mult * d.
class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(int64_t d_model, int64_t hidden);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::Linear fc1_{nullptr};
  torch::nn::Linear fc2_{nullptr};
};
TORCH_MODULE(Mlp);

// Pre-LN block: x = x + attn(ln1(x)); x = x + mlp(ln2(x)).
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t d_model, int64_t num_heads, int64_t hidden);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& causal_mask);

 private:
  torch::nn::LayerNorm ln1_{nullptr};
  CausalSelfAttention attn_{nullptr};
  torch::nn::LayerNorm ln2_{nullptr};
  Mlp mlp_{nullptr};
};
TORCH_MODULE(Block);

// logits = head(ln_f(blocks(tok_emb(tokens) + pos_emb(positions)))). Not thread-safe.
// Precondition: `config` passes ValidateTransformerConfig. The constructor leaves LibTorch's
// default initialisation in place; load InitializeParameters (common/model_spec.h) for the
// spec's initialisation (LocalTrainer does).
class TransformerLMImpl : public torch::nn::Module {
 public:
  explicit TransformerLMImpl(const v1::TransformerConfig& config);

  // tokens: [B, T] int64 with 1 <= T <= seq_len and every id < vocab_size.
  // Returns logits [B, T, vocab_size].
  torch::Tensor forward(const torch::Tensor& tokens);

  // Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1].
  // tokens: [B, T + 1] int64, T <= seq_len. The head and the loss run fused in row chunks
  // (worker/linear_cross_entropy.h) when fused_loss() says so, else as forward() then LibTorch's
  // cross_entropy.
  torch::Tensor Loss(const torch::Tensor& tokens);

  // kAuto (the default): fused on a GPU, where the logits' passes in float32 cost device memory
  // bandwidth, and on the CPU from kFusedLossCpuVocab tokens of vocabulary on, where those
  // passes outgrow the caches (docs/benchmarks.md, worker-bench). The two compute the same loss
  // and gradients to rounding.
  enum class FusedLoss { kAuto, kOn, kOff };
  static constexpr uint32_t kFusedLossCpuVocab = 4096;
  void set_fused_loss(FusedLoss fused) { fused_loss_ = fused; }

  const v1::TransformerConfig& config() const { return config_; }

 private:
  v1::TransformerConfig config_;
  torch::nn::Embedding tok_emb_{nullptr};
  torch::nn::Embedding pos_emb_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  std::vector<Block> block_list_;  // the same modules as blocks_, typed
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
  FusedLoss fused_loss_ = FusedLoss::kAuto;

  // ln_f(blocks(embeddings)): the head's input [B, T, d].
  torch::Tensor Hidden(const torch::Tensor& tokens);
};
TORCH_MODULE(TransformerLM);

// Whether the kernel set by SetAttentionKernel takes a model of `config` on `device` with the
// training steps' attention inputs (bf16 under TrainerAutocastBf16, else float32): runs causal
// attention of the model's head count and size forward and backward once on a few tokens.
// kFailedPrecondition naming the kernel and LibTorch's reason when it cannot (FlashAttention and
// cuDNN take only 16-bit inputs, say); OK at once for kAuto and on LibTorch 1.13.
absl::Status CheckAttentionKernelRuns(const v1::TransformerConfig& config,
                                      const torch::Device& device);

// Returns OK when module.named_parameters() lists exactly the tensors of `spec` in order (names
// and shapes), else kFailedPrecondition naming the first mismatch. Does not throw.
absl::Status CheckParametersMatchSpec(const torch::nn::Module& module, const v1::ModelSpec& spec);

// kInvalidArgument unless `layers` has one buffer per spec layer, each of the layer's size.
absl::Status CheckLayerSizes(const std::vector<std::vector<float>>& layers,
                             const v1::ModelSpec& spec);

// Copies `layers` into `params` (the spec's tensors in spec order), without autograd history.
// kInvalidArgument (nothing copied) when CheckLayerSizes fails; kInternal on a LibTorch error.
// Precondition: params match the spec (CheckParametersMatchSpec or equivalent).
// only: copy just these spec layers (their sizes checked instead; empty = every layer).
absl::Status CopyLayersIntoParameters(const std::vector<std::vector<float>>& layers,
                                      const v1::ModelSpec& spec,
                                      const std::vector<torch::Tensor>& params,
                                      absl::Span<const uint32_t> only = {});

// The reverse: layers[l] = the concatenated values of spec layer l's tensors (params in spec
// order, as CopyLayersIntoParameters takes them). kInternal on a LibTorch error.
// only: just these spec layers (the other entries are left as they are; empty = every layer;
// kInvalidArgument for an id past the spec).
absl::Status CopyParametersIntoLayers(const std::vector<torch::Tensor>& params,
                                      const v1::ModelSpec& spec,
                                      std::vector<std::vector<float>>* layers,
                                      absl::Span<const uint32_t> only = {});

// out[l] = base[l] - the concatenated values of spec layer l's tensors, in float32 (the DiLoCo
// pseudo-gradient), in one pass over parameters in host memory (a GPU's are copied into `out`
// first). kInvalidArgument when `base` does not fit the spec (CheckLayerSizes); kInternal on a
// LibTorch error.
absl::Status PseudoGradientOfParameters(const std::vector<torch::Tensor>& params,
                                        const v1::ModelSpec& spec,
                                        const std::vector<std::vector<float>>& base,
                                        std::vector<std::vector<float>>* out);

// Copies `layers` (one flat float32 buffer per spec layer, tensors concatenated in spec order)
// into the parameters of `module`, without recording autograd history. Returns
// kInvalidArgument when the layer count or a layer's size differs from `spec`, and
// kFailedPrecondition when the module does not match `spec` (CheckParametersMatchSpec); the
// module is unchanged in both cases. Does not throw.
absl::Status LoadParameters(const std::vector<std::vector<float>>& layers,
                            const v1::ModelSpec& spec, torch::nn::Module& module);

}  // namespace aloe::worker
