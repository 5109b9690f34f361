// The fused head and loss (worker/linear_cross_entropy.h) against LibTorch's unfused
// linear + cross_entropy: the loss and both gradients, in one chunk and in many, scaled by the
// incoming gradient, without gradients, under bf16 autocast, and through the transformer.
#include "worker/linear_cross_entropy.h"

#include <gtest/gtest.h>

#include <vector>

#include "common/model_spec.h"
#include "common/status_matchers.h"
#include "tests/testing/tiny_transformer.h"
#include "worker/torch_util.h"
#include "worker/trainer.h"
#include "worker/transformer.h"

namespace aloe::worker {
namespace {

using ::aloe::testing::IsOk;

// max |a - b| / max |b|.
double Relative(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max() /
          b.to(torch::kFloat64).abs().max())
      .item<double>();
}

struct Case {
  torch::Tensor hidden, weight, targets;
};

// 37 rows of width 12 over a vocabulary of 23 (rows that no chunk size below divides evenly).
Case MakeCase(torch::Device device = torch::kCPU) {
  torch::manual_seed(3);
  const auto floats = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  return {torch::randn({37, 12}, floats).mul_(2).requires_grad_(true),
          torch::randn({23, 12}, floats).requires_grad_(true),
          torch::randint(0, 23, {37}, torch::TensorOptions().dtype(torch::kInt64).device(device))};
}

// The loss and the two gradients, after backward of `scale` x the loss.
struct Result {
  torch::Tensor loss, grad_hidden, grad_weight;
};

Result Unfused(const Case& c, double scale = 1.0) {
  c.hidden.mutable_grad() = torch::Tensor();
  c.weight.mutable_grad() = torch::Tensor();
  torch::Tensor loss;
  {
    TrainingAutocast autocast;
    loss = torch::nn::functional::cross_entropy(torch::matmul(c.hidden, c.weight.t()), c.targets);
  }
  (loss * scale).backward();
  return {loss.detach(), c.hidden.grad().clone(), c.weight.grad().clone()};
}

Result Fused(const Case& c, int64_t chunk_rows, double scale = 1.0) {
  c.hidden.mutable_grad() = torch::Tensor();
  c.weight.mutable_grad() = torch::Tensor();
  torch::Tensor loss;
  {
    TrainingAutocast autocast;
    loss = LinearCrossEntropy(c.hidden, c.weight, c.targets, chunk_rows);
  }
  (loss * scale).backward();
  return {loss.detach(), c.hidden.grad().clone(), c.weight.grad().clone()};
}

TEST(LinearCrossEntropyTest, MatchesTheUnfusedLossAndGradientsInAnyChunking) {
  const Case c = MakeCase();
  const Result want = Unfused(c);
  EXPECT_GT(want.loss.item<double>(), 1.0);  // far from trained: the gradients are not small
  for (int64_t chunk : {1, 5, 36, 37, 1000}) {
    const Result got = Fused(c, chunk);
    EXPECT_EQ(got.loss.scalar_type(), torch::kFloat32);
    EXPECT_LE(Relative(got.loss, want.loss), 1e-6) << "chunk " << chunk;
    EXPECT_LE(Relative(got.grad_hidden, want.grad_hidden), 1e-5) << "chunk " << chunk;
    EXPECT_LE(Relative(got.grad_weight, want.grad_weight), 1e-5) << "chunk " << chunk;
  }
}

TEST(LinearCrossEntropyTest, ScalesItsGradientsByTheIncomingOne) {
  const Case c = MakeCase();
  const Result want = Unfused(c, -2.5);
  const Result got = Fused(c, 5, -2.5);
  EXPECT_LE(Relative(got.grad_hidden, want.grad_hidden), 1e-5);
  EXPECT_LE(Relative(got.grad_weight, want.grad_weight), 1e-5);
}

TEST(LinearCrossEntropyTest, WithoutGradientsGivesTheLossOnly) {
  const Case c = MakeCase();
  const torch::Tensor want =
      torch::nn::functional::cross_entropy(torch::matmul(c.hidden, c.weight.t()), c.targets);
  torch::NoGradGuard no_grad;
  const torch::Tensor got = LinearCrossEntropy(c.hidden, c.weight, c.targets, 4);
  EXPECT_FALSE(got.requires_grad());
  EXPECT_LE(Relative(got, want), 1e-6);
}

TEST(LinearCrossEntropyTest, RefusesShapesThatDoNotFit) {
  const Case c = MakeCase();
  EXPECT_THROW(LinearCrossEntropy(c.hidden, c.weight.t(), c.targets, 4), c10::Error);
  EXPECT_THROW(LinearCrossEntropy(c.hidden, c.weight, c.targets.narrow(0, 0, 5), 4), c10::Error);
  EXPECT_THROW(LinearCrossEntropy(c.hidden, c.weight, c.targets, 0), c10::Error);
}

// Under bf16 autocast the products run in bf16 as the unfused head's do: the two agree to bf16's
// precision, and differ from the float32 result by more than that.
TEST(LinearCrossEntropyTest, UnderBf16AutocastAgreesWithTheUnfusedHeadToBf16Precision) {
  const Case c = MakeCase();
  const Result float32 = Unfused(c);
  SetTrainerAutocastBf16(true);
  const Result want = Unfused(c);
  const Result got = Fused(c, 5);
  SetTrainerAutocastBf16(false);
  EXPECT_EQ(got.grad_hidden.scalar_type(), torch::kFloat32);
  EXPECT_EQ(got.grad_weight.scalar_type(), torch::kFloat32);
  EXPECT_GT(Relative(want.grad_weight, float32.grad_weight), 1e-4) << "autocast did nothing";
  EXPECT_LE(Relative(got.loss, want.loss), 1e-2);
  EXPECT_LE(Relative(got.grad_hidden, want.grad_hidden), 3e-2);
  EXPECT_LE(Relative(got.grad_weight, want.grad_weight), 3e-2);
}

// The model's loss on `tokens` and then every parameter's gradient, each flat.
std::vector<torch::Tensor> LossAndGradients(TransformerLM& model, const torch::Tensor& tokens,
                                            TransformerLMImpl::FusedLoss fused) {
  model->set_fused_loss(fused);
  model->zero_grad();
  torch::Tensor loss = model->Loss(tokens);
  loss.backward();
  std::vector<torch::Tensor> flat{loss.detach().reshape({1})};
  for (const torch::Tensor& p : model->parameters()) flat.push_back(p.grad().reshape({-1}));
  return flat;
}

// The transformer's loss and every parameter's gradient, fused against unfused.
void ExpectTheModelsLossFusedAsUnfused(torch::Device device, double tolerance) {
  const v1::TransformerConfig config = ::aloe::testing::TinyTransformer();
  TransformerLM model(config);
  ASSERT_THAT(LoadParameters(InitializeParameters(BuildTransformerSpec(config, 2), 4),
                             BuildTransformerSpec(config, 2), *model),
              IsOk());
  model->to(device);
  torch::manual_seed(5);
  const torch::Tensor tokens =
      torch::randint(0, config.vocab_size(), {3, config.seq_len() + 1},
                     torch::TensorOptions().dtype(torch::kInt64).device(device));
  const std::vector<torch::Tensor> want =
      LossAndGradients(model, tokens, TransformerLMImpl::FusedLoss::kOff);
  const std::vector<torch::Tensor> got =
      LossAndGradients(model, tokens, TransformerLMImpl::FusedLoss::kOn);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_LE(Relative(got[i], want[i]), tolerance) << (i == 0 ? "loss" : "parameter ") << i;
  }
}

