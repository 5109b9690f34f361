// The round boundary kept on the trainer's device (TensorRoundBoundary, through
// LocalTrainer::device_round_boundary) against the host one (HostRoundBoundary) over the same
// trainer, as overlapped rounds drive them: the next start staged and the pseudo-gradient taken
// on another thread while the trainer trains. On the CPU here, on a GPU where there is one.
#include "worker/round_boundary.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "common/lr_schedule.h"
#include "common/model_spec.h"
#include "common/status_matchers.h"
#include "common/token_source.h"
#include "tests/testing/tiny_transformer.h"
#include "worker/tensor_round_boundary.h"
#include "worker/trainer.h"
#include "worker/transformer.h"

namespace aloe::worker {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;
using Layers = std::vector<std::vector<float>>;

constexpr uint32_t kVocab = ::aloe::testing::kTinyVocab;
constexpr float kEager = -0.7f;  // an eager start's scale (-outer lr)

v1::TransformerConfig TinyModel() { return ::aloe::testing::TinyTransformer(); }

v1::ModelSpec Spec() { return BuildTransformerSpec(TinyModel(), 2); }

std::unique_ptr<LocalTrainer> MakeTrainer() {
  v1::InnerOptimizerConfig inner;
  inner.set_lr(1e-2f);
  inner.set_warmup_steps(2);
  inner.set_total_steps(100);
  FillInnerOptimizerDefaults(&inner);
  auto trainer = LocalTrainer::Create(TinyModel(), inner, Spec(), /*seed=*/1);
  EXPECT_THAT(trainer, IsOk());
  return trainer.ok() ? std::move(trainer).value() : nullptr;
}

InMemoryTokenSource Tokens() {
  std::vector<uint32_t> tokens(3000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = (i * 7 + i / 5) % kVocab;
  return InMemoryTokenSource(std::move(tokens), kVocab);
}

Layers Params(const LocalTrainer& trainer) {
  Layers layers;
  EXPECT_THAT(trainer.GetParameters(&layers), IsOk());
  return layers;
}

// What two overlapped rounds saw: the parameters at round 1's end, its pseudo-gradient, round
// 2's eager start and round 2's pseudo-gradient.
struct TwoRounds {
  Layers end1, delta1, start2, delta2;
};

// Round 1 from A; B staged on another thread while round 1 trains; round 2 from
// B + kEager * delta1; delta1 taken on another thread while round 2 trains.
TwoRounds RunTwoRounds(const std::string& device, bool on_device) {
  TwoRounds seen;
  EXPECT_THAT(SetTrainerDevice(device), IsOk());
  std::unique_ptr<LocalTrainer> trainer = MakeTrainer();
  if (trainer == nullptr) return seen;
  HostRoundBoundary host(trainer.get());
  RoundBoundary* boundary = on_device ? trainer->device_round_boundary() : &host;
  EXPECT_NE(boundary, nullptr);
  if (boundary == nullptr) return seen;
  const InMemoryTokenSource data = Tokens();
  EXPECT_THAT(boundary->StageStart(InitializeParameters(Spec(), 5)), IsOk());
  EXPECT_THAT(boundary->StartStaged(0), IsOk());
  std::future<absl::Status> staged = std::async(
      std::launch::async, [&] { return boundary->StageStart(InitializeParameters(Spec(), 6)); });
  EXPECT_THAT(trainer->Train(data, 3, 0, /*seed=*/11), IsOk());
  EXPECT_THAT(staged.get(), IsOk());
  EXPECT_THAT(boundary->EndRound(), IsOk());
  seen.end1 = Params(*trainer);
  EXPECT_THAT(boundary->StartStaged(kEager), IsOk());
  seen.start2 = Params(*trainer);
  std::future<absl::Status> taken =
      std::async(std::launch::async, [&] { return boundary->TakePseudoGradient(&seen.delta1); });
  EXPECT_THAT(trainer->Train(data, 3, 3, /*seed=*/12), IsOk());
  EXPECT_THAT(taken.get(), IsOk());
  EXPECT_THAT(boundary->EndRound(), IsOk());
  EXPECT_THAT(boundary->TakePseudoGradient(&seen.delta2), IsOk());
  EXPECT_THAT(SetTrainerDevice("cpu"), IsOk());
  return seen;
}

// max |a - b| / max(1, |b|) over every element; infinity when the shapes differ.
double MaxRelativeDifference(const Layers& a, const Layers& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (size_t l = 0; l < a.size(); ++l) {
    if (a[l].size() != b[l].size()) return INFINITY;
    for (size_t i = 0; i < a[l].size(); ++i) {
      worst = std::max(
          worst, std::abs(double(a[l][i]) - b[l][i]) / std::max(1.0, std::abs(double(b[l][i]))));
    }
  }
  return worst;
}

// The boundary's arithmetic, computed here in double from what the round saw.
void ExpectTheRoundsFormulas(const TwoRounds& seen) {
  const Layers a = InitializeParameters(Spec(), 5);
  const Layers b = InitializeParameters(Spec(), 6);
  Layers delta1 = a, start2 = b;
  double moved = 0;
  for (size_t l = 0; l < a.size(); ++l) {
    for (size_t i = 0; i < a[l].size(); ++i) {
      delta1[l][i] = static_cast<float>(double(a[l][i]) - seen.end1[l][i]);
      start2[l][i] = static_cast<float>(double(b[l][i]) + double(kEager) * seen.delta1[l][i]);
      moved = std::max(moved, std::abs(double(delta1[l][i])));
    }
  }
  EXPECT_GT(moved, 1e-3) << "round 1 did not train";
  // One float subtraction: exact to the last bit.
  EXPECT_EQ(seen.delta1, delta1);
  // One multiply-add, fused or not: within an ulp or two.
  EXPECT_LE(MaxRelativeDifference(seen.start2, start2), 4e-7);
  // Round 2 trained too, from the eager start.
  Layers zeros = seen.delta2;
  for (std::vector<float>& layer : zeros) std::fill(layer.begin(), layer.end(), 0.0f);
  EXPECT_GT(MaxRelativeDifference(seen.delta2, zeros), 1e-3);
}

// Through each boundary on `device`: the formulas hold and the two agree (the eager start
// within an ulp or two, round 2's pseudo-gradient within `delta2_tolerance`).
void ExpectTheDeviceBoundaryAsTheHostOne(const std::string& device, double delta2_tolerance) {
  const TwoRounds on_device = RunTwoRounds(device, /*on_device=*/true);
  const TwoRounds host = RunTwoRounds(device, /*on_device=*/false);
  ExpectTheRoundsFormulas(on_device);
  ExpectTheRoundsFormulas(host);
  EXPECT_EQ(on_device.end1, host.end1);
  EXPECT_EQ(on_device.delta1, host.delta1);
  EXPECT_LE(MaxRelativeDifference(on_device.start2, host.start2), 4e-7);
  EXPECT_LE(MaxRelativeDifference(on_device.delta2, host.delta2), delta2_tolerance);
}

TEST(RoundBoundaryTest, OnTheDeviceAsOnTheHostOnTheCpu) {
  ExpectTheDeviceBoundaryAsTheHostOne("cpu", 1e-5);
}

TEST(RoundBoundaryTest, OnTheGpuAsOnTheHost) {
  if (VisibleGpus() == 0) GTEST_SKIP() << "no GPU visible to LibTorch";
  ExpectTheDeviceBoundaryAsTheHostOne("cuda:0", 1e-4);
}

// Calls out of order are refused and change nothing.
TEST(RoundBoundaryTest, RefusesCallsOutOfOrderAndStartsThatDoNotFit) {
  std::unique_ptr<LocalTrainer> trainer = MakeTrainer();
  ASSERT_NE(trainer, nullptr);
  RoundBoundary* boundary = trainer->device_round_boundary();
  ASSERT_NE(boundary, nullptr);
  EXPECT_EQ(trainer->device_round_boundary(), boundary);  // made once
  const Layers before = Params(*trainer);
  Layers out;
  EXPECT_THAT(boundary->StartStaged(0),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_THAT(boundary->EndRound(), StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_THAT(boundary->TakePseudoGradient(&out),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  const Layers a = InitializeParameters(Spec(), 5);
  Layers short_layer = a;
  short_layer[1].pop_back();
  EXPECT_THAT(boundary->StageStart(short_layer),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  ASSERT_THAT(boundary->StageStart(a), IsOk());
  EXPECT_THAT(boundary->StageStart(Layers(a.begin(), a.end() - 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  // No pseudo-gradient yet: no eager start, and the staged one is kept.
  EXPECT_THAT(boundary->StartStaged(kEager),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("pseudo-gradient")));
  EXPECT_EQ(Params(*trainer), before);
  ASSERT_THAT(boundary->StartStaged(0), IsOk());
  EXPECT_EQ(Params(*trainer), a);  // the start staged before the refused one
  EXPECT_THAT(boundary->StartStaged(0),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  ASSERT_THAT(boundary->EndRound(), IsOk());
  ASSERT_THAT(boundary->TakePseudoGradient(&out), IsOk());
  ASSERT_EQ(out.size(), a.size());
  for (size_t l = 0; l < out.size(); ++l) {
    ASSERT_EQ(out[l].size(), a[l].size());
    for (float x : out[l]) ASSERT_EQ(x, 0.0f);  // nothing trained: base - base
  }
  EXPECT_THAT(boundary->TakePseudoGradient(&out),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
}

TEST(RoundBoundaryTest, TheHostBoundaryRefusesTheSameCalls) {
  std::unique_ptr<LocalTrainer> trainer = MakeTrainer();
  ASSERT_NE(trainer, nullptr);
  HostRoundBoundary boundary(trainer.get());
  Layers out;
  EXPECT_THAT(boundary.StartStaged(0),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_THAT(boundary.EndRound(), StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_THAT(boundary.TakePseudoGradient(&out),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  const Layers a = InitializeParameters(Spec(), 5);
  ASSERT_THAT(boundary.StageStart(a), IsOk());
  EXPECT_THAT(boundary.StartStaged(kEager),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  ASSERT_THAT(boundary.StartStaged(0), IsOk());
  EXPECT_EQ(Params(*trainer), a);
  ASSERT_THAT(boundary.EndRound(), IsOk());
  ASSERT_THAT(boundary.TakePseudoGradient(&out), IsOk());
  EXPECT_THAT(boundary.TakePseudoGradient(&out),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  // A start that does not fit the trainer is refused by StartStaged.
  Layers short_layer = a;
  short_layer[0].pop_back();
  ASSERT_THAT(boundary.StageStart(short_layer), IsOk());
  EXPECT_THAT(boundary.StartStaged(0), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_EQ(Params(*trainer), a);
}

}  // namespace
}  // namespace aloe::worker
