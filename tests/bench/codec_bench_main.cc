// aloe-bench-codec: throughput of the wire codecs (kernels/cpu/codec_kernels.h) against memcpy of
// the same bytes, measured in the same run on the same threads.
//
// A --mib MiB float32 tensor of N(0, 1) values is split into chunks of --chunk_values values
// (one wire message each, as the worker and server do) and every operation runs over all
// chunks with --threads OpenMP threads (static schedule). Every operation runs once untimed
// (page faults, caches), then --reps rounds run every operation in turn (interleaved, so a noisy
// neighbour on a shared host hurts all rows alike); each operation's best time counts.
//
// All rates are GB/s (1e9 bytes/s) of float32 input, i.e. 4 bytes per value however many bytes
// the operation itself moves, so the rows compare directly: memcpy copies the 4 bytes/value
// (reads 4, writes 4); int8 (int4) encode+decode runs the whole encode pass and then the whole
// decode pass in one timed region (what a round trip through the wire costs the two ends
// together).
//
// Output: a table, then the compression ratios and measured round-trip errors, then exactly one
// final line
//   codec: int8_encode_decode_gbps=<X> ratio=<int8 enc+dec / memcpy> (memcpy <Z> GB/s)
//   int4_encode_decode_gbps=<Y> int4_ratio=<int4 enc+dec / memcpy>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "common/flags_usage.h"
#include "kernels/cpu/codec_kernels.h"

ABSL_FLAG(int32_t, mib, 256, "Tensor size in MiB of float32");
ABSL_FLAG(int32_t, threads, 2, "OpenMP threads; chunks are split among them");
ABSL_FLAG(int32_t, reps, 5, "Timed rounds over all operations (best per operation counts)");
ABSL_FLAG(int32_t, block_size, 256, "int8 block size B");
ABSL_FLAG(int32_t, int4_block_size, 64, "int4 block size (even)");
ABSL_FLAG(int32_t, chunk_values, 262144, "Values per chunk (one wire message; 1 MiB of fp32)");

