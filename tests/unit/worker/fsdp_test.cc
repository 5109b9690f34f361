// FSDP over Gloo with ranks as threads of this process (multi-rank tests spawn ranks
// as threads): the collectives' exact results, and the sharded trainer against LocalTrainer
// (LibTorch's own AdamW) and against itself on fewer ranks.
#include "worker/fsdp.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/low_rank.h"
#include "common/low_rank_fsdp.h"
#include "common/lr_schedule.h"
#include "common/model_spec.h"
#include "common/status_matchers.h"
#include "common/token_source.h"
#include "tests/testing/tiny_transformer.h"
#include "worker/trainer.h"

namespace aloe::worker {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;
using Layers = std::vector<std::vector<float>>;

// Runs fn(collectives) on `size` threads, rank r on thread r, over a fresh Gloo group.
void RunRanks(int size, const std::function<void(Collectives&)>& fn) {
  static std::atomic<int> groups{0};
  const std::string store = ::testing::TempDir() + "/aloe_fsdp_" + std::to_string(::getpid()) +
                            "_" + std::to_string(groups++);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto collectives = ConnectGloo(store, r, size, /*timeout_seconds=*/30);
      ASSERT_THAT(collectives, IsOk());
      fn(**collectives);
    });
  }
  for (std::thread& t : threads) t.join();
  std::remove(store.c_str());
}

TEST(GlooCollectivesTest, AllGatherReduceScatterAndAllReduceOverThreeRanks) {
  constexpr size_t n = 5;
  RunRanks(3, [](Collectives& c) {
    const int r = c.rank();
    std::vector<float> shard(n);
    for (size_t i = 0; i < n; ++i) shard[i] = 10.0f * r + i;
    std::vector<float> full(3 * n, -1);
    ASSERT_THAT(c.AllGather(shard.data(), n, full.data()), IsOk());
    for (int q = 0; q < 3; ++q) {
      for (size_t i = 0; i < n; ++i) EXPECT_EQ(full[q * n + i], 10.0f * q + i);
    }
    // Rank q contributes (q + 1) * j at position j; rank r receives its chunk summed:
    // sum_q (q + 1) * (r * n + i) = 6 * (r * n + i).
    std::vector<float> contribution(3 * n);
    for (size_t j = 0; j < 3 * n; ++j) contribution[j] = static_cast<float>((r + 1) * j);
    std::vector<float> mine(n, -1);
    ASSERT_THAT(c.ReduceScatterSum(contribution.data(), n, mine.data()), IsOk());
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(mine[i], 6.0f * (r * n + i)) << "rank " << r;
    auto sum = c.AllReduceSum(r + 0.5);
    ASSERT_THAT(sum, IsOk());
    EXPECT_EQ(*sum, 4.5);
    // Element i: sum_q (q + 1) * (i + 0.25) = 6 * (i + 0.25), exact in float.
    std::vector<float> floats(n);
    for (size_t i = 0; i < n; ++i) floats[i] = (r + 1) * (i + 0.25f);
    ASSERT_THAT(c.AllReduceSumFloats(floats.data(), n), IsOk());
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(floats[i], 6 * (i + 0.25f)) << "rank " << r;
    std::string message = r == 1 ? std::string("task\0bytes\xff", 11) : "stale";
    ASSERT_THAT(c.Broadcast(&message, /*root=*/1), IsOk());
    EXPECT_EQ(message, std::string("task\0bytes\xff", 11)) << "rank " << r;
    std::string empty = r == 0 ? "" : "not yet";
    ASSERT_THAT(c.Broadcast(&empty, /*root=*/0), IsOk());
    EXPECT_EQ(empty, "");
  });
}

