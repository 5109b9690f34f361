#include "common/lr_schedule.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/status_matchers.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

// eta_max 1e-3, eta_min 1e-4, t_warmup 10, T 110: the cosine spans t = 10..110.
v1::InnerOptimizerConfig Golden() {
  v1::InnerOptimizerConfig c;
  c.set_lr(1e-3f);
  c.set_min_lr(1e-4f);
  c.set_warmup_steps(10);
  c.set_total_steps(110);
  return c;
}

// The proto fields are float: 1e-3f differs from 1e-3 by ~5e-11, so compare at 1e-9.
constexpr double kTol = 1e-9;

TEST(InnerLearningRateTest, Paper002Eq3GoldenValues) {
  const v1::InnerOptimizerConfig c = Golden();
  EXPECT_NEAR(InnerLearningRate(c, 0), 0.0, kTol);             // warmup starts at 0
  EXPECT_NEAR(InnerLearningRate(c, 5), 5e-4, kTol);            // 5 * 1e-3 / 10
  EXPECT_NEAR(InnerLearningRate(c, 10), 1e-3, kTol);           // r = 0: eta_max
  EXPECT_NEAR(InnerLearningRate(c, 35), 8.68198052e-4, kTol);  // r = .25: 1e-4 + 4.5e-4 * 1.7071
  EXPECT_NEAR(InnerLearningRate(c, 60), 5.5e-4, kTol);         // r = .5: (eta_max + eta_min) / 2
  EXPECT_NEAR(InnerLearningRate(c, 110), 1e-4, kTol);          // r = 1: eta_min
  EXPECT_NEAR(InnerLearningRate(c, 500), 1e-4, kTol);          // clamped past T
}

TEST(InnerLearningRateTest, NoWarmupStartsAtPeak) {
  v1::InnerOptimizerConfig c = Golden();
  c.set_warmup_steps(0);
  c.set_total_steps(100);
  EXPECT_NEAR(InnerLearningRate(c, 0), 1e-3, kTol);
  EXPECT_NEAR(InnerLearningRate(c, 50), 5.5e-4, kTol);
}

TEST(InnerLearningRateTest, TotalNotPastWarmupDecaysInOneStep) {
  // max(T - t_warmup, 1) = 1: eta_max at t_warmup, eta_min from t_warmup + 1.
  v1::InnerOptimizerConfig c = Golden();
  c.set_total_steps(5);
  EXPECT_NEAR(InnerLearningRate(c, 9), 9e-4, kTol);
  EXPECT_NEAR(InnerLearningRate(c, 10), 1e-3, kTol);
  EXPECT_NEAR(InnerLearningRate(c, 11), 1e-4, kTol);
}

TEST(InnerOptimizerConfigTest, FillDefaults) {
  v1::InnerOptimizerConfig c;
  FillInnerOptimizerDefaults(&c);
  EXPECT_FLOAT_EQ(c.lr(), 3e-3f);
  EXPECT_FLOAT_EQ(c.min_lr(), 3e-4f);
  EXPECT_EQ(c.warmup_steps(), 50u);
  EXPECT_EQ(c.total_steps(), 10000u);
  EXPECT_FLOAT_EQ(c.weight_decay(), 0.1f);
  EXPECT_FLOAT_EQ(c.beta1(), 0.9f);
  EXPECT_FLOAT_EQ(c.beta2(), 0.95f);
  EXPECT_FLOAT_EQ(c.eps(), 1e-8f);
  EXPECT_FLOAT_EQ(c.grad_clip(), 1.0f);
  EXPECT_EQ(c.batch_size(), 8u);
  EXPECT_THAT(ValidateInnerOptimizerConfig(c), IsOk());

  v1::InnerOptimizerConfig custom;
  custom.set_lr(1e-2f);
  FillInnerOptimizerDefaults(&custom);
  EXPECT_FLOAT_EQ(custom.min_lr(), 1e-3f);  // lr / 10 of the given lr
}

TEST(InnerOptimizerConfigTest, ValidationNamesTheField) {
  struct Case {
    void (*mutate)(v1::InnerOptimizerConfig*);
    const char* field;
  };
  const Case cases[] = {
      {[](v1::InnerOptimizerConfig* c) { c->set_lr(-1); }, "inner_optimizer.lr"},
      {[](v1::InnerOptimizerConfig* c) { c->set_min_lr(0.5f); }, "inner_optimizer.min_lr"},
      {[](v1::InnerOptimizerConfig* c) { c->set_min_lr(-1e-5f); }, "inner_optimizer.min_lr"},
      {[](v1::InnerOptimizerConfig* c) { c->set_beta1(1.0f); }, "inner_optimizer.beta1"},
      {[](v1::InnerOptimizerConfig* c) { c->set_beta2(-0.1f); }, "inner_optimizer.beta2"},
      {[](v1::InnerOptimizerConfig* c) { c->set_eps(-1); }, "inner_optimizer.eps"},
      {[](v1::InnerOptimizerConfig* c) { c->set_weight_decay(-1); },
       "inner_optimizer.weight_decay"},
      {[](v1::InnerOptimizerConfig* c) { c->set_grad_clip(-1); }, "inner_optimizer.grad_clip"},
  };
  for (const Case& k : cases) {
    v1::InnerOptimizerConfig c;
    FillInnerOptimizerDefaults(&c);
    k.mutate(&c);
    EXPECT_THAT(ValidateInnerOptimizerConfig(c),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(k.field)))
        << k.field;
  }
  v1::InnerOptimizerConfig zero_batch;
  FillInnerOptimizerDefaults(&zero_batch);
  zero_batch.set_batch_size(0);
  EXPECT_THAT(
      ValidateInnerOptimizerConfig(zero_batch),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("inner_optimizer.batch_size")));
}

}  // namespace
}  // namespace aloe
