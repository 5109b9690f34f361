// aloe-bench-optimizer: how close the server's fused outer step comes to the memory bus
// (issue 3, point 5). In one run, on tensors of --mib MiB each, with --threads OpenMP threads
// that each take one contiguous slice of every tensor (the way the server's shards split work):
//
//   stream_triad   a[i] = b[i] + s * c[i]: the baseline. Counted 16 bytes per element: read b
//                  and c (8), write a (4), and the write-allocate read of a's cache lines (4)
//                  that a normal store costs. STREAM itself counts 12 (it ignores the
//                  write-allocate read); we count what crosses the bus, as for the DN apply.
//   dn_apply       kernels::DelayedNesterovApply on a buffer step with c > 0 (paper 002 Alg. 3):
//                  read theta, g, m, D (16), write theta, D (8) = 24 bytes per parameter; theta
//                  and D are read before they are written, so there is no extra write-allocate.
//                  This is the figure the ratio uses.
// and, for information, the other branches of the same kernel and the Nesterov kernel:
//   dn_momentum_step   (t+1) % N == 0: reads 4, writes theta, m, D: 28 bytes;
//   dn_buffer_step_c0  c = 0 (the default): m is not read: 20 bytes;
//   nesterov_apply     reads theta, g, m, writes theta, m: 20 bytes.
// GB/s = counted bytes / best time (1 GB = 1e9 bytes), best of --reps timed repetitions after
// --warmup untimed ones; the loops are interleaved per repetition so that background load hits
// them alike. Stores are ordinary (no non-temporal stores: they would skip the write-allocate
// read of the triad and make the baseline look faster than the same code in the server).
//
// Then the server's apply path of one pushed int8 update, through the real classes, as the
// server's shards run it (--threads layers of --mib / --threads MiB, one per thread):
//   push_int8_penalty_dn   kernels::Int8BlockwiseDecode (block 256) into a scratch g ->
//                          PseudoGradientPenalty::AggregateModule with the one update (norm pass,
//                          weight 1 -> copy into the step's g, clip-norm pass; phi not reached) ->
//                          OuterDelayedNesterov::Apply (N = 4, c = 0.1; best over buffer steps);
//   push_int8_dn           the same without the penalty (decode -> DN apply).
// Reported in GB/s of parameters (4 bytes per fp32 parameter updated per second), not bus bytes.
// Not included: receiving and reassembling the gRPC chunks (UpdateAssembler) and the version
// bookkeeping of ServerCore.
//
// Memory: 2 MiB-aligned allocations with MADV_HUGEPAGE (same for every buffer), first touched in
// parallel by the thread that later works on each slice.
//
// Output: one line per measurement, then
//   summary dn_apply_gbps=<X> triad_gbps=<Z> ratio=<X/Z> push_int8_penalty_dn_param_gbps=<P>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "kernels/cpu/codec_kernels.h"
#include "kernels/cpu/outer_kernels.h"
#include "proto/aloe.pb.h"
#include "server/core/outer_optimizer.h"
#include "server/core/pseudo_gradient_penalty.h"

ABSL_FLAG(int32_t, mib, 256, "Size of each tensor in MiB");
ABSL_FLAG(int32_t, threads, 2, "OpenMP threads, one contiguous slice of each tensor each");
ABSL_FLAG(int32_t, reps, 12, "Timed repetitions of each loop; the best is reported");
ABSL_FLAG(int32_t, warmup, 2, "Untimed repetitions before the timed ones");

