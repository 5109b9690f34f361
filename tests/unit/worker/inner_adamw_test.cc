#include "worker/inner_adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "common/lr_schedule.h"
#include "worker/step_graph.h"
#include "worker/trainer.h"

namespace aloe::worker {
namespace {

v1::InnerOptimizerConfig Inner() {
  v1::InnerOptimizerConfig c;
  c.set_lr(1e-2f);
  c.set_weight_decay(0.1f);
  FillInnerOptimizerDefaults(&c);
  return c;
}

// Parameters of assorted shapes: matrices (decayed) and vectors (not), one of them large enough
// that LibTorch vectorises its kernels.
// A parameter's state in a LibTorch optimizer: keyed by a string of the parameter's address in
// older LibTorch versions, by the address itself in newer ones.
template <typename Optimizer>
const torch::optim::OptimizerParamState& StateOf(const Optimizer& optimizer,
                                                 const torch::Tensor& p) {
  using Key = typename std::decay_t<decltype(optimizer.state())>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    return *optimizer.state().at(c10::str(p.unsafeGetTensorImpl()));
  } else {
    return *optimizer.state().at(p.unsafeGetTensorImpl());
  }
}

std::vector<torch::Tensor> MakeParams(uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> params;
  for (auto shape : std::vector<std::vector<int64_t>>{{7, 5}, {5}, {64, 33}, {1}, {3, 4, 2}}) {
    params.push_back(torch::randn(shape).requires_grad_(true));
  }
  return params;
}

std::vector<bool> DecayFlags(const std::vector<torch::Tensor>& params) {
  std::vector<bool> decay;
  for (const torch::Tensor& p : params) decay.push_back(p.dim() >= 2);
  return decay;
}

// Gradients of a fixed random quadratic loss: the same for both runs, large enough that the
// clip (max norm 1) acts in early steps and not in late ones. Parameter `skip` (if >= 0) gets
// no gradient in odd steps: it must not step then.
void Backward(const std::vector<torch::Tensor>& params, int step, int skip) {
  torch::Tensor loss = torch::zeros({});
  for (size_t i = 0; i < params.size(); ++i) {
    if (static_cast<int>(i) == skip && step % 2 == 1) continue;
    torch::manual_seed(1000 * step + i);
    const torch::Tensor target =
        torch::randn(params[i].sizes(), params[i].options().requires_grad(false));
    loss = loss + (params[i] - target).square().sum() * (step < 3 ? 4.0 : 0.001);
  }
  loss.backward();
}

std::vector<torch::Tensor> Copies(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const torch::Tensor& t : tensors) out.push_back(t.detach().clone());
  return out;
}

void ExpectBitIdentical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                        const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i], b[i]))
        << what << " " << i << " differs by up to " << (a[i] - b[i]).abs().max().item<double>();
  }
}

// The multi-tensor step against LibTorch's AdamW and clip_grad_norm_, step for step: bit for bit
// on the CPU, for decayed and undecayed parameters, a changing learning rate, a clip that acts
// and one that does not, and a parameter left out of every other step's loss.
TEST(InnerAdamWTest, MatchesLibTorchAdamWAndClipBitForBitOnTheCpu) {
  const v1::InnerOptimizerConfig inner = Inner();
  std::vector<torch::Tensor> mine = MakeParams(7);
  std::vector<torch::Tensor> theirs = MakeParams(7);
  InnerAdamW adam(mine, DecayFlags(mine), inner, AdamWKernel::kForEach);
  const std::unique_ptr<torch::optim::AdamW> owned = LibTorchAdamW(theirs, inner);
  torch::optim::AdamW& reference = *owned;
  const int skip = 1;  // the vector of 5: undecayed, steps only in even steps
  bool clipped = false, unclipped = false;
  for (int step = 0; step < 8; ++step) {
    const double lr = 0.01 * (step + 1) / 8;
    adam.ZeroGrad();
    Backward(mine, step, skip);
    const torch::Tensor clip = GradClipFactor(mine, 1.0);
    (clip.item<double>() < 1 ? clipped : unclipped) = true;
    adam.Step(lr, clip);

    for (torch::Tensor& p : theirs) {
      if (p.mutable_grad().defined()) p.mutable_grad().zero_();  // LibTorch 1.13's zero_grad
    }
    Backward(theirs, step, skip);
    torch::nn::utils::clip_grad_norm_(theirs, 1.0);
    for (auto& group : reference.param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    }
    reference.step();
    ExpectBitIdentical(mine, theirs, "parameter");
  }
  EXPECT_TRUE(clipped && unclipped) << "the test must see the clip act and not act";
  // A zeroed gradient stays defined: the parameter left out of the odd steps' loss still steps
  // there, on a zero gradient, in both.
  EXPECT_EQ(adam.steps(skip), 8);
  for (size_t i = 0; i < adam.size(); ++i) {
    const auto& state =
        static_cast<const torch::optim::AdamWParamState&>(StateOf(reference, theirs[i]));
    EXPECT_EQ(adam.steps(i), state.step()) << "parameter " << i;
    EXPECT_TRUE(torch::equal(adam.exp_avg(i), state.exp_avg())) << "first moment " << i;
    EXPECT_TRUE(torch::equal(adam.exp_avg_sq(i), state.exp_avg_sq())) << "second moment " << i;
  }
}

