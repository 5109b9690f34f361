#include "worker/trainer.h"

#include <ATen/Parallel.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define ALOE_TEST_HAS_MXCSR 1
#endif

#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/lr_schedule.h"
#include "common/model_spec.h"
#include "common/status_matchers.h"
#include "common/step_times.h"
#include "common/token_source.h"
#include "tests/testing/tiny_transformer.h"
#include "worker/step_graph.h"
#include "worker/torch_util.h"
#include "worker/transformer.h"

namespace aloe::worker {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using Layers = std::vector<std::vector<float>>;

constexpr uint32_t kVocab = ::aloe::testing::kTinyVocab;

v1::TransformerConfig TinyModel() { return ::aloe::testing::TinyTransformer(); }

v1::InnerOptimizerConfig Inner() {
  v1::InnerOptimizerConfig c;
  c.set_lr(1e-2f);
  c.set_warmup_steps(5);
  c.set_total_steps(200);
  c.set_weight_decay(0.01f);
  FillInnerOptimizerDefaults(&c);
  return c;
}

std::unique_ptr<LocalTrainer> MakeTrainer(uint64_t seed = 1) {
  auto trainer =
      LocalTrainer::Create(TinyModel(), Inner(), BuildTransformerSpec(TinyModel(), 2), seed);
  EXPECT_THAT(trainer, IsOk());
  return trainer.ok() ? std::move(trainer).value() : nullptr;
}

// A period-7 token sequence: fully predictable from the context.
InMemoryTokenSource PeriodicTokens(size_t n) {
  const uint32_t pattern[] = {5, 2, 6, 0, 3, 1, 4};
  std::vector<uint32_t> tokens(n);
  for (size_t i = 0; i < n; ++i) tokens[i] = pattern[i % 7];
  return InMemoryTokenSource(std::move(tokens), kVocab);
}

Layers Params(const LocalTrainer& trainer) {
  Layers layers;
  EXPECT_THAT(trainer.GetParameters(&layers), IsOk());
  return layers;
}

// A worker restarted with its saved AdamW state (aloe-worker --state_dir) trains the next round
// as the one that never stopped, bit for bit; one restarted with fresh moments does not.
TEST(LocalTrainerInnerStateTest, ARestoredTrainerGoesOnBitForBitAndAFreshOneDoesNot) {
  const InMemoryTokenSource data = PeriodicTokens(4000);
  std::unique_ptr<LocalTrainer> straight = MakeTrainer();
  ASSERT_THAT(straight->Train(data, 30, /*lr_step=*/0, /*seed=*/1), IsOk());
  absl::StatusOr<InnerState> state = straight->SaveInnerState();
  ASSERT_THAT(state, IsOk());
  EXPECT_EQ(state->steps, 30u);
  const Layers params = Params(*straight);
  ASSERT_EQ(state->first.size(), params.size());
  for (size_t l = 0; l < params.size(); ++l) {
    ASSERT_EQ(state->first[l].size(), params[l].size());
    ASSERT_EQ(state->second[l].size(), params[l].size());
  }
  double second_moment = 0;
  for (const auto& layer : state->second) {
    for (float v : layer) second_moment += v;
  }
  EXPECT_GT(second_moment, 0);

  std::unique_ptr<LocalTrainer> restored = MakeTrainer(/*seed=*/7);
  ASSERT_THAT(restored->SetParameters(params), IsOk());
  ASSERT_THAT(restored->RestoreInnerState(*state), IsOk());
  std::unique_ptr<LocalTrainer> fresh = MakeTrainer(/*seed=*/7);
  ASSERT_THAT(fresh->SetParameters(params), IsOk());

  const auto next = [&](LocalTrainer& t) { return t.Train(data, 10, /*lr_step=*/30, /*seed=*/2); };
  absl::StatusOr<TrainStats> a = next(*straight);
  absl::StatusOr<TrainStats> b = next(*restored);
  absl::StatusOr<TrainStats> c = next(*fresh);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(Params(*restored), Params(*straight));
  EXPECT_EQ(b->mean_loss, a->mean_loss);
  EXPECT_NE(Params(*fresh), Params(*straight));
  std::printf("next round's loss: went on %.4f, restored %.4f, fresh moments %.4f\n", a->mean_loss,
              b->mean_loss, c->mean_loss);
  absl::StatusOr<InnerState> again = restored->SaveInnerState();
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->steps, 40u);
}