namespace aloe::kernels {
namespace {

constexpr size_t kAlignment = size_t{2} << 20;  // one huge page
constexpr size_t kSliceAlignment = 16;          // floats: slices start on a 64-byte line

// A float buffer aligned to kAlignment, huge-page advised, not initialised (first touch is the
// caller's, in parallel).
class Buffer {
 public:
  explicit Buffer(size_t n) : n_(n) {
    const size_t bytes = (n * sizeof(float) + kAlignment - 1) / kAlignment * kAlignment;
    data_ = static_cast<float*>(std::aligned_alloc(kAlignment, bytes));
    if (data_ != nullptr) madvise(data_, bytes, MADV_HUGEPAGE);  // advisory; failure is fine
  }
  ~Buffer() { std::free(data_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  bool ok() const { return data_ != nullptr; }
  float* data() { return data_; }
  size_t size() const { return n_; }

 private:
  size_t n_;
  float* data_ = nullptr;
};

// [begin, end) of slice `index` of `count` over n elements, boundaries on 64-byte lines.
std::pair<size_t, size_t> Slice(size_t n, int index, int count) {
  const size_t per = (n / count + kSliceAlignment - 1) / kSliceAlignment * kSliceAlignment;
  const size_t begin = std::min(n, per * index);
  const size_t end = index + 1 == count ? n : std::min(n, per * (index + 1));
  return {begin, end};
}

// Runs body(begin, end) on each thread's slice; returns the wall time in seconds.
double TimeParallel(size_t n, int threads, const std::function<void(size_t, size_t)>& body) {
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    const auto [begin, end] = Slice(n, omp_get_thread_num(), omp_get_num_threads());
    body(begin, end);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// STREAM triad, compiled with the same flags as the kernels (tests/CMakeLists.txt).
__attribute__((noinline)) void Triad(float* a, const float* b, const float* c, float s, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

// See the header: one pushed int8 update through decode -> penalty -> DN per layer. Returns the
// best seconds over the buffer-step calls, or a negative value after printing an error.
double TimePushPath(size_t n, int threads, int warmup, int reps, bool with_penalty) {
  const int layers = threads;
  std::vector<size_t> begin(layers), end(layers);
  for (int l = 0; l < layers; ++l) std::tie(begin[l], end[l]) = Slice(n, l, layers);
  Buffer theta(n), g(n), step(n);
  if (!theta.ok() || !g.ok() || !step.ok()) return -1;
  std::vector<std::string> wire(layers);
  std::vector<std::unique_ptr<server::OuterOptimizer>> optimizers(layers);
  v1::OuterOptimizerConfig dn;
  dn.set_type(v1::OUTER_DELAYED_NESTEROV);
  dn.set_lr(0.7f);
  dn.set_momentum(0.9f);
  dn.set_dn_buffer_size(4);
  dn.set_dn_momentum_activation(0.1f);
  v1::PenaltyConfig penalty_config;  // the defaults of docs/algorithms.md
  penalty_config.set_enabled(true);
  penalty_config.set_ema_alpha(0.02f);
  penalty_config.set_z_threshold(3.0f);
  penalty_config.set_warmup(120);
  penalty_config.set_temperature(1.0f);
  penalty_config.set_clip_norm(10.0f);
  absl::StatusOr<std::unique_ptr<server::PseudoGradientPenalty>> penalty =
      server::PseudoGradientPenalty::Create(penalty_config, layers);
  if (!penalty.ok()) {
    std::fprintf(stderr, "penalty: %s\n", penalty.status().ToString().c_str());
    return -1;
  }
  bool ok = true;
#pragma omp parallel num_threads(threads) reduction(&& : ok)
  {
    const int l = omp_get_thread_num();
    const size_t count = end[l] - begin[l];
    for (size_t i = begin[l]; i < end[l]; ++i) {
      const float x = static_cast<float>(i % 1024) * (1.0f / 1024) - 0.5f;
      theta.data()[i] = x;
      g.data()[i] = 1e-3f * x;  // the worker's pseudo-gradient, encoded once below
      step.data()[i] = 0.0f;
    }
    wire[l].resize(Int8EncodedSize(count, kInt8DefaultBlockSize));
    ok = Int8BlockwiseEncode(g.data() + begin[l], count, kInt8DefaultBlockSize, wire[l].data(),
                             nullptr)
             .ok();
    absl::StatusOr<std::unique_ptr<server::OuterOptimizer>> opt =
        server::MakeOuterOptimizer(dn, count);
    ok = ok && opt.ok();
    if (opt.ok()) optimizers[l] = std::move(opt).value();
  }
  if (!ok) {
    std::fprintf(stderr, "push path: encode or optimizer setup failed\n");
    return -1;
  }

  double best = 1e30;
  for (int call = 0; call < warmup + reps; ++call) {
    bool call_ok = true;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(&& : call_ok)
    {
      const int l = omp_get_thread_num();
      const size_t count = end[l] - begin[l];
      float* g_l = g.data() + begin[l];
      float* step_l = step.data() + begin[l];
      absl::Span<float> theta_l(theta.data() + begin[l], count);
      call_ok = Int8BlockwiseDecode(wire[l].data(), wire[l].size(), g_l, count).ok();
      const float* applied = g_l;
      if (call_ok && with_penalty) {
        const uint64_t stream = 1;
        const absl::Span<const float> grads[] = {absl::Span<const float>(g_l, count)};
        absl::StatusOr<server::PenaltyModuleReport> report = (*penalty)->AggregateModule(
            l, absl::MakeConstSpan(&stream, 1), grads, absl::MakeSpan(step_l, count));
        call_ok = report.ok() && !report->rollback;
        applied = step_l;
      }
      call_ok = call_ok &&
                optimizers[l]->Apply(absl::MakeConstSpan(applied, count), theta_l, theta_l).ok();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!call_ok) {
      std::fprintf(stderr, "push path: call %d failed\n", call);
      return -1;
    }
    const bool momentum_step = (call + 1) % 4 == 0;
    if (call >= warmup && !momentum_step) best = std::min(best, seconds);
  }
  return best;
}

struct Measurement {
  std::string name;
  double bytes_per_element;
  std::function<void(size_t, size_t)> body;
  double best_seconds = 1e30;
};

int Main() {
  const size_t n =
      static_cast<size_t>(absl::GetFlag(FLAGS_mib)) * (size_t{1} << 20) / sizeof(float);
  const int threads = absl::GetFlag(FLAGS_threads);
  const int reps = absl::GetFlag(FLAGS_reps);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  if (n == 0 || threads < 1 || reps < 1 || warmup < 0) {
    std::fprintf(stderr, "aloe-bench-optimizer: --mib, --threads and --reps must be >= 1\n");
    return 2;
  }

  // Triad: a, b, c. DN: theta, g, m, d (separate buffers, so the triad's lines are cold too).
  Buffer a(n), b(n), c(n), theta(n), g(n), m(n), d(n);
  for (Buffer* buf : {&a, &b, &c, &theta, &g, &m, &d}) {
    if (!buf->ok()) {
      std::fprintf(stderr, "aloe-bench-optimizer: cannot allocate %d MiB\n",
                   absl::GetFlag(FLAGS_mib));
      return 1;
    }
  }
  // First touch by the thread that owns each slice; small O(1) values that stay finite.
  TimeParallel(n, threads, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const float x = static_cast<float>(i % 1024) * (1.0f / 1024) - 0.5f;
      a.data()[i] = 0.0f;
      b.data()[i] = x;
      c.data()[i] = -x;
      theta.data()[i] = x;
      g.data()[i] = 1e-3f * x;
      m.data()[i] = 0.5f * x;
      d.data()[i] = 0.0f;
    }
  });

  constexpr float kLr = 0.7f;
  constexpr float kBeta = 0.9f;
  constexpr uint32_t kBufferSize = 4;
  constexpr float kActivation = 0.1f;  // c in [0, 1/N]: the buffer step reads m
  std::vector<Measurement> measurements = {
      {"stream_triad", 16,
       [&](size_t begin, size_t end) {
         Triad(a.data() + begin, b.data() + begin, c.data() + begin, 0.5f, end - begin);
       }},
      {"dn_apply", 24,
       [&](size_t begin, size_t end) {
         DelayedNesterovApply(g.data() + begin, m.data() + begin, d.data() + begin,
                              theta.data() + begin, theta.data() + begin, end - begin, kLr, kBeta,
                              kBufferSize, kActivation, /*momentum_step=*/false);
       }},
      {"dn_momentum_step", 28,
       [&](size_t begin, size_t end) {
         DelayedNesterovApply(g.data() + begin, m.data() + begin, d.data() + begin,
                              theta.data() + begin, theta.data() + begin, end - begin, kLr, kBeta,
                              kBufferSize, kActivation, /*momentum_step=*/true);
       }},
      {"dn_buffer_step_c0", 20,
       [&](size_t begin, size_t end) {
         DelayedNesterovApply(g.data() + begin, m.data() + begin, d.data() + begin,
                              theta.data() + begin, theta.data() + begin, end - begin, kLr, kBeta,
                              kBufferSize, 0.0f, /*momentum_step=*/false);
       }},
      {"nesterov_apply", 20,
       [&](size_t begin, size_t end) {
         NesterovApply(g.data() + begin, m.data() + begin, theta.data() + begin,
                       theta.data() + begin, end - begin, kLr, kBeta);
       }},
  };

  for (int rep = 0; rep < warmup + reps; ++rep) {
    for (Measurement& meas : measurements) {
      const double seconds = TimeParallel(n, threads, meas.body);
      if (rep >= warmup) meas.best_seconds = std::min(meas.best_seconds, seconds);
    }
  }

  std::printf("threads=%d tensor_mib=%d elements=%zu reps=%d warmup=%d\n", threads,
              absl::GetFlag(FLAGS_mib), n, reps, warmup);
  std::printf("%-20s %14s %10s %10s\n", "loop", "bytes/element", "best_ms", "GB/s");
  double triad_gbps = 0;
  double dn_gbps = 0;
  for (const Measurement& meas : measurements) {
    const double gbps = meas.bytes_per_element * static_cast<double>(n) / meas.best_seconds / 1e9;
    std::printf("%-20s %14.0f %10.2f %10.2f\n", meas.name.c_str(), meas.bytes_per_element,
                meas.best_seconds * 1e3, gbps);
    if (meas.name == "stream_triad") triad_gbps = gbps;
    if (meas.name == "dn_apply") dn_gbps = gbps;
  }
  // The push path, after the kernel loops (its own buffers; the kernel loops' stay allocated).
  double push_param_gbps = 0;
  for (bool with_penalty : {true, false}) {
    const double seconds = TimePushPath(n, threads, warmup, reps + reps / 3, with_penalty);
    if (seconds < 0) return 1;
    const double gbps = 4.0 * static_cast<double>(n) / seconds / 1e9;
    std::printf("%-20s %14s %10.2f %10.2f  (GB/s of fp32 parameters)\n",
                with_penalty ? "push_int8_penalty_dn" : "push_int8_dn", "-", seconds * 1e3, gbps);
    if (with_penalty) push_param_gbps = gbps;
  }

  // Keep the results observable so no loop can be optimised away.
  double checksum = 0;
  for (size_t i = 0; i < n; i += 4099) checksum += a.data()[i] + theta.data()[i] + d.data()[i];
  std::printf("checksum=%g\n", checksum);
  std::printf(
      "summary dn_apply_gbps=%.2f triad_gbps=%.2f ratio=%.2f "
      "push_int8_penalty_dn_param_gbps=%.2f\n",
      dn_gbps, triad_gbps, dn_gbps / triad_gbps, push_param_gbps);
  return 0;
}

}  // namespace
}  // namespace aloe::kernels

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Measures STREAM-triad bandwidth and the fused Delayed Nesterov apply on large tensors "
      "with OpenMP threads; prints GB/s of each and their ratio.");
  absl::ParseCommandLine(argc, argv);
  return aloe::kernels::Main();
}
