// Bring-your-own models end to end: Python (Debian's python3-torch) scripts small modules,
// aloe-import-model turns them into imported-model files, and a real aloe-server trains them
// with aloe-worker --torchscript trainers and evaluators. Skips when python3-torch is missing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/imported_model.h"
#include "common/tensor_codec.h"
#include "server/core/checkpoint_store.h"
#include "tests/integration/loopback_cluster.h"
#include "tests/testing/subprocess.h"

namespace aloe {
namespace {

using ::aloe::testing::LoopbackTest;
using ::aloe::testing::ReadFile;

// Runs `command` through the shell; returns its exit code and stdout + stderr.
std::pair<int, std::string> RunShell(const std::string& command) {
  std::string output;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {-1, ""};
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

// `text` with every run of spaces collapsed to one.
std::string CollapseSpaces(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c != ' ' || out.empty() || out.back() != ' ') out.push_back(c);
  }
  return out;
}

class ByoModelTest : public LoopbackTest {
 protected:
  void SetUp() override {
    LoopbackTest::SetUp();
    if (RunShell("/usr/bin/python3 -c 'import torch'").first != 0) {
      GTEST_SKIP() << "python3-torch is not installed (scripts/install-deps.sh installs it)";
    }
    // Python writes the modules and evaluates the logits model on the first 64 held-out windows.
    auto [code, out] = RunShell(absl::StrCat("/usr/bin/python3 ", ALOE_SOURCE_DIR,
                                             "/tests/integration/make_torchscript_models.py ", dir_,
                                             " ", dir_, "/heldout.tok 64"));
    ASSERT_EQ(code, 0) << out;
    const size_t at = out.find("heldout_loss=");
    ASSERT_NE(at, std::string::npos) << out;
    ASSERT_TRUE(
        absl::SimpleAtod(out.substr(at + 13, out.find('\n', at) - at - 13), &python_heldout_loss_))
        << out;
  }

  // aloe-import-model on dir_/<name>.pt; returns its exit code and output.
  std::pair<int, std::string> Import(const std::string& name, const std::string& flags = "") {
    return RunShell(absl::StrCat(Bin("aloe-import-model"), " --torchscript=", dir_, "/", name,
                                 ".pt --out=", dir_, "/", name, ".aloemodel ", flags));
  }