TEST(LinearCrossEntropyTest, TheTransformersLossFusedAsUnfusedOnTheCpu) {
  ExpectTheModelsLossFusedAsUnfused(torch::kCPU, 1e-5);
}

// kAuto on the CPU: unfused for a small vocabulary, fused from kFusedLossCpuVocab on, to the bit.
TEST(LinearCrossEntropyTest, TheTransformerFusesItsLossOnTheCpuForALargeVocabulary) {
  for (const uint32_t vocab :
       {TransformerLMImpl::kFusedLossCpuVocab - 1, TransformerLMImpl::kFusedLossCpuVocab}) {
    v1::TransformerConfig config;
    config.set_vocab_size(vocab);
    config.set_seq_len(4);
    config.set_d_model(8);
    config.set_num_layers(1);
    config.set_num_heads(2);
    FillTransformerDefaults(&config);
    TransformerLM model(config);
    torch::manual_seed(6);
    const torch::Tensor tokens =
        torch::randint(0, vocab, {3, 5}, torch::TensorOptions().dtype(torch::kInt64));
    // The loss and every gradient, flat. 12 rows: the fused loss's 1 / n is not exact.
    auto run = [&](TransformerLMImpl::FusedLoss fused) {
      return torch::cat(LossAndGradients(model, tokens, fused));
    };
    const torch::Tensor fused = run(TransformerLMImpl::FusedLoss::kOn);
    const torch::Tensor unfused = run(TransformerLMImpl::FusedLoss::kOff);
    const torch::Tensor automatic = run(TransformerLMImpl::FusedLoss::kAuto);
    EXPECT_FALSE(torch::equal(fused, unfused)) << "vocabulary " << vocab << ": no bit differs";
    EXPECT_TRUE(
        torch::equal(automatic, vocab >= TransformerLMImpl::kFusedLossCpuVocab ? fused : unfused))
        << "vocabulary " << vocab;
  }
}

TEST(LinearCrossEntropyTest, TheTransformersLossFusedAsUnfusedOnTheGpu) {
  if (VisibleGpus() == 0) GTEST_SKIP() << "no GPU visible to LibTorch";
  ExpectTheModelsLossFusedAsUnfused(torch::Device(torch::kCUDA, 0), 1e-4);
}

}  // namespace
}  // namespace aloe::worker
