// aloe-bench-worker: the bare-LibTorch baseline for the worker benchmark. Builds the same
// TransformerLM module the worker trains (worker/transformer.h), initialised from the spec, and
// runs a plain loop: random-window batch, forward, loss, backward, grad-norm clip, AdamW step.
// No LocalTrainer, no schedule, no status plumbing: what LibTorch alone achieves on this machine
// (with denormals flushed to zero, as the trainers run).
//
// The bare loop's inner-step arithmetic is chosen piece by piece, so that each change to the
// trainer's step is measured on its own against the same loop without it:
//   --bare_adamw   libtorch: torch::optim::AdamW (one update per tensor); foreach: the
//                  trainer's multi-tensor AdamW (worker/inner_adamw.h); fused: its fused CUDA
//                  kernel (GPU only)
//   --bare_clip    libtorch: torch::nn::utils::clip_grad_norm_ (one norm per tensor, then the
//                  norm read back to the host); one_pass: GradClipFactor, one multi-tensor pass,
//                  applied inside the AdamW step (the fused kernel's gradient scale)
//   --bare_sync    step: every step copies its batch from pageable memory and reads its loss
//                  back (the host waits for the device twice a step); round: batches through
//                  page-locked memory, the losses read back once per timed block
//   --bare_loss    unfused: the head's logits, then LibTorch's cross_entropy; fused: the head
//                  and the loss in row chunks (worker/linear_cross_entropy.h)
//   --cuda_graphs  the whole step as one CUDA graph (worker/step_graph.h), where the step can
//                  be captured: a GPU, the fused AdamW, the one_pass clip, round sync; the
//                  trainer's too (worker/trainer.h SetTrainerCudaGraphs)
//   --attention    the fused attention's kernel (worker/trainer.h AttentionKernel), for the
//                  trainer too
//   --bare_precision
//                  autocast: the forward pass under --autocast, as the trainer; bf16: a bf16
//                  copy of the model runs forward and backward without autocast (no float32
//                  activations: LayerNorm, residual stream, casts), its gradients are copied
//                  into float32 master parameters for the clip and AdamW, which are copied
//                  back: what training in bf16 would gain, measured before the trainer does it
// The defaults (foreach or fused by device, one_pass, round, the model's own loss: fused on a
// GPU, CUDA graphs on) are the trainer's own code: with
// --trainer, the ratio then compares the trainer with a bare loop of the same step.
//
// Output (two lines):
//   bare_step batch=<b> adamw=<kind> clip=<kind> sync=<kind> loss=<kind> graph=<asked>
//       attention=<kernel> precision=<autocast|bf16>
//   bare_libtorch tokens_per_second=<X> steps=<n> seconds=<s> params=<count> device=<d>
//       flops_per_token=<F> graph=<on: the steps replayed a CUDA graph>
//       loss=<mean of the timed steps' losses> [mfu=<m>]
// where tokens are predicted tokens (batch_size * seq_len per step) over the --steps timed steps
// that follow --warmup untimed ones. With --trainer the same number of steps also runs through
// LocalTrainer::Train, from the same initial parameters, the two taking turns in --blocks blocks;
// a second line follows
//   aloe_trainer tokens_per_second=<X> steps=<n> seconds=<s> ratio=<trainer / bare>
//       graph=<on|off> loss=<mean of its steps' losses> [mfu=<m>]
// and with --round_steps H > 0 two more, one per round boundary (common/trainer_interface.h
// RoundBoundary: host, then device): --rounds R overlapped rounds of H steps as aloe-worker
// --overlap eager runs them, against the same R x H steps in one Train call; the difference is
// what the device waited for between rounds:
//   aloe_round boundary=<host|device> rounds=<R> round_steps=<H> round_seconds=<s>
//       idle_seconds=<per round> idle_fraction=<idle / rounds' wall time>
// Both run on --device (worker/trainer.h SetTrainerDevice), with --autocast bf16 both run their
// forward passes under bf16 autocast. flops_per_token is the model's training FLOPs per token,
// 6 N + 12 L d T (N: parameters of the matrix products, i.e. all but the token and position
// embeddings; L layers of width d over T tokens: the attention scores and their weighted sums);
// mfu = tokens/s x flops_per_token / (--peak_tflops x 1e12), printed when --peak_tflops > 0.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/flags_usage.h"
#include "common/lr_schedule.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "common/token_shard.h"
#include "common/token_source.h"
#include "worker/inner_adamw.h"
#include "worker/round_boundary.h"
#include "worker/step_graph.h"
#include "worker/torch_util.h"
#include "worker/trainer.h"
#include "worker/transformer.h"