// A parameter whose gradient was never defined takes no step and keeps zero moments; the others'
// steps are as if it were not there.
TEST(InnerAdamWTest, AParameterWithoutAGradientDoesNotStep) {
  const v1::InnerOptimizerConfig inner = Inner();
  std::vector<torch::Tensor> params = MakeParams(3);
  const torch::Tensor frozen_before = params[2].detach().clone();
  InnerAdamW adam(params, DecayFlags(params), inner, AdamWKernel::kForEach);
  std::vector<torch::Tensor> rest = {params[0], params[1], params[3], params[4]};
  std::vector<torch::Tensor> alone = Copies(rest);
  for (torch::Tensor& t : alone) t.requires_grad_(true);
  InnerAdamW other(alone, DecayFlags(alone), inner, AdamWKernel::kForEach);
  for (int step = 0; step < 3; ++step) {
    adam.ZeroGrad();
    other.ZeroGrad();
    Backward(rest, step, -1);
    Backward(alone, step, -1);
    adam.Step(0.01, torch::Tensor());
    other.Step(0.01, torch::Tensor());
  }
  EXPECT_TRUE(torch::equal(params[2], frozen_before));
  EXPECT_EQ(adam.steps(2), 0);
  EXPECT_EQ(adam.exp_avg(2).abs().sum().item<double>(), 0.0);
  ExpectBitIdentical(Copies(rest), Copies(alone), "parameter");
}

// GradClipFactor is min(1, max_norm / (||g|| + 1e-6)) over all gradients together.
TEST(InnerAdamWTest, ClipFactorIsTheGlobalNormRatio) {
  torch::Tensor a = torch::zeros({2}, torch::requires_grad());
  torch::Tensor b = torch::zeros({1}, torch::requires_grad());
  torch::Tensor c = torch::zeros({3}, torch::requires_grad());
  a.mutable_grad() = torch::tensor({3.0f, 0.0f});
  b.mutable_grad() = torch::tensor({4.0f});  // ||(3, 0, 4)|| = 5; c has no gradient
  EXPECT_NEAR(GradClipFactor({a, b, c}, 1.0).item<double>(), 1.0 / (5 + 1e-6), 1e-7);
  EXPECT_EQ(GradClipFactor({a, b, c}, 10.0).item<double>(), 1.0);
  EXPECT_FALSE(GradClipFactor({c}, 1.0).defined());
  EXPECT_EQ(a.grad()[0].item<float>(), 3.0f) << "the factor must not scale the gradients";
}