// The tensor forms the trainer calls: over Gloo they take flat float32 host tensors (the CPU
// trainer's buffers) and refuse anything else by name.
// The low-rank factors of a node's push over Gloo (common/low_rank_fsdp.h): the all-reduce leaves
// the same bits on every rank, so every rank orthonormalises the same P and keeps the same Q, and
// they are one rank's factors up to the all-reduce's summation order.
TEST(GlooCollectivesTest, LowRankFactorsOfSlicesAreTheSameOnEveryRankAndOneRanks) {
  constexpr uint32_t kRows = 64, kCols = 48, kRank = 4;
  std::vector<float> m(kRows * kCols);
  for (size_t i = 0; i < m.size(); ++i) {
    const size_t row = i / kCols, col = i % kCols;
    m[i] = std::sin(0.1f * row * (col % 7 + 1)) + 0.01f * std::cos(3.0f * i);
  }
  auto one = CompressLowRank(m, kRows, kCols, kRank, {}, /*seed=*/5);
  ASSERT_THAT(one, IsOk());
  for (const int size : {2, 3}) {
    std::vector<LowRankFactors> factors(size);
    RunRanks(size, [&](Collectives& c) {
      // Slices of the flat matrix, cut mid-row.
      const auto [b, e] = SliceRange(m.size(), c.size(), c.rank());
      LowRankSlicePiece piece;
      piece.m = absl::MakeConstSpan(m).subspan(b, e - b);
      piece.begin = b;
      piece.rows = kRows;
      piece.cols = kCols;
      piece.rank = kRank;
      piece.seed = 5;
      auto out = CompressLowRankSlices({&piece, 1}, [&](absl::Span<float> values) {
        return c.AllReduceSumFloats(values.data(), values.size());
      });
      ASSERT_THAT(out, IsOk());
      factors[c.rank()] = (*out)[0].factors;
    });
    for (int r = 1; r < size; ++r) {
      EXPECT_EQ(factors[r].p, factors[0].p) << size << " ranks, rank " << r;
      EXPECT_EQ(factors[r].q, factors[0].q) << size << " ranks, rank " << r;
    }
    std::vector<float> node(m.size()), single(m.size());
    ASSERT_THAT(DecompressLowRank(factors[0], absl::MakeSpan(node)), IsOk());
    ASSERT_THAT(DecompressLowRank(*one, absl::MakeSpan(single)), IsOk());
    float diff = 0, scale = 0;
    for (size_t i = 0; i < m.size(); ++i) {
      diff = std::max(diff, std::abs(node[i] - single[i]));
      scale = std::max(scale, std::abs(single[i]));
    }
    EXPECT_LE(diff, 1e-6f * scale) << size << " ranks";
  }
}

TEST(GlooCollectivesTest, TensorFormsTakeHostFloatsAndRefuseOthers) {
  RunRanks(2, [](Collectives& c) {
    const int r = c.rank();
    torch::Tensor shard = torch::full({3}, 1.0f + r, torch::kFloat32);
    torch::Tensor full = torch::zeros({6}, torch::kFloat32);
    ASSERT_THAT(c.AllGatherTensor(shard, full), IsOk());
    EXPECT_TRUE(torch::equal(full, torch::tensor({1.0f, 1.0f, 1.0f, 2.0f, 2.0f, 2.0f})));
    // Rank q contributes (q + 1) * j at j: rank r gets 3 * (3 r + i).
    torch::Tensor contribution = torch::arange(6, torch::kFloat32) * (r + 1);
    torch::Tensor mine = torch::zeros({3}, torch::kFloat32);
    ASSERT_THAT(c.ReduceScatterSumTensor(contribution, mine), IsOk());
    EXPECT_TRUE(torch::equal(mine, (torch::arange(3, torch::kFloat32) + 3 * r) * 3)) << mine;
    // Refused before any communication, so the ranks stay in step.
    EXPECT_THAT(c.AllGatherTensor(torch::zeros({3}, torch::kInt64), full),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("contiguous float32 host memory; got a Long tensor on cpu")));
    EXPECT_THAT(c.AllGatherTensor(shard, torch::zeros({5}, torch::kFloat32)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("3 elements per rank")));
    EXPECT_THAT(
        c.ReduceScatterSumTensor(torch::zeros({12}, torch::kFloat32).slice(0, 0, 12, 2), mine),
        StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("contiguous")));
  });
}