ABSL_FLAG(int32_t, steps, 20, "Timed training steps");
ABSL_FLAG(int32_t, warmup, 3, "Untimed steps before the timed ones");
ABSL_FLAG(int32_t, threads, 1, "Intra-op threads (torch::set_num_threads)");
ABSL_FLAG(int32_t, vocab_size, 256, "Model vocabulary size");
ABSL_FLAG(int32_t, seq_len, 128, "Tokens per sequence");
ABSL_FLAG(int32_t, d_model, 256, "Model width");
ABSL_FLAG(int32_t, num_layers, 4, "Transformer blocks");
ABSL_FLAG(int32_t, num_heads, 4, "Attention heads (must divide d_model)");
ABSL_FLAG(int32_t, batch_size, 8, "Sequences per step");
ABSL_FLAG(std::string, token_file, "",
          "Token shard to sample windows from (common/token_shard.h); synthetic uniform random "
          "tokens when empty");
ABSL_FLAG(uint64_t, seed, 1, "Seed for initialisation and window sampling");
ABSL_FLAG(bool, tune_malloc, true,
          "Call ConfigureAllocatorForTraining() (worker/trainer.h) first, as aloe-worker does");
ABSL_FLAG(bool, trainer, false,
          "Also time the same steps through LocalTrainer::Train and print the ratio");
ABSL_FLAG(int32_t, blocks, 4,
          "With --trainer: the timed steps run in this many blocks, bare loop and trainer "
          "taking turns");
ABSL_FLAG(std::string, device, "cpu", "cpu | cuda | cuda:I | auto (as aloe-worker --device)");
ABSL_FLAG(std::string, autocast, "off", "off | bf16 (as aloe-worker --autocast)");
ABSL_FLAG(std::string, bare_adamw, "default",
          "The bare loop's AdamW: libtorch | foreach | fused | default (fused on a GPU, "
          "else foreach: the trainer's)");
ABSL_FLAG(std::string, bare_clip, "one_pass",
          "The bare loop's gradient-norm clip: libtorch | "
          "one_pass (the trainer's)");
ABSL_FLAG(std::string, bare_loss, "default",
          "The bare loop's head and loss: unfused | fused | default (fused on a GPU, as the "
          "trainer's model)");
ABSL_FLAG(std::string, bare_sync, "round",
          "When the bare loop's host waits for the device: "
          "step | round (the trainer's)");
ABSL_FLAG(std::string, bare_precision, "autocast",
          "The bare loop's arithmetic: autocast (as --autocast, the trainer's) | bf16 (a bf16 "
          "copy of the model computes the step: activations, LayerNorm, residual stream and "
          "gradients in bf16; float32 master parameters take the clip and AdamW)");
ABSL_FLAG(bool, cuda_graphs, true,
          "On a GPU: the bare loop's step (when it can be captured) and the trainer's as one "
          "CUDA graph each");
ABSL_FLAG(std::string, attention, "auto",
          "auto | flash | cudnn | efficient | math: the attention kernel of the bare loop and "
          "the trainer (as aloe-worker --attention)");
ABSL_FLAG(int32_t, round_steps, 0,
          "With --trainer and > 0: also time --rounds overlapped rounds of this many steps "
          "through the host and the device round boundary against the same steps in one call");