TEST(LocalTrainerInnerStateTest, AStateOfTheWrongShapeIsRefusedAndNothingChanges) {
  const InMemoryTokenSource data = PeriodicTokens(2000);
  std::unique_ptr<LocalTrainer> trainer = MakeTrainer();
  ASSERT_THAT(trainer->Train(data, 3, 0, 1), IsOk());
  const InnerState before = trainer->SaveInnerState().value();
  InnerState wrong = before;
  wrong.second.back().pop_back();
  EXPECT_THAT(trainer->RestoreInnerState(wrong),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer")));
  const InnerState after = trainer->SaveInnerState().value();
  EXPECT_EQ(after.steps, before.steps);
  EXPECT_EQ(after.first, before.first);
  EXPECT_EQ(after.second, before.second);
}

TEST(TransformerTest, NamedParametersAreTheSpecTensorsInOrder) {
  const v1::ModelSpec spec = BuildTransformerSpec(TinyModel(), 1);
  TransformerLM model(TinyModel());
  EXPECT_THAT(CheckParametersMatchSpec(*model, spec), IsOk());
  std::vector<std::string> spec_names;
  for (const auto& layer : spec.layers()) {
    for (const auto& t : layer.tensors()) spec_names.push_back(t.name());
  }
  std::vector<std::string> module_names;
  for (const auto& p : model->named_parameters()) module_names.push_back(p.key());
  EXPECT_EQ(module_names, spec_names);
  EXPECT_EQ(module_names.front(), "tok_emb.weight");
  EXPECT_EQ(module_names.back(), "head.weight");

  v1::TransformerConfig deeper = TinyModel();
  deeper.set_num_layers(3);
  EXPECT_THAT(CheckParametersMatchSpec(*model, BuildTransformerSpec(deeper, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("blocks.2.ln1.weight")));
}

TEST(TransformerTest, LossAtInitIsNearLogVocab) {
  TransformerLM model(TinyModel());
  const v1::ModelSpec spec = BuildTransformerSpec(TinyModel(), 1);
  ASSERT_THAT(LoadParameters(InitializeParameters(spec, 3), spec, *model), IsOk());
  torch::Tensor tokens = torch::randint(kVocab, {4, 17}, torch::kInt64);
  const double loss = model->Loss(tokens).item<double>();
  EXPECT_NEAR(loss, std::log(double(kVocab)), 0.1);
}

TEST(TransformerTest, AttentionIsCausal) {
  // Changing a later token must not change the logits of earlier positions.
  TransformerLM model(TinyModel());
  torch::NoGradGuard no_grad;
  torch::Tensor a = torch::randint(kVocab, {1, 10}, torch::kInt64);
  torch::Tensor b = a.clone();
  b[0][7] = (b[0][7].item<int64_t>() + 1) % kVocab;
  torch::Tensor la = model->forward(a);
  torch::Tensor lb = model->forward(b);
  EXPECT_TRUE(torch::allclose(la.narrow(1, 0, 7), lb.narrow(1, 0, 7), 1e-5, 1e-6));
  EXPECT_FALSE(torch::allclose(la.narrow(1, 7, 3), lb.narrow(1, 7, 3)));
}

TEST(LocalTrainerTest, CreateRejectsAMismatchedSpec) {
  v1::TransformerConfig other = TinyModel();
  other.set_d_model(64);
  EXPECT_THAT(LocalTrainer::Create(TinyModel(), Inner(), BuildTransformerSpec(other, 1), 1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("tok_emb.weight")));
  v1::InnerOptimizerConfig bad = Inner();
  bad.set_min_lr(1.0f);
  EXPECT_THAT(LocalTrainer::Create(TinyModel(), bad, BuildTransformerSpec(TinyModel(), 1), 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("inner_optimizer.min_lr")));
}

TEST(LocalTrainerTest, StartsFromSpecInitAndRoundTripsParametersExactly) {
  auto trainer = MakeTrainer(/*seed=*/9);
  ASSERT_NE(trainer, nullptr);
  EXPECT_EQ(Params(*trainer), InitializeParameters(trainer->spec(), 9));
  const Layers other = InitializeParameters(trainer->spec(), 1234);
  ASSERT_THAT(trainer->SetParameters(other), IsOk());
  EXPECT_EQ(Params(*trainer), other);
}

TEST(LocalTrainerTest, SetParametersRejectsWrongShapes) {
  auto trainer = MakeTrainer();
  ASSERT_NE(trainer, nullptr);
  const Layers before = Params(*trainer);
  Layers fewer = before;
  fewer.pop_back();
  EXPECT_THAT(trainer->SetParameters(fewer),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layers")));
  Layers shorter = InitializeParameters(trainer->spec(), 5);
  shorter[1].pop_back();
  EXPECT_THAT(trainer->SetParameters(shorter),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocks.0")));
  EXPECT_EQ(Params(*trainer), before);  // unchanged
  Layers out;
  EXPECT_THAT(trainer->PseudoGradient(fewer, &out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layers")));
}

TEST(LocalTrainerTest, LayersAreReadAndWrittenOneByOne) {
  auto trainer = MakeTrainer(/*seed=*/9);
  ASSERT_NE(trainer, nullptr);
  const Layers before = Params(*trainer);
  const Layers other = InitializeParameters(trainer->spec(), 1234);
  ASSERT_GE(other.size(), 3u);
  // Layers 0 and 2 replaced, the others kept exactly.
  ASSERT_THAT(trainer->SetLayers({0, 2}, other), IsOk());
  const Layers now = Params(*trainer);
  for (size_t l = 0; l < now.size(); ++l) {
    EXPECT_EQ(now[l], l == 0 || l == 2 ? other[l] : before[l]) << "layer " << l;
  }
  // GetLayers fills only the entries named; the rest stay as they were.
  Layers out(now.size(), std::vector<float>{-1.0f});
  ASSERT_THAT(trainer->GetLayers({1}, &out), IsOk());
  EXPECT_EQ(out[1], now[1]);
  EXPECT_EQ(out[0], std::vector<float>{-1.0f});
  // A wrong id or size changes nothing.
  Layers shorter = other;
  shorter[2].pop_back();
  EXPECT_THAT(trainer->SetLayers({2}, shorter),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocks.1")));
  EXPECT_THAT(trainer->SetLayers({99}, other),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 99")));
  EXPECT_THAT(trainer->GetLayers({99}, &out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 99")));
  EXPECT_EQ(Params(*trainer), now);
}

TEST(LocalTrainerTest, PseudoGradientIsBaseMinusEnd) {
  auto trainer = MakeTrainer();
  ASSERT_NE(trainer, nullptr);
  const InMemoryTokenSource data = PeriodicTokens(500);
  const Layers base = Params(*trainer);
  auto stats = trainer->Train(data, 3, /*lr_step=*/10, /*seed=*/7);
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->steps, 3u);
  EXPECT_EQ(stats->tokens, 3u * 8 * 16);
  EXPECT_GT(stats->mean_loss, 0);
  const Layers end = Params(*trainer);
  Layers g;
  ASSERT_THAT(trainer->PseudoGradient(base, &g), IsOk());
  ASSERT_EQ(g.size(), base.size());
  bool any_nonzero = false;
  for (size_t l = 0; l < base.size(); ++l) {
    ASSERT_EQ(g[l].size(), base[l].size());
    for (size_t i = 0; i < base[l].size(); ++i) {
      ASSERT_EQ(g[l][i], base[l][i] - end[l][i]) << "layer " << l << " element " << i;
      any_nonzero |= g[l][i] != 0;
    }
  }
  EXPECT_TRUE(any_nonzero);
  Layers short_base = base;
  short_base[1].pop_back();
  EXPECT_THAT(trainer->PseudoGradient(short_base, &g),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("base: layer 1")));
}

// Raises `flag` once `after` windows have been read (batch size 8: 16 windows = during step 2).
class InterruptingSource final : public TokenSource {
 public:
  InterruptingSource(const TokenSource& inner, std::atomic<bool>& flag, int after)
      : inner_(inner), flag_(flag), after_(after) {}
  uint64_t num_tokens() const override { return inner_.num_tokens(); }
  uint32_t vocab_size() const override { return inner_.vocab_size(); }
  void Read(uint64_t offset, uint64_t count, int64_t* out) const override {
    if (++reads_ >= after_) flag_.store(true);
    inner_.Read(offset, count, out);
  }

 private:
  const TokenSource& inner_;
  std::atomic<bool>& flag_;
  const int after_;
  mutable std::atomic<int> reads_{0};
};

TEST(LocalTrainerTest, InterruptEndsTheRoundAtTheNextStepEnd) {
  auto trainer = MakeTrainer();
  ASSERT_NE(trainer, nullptr);
  const InMemoryTokenSource data = PeriodicTokens(500);
  const Layers base = Params(*trainer);
  std::atomic<bool> stop{true};
  auto none = trainer->Train(data, 5, /*lr_step=*/10, /*seed=*/7, 1.0, 0, &stop);
  ASSERT_THAT(none, IsOk());
  EXPECT_EQ(none->steps, 0u);
  EXPECT_EQ(Params(*trainer), base);  // no step taken

  stop.store(false);
  const InterruptingSource interrupting(data, stop, 16);
  auto two = trainer->Train(interrupting, 5, /*lr_step=*/10, /*seed=*/7, 1.0, 0, &stop);
  ASSERT_THAT(two, IsOk());
  EXPECT_EQ(two->steps, 2u);  // step 2 completes, step 3 never starts
  EXPECT_EQ(two->tokens, 2u * 8 * 16);
  EXPECT_NE(Params(*trainer), base);
}

TEST(LocalTrainerTest, FollowsTheLrScheduleStepByStep) {
  // InnerLearningRate(t = 0) = 0 during warmup: AdamW with lr 0 (decay lr * wd = 0) leaves the
  // parameters bit-identical; at t = 5 (peak) they move.
  auto trainer = MakeTrainer();
  ASSERT_NE(trainer, nullptr);
  const InMemoryTokenSource data = PeriodicTokens(500);
  const Layers base = Params(*trainer);
  ASSERT_THAT(trainer->Train(data, 1, /*lr_step=*/0, /*seed=*/1), IsOk());
  EXPECT_EQ(Params(*trainer), base);
  ASSERT_THAT(trainer->Train(data, 1, /*lr_step=*/5, /*seed=*/1), IsOk());
  EXPECT_NE(Params(*trainer), base);
}

TEST(LocalTrainerTest, AdamWStatePersistsAcrossRounds) {
  const InMemoryTokenSource data = PeriodicTokens(500);
  // Round 1, then the next round from the same base: AdamW moments carry over.
  auto used = MakeTrainer();
  ASSERT_NE(used, nullptr);
  const Layers base = Params(*used);
  ASSERT_THAT(used->Train(data, 5, /*lr_step=*/10, /*seed=*/3), IsOk());
  ASSERT_THAT(used->SetParameters(base), IsOk());
  ASSERT_THAT(used->Train(data, 1, /*lr_step=*/10, /*seed=*/4), IsOk());
  // Two fresh trainers take the same single step: identical to each other (determinism)...
  auto fresh = MakeTrainer();
  auto fresh_again = MakeTrainer();
  ASSERT_NE(fresh, nullptr);
  ASSERT_NE(fresh_again, nullptr);
  ASSERT_THAT(fresh->Train(data, 1, /*lr_step=*/10, /*seed=*/4), IsOk());
  ASSERT_THAT(fresh_again->Train(data, 1, /*lr_step=*/10, /*seed=*/4), IsOk());
  EXPECT_EQ(Params(*fresh), Params(*fresh_again));
  // ...but not to the trainer whose optimizer state survived SetParameters.
  EXPECT_NE(Params(*used), Params(*fresh));
}

TEST(LocalTrainerTest, LossOnAPeriodicSequenceFallsByMoreThanHalf) {
  auto trainer = MakeTrainer();
  ASSERT_NE(trainer, nullptr);
  const InMemoryTokenSource data = PeriodicTokens(2000);
  auto before = trainer->Evaluate(data, 32);
  ASSERT_THAT(before, IsOk());
  uint64_t lr_step = 0;
  double first_round_loss = 0;
  for (int round = 0; round < 3; ++round) {  // 3 rounds x 20 steps, the schedule continuing
    auto stats = trainer->Train(data, 20, lr_step, /*seed=*/100 + round);
    ASSERT_THAT(stats, IsOk());
    if (round == 0) first_round_loss = stats->mean_loss;
    lr_step += stats->steps;
  }
  auto after = trainer->Evaluate(data, 32);
  ASSERT_THAT(after, IsOk());
  RecordProperty("loss_before", std::to_string(*before));
  RecordProperty("loss_after", std::to_string(*after));
  EXPECT_NEAR(*before, std::log(double(kVocab)), 0.2);
  EXPECT_LT(*after, 0.5 * *before)
      << "before " << *before << " after " << *after << " first round mean " << first_round_loss;
}

// --autocast bf16: the forward pass runs its matrix products in bfloat16, so the same round from
// the same start ends at other parameters than in float32 (autocast really is on), yet trains as
// well; the parameters, gradients and AdamW state stay float32.
TEST(LocalTrainerTest, Bf16AutocastTrainsAsWellButNotBitForBit) {
  const InMemoryTokenSource data = PeriodicTokens(2000);
  auto train = [&](bool bf16, double* eval) {
    SetTrainerAutocastBf16(bf16);
    auto trainer = MakeTrainer();
    EXPECT_NE(trainer, nullptr);
    uint64_t lr_step = 0;
    for (int round = 0; round < 3; ++round) {
      auto stats = trainer->Train(data, 20, lr_step, /*seed=*/100 + round);
      EXPECT_THAT(stats, IsOk());
      lr_step += stats->steps;
    }
    SetTrainerAutocastBf16(false);
    auto loss = trainer->Evaluate(data, 32);
    EXPECT_THAT(loss, IsOk());
    *eval = *loss;
    return Params(*trainer);
  };
  double fp32_loss = 0, bf16_loss = 0;
  const Layers fp32 = train(false, &fp32_loss);
  const Layers bf16 = train(true, &bf16_loss);
  EXPECT_FALSE(AutocastEnabled(at::kCPU));  // the thread's state is restored
  ASSERT_EQ(fp32.size(), bf16.size());
  double diff = 0, norm = 0;
  for (size_t l = 0; l < fp32.size(); ++l) {
    ASSERT_EQ(fp32[l].size(), bf16[l].size());
    for (size_t i = 0; i < fp32[l].size(); ++i) {
      diff += std::pow(double(bf16[l][i]) - fp32[l][i], 2);
      norm += std::pow(double(fp32[l][i]), 2);
    }
  }
  const double relative = std::sqrt(diff / norm);
  RecordProperty("bf16_vs_fp32_relative", std::to_string(relative));
  RecordProperty("loss_fp32", std::to_string(fp32_loss));
  RecordProperty("loss_bf16", std::to_string(bf16_loss));
  EXPECT_GT(relative, 1e-4) << "bf16 autocast changed nothing";
  // Both learn the period-7 sequence (ln 16 = 2.77 at start); bf16 within 10% of float32.
  EXPECT_LT(fp32_loss, 0.5 * std::log(double(kVocab)));
  EXPECT_LT(bf16_loss, 0.5 * std::log(double(kVocab)));
  EXPECT_NEAR(bf16_loss, fp32_loss, 0.1 * fp32_loss + 0.02)
      << "fp32 " << fp32_loss << " bf16 " << bf16_loss << " relative " << relative;
}

// --device: the strings it takes; a GPU that this LibTorch build or machine lacks is refused
// naming why, and leaves the device as it was.
TEST(TrainerDeviceTest, TakesCpuCudaAndAutoAndRefusesMissingGpus) {
  ASSERT_THAT(SetTrainerDevice("cpu"), IsOk());
  EXPECT_EQ(*SetTrainerDevice("cpu"), "cpu");
  EXPECT_EQ(TrainerDevice(), "cpu");
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:1x", "CPU", ""}) {
    EXPECT_THAT(SetTrainerDevice(bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr("must be cpu, cuda, cuda:I or auto")))
        << bad;
  }
  const int gpus = VisibleGpus();
  auto automatic = SetTrainerDevice("auto");
  ASSERT_THAT(automatic, IsOk());
  EXPECT_EQ(*automatic, gpus > 0 ? "cuda:0" : "cpu");
  ASSERT_THAT(SetTrainerDevice("cpu"), IsOk());
  const std::string missing = "cuda:" + std::to_string(gpus);
#if defined(ALOE_WITH_TORCH_CUDA)
  const std::string why = gpus > 0 ? "LibTorch sees " + std::to_string(gpus) + " GPU(s)"
                                   : std::string("LibTorch sees no CUDA GPU");
#else
  ASSERT_EQ(gpus, 0);
  const std::string why = "links a CPU-only LibTorch";
#endif
  EXPECT_THAT(SetTrainerDevice(missing),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(why)));
  if (gpus == 0) {
    EXPECT_THAT(SetTrainerDevice("cuda"),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(why)));
  }
  EXPECT_EQ(TrainerDevice(), "cpu");
}

// On a GPU (skipped without one): the same rounds from the same start end where they end on the
// CPU, up to float summation order; bf16 autocast there uses CUDA's autocast (it changes the
// steps) and restores the thread's state.
TEST(LocalTrainerTest, TrainsOnTheGpuAsOnTheCpu) {
  if (VisibleGpus() == 0) GTEST_SKIP() << "no GPU visible to LibTorch";
  const InMemoryTokenSource data = PeriodicTokens(2000);
  auto train = [&](const char* device, bool bf16) {
    EXPECT_THAT(SetTrainerDevice(device), IsOk());
    SetTrainerAutocastBf16(bf16);
    auto trainer = MakeTrainer();
    EXPECT_NE(trainer, nullptr);
    EXPECT_THAT(trainer->Train(data, 5, 0, /*seed=*/100), IsOk());
    SetTrainerAutocastBf16(false);
    EXPECT_THAT(SetTrainerDevice("cpu"), IsOk());
    return Params(*trainer);
  };
  auto relative = [](const Layers& a, const Layers& b) {
    double diff = 0, norm = 0;
    for (size_t l = 0; l < b.size(); ++l) {
      for (size_t i = 0; i < b[l].size(); ++i) {
        diff += std::pow(double(a[l][i]) - b[l][i], 2);
        norm += std::pow(double(b[l][i]), 2);
      }
    }
    return std::sqrt(diff / norm);
  };
  const Layers cpu = train("cpu", false);
  const Layers gpu = train("cuda:0", false);
  const Layers gpu_bf16 = train("cuda:0", true);
  const double error = relative(gpu, cpu);
  std::printf(
      "LocalTrainer GPU vs CPU after 5 steps: relative error %.3g; bf16 vs float32 on "
      "the GPU %.3g\n",
      error, relative(gpu_bf16, gpu));
  EXPECT_LE(error, 1e-4);
  EXPECT_GT(relative(gpu_bf16, gpu), 1e-4) << "bf16 autocast changed nothing on the GPU";
  EXPECT_GT(relative(gpu, InitializeParameters(BuildTransformerSpec(TinyModel(), 2), 1)), 1e-3);
}

// CUDA graphs are for GPUs: on the CPU the setting changes nothing, bit for bit.
TEST(LocalTrainerTest, StepsEagerlyOnTheCpuWhateverTheCudaGraphSetting) {
  const InMemoryTokenSource data = PeriodicTokens(2000);
  auto train = [&](bool graphs) {
    SetTrainerCudaGraphs(graphs);
    auto trainer = MakeTrainer();
    EXPECT_NE(trainer, nullptr);
    EXPECT_THAT(trainer->Train(data, 5, 0, /*seed=*/3), IsOk());
    EXPECT_FALSE(trainer->replays_cuda_graph());
    SetTrainerCudaGraphs(true);
    return Params(*trainer);
  };
  EXPECT_TRUE(TrainerCudaGraphs()) << "on by default";
  EXPECT_EQ(train(true), train(false));
}

// --attention: names in and out; a kernel the device or this LibTorch lacks is refused with
// nothing changed; math (the unfused reference) trains as LibTorch's own choice does.
TEST(LocalTrainerTest, AttentionKernelsAreChosenByNameAndRefusedWhereTheyCannotRun) {
  for (const char* name : {"auto", "flash", "cudnn", "efficient", "math"}) {
    auto kernel = ParseAttentionKernel(name);
    ASSERT_THAT(kernel, IsOk()) << name;
    EXPECT_STREQ(AttentionKernelName(*kernel), name);
  }
  EXPECT_THAT(
      ParseAttentionKernel("fast"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("auto, flash, cudnn, efficient or math"), HasSubstr("\"fast\""))));
  ASSERT_EQ(CurrentAttentionKernel(), AttentionKernel::kAuto) << "LibTorch's choice by default";
  ASSERT_EQ(TrainerDevice(), "cpu");
  // Kernels for GPUs only, or (LibTorch 1.13) no fused attention at all.
  for (const AttentionKernel gpu_only : {AttentionKernel::kCudnn, AttentionKernel::kEfficient}) {
    EXPECT_THAT(SetAttentionKernel(gpu_only), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                       HasSubstr(AttentionKernelName(gpu_only))));
    EXPECT_EQ(CurrentAttentionKernel(), AttentionKernel::kAuto);
  }
#if TORCH_VERSION_MAJOR >= 2
  EXPECT_THAT(SetAttentionKernel(AttentionKernel::kFlash), IsOk()) << "LibTorch 2.x's CPU kernel";
#else
  EXPECT_THAT(SetAttentionKernel(AttentionKernel::kFlash),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no fused attention")));
  EXPECT_EQ(CurrentAttentionKernel(), AttentionKernel::kAuto);
#endif
  const InMemoryTokenSource data = PeriodicTokens(2000);
  auto train = [&](AttentionKernel kernel) {
    EXPECT_THAT(SetAttentionKernel(kernel), IsOk());
    EXPECT_EQ(CurrentAttentionKernel(), kernel);
    auto trainer = MakeTrainer();
    EXPECT_NE(trainer, nullptr);
    EXPECT_THAT(trainer->Train(data, 5, 0, /*seed=*/3), IsOk());
    EXPECT_THAT(SetAttentionKernel(AttentionKernel::kAuto), IsOk());
    return Params(*trainer);
  };
  const Layers automatic = train(AttentionKernel::kAuto);
  const Layers math = train(AttentionKernel::kMath);
  double diff = 0, norm = 0;
  for (size_t l = 0; l < automatic.size(); ++l) {
    for (size_t i = 0; i < automatic[l].size(); ++i) {
      diff += std::pow(double(math[l][i]) - automatic[l][i], 2);
      norm += std::pow(double(automatic[l][i]), 2);
    }
  }
  EXPECT_LE(std::sqrt(diff / norm), 1e-4) << "the same function up to rounding";
  EXPECT_NE(math, InitializeParameters(BuildTransformerSpec(TinyModel(), 2), 1));
}

// On a GPU (skipped without one): every kernel this LibTorch has trains the model as LibTorch's
// own choice does in bf16 autocast (a kernel that saw later tokens, or none, would learn the
// periodic sequence at another pace), and one that cannot take float32 is refused when the
// trainer is created, naming the kernel.
TEST(LocalTrainerTest, EveryAttentionKernelTrainsAlikeOnTheGpu) {
  if (VisibleGpus() == 0) GTEST_SKIP() << "no GPU visible to LibTorch";
  ASSERT_THAT(SetTrainerDevice("cuda:0"), IsOk());
  const InMemoryTokenSource data = PeriodicTokens(4000);
  auto losses = [&](AttentionKernel kernel) -> std::vector<double> {
    std::vector<double> out;
    EXPECT_THAT(SetAttentionKernel(kernel), IsOk()) << AttentionKernelName(kernel);
    SetTrainerAutocastBf16(true);
    auto trainer = MakeTrainer();
    if (trainer != nullptr) {
      for (int round = 0; round < 3; ++round) {
        auto stats = trainer->Train(data, 10, /*lr_step=*/10 * round, /*seed=*/50 + round);
        EXPECT_THAT(stats, IsOk()) << AttentionKernelName(kernel);
        out.push_back(stats.ok() ? stats->mean_loss : 0.0);
      }
    }
    SetTrainerAutocastBf16(false);
    EXPECT_THAT(SetAttentionKernel(AttentionKernel::kAuto), IsOk());
    return out;
  };
  const std::vector<double> automatic = losses(AttentionKernel::kAuto);
  ASSERT_EQ(automatic.size(), 3u);
  EXPECT_LT(automatic[2], 0.8 * automatic[0]) << "the periodic tokens are learned";
  for (const AttentionKernel kernel : {AttentionKernel::kFlash, AttentionKernel::kCudnn,
                                       AttentionKernel::kEfficient, AttentionKernel::kMath}) {
    if (kernel == AttentionKernel::kCudnn && !SetAttentionKernel(kernel).ok()) {
      std::printf("attention kernel cudnn: not in this LibTorch\n");
      continue;
    }
    const std::vector<double> got = losses(kernel);
    ASSERT_EQ(got.size(), 3u) << AttentionKernelName(kernel);
    std::printf("attention kernel %s: round losses %.4f %.4f %.4f (auto %.4f %.4f %.4f)\n",
                AttentionKernelName(kernel), got[0], got[1], got[2], automatic[0], automatic[1],
                automatic[2]);
    for (size_t r = 0; r < got.size(); ++r) {
      EXPECT_NEAR(got[r], automatic[r], 0.03 * automatic[r]) << AttentionKernelName(kernel);
    }
  }
  // FlashAttention takes 16-bit inputs only: float32 training is refused up front.
  ASSERT_THAT(SetAttentionKernel(AttentionKernel::kFlash), IsOk());
  EXPECT_THAT(
      LocalTrainer::Create(TinyModel(), Inner(), BuildTransformerSpec(TinyModel(), 2), 1),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("attention kernel flash cannot run 2 heads of 16 on cuda:0 in Float")));
  EXPECT_THAT(SetAttentionKernel(AttentionKernel::kAuto), IsOk());
  EXPECT_THAT(SetTrainerDevice("cpu"), IsOk());
}

// On a GPU (skipped without one): steps replayed from a CUDA graph (worker/step_graph.h) end
// where eager steps end, in float32 and in bf16 autocast, across two Train calls with the
// learning rate changing every step and parameters set in place between them; both count the
// same AdamW steps and report the same losses.
TEST(LocalTrainerTest, CudaGraphStepsMatchEagerStepsOnTheGpu) {
  if (VisibleGpus() == 0) GTEST_SKIP() << "no GPU visible to LibTorch";
  ASSERT_TRUE(CudaGraphsAvailable()) << "a CUDA LibTorch without CUDA graphs";
  const InMemoryTokenSource data = PeriodicTokens(4000);
  const Layers restart = InitializeParameters(BuildTransformerSpec(TinyModel(), 2), 9);
  for (const bool bf16 : {false, true}) {
    auto train = [&](bool graphs, std::vector<double>* losses) {
      EXPECT_THAT(SetTrainerDevice("cuda:0"), IsOk());
      SetTrainerAutocastBf16(bf16);
      SetTrainerCudaGraphs(graphs);
      auto trainer = MakeTrainer();
      EXPECT_NE(trainer, nullptr);
      // 3 eager steps, the capture, 2 replays; then 4 more replays from other parameters.
      auto first = trainer->Train(data, 6, /*lr_step=*/0, /*seed=*/100);
      EXPECT_THAT(first, IsOk());
      EXPECT_EQ(trainer->replays_cuda_graph(), graphs);
      EXPECT_THAT(trainer->SetParameters(restart), IsOk());
      auto second = trainer->Train(data, 4, /*lr_step=*/6, /*seed=*/101);
      EXPECT_THAT(second, IsOk());
      if (first.ok() && second.ok()) *losses = {first->mean_loss, second->mean_loss};
      auto state = trainer->SaveInnerState();
      EXPECT_THAT(state, IsOk());
      if (state.ok()) {
        EXPECT_EQ(state->steps, 10u);
      }
      SetTrainerCudaGraphs(true);
      SetTrainerAutocastBf16(false);
      EXPECT_THAT(SetTrainerDevice("cpu"), IsOk());
      return Params(*trainer);
    };
    std::vector<double> graph_losses, eager_losses;
    const Layers graphed = train(true, &graph_losses);
    const Layers eager = train(false, &eager_losses);
    double diff = 0, norm = 0;
    for (size_t l = 0; l < eager.size(); ++l) {
      for (size_t i = 0; i < eager[l].size(); ++i) {
        diff += std::pow(double(graphed[l][i]) - eager[l][i], 2);
        norm += std::pow(double(eager[l][i]), 2);
      }
    }
    std::printf("CUDA graph vs eager steps (%s): relative difference %.3g\n",
                bf16 ? "bf16" : "float32", std::sqrt(diff / norm));
    // The same kernels either way, but the fused attention's backward may sum in another order
    // from run to run; a graph that replayed a stale batch or learning rate would miss by far more.
    const double tolerance = bf16 ? 1e-4 : 1e-5;
    EXPECT_LE(std::sqrt(diff / norm), tolerance) << (bf16 ? "bf16" : "float32");
    ASSERT_EQ(graph_losses.size(), 2u);
    ASSERT_EQ(eager_losses.size(), 2u);
    for (size_t r = 0; r < 2; ++r) {
      EXPECT_NEAR(graph_losses[r], eager_losses[r], tolerance * std::abs(eager_losses[r])) << r;
    }
    EXPECT_NE(graphed, InitializeParameters(BuildTransformerSpec(TinyModel(), 2), 1));
  }
}

TEST(LocalTrainerTest, EvaluateIsDeterministicAndChangesNothing) {
  auto trainer = MakeTrainer();
  ASSERT_NE(trainer, nullptr);
  const InMemoryTokenSource data = PeriodicTokens(1000);
  ASSERT_THAT(trainer->Train(data, 2, 10, 1), IsOk());
  const Layers params = Params(*trainer);
  auto a = trainer->Evaluate(data, 20);  // 20 windows: batches of 8, 8, 4
  auto b = trainer->Evaluate(data, 20);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(Params(*trainer), params);
  // Another trainer with the same parameters measures the same loss.
  auto other = MakeTrainer(/*seed=*/77);
  ASSERT_NE(other, nullptr);
  ASSERT_THAT(other->SetParameters(params), IsOk());
  auto c = other->Evaluate(data, 20);
  ASSERT_THAT(c, IsOk());
  EXPECT_DOUBLE_EQ(*a, *c);
  // Capped by the data: 1000 / 17 = 58 windows at most.
  auto all = trainer->Evaluate(data, 1000);
  auto capped = trainer->Evaluate(data, 58);
  ASSERT_THAT(all, IsOk());
  ASSERT_THAT(capped, IsOk());
  EXPECT_EQ(*all, *capped);
}

TEST(LocalTrainerTest, RejectsBadData) {
  auto trainer = MakeTrainer();
  ASSERT_NE(trainer, nullptr);
  const InMemoryTokenSource tiny = PeriodicTokens(16);  // < seq_len + 1
  EXPECT_THAT(trainer->Train(tiny, 1, 0, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("17")));
  EXPECT_THAT(trainer->Evaluate(tiny, 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("seq_len")));
  const InMemoryTokenSource out_of_vocab(std::vector<uint32_t>(100, kVocab), kVocab + 1);
  EXPECT_THAT(trainer->Train(out_of_vocab, 1, 0, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vocabulary")));
  EXPECT_THAT(trainer->Evaluate(out_of_vocab, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vocabulary")));
  const InMemoryTokenSource ok = PeriodicTokens(100);
  EXPECT_THAT(trainer->Train(ok, 1, 0, 1, /*slowdown=*/0.5),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slowdown")));
}

TEST(LocalTrainerTest, SlowdownKeepsComputeSecondsAndResults) {
  const InMemoryTokenSource data = PeriodicTokens(300);
  auto normal = MakeTrainer();
  auto slowed = MakeTrainer();
  ASSERT_NE(normal, nullptr);
  ASSERT_NE(slowed, nullptr);
  auto a = normal->Train(data, 2, 10, 5);
  auto b = slowed->Train(data, 2, 10, 5, /*slowdown=*/1.5);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(a->steps, b->steps);
  EXPECT_EQ(a->mean_loss, b->mean_loss);
  EXPECT_GT(b->compute_seconds, 0);
  EXPECT_EQ(Params(*normal), Params(*slowed));
}

TEST(LocalTrainerTest, StepTraceSlowsEachStepByItsFactorAcrossRounds) {
  const InMemoryTokenSource data = PeriodicTokens(300);
  auto normal = MakeTrainer();
  auto traced = MakeTrainer();
  ASSERT_NE(normal, nullptr);
  ASSERT_NE(traced, nullptr);
  // One worker alternating 0.1 s and 4 s steps: factors 1 and 40.
  auto trace = ParseTrace("0,0.1\n0,4\n", "t");
  ASSERT_THAT(trace, IsOk());
  auto slowdowns = StepSlowdowns::ForWorker(*trace, 0);
  ASSERT_THAT(slowdowns, IsOk());
  traced->SetStepSlowdowns(*slowdowns);
  for (int round = 0; round < 2; ++round) {
    ASSERT_THAT(normal->Train(data, 1, round, 5), IsOk());
    const auto t0 = std::chrono::steady_clock::now();
    auto stats = traced->Train(data, 1, round, 5);
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_THAT(stats, IsOk());
    if (round == 1) {
      // The second step (the cycle continues into the next round) sleeps 39 x its compute.
      EXPECT_GE(wall, 40 * stats->compute_seconds);
    }
  }
  EXPECT_EQ(Params(*normal), Params(*traced));  // pacing never changes the arithmetic
}

TEST(LocalTrainerTest, ZeroStepsIsANoOp) {
  auto trainer = MakeTrainer();
  ASSERT_NE(trainer, nullptr);
  const InMemoryTokenSource data = PeriodicTokens(100);
  const Layers before = Params(*trainer);
  auto stats = trainer->Train(data, 0, 0, 1);
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->steps, 0u);
  EXPECT_EQ(stats->tokens, 0u);
  EXPECT_EQ(Params(*trainer), before);
}

}  // namespace
}  // namespace aloe::worker

namespace aloe::worker {
namespace {

TEST(LocalTrainerTest, TimeBudgetEndsTheRoundAtTheFirstStepEndAfterIt) {
  auto trainer = MakeTrainer();
  const InMemoryTokenSource data = PeriodicTokens(500);
  const auto start = std::chrono::steady_clock::now();
  auto stats = trainer->Train(data, /*steps=*/1000000, /*lr_step=*/0, /*seed=*/3,
                              /*slowdown=*/1.0, /*time_budget_seconds=*/0.2);
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GE(stats->steps, 1u);
  EXPECT_LT(stats->steps, 1000000u);  // the budget, not the cap, ended the round
  EXPECT_GE(elapsed, 0.2);
  EXPECT_FALSE(trainer->Train(data, 1, 0, 3, 1.0, -1.0).ok());
}

#ifdef ALOE_TEST_HAS_MXCSR
constexpr unsigned kFlushToZero = 0x8000;       // MXCSR bit 15
constexpr unsigned kDenormalsAreZero = 0x0040;  // MXCSR bit 6
#endif

// Flush-to-zero and denormals-are-zero are per-thread CPU state: a thread that trains sets them
// on itself and on the intra-op threads it computes with, including pool threads that existed
// before without them. Read back from the MXCSR of every such thread.
TEST(LocalTrainerTest, TrainingThreadAndItsIntraOpThreadsFlushDenormals) {
#ifndef ALOE_TEST_HAS_MXCSR
  GTEST_SKIP() << "the MXCSR is x86 state";
#else
  constexpr int kThreads = 2;
  unsigned trainer_csr = 0;
  std::vector<unsigned> pool_csr(kThreads, 0);
  int pool_size = 0;
  std::thread thread([&] {
    // A fresh thread with both modes off, and a pool that already runs without them.
    _mm_setcsr(_mm_getcsr() & ~(kFlushToZero | kDenormalsAreZero));
    torch::set_num_threads(kThreads);
    at::parallel_for(0, kThreads, 1, [](int64_t, int64_t) {
      _mm_setcsr(_mm_getcsr() & ~(kFlushToZero | kDenormalsAreZero));
    });
    SetTrainerThreads(kThreads);
    std::unique_ptr<LocalTrainer> trainer = MakeTrainer();
    const InMemoryTokenSource data = PeriodicTokens(500);
    ASSERT_THAT(trainer->Train(data, 1, 0, 3), IsOk());
    trainer_csr = _mm_getcsr();
    pool_size = at::get_num_threads();
    at::parallel_for(0, kThreads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) pool_csr[i] = _mm_getcsr();
    });
  });
  thread.join();
  SetTrainerThreads(1);
  EXPECT_EQ(pool_size, kThreads);
  EXPECT_EQ(trainer_csr & kFlushToZero, kFlushToZero);
  EXPECT_EQ(trainer_csr & kDenormalsAreZero, kDenormalsAreZero);
  for (unsigned csr : pool_csr) {
    EXPECT_EQ(csr & (kFlushToZero | kDenormalsAreZero), kFlushToZero | kDenormalsAreZero);
  }
#endif
}

// A corpus of another tokenizer (here GPT-2's 50257 ids) against a model of 16 is refused
// before training, naming both sizes; a model vocabulary larger than the data's is fine.
TEST(LocalTrainerTest, RefusesDataOfALargerVocabularyThanTheModel) {
  auto trainer = MakeTrainer();
  ASSERT_NE(trainer, nullptr);
  const InMemoryTokenSource gpt2_data(std::vector<uint32_t>(64, 3), 50257);
  EXPECT_THAT(
      trainer->Train(gpt2_data, 1, /*lr_step=*/0, /*seed=*/1),
      StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("vocabulary of 50257 token ids"),
                                                         HasSubstr("model's vocab_size is 16"))));
  EXPECT_THAT(trainer->Evaluate(gpt2_data, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("50257")));
  const InMemoryTokenSource byte_data(std::vector<uint32_t>(64, 3), 8);
  EXPECT_THAT(trainer->Train(byte_data, 1, /*lr_step=*/0, /*seed=*/1), IsOk());
}

}  // namespace
}  // namespace aloe::worker