TEST(GlooCollectivesTest, RejectsBadRanks) {
  EXPECT_THAT(ConnectGloo("/nonexistent/store", 2, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 2 of 2")));
}

TEST(ShardLayoutTest, SlicesCoverEveryLayerOnce) {
  v1::TransformerConfig model;
  model.set_vocab_size(16);
  model.set_seq_len(16);
  model.set_d_model(32);
  model.set_num_layers(2);
  model.set_num_heads(2);
  FillTransformerDefaults(&model);
  const v1::ModelSpec spec = BuildTransformerSpec(model, 2);
  for (int ranks : {1, 2, 3, 7}) {
    size_t total = 0, spec_total = 0;
    for (int r = 0; r < ranks; ++r) total += ShardLayout(spec, ranks, r).total_owned();
    for (const auto& layer : spec.layers()) spec_total += layer.num_elements();
    EXPECT_EQ(total, spec_total) << ranks << " ranks";
    const ShardLayout last(spec, ranks, ranks - 1);
    for (int l = 0; l < spec.layers_size(); ++l) {
      EXPECT_EQ(last.end(l), spec.layers(l).num_elements());
      EXPECT_EQ(last.slice(l), (spec.layers(l).num_elements() + ranks - 1) / ranks);
    }
  }
}

class FsdpTrainerTest : public ::testing::Test {
 protected:
  static v1::TransformerConfig Model() { return ::aloe::testing::TinyTransformer(); }
  static v1::InnerOptimizerConfig Inner() {
    v1::InnerOptimizerConfig c;
    c.set_lr(1e-2f);
    c.set_warmup_steps(2);
    c.set_total_steps(200);
    c.set_weight_decay(0.01f);
    c.set_batch_size(8);
    c.set_grad_clip(0.5f);  // low enough to clip: the all-reduced norm is exercised
    FillInnerOptimizerDefaults(&c);
    return c;
  }
  static InMemoryTokenSource Data() {
    const uint32_t pattern[] = {5, 2, 6, 0, 3, 1, 4, 9, 12, 7, 15, 11};
    std::vector<uint32_t> tokens(600);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = pattern[(i * 7 + i / 13) % 12];
    return InMemoryTokenSource(std::move(tokens), 16);
  }
  const v1::ModelSpec spec_ = BuildTransformerSpec(Model(), 2);

  // Trains `rounds` rounds of `steps` steps on `ranks` FSDP ranks; returns the gathered model.
  Layers TrainFsdp(int ranks, int rounds, uint32_t steps, std::vector<size_t>* state = nullptr) {
    Layers result;
    std::vector<size_t> state_elements(ranks);
    const InMemoryTokenSource data = Data();
    RunRanks(ranks, [&](Collectives& c) {
      auto trainer = FsdpTrainer::Create(Model(), Inner(), spec_, /*seed=*/3, c);
      ASSERT_THAT(trainer, IsOk());
      for (int round = 0; round < rounds; ++round) {
        auto stats = (*trainer)->Train(data, steps, /*lr_step=*/round * steps, /*seed=*/11 + round);
        ASSERT_THAT(stats, IsOk());
        EXPECT_EQ(stats->steps, steps);
        EXPECT_EQ(stats->tokens, steps * 8u * 16u);  // the node's batch
      }
      state_elements[c.rank()] = (*trainer)->optimizer_state_elements();
      Layers gathered;
      ASSERT_THAT((*trainer)->GatherParameters(&gathered), IsOk());
      if (c.rank() == 0) result = gathered;
    });
    if (state != nullptr) *state = state_elements;
    return result;
  }

  static double RelativeError(const Layers& a, const Layers& b) {
    double diff = 0, norm = 0;
    for (size_t l = 0; l < b.size(); ++l) {
      for (size_t i = 0; i < b[l].size(); ++i) {
        diff += std::pow(static_cast<double>(a[l][i]) - b[l][i], 2);
        norm += std::pow(static_cast<double>(b[l][i]), 2);
      }
    }
    return std::sqrt(diff / norm);
  }
};

// One rank of FSDP is LibTorch's AdamW (LocalTrainer) with the same batches: the flat-slice
// AdamW, the clipping and the data sampling follow it step for step.
TEST_F(FsdpTrainerTest, OneRankMatchesLocalTrainerAfterFiveSteps) {
  auto local = LocalTrainer::Create(Model(), Inner(), spec_, /*seed=*/3);
  ASSERT_THAT(local, IsOk());
  const InMemoryTokenSource data = Data();
  ASSERT_THAT((*local)->Train(data, 5, /*lr_step=*/0, /*seed=*/11), IsOk());
  Layers expected;
  ASSERT_THAT((*local)->GetParameters(&expected), IsOk());
  const Layers initial = InitializeParameters(spec_, 3);
  ASSERT_GT(RelativeError(initial, expected), 1e-3);  // training moved the model

  const Layers fsdp = TrainFsdp(1, 1, 5);
  ASSERT_EQ(fsdp.size(), expected.size());
  const double error = RelativeError(fsdp, expected);
  std::printf("FSDP 1 rank vs LocalTrainer after 5 steps: relative error %.3g\n", error);
  EXPECT_LE(error, 1e-5);
}

// The acceptance test: 2 ranks on their halves of each batch = 1 rank on the whole
// batch, after 5 steps (and across two rounds, so the persistent AdamW state is covered); each
// rank holds half of the AdamW state.
TEST_F(FsdpTrainerTest, TwoRanksMatchOneRankOnTheConcatenatedBatch) {
  std::vector<size_t> one_state, two_state;
  const Layers one = TrainFsdp(1, 2, 5, &one_state);
  const Layers two = TrainFsdp(2, 2, 5, &two_state);
  const double error = RelativeError(two, one);
  std::printf("FSDP 2 ranks vs 1 rank after 2 x 5 steps: relative error %.3g\n", error);
  EXPECT_LE(error, 1e-5);
  EXPECT_GT(RelativeError(one, InitializeParameters(spec_, 3)), 1e-3);

  size_t params = 0, padded_half = 0;
  for (const auto& layer : spec_.layers()) {
    params += layer.num_elements();
    padded_half += (layer.num_elements() + 1) / 2;
  }
  ASSERT_EQ(one_state.size(), 1u);
  EXPECT_EQ(one_state[0], 2 * params);  // m and v of every parameter
  ASSERT_EQ(two_state.size(), 2u);
  EXPECT_EQ(two_state[0] + two_state[1], 2 * params);
  for (size_t s : two_state) EXPECT_LE(s, 2 * padded_half);  // 1/N each (ceil per layer)
}

TEST_F(FsdpTrainerTest, ThreeRanksMatchOneRank) {
  // 8 sequences do not split over 3 ranks: use 6.
  v1::InnerOptimizerConfig inner = Inner();
  inner.set_batch_size(6);
  Layers one, three;
  const InMemoryTokenSource data = Data();
  for (int ranks : {1, 3}) {
    RunRanks(ranks, [&](Collectives& c) {
      auto trainer = FsdpTrainer::Create(Model(), inner, spec_, 3, c);
      ASSERT_THAT(trainer, IsOk());
      ASSERT_THAT((*trainer)->Train(data, 4, 0, 5), IsOk());
      Layers gathered;
      ASSERT_THAT((*trainer)->GatherParameters(&gathered), IsOk());
      if (c.rank() == 0) (ranks == 1 ? one : three) = gathered;
    });
  }
  EXPECT_LE(RelativeError(three, one), 1e-5);
}

// --autocast bf16 reaches the ranks' forward passes: 2 ranks with it end elsewhere than 2 ranks
// without it (and than one LocalTrainer with it: the ranks' rows differ), yet close by.
TEST_F(FsdpTrainerTest, Bf16AutocastChangesTheRanksStepsButNotMuch) {
  const Layers fp32 = TrainFsdp(2, 1, 5);
  SetTrainerAutocastBf16(true);
  const Layers bf16 = TrainFsdp(2, 1, 5);
  SetTrainerAutocastBf16(false);
  const double error = RelativeError(bf16, fp32);
  std::printf("FSDP 2 ranks, bf16 autocast vs float32 after 5 steps: relative error %.3g\n", error);
  EXPECT_GT(error, 1e-4) << "bf16 autocast changed nothing";
  EXPECT_LT(error, 0.05);
}

TEST_F(FsdpTrainerTest, AnInterruptOnOneRankStopsEveryRankAfterTheSameStep) {
  const InMemoryTokenSource data = Data();
  RunRanks(2, [&](Collectives& c) {
    auto trainer = FsdpTrainer::Create(Model(), Inner(), spec_, 3, c);
    ASSERT_THAT(trainer, IsOk());
    std::atomic<bool> stop{c.rank() == 1};
    auto stats = (*trainer)->Train(data, 5, 0, 7, 0, &stop);
    ASSERT_THAT(stats, IsOk());
    EXPECT_EQ(stats->steps, 0u) << "rank " << c.rank();
    EXPECT_EQ((*trainer)->optimizer_steps(), 0u);
  });
}

// A rank restarted with its saved slices and AdamW state (aloe-worker --state_dir) trains the
// next round as the ranks that never stopped: bit for bit.
TEST_F(FsdpTrainerTest, RanksRestartedWithTheirInnerStateGoOnBitForBit) {
  const Layers straight = TrainFsdp(2, 2, 5);
  const InMemoryTokenSource data = Data();
  std::vector<Layers> params(2);
  std::vector<InnerState> states(2);
  RunRanks(2, [&](Collectives& c) {
    auto trainer = FsdpTrainer::Create(Model(), Inner(), spec_, /*seed=*/3, c);
    ASSERT_THAT(trainer, IsOk());
    ASSERT_THAT((*trainer)->Train(data, 5, /*lr_step=*/0, /*seed=*/11), IsOk());
    ASSERT_THAT((*trainer)->GetParameterShards(&params[c.rank()]), IsOk());
    absl::StatusOr<InnerState> state = (*trainer)->SaveInnerState();
    ASSERT_THAT(state, IsOk());
    EXPECT_EQ(state->steps, 5u);
    for (int l = 0; l < spec_.layers_size(); ++l) {
      EXPECT_EQ(state->first[l].size(), (*trainer)->layout().owned(l));
    }
    states[c.rank()] = *std::move(state);
  });
  Layers restarted;
  RunRanks(2, [&](Collectives& c) {
    auto trainer = FsdpTrainer::Create(Model(), Inner(), spec_, /*seed=*/99, c);
    ASSERT_THAT(trainer, IsOk());
    ASSERT_THAT((*trainer)->SetParameterShards(params[c.rank()]), IsOk());
    // A state whose slices are not this rank's lengths is refused.
    InnerState short_state = states[c.rank()];
    short_state.second.back().pop_back();
    EXPECT_THAT((*trainer)->RestoreInnerState(short_state),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("this rank owns")));
    ASSERT_THAT((*trainer)->RestoreInnerState(states[c.rank()]), IsOk());
    EXPECT_EQ((*trainer)->optimizer_steps(), 5u);
    ASSERT_THAT((*trainer)->Train(data, 5, /*lr_step=*/5, /*seed=*/12), IsOk());
    Layers gathered;
    ASSERT_THAT((*trainer)->GatherParameters(&gathered), IsOk());
    if (c.rank() == 0) restarted = gathered;
  });
  EXPECT_EQ(restarted, straight);
}

TEST_F(FsdpTrainerTest, SlicesRoundTripAndPseudoGradientIsPerSlice) {
  const InMemoryTokenSource data = Data();
  RunRanks(2, [&](Collectives& c) {
    auto trainer = FsdpTrainer::Create(Model(), Inner(), spec_, 3, c);
    ASSERT_THAT(trainer, IsOk());
    const ShardLayout& layout = (*trainer)->layout();
    Layers base;
    ASSERT_THAT((*trainer)->GetParameterShards(&base), IsOk());
    const Layers initial = InitializeParameters(spec_, 3);
    for (int l = 0; l < spec_.layers_size(); ++l) {
      ASSERT_EQ(base[l].size(), layout.owned(l));
      EXPECT_TRUE(std::equal(base[l].begin(), base[l].end(), initial[l].begin() + layout.begin(l)));
    }
    ASSERT_THAT((*trainer)->Train(data, 2, 0, 7), IsOk());
    Layers end, g;
    ASSERT_THAT((*trainer)->GetParameterShards(&end), IsOk());
    ASSERT_THAT((*trainer)->PseudoGradientShards(base, &g), IsOk());
    for (int l = 0; l < spec_.layers_size(); ++l) {
      for (size_t i = 0; i < g[l].size(); ++i) ASSERT_EQ(g[l][i], base[l][i] - end[l][i]);
    }
    // Back to the base: the gathered model is the initial one again.
    ASSERT_THAT((*trainer)->SetParameterShards(base), IsOk());
    Layers gathered;
    ASSERT_THAT((*trainer)->GatherParameters(&gathered), IsOk());
    EXPECT_EQ(gathered, initial);
    // Wrong slice sizes are refused and change nothing.
    Layers bad = base;
    bad[0].push_back(1.0f);
    EXPECT_THAT((*trainer)->SetParameterShards(bad),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 0")));
    EXPECT_THAT((*trainer)->PseudoGradientShards(bad, &g),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 0")));
  });
}

// A Collectives that is never called: Create must refuse before any communication.
class UnusedCollectives final : public Collectives {
 public:
  int rank() const override { return 0; }
  int size() const override { return 4; }
  absl::Status AllGather(const float*, size_t, float*) override { return Fail(); }
  absl::Status ReduceScatterSum(const float*, size_t, float*) override { return Fail(); }
  absl::StatusOr<double> AllReduceSum(double) override { return Fail(); }
  absl::Status AllReduceSumFloats(float*, size_t) override { return Fail(); }
  absl::Status Broadcast(std::string*, int) override { return Fail(); }

 private:
  static absl::Status Fail() {
    ADD_FAILURE() << "unexpected collective";
    return absl::InternalError("unexpected");
  }
};

// On a GPU (skipped without one): one rank whose trainer group is NCCL on the GPU steps like a
// LocalTrainer on the same GPU (LibTorch's AdamW), and like FSDP on the CPU up to float
// summation order. A build without NCCL refuses the GPU group by name instead.
TEST_F(FsdpTrainerTest, OneNcclRankOnTheGpuMatchesLocalTrainerThere) {
  if (VisibleGpus() == 0) GTEST_SKIP() << "no GPU visible to LibTorch";
  const InMemoryTokenSource data = Data();
  const Layers cpu = TrainFsdp(1, 1, 5);
  ASSERT_THAT(SetTrainerDevice("cuda:0"), IsOk());
  auto local = LocalTrainer::Create(Model(), Inner(), spec_, /*seed=*/3);
  ASSERT_THAT(local, IsOk());
  ASSERT_THAT((*local)->Train(data, 5, /*lr_step=*/0, /*seed=*/11), IsOk());
  Layers expected;
  ASSERT_THAT((*local)->GetParameters(&expected), IsOk());
  const std::string store = ::testing::TempDir() + "/aloe_fsdp_nccl_" + std::to_string(::getpid());
  auto groups = ConnectNodeGroups(store, 0, 1, /*groups=*/2, /*timeout_seconds=*/60);
#if defined(ALOE_WITH_NCCL)
  ASSERT_THAT(groups, IsOk());
  auto trainer = FsdpTrainer::Create(Model(), Inner(), spec_, /*seed=*/3, *(*groups)[0]);
  ASSERT_THAT(trainer, IsOk());
  ASSERT_THAT((*trainer)->Train(data, 5, /*lr_step=*/0, /*seed=*/11), IsOk());
  Layers gpu;
  ASSERT_THAT((*trainer)->GatherParameters(&gpu), IsOk());
  // The control group stays Gloo: a host message crosses it.
  std::string message = "task";
  EXPECT_THAT((*groups)[1]->Broadcast(&message, 0), IsOk());
  const double error = RelativeError(gpu, expected);
  std::printf("FSDP 1 NCCL rank vs LocalTrainer on the GPU: %.3g; vs FSDP on the CPU: %.3g\n",
              error, RelativeError(gpu, cpu));
  EXPECT_LE(error, 1e-5);
  EXPECT_LE(RelativeError(gpu, cpu), 1e-4);
#else
  EXPECT_THAT(groups, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no NCCL")));
#endif
  ASSERT_THAT(SetTrainerDevice("cpu"), IsOk());
  std::remove(store.c_str());
}

TEST_F(FsdpTrainerTest, BatchMustSplitEvenlyAcrossRanks) {
  UnusedCollectives four;
  v1::InnerOptimizerConfig inner = Inner();
  inner.set_batch_size(6);
  EXPECT_THAT(FsdpTrainer::Create(Model(), inner, spec_, 3, four),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("multiple of the 4 ranks")));
}

}  // namespace
}  // namespace aloe::worker
