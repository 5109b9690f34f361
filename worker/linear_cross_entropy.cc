#include "worker/linear_cross_entropy.h"

#include <algorithm>
#include <utility>

namespace aloe::worker {
namespace {

// The mean loss over the rows; with a non-null grad_hidden or grad_weight also that gradient of
// it (float32 for the weight, hidden's type for hidden).
torch::Tensor ChunkedLoss(const torch::Tensor& hidden, const torch::Tensor& weight,
                          const torch::Tensor& targets, int64_t chunk_rows,
                          torch::Tensor* grad_hidden, torch::Tensor* grad_weight) {
  const int64_t n = hidden.size(0);
  const double inv_n = 1.0 / static_cast<double>(n);
  const torch::TensorOptions floats = hidden.options().dtype(torch::kFloat32);
  torch::Tensor loss_sum = torch::zeros({}, floats);
  if (grad_hidden != nullptr) *grad_hidden = torch::empty_like(hidden);
  if (grad_weight != nullptr) *grad_weight = torch::zeros(weight.sizes(), floats);
  for (int64_t first = 0; first < n; first += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, n - first);
    const torch::Tensor h = hidden.narrow(0, first, rows);
    const torch::Tensor t = targets.narrow(0, first, rows).unsqueeze(1);
    const torch::Tensor logits = torch::matmul(h, weight.t());  // autocast's precision
    // Log-probabilities in float32, as the unfused loss computes them.
    torch::Tensor log_p = torch::log_softmax(logits, 1, torch::kFloat32);
    const torch::Tensor log_p_target = log_p.gather(1, t);
    loss_sum.sub_(log_p_target.sum());
    if (grad_hidden == nullptr && grad_weight == nullptr) continue;
    // n d loss / d z = softmax(z) - onehot(t), in the logits' precision for the products: one
    // pass from log_p (in place when that is float32). The targets' entries p - 1 are made in
    // float32 first, so a confident prediction keeps its small gradient in 16 bits.
    torch::Tensor g = log_p;
    if (logits.scalar_type() == torch::kFloat32) {
      g.exp_();
    } else {
      g = torch::empty_like(logits);
      at::exp_out(g, log_p);
    }
    g.scatter_(1, t, log_p_target.exp().sub_(1.0).to(g.scalar_type()));
    if (grad_hidden != nullptr) {
      grad_hidden->narrow(0, first, rows).copy_(torch::matmul(g, weight).mul_(inv_n));
    }
    if (grad_weight != nullptr) grad_weight->add_(torch::matmul(g.t(), h), inv_n);
  }
  return loss_sum.mul_(inv_n);
}

class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight, const torch::Tensor& targets,
                               int64_t chunk_rows) {
    // Grad mode is off inside forward: the inputs say which gradients backward will need.
    torch::Tensor grad_hidden, grad_weight;
    torch::Tensor loss = ChunkedLoss(hidden, weight, targets, chunk_rows,
                                     hidden.requires_grad() ? &grad_hidden : nullptr,
                                     weight.requires_grad() ? &grad_weight : nullptr);
    ctx->saved_data["grad_hidden"] = grad_hidden;
    ctx->saved_data["grad_weight"] =
        grad_weight.defined() ? grad_weight.to(weight.scalar_type()) : grad_weight;
    return loss;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    const torch::Tensor& scale = grad_outputs[0];
    torch::Tensor grad_hidden = ctx->saved_data["grad_hidden"].toTensor();
    torch::Tensor grad_weight = ctx->saved_data["grad_weight"].toTensor();
    if (grad_hidden.defined()) grad_hidden = grad_hidden * scale.to(grad_hidden.scalar_type());
    if (grad_weight.defined()) grad_weight = grad_weight * scale.to(grad_weight.scalar_type());
    return {grad_hidden, grad_weight, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor LinearCrossEntropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                 const torch::Tensor& targets, int64_t chunk_rows) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "LinearCrossEntropy: hidden [N, d] and weight [V, d] expected");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0),
              "LinearCrossEntropy: one target per row of hidden expected");
  TORCH_CHECK(hidden.size(0) > 0 && chunk_rows >= 1, "LinearCrossEntropy: no rows or chunk < 1");
  if (!torch::GradMode::is_enabled() || (!hidden.requires_grad() && !weight.requires_grad())) {
    // Evaluation: the loss alone, without the gradients' passes and products.
    return ChunkedLoss(hidden, weight, targets, chunk_rows, nullptr, nullptr);
  }
  return LinearCrossEntropyFunction::apply(hidden, weight, targets, chunk_rows);
}

int64_t LinearCrossEntropyChunkRows(int64_t vocab) {
  constexpr int64_t kChunkElements = int64_t{1} << 26;  // 256 MiB of float32
  return std::max<int64_t>(1, kChunkElements / std::max<int64_t>(1, vocab));
}

}  // namespace aloe::worker