ABSL_FLAG(int32_t, rounds, 2, "With --round_steps: overlapped rounds timed per boundary");
ABSL_FLAG(double, peak_tflops, 0,
          "The device's peak dense TFLOP/s for the run's precision (e.g. 989 for an H100 SXM in "
          "bf16); > 0 prints the model FLOPs utilisation (mfu)");

namespace aloe::worker {
namespace {

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Wall time of `rounds` rounds of `round_steps` steps as aloe-worker --overlap eager runs them
// (worker/agent_overlap.cc): the next start staged and the last pseudo-gradient taken on another
// thread while a round trains, the eager start and the pseudo-gradient between rounds, through
// the host boundary or the trainer's device boundary. The next start is the first one again
// (what a pull would bring).
absl::StatusOr<double> TimeOverlappedRounds(LocalTrainer& trainer, const TokenSource& data,
                                            const v1::InnerOptimizerConfig& inner, bool on_device,
                                            int rounds, int round_steps, uint64_t seed) {
  HostRoundBoundary host(&trainer);
  RoundBoundary* boundary = on_device ? trainer.device_round_boundary() : &host;
  if (boundary == nullptr) return absl::FailedPreconditionError("no device round boundary");
  std::vector<std::vector<float>> pulled, delta;
  ALOE_RETURN_IF_ERROR(trainer.GetParameters(&pulled));
  ALOE_RETURN_IF_ERROR(boundary->StageStart(pulled));
  const float eager = -0.7f;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < rounds; ++r) {
    ALOE_RETURN_IF_ERROR(boundary->StartStaged(r == 0 ? 0.0f : eager));
    std::future<absl::Status> background = std::async(std::launch::async, [&]() -> absl::Status {
      if (r > 0) ALOE_RETURN_IF_ERROR(boundary->TakePseudoGradient(&delta));
      return r + 1 < rounds ? boundary->StageStart(pulled) : absl::OkStatus();
    });
    absl::Status trained =
        trainer.Train(data, round_steps, inner.warmup_steps(), seed + 100 + r).status();
    ALOE_RETURN_IF_ERROR(background.get());
    ALOE_RETURN_IF_ERROR(trained);
    ALOE_RETURN_IF_ERROR(boundary->EndRound());
  }
  ALOE_RETURN_IF_ERROR(boundary->TakePseudoGradient(&delta));
  return Since(t0);
}

absl::StatusOr<std::unique_ptr<TokenSource>> OpenData(uint32_t vocab_size, uint64_t seed) {
  const std::string path = absl::GetFlag(FLAGS_token_file);
  if (path.empty()) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<uint32_t> token(0, vocab_size - 1);
    std::vector<uint32_t> tokens(1 << 20);
    for (uint32_t& t : tokens) t = token(rng);
    return std::make_unique<InMemoryTokenSource>(std::move(tokens), vocab_size);
  }
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<TokenShard> shard, TokenShard::Open(path));
  if (shard->vocab_size() > vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s has vocab_size %d, larger than --vocab_size %d", path,
                        shard->vocab_size(), vocab_size));
  }
  return std::unique_ptr<TokenSource>(std::move(shard));
}