namespace aloe::kernels {
namespace {

struct Chunking {
  size_t n;
  size_t chunk;
  size_t count;
  size_t Begin(size_t c) const { return c * chunk; }
  size_t Len(size_t c) const { return std::min(chunk, n - c * chunk); }
};

// Runs fn(c) for every chunk across the OpenMP team; returns false if any call failed.
bool ForChunks(const Chunking& ch, int threads, const std::function<absl::Status(size_t)>& fn) {
  int failures = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : failures)
  for (size_t c = 0; c < ch.count; ++c) {
    const absl::Status s = fn(c);
    if (!s.ok()) {
      std::fprintf(stderr, "chunk %zu: %s\n", c, std::string(s.message()).c_str());
      ++failures;
    }
  }
  return failures == 0;
}

int Main() {
  const size_t n = static_cast<size_t>(absl::GetFlag(FLAGS_mib)) * (size_t{1} << 20) / 4;
  const int threads = absl::GetFlag(FLAGS_threads);
  const int reps = absl::GetFlag(FLAGS_reps);
  const size_t block = static_cast<size_t>(absl::GetFlag(FLAGS_block_size));
  const size_t block4 = static_cast<size_t>(absl::GetFlag(FLAGS_int4_block_size));
  const size_t chunk = static_cast<size_t>(absl::GetFlag(FLAGS_chunk_values));
  if (n == 0 || threads < 1 || reps < 1 || chunk == 0 || block < kInt8MinBlockSize ||
      block > kInt8MaxBlockSize || !Int4BlockSizeValid(block4)) {
    std::fprintf(stderr, "aloe-bench-codec: bad flags\n");
    return 2;
  }
  const Chunking ch{n, chunk, (n + chunk - 1) / chunk};
  const size_t int8_stride = Int8EncodedSize(chunk, block);  // bytes per encoded chunk slot
  const size_t int4_stride = Int4EncodedSize(chunk, block4);

  // Buffers are first touched by the threads that use them (static schedule, same chunks).
  std::vector<float> x(n);
  std::vector<float> y(n);
  std::vector<float> residual(n);
  std::vector<uint8_t> bf16(Bf16EncodedSize(n));
  std::vector<uint8_t> int8(int8_stride * ch.count);
  std::vector<uint8_t> int4(int4_stride * ch.count);
  ForChunks(ch, threads, [&](size_t c) {
    std::mt19937 rng(static_cast<unsigned>(c) * 7919u + 17u);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (size_t i = ch.Begin(c); i < ch.Begin(c) + ch.Len(c); ++i) x[i] = dist(rng);
    return absl::OkStatus();
  });

  auto bf16_encode = [&](size_t c) {
    return Bf16Encode(x.data() + ch.Begin(c), ch.Len(c), bf16.data() + 2 * ch.Begin(c), nullptr);
  };
  auto bf16_decode = [&](size_t c) {
    return Bf16Decode(bf16.data() + 2 * ch.Begin(c), Bf16EncodedSize(ch.Len(c)),
                      y.data() + ch.Begin(c), ch.Len(c));
  };
  auto int8_encode = [&](size_t c) {
    return Int8BlockwiseEncode(x.data() + ch.Begin(c), ch.Len(c), block,
                               int8.data() + c * int8_stride, nullptr);
  };
  auto int8_encode_residual = [&](size_t c) {
    return Int8BlockwiseEncode(x.data() + ch.Begin(c), ch.Len(c), block,
                               int8.data() + c * int8_stride, residual.data() + ch.Begin(c));
  };
  auto int8_decode = [&](size_t c) {
    return Int8BlockwiseDecode(int8.data() + c * int8_stride, Int8EncodedSize(ch.Len(c), block),
                               y.data() + ch.Begin(c), ch.Len(c));
  };
  auto int8_decode_accumulate = [&](size_t c) {
    return Int8BlockwiseDecodeAccumulate(int8.data() + c * int8_stride,
                                         Int8EncodedSize(ch.Len(c), block), 0.5f,
                                         y.data() + ch.Begin(c), ch.Len(c));
  };
  auto int4_encode = [&](size_t c) {
    return Int4BlockwiseEncode(x.data() + ch.Begin(c), ch.Len(c), block4,
                               int4.data() + c * int4_stride, nullptr);
  };
  auto int4_encode_residual = [&](size_t c) {
    return Int4BlockwiseEncode(x.data() + ch.Begin(c), ch.Len(c), block4,
                               int4.data() + c * int4_stride, residual.data() + ch.Begin(c));
  };
  auto int4_decode = [&](size_t c) {
    return Int4BlockwiseDecode(int4.data() + c * int4_stride, Int4EncodedSize(ch.Len(c), block4),
                               y.data() + ch.Begin(c), ch.Len(c));
  };
  auto int4_decode_accumulate = [&](size_t c) {
    return Int4BlockwiseDecodeAccumulate(int4.data() + c * int4_stride,
                                         Int4EncodedSize(ch.Len(c), block4), 0.5f,
                                         y.data() + ch.Begin(c), ch.Len(c));
  };
  auto memcpy_chunk = [&](size_t c) {
    std::memcpy(y.data() + ch.Begin(c), x.data() + ch.Begin(c), ch.Len(c) * sizeof(float));
    return absl::OkStatus();
  };

  // Operations in dependency order (each decode reads what the encode before it wrote).
  struct Op {
    const char* name;
    std::function<bool()> run;
    double best_seconds = std::numeric_limits<double>::infinity();
  };
  auto over = [&](const std::function<absl::Status(size_t)>& fn) {
    return [&ch, threads, fn] { return ForChunks(ch, threads, fn); };
  };
  std::vector<Op> ops = {
      {"memcpy (baseline)", over(memcpy_chunk)},
      {"bf16 encode", over(bf16_encode)},
      {"bf16 decode", over(bf16_decode)},
      {"int8 encode", over(int8_encode)},
      {"int8 encode + residual", over(int8_encode_residual)},
      {"int8 decode", over(int8_decode)},
      {"int8 decode-accumulate", over(int8_decode_accumulate)},
      {"int8 encode+decode",
       [&] { return ForChunks(ch, threads, int8_encode) && ForChunks(ch, threads, int8_decode); }},
      {"int4 encode", over(int4_encode)},
      {"int4 encode + residual", over(int4_encode_residual)},
      {"int4 decode", over(int4_decode)},
      {"int4 decode-accumulate", over(int4_decode_accumulate)},
      {"int4 encode+decode",
       [&] { return ForChunks(ch, threads, int4_encode) && ForChunks(ch, threads, int4_decode); }},
  };
  // One untimed round (page faults, caches), then `reps` rounds of every operation in turn, so
  // that on a shared host every operation gets the same chances at a quiet moment.
  for (Op& op : ops) {
    if (!op.run()) {
      std::fprintf(stderr, "aloe-bench-codec: %s failed\n", op.name);
      return 1;
    }
  }
  for (int r = 0; r < reps; ++r) {
    for (Op& op : ops) {
      const auto start = std::chrono::steady_clock::now();
      if (!op.run()) {
        std::fprintf(stderr, "aloe-bench-codec: %s failed\n", op.name);
        return 1;
      }
      const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
      op.best_seconds = std::min(op.best_seconds, elapsed.count());
    }
  }
  const double memcpy_s = ops.front().best_seconds;
  const double roundtrip_s = ops[7].best_seconds;
  const double int4_roundtrip_s = ops.back().best_seconds;

  const double fp32_bytes = 4.0 * static_cast<double>(n);
  std::printf(
      "tensor %zu MiB fp32 (%zu values), %zu chunks of %zu values, %d threads, "
      "int8 block %zu, int4 block %zu, best of %d interleaved rounds\n",
      static_cast<size_t>(fp32_bytes) >> 20, n, ch.count, chunk, threads, block, block4, reps);
  std::printf("%-26s %10s %12s %8s\n", "operation", "ms", "GB/s fp32", "/memcpy");
  for (const Op& op : ops) {
    const double gbps = fp32_bytes / op.best_seconds / 1e9;
    std::printf("%-26s %10.2f %12.2f %8.2f\n", op.name, op.best_seconds * 1e3, gbps,
                memcpy_s / op.best_seconds);
  }

  // Round-trip errors of the last bf16 and int8 round trips over the whole tensor, against the
  // documented per-element bounds (codec_kernels.h).
  if (!ForChunks(ch, threads, bf16_decode)) return 1;
  double bf16_max_rel = 0.0;
  for (size_t i = 0; i < n; ++i) {
    if (std::fabs(x[i]) >= std::numeric_limits<float>::min()) {
      bf16_max_rel = std::max(bf16_max_rel, std::fabs(static_cast<double>(y[i]) - x[i]) /
                                                std::fabs(static_cast<double>(x[i])));
    }
  }
  // The largest |y - x| over the tensor and the largest |y - x| / half-step, a half step being
  // max|x_block| / (2 max_level) of the element's block (chunks start new blocks).
  auto blockwise_errors = [&](size_t b_size, double max_level, double* max_abs,
                              double* max_over_bound) {
    *max_abs = 0.0;
    *max_over_bound = 0.0;
    for (size_t c = 0; c < ch.count; ++c) {
      for (size_t b = ch.Begin(c); b < ch.Begin(c) + ch.Len(c); b += b_size) {
        const size_t e = std::min(b + b_size, ch.Begin(c) + ch.Len(c));
        double m = 0.0;
        for (size_t i = b; i < e; ++i) m = std::max(m, std::fabs(static_cast<double>(x[i])));
        for (size_t i = b; i < e; ++i) {
          const double err = std::fabs(static_cast<double>(y[i]) - x[i]);
          *max_abs = std::max(*max_abs, err);
          if (m > 0) *max_over_bound = std::max(*max_over_bound, err / (m / (2 * max_level)));
        }
      }
    }
  };
  // Bytes of the whole tensor encoded chunk by chunk.
  auto encoded_bytes = [&](size_t (*size)(size_t, size_t), size_t b_size) {
    return static_cast<double>(size(chunk, b_size)) * static_cast<double>(ch.count - 1) +
           static_cast<double>(size(ch.Len(ch.count - 1), b_size));
  };
  double int8_max_abs = 0.0;
  double int8_max_over_bound = 0.0;
  if (!ForChunks(ch, threads, int8_decode)) return 1;
  blockwise_errors(block, 127.0, &int8_max_abs, &int8_max_over_bound);
  double int4_max_abs = 0.0;
  double int4_max_over_bound = 0.0;
  if (!ForChunks(ch, threads, int4_decode)) return 1;
  blockwise_errors(block4, 7.0, &int4_max_abs, &int4_max_over_bound);
  std::printf("compression: bf16 %.2fx, int8 (B=%zu) %.2fx, int4 (B=%zu) %.2fx of fp32 bytes\n",
              fp32_bytes / static_cast<double>(Bf16EncodedSize(n)), block,
              fp32_bytes / encoded_bytes(Int8EncodedSize, block), block4,
              fp32_bytes / encoded_bytes(Int4EncodedSize, block4));
  std::printf(
      "max error: bf16 relative %.3g (bound 2^-8 = %.3g); int8 absolute %.3g, "
      "%.4f of the bound max|x_block|/254; int4 absolute %.3g, %.4f of the bound "
      "max|x_block|/14\n",
      bf16_max_rel, std::ldexp(1.0, -8), int8_max_abs, int8_max_over_bound, int4_max_abs,
      int4_max_over_bound);

  const double roundtrip_gbps = fp32_bytes / roundtrip_s / 1e9;
  const double memcpy_gbps = fp32_bytes / memcpy_s / 1e9;
  const double int4_roundtrip_gbps = fp32_bytes / int4_roundtrip_s / 1e9;
  std::printf(
      "codec: int8_encode_decode_gbps=%.2f ratio=%.2f (memcpy %.2f GB/s) "
      "int4_encode_decode_gbps=%.2f int4_ratio=%.2f\n",
      roundtrip_gbps, roundtrip_gbps / memcpy_gbps, memcpy_gbps, int4_roundtrip_gbps,
      int4_roundtrip_gbps / memcpy_gbps);
  return 0;
}

}  // namespace
}  // namespace aloe::kernels

int main(int argc, char** argv) {
  aloe::SetUsage("Throughput of the bf16, int8 and int4 wire codecs vs memcpy of the same bytes");
  absl::ParseCommandLine(argc, argv);
  return aloe::kernels::Main();
}