TEST(InnerAdamWTest, RestoreSetsMomentsAndStepsAndRefusesWrongShapes) {
  const v1::InnerOptimizerConfig inner = Inner();
  std::vector<torch::Tensor> params = MakeParams(5);
  InnerAdamW adam(params, DecayFlags(params), inner, AdamWKernel::kForEach);
  std::vector<torch::Tensor> first, second;
  for (const torch::Tensor& p : params) {
    first.push_back(torch::full(p.sizes(), 0.5f));
    second.push_back(torch::full(p.sizes(), 0.25f));
  }
  adam.Restore(41, first, second);
  for (size_t i = 0; i < adam.size(); ++i) {
    EXPECT_EQ(adam.steps(i), 41);
    EXPECT_TRUE(torch::equal(adam.exp_avg(i), first[i]));
    EXPECT_TRUE(torch::equal(adam.exp_avg_sq(i), second[i]));
  }
  // The next step uses t = 42 in the bias corrections: with a zero gradient and no decay, a
  // vector parameter moves by lr / (1 - b1^42) * b1 m / (sqrt(b2 v / (1 - b2^42)) + eps).
  const torch::Tensor before = params[1].detach().clone();
  params[1].mutable_grad() = torch::zeros_like(params[1]);
  adam.Step(0.01, torch::Tensor());
  const double b1 = inner.beta1(), b2 = inner.beta2();
  const double expected = 0.01 / (1 - std::pow(b1, 42)) * (b1 * 0.5) /
                          (std::sqrt(b2 * 0.25) / std::sqrt(1 - std::pow(b2, 42)) + inner.eps());
  EXPECT_NEAR((before - params[1]).mean().item<double>(), expected, 1e-6);
  EXPECT_EQ(adam.steps(1), 42);
  EXPECT_EQ(adam.steps(0), 41) << "parameters without a gradient keep their count";

  std::vector<torch::Tensor> wrong = first;
  wrong[2] = torch::zeros({33, 64});
  EXPECT_THROW(adam.Restore(1, wrong, second), std::invalid_argument);
  EXPECT_EQ(adam.steps(2), 41) << "a refused restore changes nothing";
  EXPECT_THROW(InnerAdamW(params, {true}, inner, AdamWKernel::kForEach), std::invalid_argument);
  EXPECT_THROW(InnerAdamW(params, DecayFlags(params), inner, AdamWKernel::kFused),
               std::invalid_argument);
}

// The multi-tensor step takes its learning rate from the host: it cannot be split for a graph.
TEST(InnerAdamWTest, OnlyTheFusedKernelReadsItsLearningRateFromTheDevice) {
  std::vector<torch::Tensor> params = MakeParams(3);
  InnerAdamW adam(params, DecayFlags(params), Inner(), AdamWKernel::kForEach);
  EXPECT_FALSE(adam.capturable());
  EXPECT_THROW(adam.SetLearningRate(0.1), std::logic_error);
  EXPECT_THROW(adam.LaunchStep(torch::Tensor()), std::logic_error);
}

// On a GPU (skipped without one): the fused kernel with the clip folded into its gradient scale
// against the multi-tensor one, over steps where the clip acts and where it does not.
TEST(InnerAdamWTest, FusedKernelOnTheGpuMatchesTheMultiTensorOne) {
  if (VisibleGpus() == 0) GTEST_SKIP() << "no GPU visible to LibTorch";
  const v1::InnerOptimizerConfig inner = Inner();
  std::vector<torch::Tensor> fused = MakeParams(9);
  std::vector<torch::Tensor> foreach = MakeParams(9);
  for (auto* list : {&fused, &foreach}) {
    for (torch::Tensor& p : *list) p = p.detach().to(torch::kCUDA).requires_grad_(true);
  }
  InnerAdamW a(fused, DecayFlags(fused), inner, AdamWKernel::kFused);
  InnerAdamW b(foreach, DecayFlags(foreach), inner, AdamWKernel::kForEach);
  EXPECT_EQ(a.capturable(), CudaGraphsAvailable()) << "the learning rate on the device";
  EXPECT_FALSE(b.capturable());
  for (int step = 0; step < 6; ++step) {
    for (auto [adam, params] : {std::pair{&a, &fused}, std::pair{&b, &foreach}}) {
      adam->ZeroGrad();
      Backward(*params, step, 1);
      adam->Step(0.01, GradClipFactor(*params, 1.0));
    }
  }
  for (size_t i = 0; i < fused.size(); ++i) {
    const double scale = foreach[i].abs().max().item<double>();
    EXPECT_LE((fused[i] - foreach[i]).abs().max().item<double>(), 1e-5 * scale) << i;
    EXPECT_EQ(a.steps(i), b.steps(i));
  }
}

}  // namespace
}  // namespace aloe::worker