absl::Status Run() {
  v1::TransformerConfig config;
  config.set_vocab_size(absl::GetFlag(FLAGS_vocab_size));
  config.set_seq_len(absl::GetFlag(FLAGS_seq_len));
  config.set_d_model(absl::GetFlag(FLAGS_d_model));
  config.set_num_layers(absl::GetFlag(FLAGS_num_layers));
  config.set_num_heads(absl::GetFlag(FLAGS_num_heads));
  FillTransformerDefaults(&config);
  ALOE_RETURN_IF_ERROR(ValidateTransformerConfig(config));
  v1::InnerOptimizerConfig inner;
  inner.set_batch_size(absl::GetFlag(FLAGS_batch_size));
  FillInnerOptimizerDefaults(&inner);
  ALOE_RETURN_IF_ERROR(ValidateInnerOptimizerConfig(inner));
  const int steps = absl::GetFlag(FLAGS_steps);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int threads = absl::GetFlag(FLAGS_threads);
  if (steps < 1 || warmup < 0 || threads < 1) {
    return absl::InvalidArgumentError("--steps and --threads must be >= 1, --warmup >= 0");
  }
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  if (absl::GetFlag(FLAGS_tune_malloc)) ConfigureAllocatorForTraining();
  ALOE_ASSIGN_OR_RETURN(const std::string device_name,
                        SetTrainerDevice(absl::GetFlag(FLAGS_device)));
  const std::string autocast = absl::GetFlag(FLAGS_autocast);
  if (autocast != "off" && autocast != "bf16") {
    return absl::InvalidArgumentError("--autocast must be off or bf16");
  }
  SetTrainerAutocastBf16(autocast == "bf16");
  ALOE_ASSIGN_OR_RETURN(const AttentionKernel attention,
                        ParseAttentionKernel(absl::GetFlag(FLAGS_attention)));
  ALOE_RETURN_IF_ERROR(SetAttentionKernel(attention));
  const double peak_tflops = absl::GetFlag(FLAGS_peak_tflops);
  if (!(peak_tflops >= 0)) return absl::InvalidArgumentError("--peak_tflops must be >= 0");
  const torch::Device device = TrainingDevice();
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<TokenSource> data, OpenData(config.vocab_size(), seed));
  const int64_t window = config.seq_len() + 1;
  if (data->num_tokens() < static_cast<uint64_t>(window)) {
    return absl::InvalidArgumentError("the token file is shorter than seq_len + 1");
  }
  const int64_t batch_size = inner.batch_size();
  const v1::ModelSpec spec = BuildTransformerSpec(config, 1);

  torch::set_num_threads(threads);
  // Flush-to-zero and denormals-are-zero on this thread and its intra-op threads, as every
  // trainer sets them: like with like.
  FlushDenormals();
  ALOE_RETURN_IF_ERROR(CheckAttentionKernelRuns(config, device));
  TransformerLM model(config);
  ALOE_RETURN_IF_ERROR(LoadParameters(InitializeParameters(spec, seed), spec, *model));
  model->to(device);
  const double flops_per_token = TrainingFlopsPerToken(spec, config);  // 6 N + 12 L d T
  auto mfu = [&](double tokens_per_second) {
    return peak_tflops > 0 ? absl::StrFormat(" mfu=%.3f", tokens_per_second * flops_per_token /
                                                              (peak_tflops * 1e12))
                           : std::string();
  };
  const std::string adamw = absl::GetFlag(FLAGS_bare_adamw);
  const std::string clip_kind = absl::GetFlag(FLAGS_bare_clip);
  const std::string sync = absl::GetFlag(FLAGS_bare_sync);
  const std::string loss_kind = absl::GetFlag(FLAGS_bare_loss);
  if (loss_kind != "unfused" && loss_kind != "fused" && loss_kind != "default") {
    return absl::InvalidArgumentError("--bare_loss must be unfused, fused or default");
  }
  model->set_fused_loss(loss_kind == "fused"     ? TransformerLMImpl::FusedLoss::kOn
                        : loss_kind == "unfused" ? TransformerLMImpl::FusedLoss::kOff
                                                 : TransformerLMImpl::FusedLoss::kAuto);
  if (adamw != "libtorch" && adamw != "foreach" && adamw != "fused" && adamw != "default") {
    return absl::InvalidArgumentError("--bare_adamw must be libtorch, foreach, fused or default");
  }
  if (adamw == "fused" && !device.is_cuda()) {
    return absl::InvalidArgumentError("--bare_adamw=fused needs a CUDA --device");
  }
  if (clip_kind != "libtorch" && clip_kind != "one_pass") {
    return absl::InvalidArgumentError("--bare_clip must be libtorch or one_pass");
  }
  if (sync != "step" && sync != "round") {
    return absl::InvalidArgumentError("--bare_sync must be step or round");
  }
  const std::string precision = absl::GetFlag(FLAGS_bare_precision);
  if (precision != "autocast" && precision != "bf16") {
    return absl::InvalidArgumentError("--bare_precision must be autocast or bf16");
  }
  const bool pure_bf16 = precision == "bf16";
  if (pure_bf16 && (adamw == "libtorch" || clip_kind != "one_pass")) {
    return absl::InvalidArgumentError(
        "--bare_precision=bf16 steps the master parameters with --bare_adamw foreach, fused or "
        "default and --bare_clip one_pass");
  }
  const bool one_pass_clip = clip_kind == "one_pass";
  const bool sync_each_step = sync == "step";
  // Matrices decay, biases and LayerNorm parameters do not: the trainer's groups.
  const std::vector<torch::Tensor> params = model->parameters();
  std::unique_ptr<torch::optim::AdamW> libtorch_adamw;
  std::unique_ptr<InnerAdamW> inner_adamw;
  if (adamw == "libtorch") {
    libtorch_adamw = LibTorchAdamW(params, inner);
  } else {
    std::vector<bool> decay;
    for (const torch::Tensor& p : params) decay.push_back(p.dim() >= 2);
    const AdamWKernel kernel = adamw == "fused"     ? AdamWKernel::kFused
                               : adamw == "foreach" ? AdamWKernel::kForEach
                                                    : DefaultAdamWKernel(device);
    inner_adamw = std::make_unique<InnerAdamW>(params, std::move(decay), inner, kernel);
  }
  const bool fused_loss = loss_kind == "fused" || (loss_kind == "default" && device.is_cuda());
  // --bare_precision=bf16: the model that computes, a bf16 copy of `model`, whose parameters
  // stay the masters. The masters' gradients are allocated once and overwritten every step.
  TransformerLM bf16_model{nullptr};
  std::vector<torch::Tensor> bf16_params;
  if (pure_bf16) {
    bf16_model = TransformerLM(config);
    bf16_model->set_fused_loss(fused_loss ? TransformerLMImpl::FusedLoss::kOn
                                          : TransformerLMImpl::FusedLoss::kOff);
    bf16_model->to(device, torch::kBFloat16);
    bf16_params = bf16_model->parameters();
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      bf16_params[i].copy_(params[i]);
      params[i].mutable_grad() = torch::zeros_like(params[i]);
    }
  }
  // A step's loss and the gradients of `params` (the masters with --bare_precision=bf16); after
  // the AdamW step, copy_back() makes the bf16 copy the masters' values again (a no-op without
  // one).
  auto loss_and_gradients = [&](const torch::Tensor& batch) {
    torch::Tensor loss;
    if (!pure_bf16) {
      if (inner_adamw) {
        inner_adamw->ZeroGrad();
      } else {
        libtorch_adamw->zero_grad();
      }
      {
        TrainingAutocast bf16;  // --autocast bf16: the forward pass, as the trainer does
        loss = model->Loss(batch);
      }
      loss.backward();
      return loss;
    }
    for (torch::Tensor& p : bf16_params) p.mutable_grad().reset();
    loss = bf16_model->Loss(batch);
    loss.backward();
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i)
      params[i].mutable_grad().copy_(bf16_params[i].grad());
    return loss;
  };
  auto copy_back = [&]() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < bf16_params.size(); ++i) bf16_params[i].copy_(params[i]);
  };
  // The same step, captured once and replayed (the trainer's GraphedSteps), where it can be.
  SetTrainerCudaGraphs(absl::GetFlag(FLAGS_cuda_graphs));
  std::unique_ptr<GraphedSteps> graphed;
  if (TrainerCudaGraphs() && CudaGraphsAvailable() && device.is_cuda() && inner_adamw &&
      inner_adamw->capturable() && one_pass_clip && !sync_each_step) {
    graphed =
        std::make_unique<GraphedSteps>(inner_adamw.get(), device, [&](const torch::Tensor& batch) {
          const torch::Tensor loss = loss_and_gradients(batch);
          inner_adamw->LaunchStep(GradClipFactor(params, inner.grad_clip()));
          copy_back();
          return loss;
        });
  }
  std::printf(
      "bare_step batch=%lld adamw=%s clip=%s sync=%s loss=%s graph=%s attention=%s "
      "precision=%s\n",
      static_cast<long long>(batch_size),
      libtorch_adamw                                 ? "libtorch"
      : inner_adamw->kernel() == AdamWKernel::kFused ? "fused"
                                                     : "foreach",
      clip_kind.c_str(), sync.c_str(), fused_loss ? "fused" : "unfused", graphed ? "on" : "off",
      AttentionKernelName(attention), precision.c_str());
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<uint64_t> start(0, data->num_tokens() - window);
  // Runs `n` bare steps; returns their seconds unless they are warmup steps (a call's steps are
  // all warmup or all timed).
  int bare_steps_done = 0;
  double timed_loss = 0;  // the sum of the timed steps' losses
  auto bare_steps = [&](int n) {
    const bool timed = bare_steps_done >= warmup;
    const auto t0 = std::chrono::steady_clock::now();
    torch::Tensor queued_loss;  // --bare_sync=round: the losses, read back once
    double block_loss = 0;
    auto take_loss = [&](const torch::Tensor& loss) {
      if (sync_each_step) {
        block_loss += loss.item<double>();
      } else {
        queued_loss = queued_loss.defined() ? queued_loss + loss.detach() : loss.detach().clone();
      }
    };
    for (int k = 0; k < n; ++k, ++bare_steps_done) {
      torch::Tensor batch = torch::empty({batch_size, window}, torch::kInt64);
      for (int64_t b = 0; b < batch_size; ++b) {
        data->Read(start(rng), window, batch.data_ptr<int64_t>() + b * window);
      }
      if (graphed) {
        take_loss(graphed->Step(batch, inner.lr()));
        continue;
      }
      batch = sync_each_step ? batch.to(device) : BatchOnDevice(batch, device);
      const torch::Tensor loss = loss_and_gradients(batch);
      torch::Tensor clip;
      if (one_pass_clip) {
        clip = GradClipFactor(params, inner.grad_clip());
      } else {
        torch::nn::utils::clip_grad_norm_(params, inner.grad_clip());
      }
      if (inner_adamw) {
        inner_adamw->Step(inner.lr(), clip);
      } else {
        if (clip.defined()) {
          torch::NoGradGuard no_grad;
          for (const torch::Tensor& p : params) {
            if (p.grad().defined()) p.grad().mul_(clip);
          }
        }
        libtorch_adamw->step();
      }
      copy_back();
      take_loss(loss);
    }
    if (queued_loss.defined()) block_loss += queued_loss.item<double>();
    if (timed) timed_loss += block_loss;
    return timed ? Since(t0) : 0.0;
  };
  // With --trainer the two loops take turns, one block each, starting from the same
  // parameters: both see the same machine state, and neither trains a model the other has
  // already moved into another numeric regime.
  const bool with_trainer = absl::GetFlag(FLAGS_trainer);
  const int blocks = with_trainer ? std::max(1, std::min(absl::GetFlag(FLAGS_blocks), steps)) : 1;
  std::unique_ptr<LocalTrainer> trainer;
  if (with_trainer) {
    SetTrainerThreads(threads);
    ALOE_ASSIGN_OR_RETURN(trainer, LocalTrainer::Create(config, inner, spec, seed));
    if (warmup > 0) {
      ALOE_RETURN_IF_ERROR(trainer->Train(*data, warmup, inner.warmup_steps(), seed).status());
    }
  }
  double seconds = bare_steps(warmup);
  double trainer_seconds = 0;
  double trainer_loss = 0;  // the sum of its timed steps' losses
  int trainer_steps = 0;
  for (int b = 0; b < blocks; ++b) {
    const int n = steps / blocks + (b < steps % blocks ? 1 : 0);
    auto run_trainer = [&]() -> absl::Status {
      if (!with_trainer) return absl::OkStatus();
      ALOE_ASSIGN_OR_RETURN(
          TrainStats stats,
          trainer->Train(*data, n, inner.warmup_steps() + trainer_steps, seed + 1 + b));
      trainer_seconds += stats.compute_seconds;
      trainer_steps += static_cast<int>(stats.steps);
      trainer_loss += stats.mean_loss * static_cast<double>(stats.steps);
      return absl::OkStatus();
    };
    if (b % 2 == 1) ALOE_RETURN_IF_ERROR(run_trainer());  // alternate who goes first
    seconds += bare_steps(n);
    if (b % 2 == 0) ALOE_RETURN_IF_ERROR(run_trainer());
  }
  const double tokens = static_cast<double>(steps) * batch_size * config.seq_len();
  const double bare_tps = tokens / seconds;
  std::printf(
      "bare_libtorch tokens_per_second=%.1f steps=%d seconds=%.3f params=%llu device=%s "
      "flops_per_token=%.4g graph=%s loss=%.4f%s\n",
      bare_tps, steps, seconds, static_cast<unsigned long long>(TotalElements(spec)),
      device_name.c_str(), flops_per_token, graphed && graphed->replaying() ? "on" : "off",
      timed_loss / steps, mfu(bare_tps).c_str());
  std::fflush(stdout);

  if (with_trainer) {
    const double tps =
        static_cast<double>(trainer_steps) * batch_size * config.seq_len() / trainer_seconds;
    std::printf(
        "aloe_trainer tokens_per_second=%.1f steps=%d seconds=%.3f ratio=%.3f graph=%s "
        "loss=%.4f%s\n",
        tps, trainer_steps, trainer_seconds, tps / bare_tps,
        trainer->replays_cuda_graph() ? "on" : "off",
        trainer_steps > 0 ? trainer_loss / trainer_steps : 0.0, mfu(tps).c_str());
    const int round_steps = absl::GetFlag(FLAGS_round_steps);
    if (round_steps > 0) {
      // The same steps in one call, then as overlapped rounds through each boundary: what the
      // rounds take beyond the one call is what the device waited for between them.
      const int rounds = std::max(1, absl::GetFlag(FLAGS_rounds));
      const auto t0 = std::chrono::steady_clock::now();
      ALOE_RETURN_IF_ERROR(
          trainer->Train(*data, rounds * round_steps, inner.warmup_steps(), seed).status());
      const double one_call = Since(t0);
      for (const bool on_device : {false, true}) {
        ALOE_ASSIGN_OR_RETURN(
            const double wall,
            TimeOverlappedRounds(*trainer, *data, inner, on_device, rounds, round_steps, seed));
        const double idle = std::max(0.0, wall - one_call);
        std::printf(
            "aloe_round boundary=%s rounds=%d round_steps=%d round_seconds=%.4f "
            "idle_seconds=%.4f idle_fraction=%.4f\n",
            on_device ? "device" : "host", rounds, round_steps, wall / rounds, idle / rounds,
            idle / wall);
        std::fflush(stdout);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace aloe::worker

int main(int argc, char** argv) {
  aloe::SetUsage(
      "Bare-LibTorch training-loop baseline for the ALOE worker benchmark.\n"
      "Prints: bare_libtorch tokens_per_second=<X> steps=<n> seconds=<s> params=<count>");
  absl::ParseCommandLine(argc, argv);
  absl::Status status;
  try {
    status = aloe::worker::Run();
  } catch (const std::exception& e) {
    status = absl::InternalError(e.what());
  }
  if (!status.ok()) {
    std::fprintf(stderr, "aloe-bench-worker: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