  double python_heldout_loss_ = 0;
};

TEST_F(ByoModelTest, ImportedLogitsModelTrainsThroughARealServer) {
  auto [code, out] = Import("logits");
  ASSERT_EQ(code, 0) << out;
  out = CollapseSpaces(out);
  // Layers from the module hierarchy: the root's own parameter, top-level submodules, and one
  // layer per ModuleList child. 48-wide model, 2 blocks, vocab 256, seq_len 32 (attributes).
  EXPECT_TRUE(absl::StrContains(out, "layer root 1536 parameters")) << out;
  EXPECT_TRUE(absl::StrContains(out, "layer tok_emb 12288 parameters")) << out;
  // ln1 96 + qkv 48*144+144 + proj 48*48+48 + ln2 96 + fc1 48*192+192 + fc2 192*48+48
  EXPECT_TRUE(absl::StrContains(out, "layer blocks.0 28272 parameters")) << out;
  EXPECT_TRUE(absl::StrContains(out, "layer blocks.1"));
  EXPECT_TRUE(absl::StrContains(out, "layer ln_f 96 parameters")) << out;
  EXPECT_TRUE(absl::StrContains(out, "layer head 12288 parameters")) << out;
  EXPECT_TRUE(absl::StrContains(out,
                                "6 layers, 82752 parameters, output MODEL_OUTPUT_LOGITS, "
                                "vocab_size 256, seq_len 32"))
      << out;

  model_ = absl::StrCat("model_file: \"", dir_, "/logits.aloemodel\"");
  model_flags_ = {absl::StrCat("--torchscript=", dir_, "/logits.pt")};
  RunSingleTrainerJob("logits", "local_steps: 20\nmax_versions: 6\n", {}, /*evaluate=*/true);
  const std::string summary = ReadFile(dir_ + "/summary");
  EXPECT_TRUE(absl::StrContains(summary, "version=6")) << summary << Logs();
  // Version 0 is the module's own initialisation, and the evaluator's loss of it (LibTorch in
  // the worker) equals PyTorch's cross-entropy of the same windows.
  const size_t at = summary.find("eval=0:");
  ASSERT_NE(at, std::string::npos) << summary << Logs();
  double v0_loss = 0;
  ASSERT_TRUE(absl::SimpleAtod(summary.substr(at + 7, summary.find('\n', at) - at - 7), &v0_loss));
  EXPECT_NEAR(v0_loss, python_heldout_loss_, 1e-4 * python_heldout_loss_) << summary;
  EXPECT_GT(v0_loss, 5.0);  // about ln(256) = 5.55 at initialisation
  const double final_loss = FinalEvalLoss();
  std::printf(
      "imported logits model: held-out loss %.6f at version 0 (PyTorch %.6f), %.6f at "
      "version 6\n",
      v0_loss, python_heldout_loss_, final_loss);
  EXPECT_LT(final_loss, v0_loss - 1.5)
      << "held-out loss " << v0_loss << " -> " << final_loss << "\n"
      << Logs();
}

TEST_F(ByoModelTest, LossModelTrainsAndMismatchedWorkersAreRefused) {
  ASSERT_EQ(Import("loss", "--vocab_size=256 --seq_len=32").first, 0);
  ASSERT_EQ(Import("logits").first, 0);
  auto [code, out] = Import("three_args", "--vocab_size=256 --seq_len=32");
  EXPECT_EQ(code, 1);
  EXPECT_TRUE(absl::StrContains(out, "forward takes 3 arguments")) << out;
  std::tie(code, out) = Import("loss");  // neither flags nor attributes give vocab_size/seq_len
  EXPECT_EQ(code, 1);
  EXPECT_TRUE(absl::StrContains(out, "set --vocab_size and --seq_len")) << out;
  std::tie(code, out) = Import("missing");
  EXPECT_EQ(code, 1);
  EXPECT_TRUE(absl::StrContains(out, "no such TorchScript file")) << out;

  model_ = absl::StrCat("model_file: \"", dir_, "/loss.aloemodel\"");
  const int port =
      StartServer("local_steps: 20\nmax_versions: 3\naggregation { min_workers: 1 }\n");
  ASSERT_GT(port, 0);
  // The built-in transformer and another module are refused at join, naming the fix.
  auto builtin = StartWorker(port, "trainer", 1);
  EXPECT_EQ(builtin->Wait(absl::Seconds(60)), std::optional<int>(1));
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/trainer1.log"), "start it with --torchscript"))
      << ReadFile(dir_ + "/trainer1.log");
  auto other = StartWorker(port, "trainer", 2, 1.0, {"--torchscript=" + dir_ + "/logits.pt"});
  EXPECT_EQ(other->Wait(absl::Seconds(60)), std::optional<int>(1));
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/trainer2.log"), "brings another model"))
      << ReadFile(dir_ + "/trainer2.log");
  // The right module trains to the end.
  auto worker = StartWorker(port, "trainer", 0, 1.0, {"--torchscript=" + dir_ + "/loss.pt"});
  EXPECT_EQ(server_->Wait(absl::Seconds(180)), std::optional<int>(0)) << Logs();
  EXPECT_EQ(worker->Wait(absl::Seconds(60)), std::optional<int>(0)) << Logs();
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/summary"), "version=3"))
      << ReadFile(dir_ + "/summary") << Logs();
  // A server refuses a bring-your-own worker when it trains the built-in transformer: see
  // ServerCoreTest. aloe-sim with a model_file: StragglerSimulatorTrainsAnImportedModel.
}

// The imported logits model on a two-rank node (--nproc 2 --torchscript: FSDP over Gloo on the
// module's parameters, each rank pulling and pushing its slices) ends where a one-process worker
// ends, with half the push bytes per rank.
TEST_F(ByoModelTest, ATwoRankNodeTrainsAnImportedModelLikeOneProcess) {
  ASSERT_EQ(Import("logits").first, 0);
  model_ = absl::StrCat("model_file: \"", dir_, "/logits.aloemodel\"");
  model_flags_ = {absl::StrCat("--torchscript=", dir_, "/logits.pt")};
  auto run = [&](const std::string& name, const std::vector<std::string>& flags) {
    const std::string ckpt = RunSingleTrainerJob(name, "local_steps: 6\nmax_versions: 3\n", flags);
    EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/summary"), "version=3\nupdates_applied=3\n"))
        << ReadFile(dir_ + "/summary") << Logs();
    std::vector<float> params;
    auto loaded = server::CheckpointStore(ckpt, 1).LoadLatest();
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    if (!loaded.ok()) return params;
    for (const std::string& layer : loaded->checkpoint.layer_params()) {
      std::vector<float> values(layer.size() / sizeof(float));
      EXPECT_TRUE(DecodeFloats(layer, absl::MakeSpan(values)).ok());
      params.insert(params.end(), values.begin(), values.end());
    }
    return params;
  };
  const std::vector<float> one = run("one", {});
  const std::vector<float> two = run("two", {"--nproc=2"});
  const std::string log = ReadFile(dir_ + "/two.log");
  ASSERT_EQ(one.size(), 82752u);
  ASSERT_EQ(two.size(), one.size());
  EXPECT_TRUE(absl::StrContains(log, "(2 ranks)")) << log;
  EXPECT_FALSE(absl::StrContains(log, "dropped")) << log;
  auto distance = [&](const std::vector<float>& a, const std::vector<float>& b) {
    double diff = 0, norm = 0;
    for (size_t i = 0; i < b.size(); ++i) {
      diff += std::pow(static_cast<double>(a[i]) - b[i], 2);
      norm += std::pow(static_cast<double>(b[i]), 2);
    }
    return std::sqrt(diff / norm);
  };
  // The module's own initialisation, as imported: training moved far from it.
  absl::StatusOr<v1::ImportedModel> imported = ReadImportedModel(dir_ + "/logits.aloemodel");
  ASSERT_TRUE(imported.ok()) << imported.status();
  std::vector<float> initial;
  for (const std::string& layer : imported->layer_params()) {
    std::vector<float> values(layer.size() / sizeof(float));
    ASSERT_TRUE(DecodeFloats(layer, absl::MakeSpan(values)).ok());
    initial.insert(initial.end(), values.begin(), values.end());
  }
  ASSERT_EQ(initial.size(), one.size());
  const double relative = distance(two, one);
  const double trained = distance(one, initial);
  std::printf(
      "imported model, 2-rank node vs 1-process worker after 3 rounds: relative error %.3g "
      "(training moved the model %.3g from its initialisation)\n",
      relative, trained);
  EXPECT_LE(relative, 1e-4) << log;
  EXPECT_GE(trained, 100 * relative) << log;
  EXPECT_TRUE(absl::StrContains(log, "rank 1 of 2 connected")) << log;
}

// The straggler simulator trains an imported model as well (aloe-sim --torchscript): version 0
// is the module's own initialisation (its held-out loss is PyTorch's), the loss falls, and the
// module must be the one model_file was imported from.
TEST_F(ByoModelTest, StragglerSimulatorTrainsAnImportedModel) {
  ASSERT_EQ(Import("logits").first, 0);
  ASSERT_EQ(Import("loss", "--vocab_size=256 --seq_len=32").first, 0);
  std::ofstream(dir_ + "/sim.textproto")
      << absl::StrCat("corpus_dir: \"", dir_, "\"\nmodel_file: \"", dir_, "/logits.aloemodel\"\n",
                      "inner_optimizer { lr: 0.003 min_lr: 0.0003 warmup_steps: 5 total_steps: 400 "
                      "batch_size: 8 }\n",
                      kNesterov, "\nlocal_steps: 20\nmax_versions: 6\n");
  auto sim = [&](const std::string& flags) {
    return RunShell(absl::StrCat(Bin("aloe-sim"), " --config=", dir_,
                                 "/sim.textproto --speeds=1,0.5 --eval_sequences=64 --out=", dir_,
                                 "/sim.csv ", flags));
  };
  auto [code, out] = sim("--torchscript=" + dir_ + "/logits.pt");
  ASSERT_EQ(code, 0) << out;
  ASSERT_TRUE(absl::StrContains(out, "versions=6")) << out;
  // Rows with an evaluation: "<time>,<version>,<worker>,<staleness>,<shard>,<steps>,<loss>,...".
  std::vector<std::pair<int, double>> evals;
  for (absl::string_view line : absl::StrSplit(ReadFile(dir_ + "/sim.csv"), '\n')) {
    std::vector<std::string> fields = absl::StrSplit(line, ',');
    if (fields.size() != 8 || fields[6].empty() || fields[6] == "eval_loss") continue;
    int version = 0;
    double loss = 0;
    ASSERT_TRUE(absl::SimpleAtoi(fields[1], &version) && absl::SimpleAtod(fields[6], &loss))
        << line;
    evals.emplace_back(version, loss);
  }
  ASSERT_GE(evals.size(), 2u) << ReadFile(dir_ + "/sim.csv");
  EXPECT_EQ(evals.front().first, 0);
  EXPECT_EQ(evals.back().first, 6);
  EXPECT_NEAR(evals.front().second, python_heldout_loss_, 1e-4 * python_heldout_loss_);
  std::printf(
      "aloe-sim, imported logits model: held-out loss %.6f at version 0 (PyTorch %.6f), "
      "%.6f at version 6\n",
      evals.front().second, python_heldout_loss_, evals.back().second);
  EXPECT_LT(evals.back().second, evals.front().second - 1.0) << out;

  // Another module, no module at all, and a module for the built-in transformer are refused.
  std::tie(code, out) = sim("--torchscript=" + dir_ + "/loss.pt");
  EXPECT_EQ(code, 1);
  EXPECT_TRUE(absl::StrContains(out, "loss.pt is not the module model_file")) << out;
  std::tie(code, out) = sim("");
  EXPECT_EQ(code, 1);
  EXPECT_TRUE(absl::StrContains(out, "the torch trainer needs --torchscript")) << out;
  // The synthetic trainer needs no module: it takes the imported model's layers.
  std::tie(code, out) = sim("--trainer=synthetic");
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "versions=6")) << out;
}

}  // namespace
}  // namespace aloe
