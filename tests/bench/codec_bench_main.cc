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
// Low-rank rows (CODEC_LOWRANK, common/low_rank_push.h and common/low_rank_wire.h): each of the
// --threads threads owns one --lowrank_rows x --lowrank_cols matrix of N(0, 1) values, pushed as
// a one-tensor layer at every rank of --lowrank_ranks with FP32 and with INT4 factors. "encode"
// is the worker's whole path (LowRankPushEncoder::EncodeLayer: power iteration warm-started from
// the previous round, orthonormalisation, factor encoding into wire chunks), "+ residual" adds
// the error-feedback residual, and "decode" is the server's: DecodeChunk of every chunk into its
// staging range. Rates are GB/s of the matrices' float32 bytes, like the other rows.
//
// Output: a table, then the compression ratios and measured round-trip errors, then exactly one
// final line
//   codec: int8_encode_decode_gbps=<X> ratio=<int8 enc+dec / memcpy> (memcpy <Z> GB/s)
//   int4_encode_decode_gbps=<Y> int4_ratio=<int4 enc+dec / memcpy>
//   lowrank_r<R>_int4_encode_gbps=<E> lowrank_r<R>_int4_decode_gbps=<D>
//   lowrank_r<R>_int4_compression=<fp32 bytes / wire bytes>
// where R is the largest rank of --lowrank_ranks.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/flags_usage.h"
#include "common/low_rank_push.h"
#include "common/tensor_codec.h"
#include "kernels/cpu/codec_kernels.h"

ABSL_FLAG(int32_t, mib, 256, "Tensor size in MiB of float32");
ABSL_FLAG(int32_t, threads, 2, "OpenMP threads; chunks are split among them");
ABSL_FLAG(int32_t, reps, 5, "Timed rounds over all operations (best per operation counts)");
ABSL_FLAG(int32_t, block_size, 256, "int8 block size B");
ABSL_FLAG(int32_t, int4_block_size, 64, "int4 block size (even)");
ABSL_FLAG(int32_t, chunk_values, 262144, "Values per chunk (one wire message; 1 MiB of fp32)");
ABSL_FLAG(int32_t, lowrank_rows, 768, "Rows of each low-rank matrix (one per thread)");
ABSL_FLAG(int32_t, lowrank_cols, 3072, "Columns of each low-rank matrix");
ABSL_FLAG(std::string, lowrank_ranks, "16,64", "Comma-separated ranks of the low-rank rows");

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

// One low-rank row group: a rank and a factor codec, an encoder per thread (each holds its
// matrix's warm start) and the chunks of its last push.
struct LowRankCase {
  uint32_t rank = 0;
  v1::Codec factor = v1::CODEC_FP32;
  std::string label;
  std::vector<std::unique_ptr<LowRankPushEncoder>> encoders;
  std::vector<std::vector<EncodedChunk>> chunks;
};

// A model of one layer "m" holding one rows x cols tensor, pushed low-rank at `rank`.
void ConfigureLowRank(LowRankCase* lr, int threads, uint32_t rows, uint32_t cols,
                      size_t int4_block) {
  v1::ModelSpec spec;
  v1::LayerSpec* layer = spec.add_layers();
  layer->set_name("m");
  layer->set_num_elements(static_cast<uint64_t>(rows) * cols);
  v1::TensorSpec* tensor = layer->add_tensors();
  tensor->set_name("w");
  tensor->add_shape(rows);
  tensor->add_shape(cols);
  v1::TransportConfig transport;
  transport.set_int4_block_size(static_cast<uint32_t>(int4_block));
  v1::LayerCodec* codec = transport.add_layer_codecs();
  codec->set_layer("m");
  codec->set_codec(v1::CODEC_LOWRANK);
  codec->set_rank(lr->rank);
  codec->set_factor_codec(lr->factor);
  for (int t = 0; t < threads; ++t) {
    lr->encoders.push_back(std::make_unique<LowRankPushEncoder>());
    lr->encoders.back()->Configure(transport, spec);
  }
  lr->chunks.resize(threads);
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
  const uint32_t lr_rows = static_cast<uint32_t>(std::max(0, absl::GetFlag(FLAGS_lowrank_rows)));
  const uint32_t lr_cols = static_cast<uint32_t>(std::max(0, absl::GetFlag(FLAGS_lowrank_cols)));
  std::vector<uint32_t> lr_ranks;
  for (absl::string_view r :
       absl::StrSplit(absl::GetFlag(FLAGS_lowrank_ranks), ',', absl::SkipWhitespace())) {
    uint32_t rank = 0;
    if (!absl::SimpleAtoi(r, &rank) || rank == 0) {
      std::fprintf(stderr, "aloe-bench-codec: bad --lowrank_ranks\n");
      return 2;
    }
    lr_ranks.push_back(rank);
  }
  if (lr_rows == 0 || lr_cols == 0 || lr_ranks.empty()) {
    std::fprintf(stderr, "aloe-bench-codec: bad low-rank flags\n");
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
  // Low-rank: matrix t of lr_x is thread t's; lr_y is the server's staging for it.
  const size_t lr_n = static_cast<size_t>(lr_rows) * lr_cols;
  const Chunking per_thread{static_cast<size_t>(threads), 1, static_cast<size_t>(threads)};
  std::vector<float> lr_x(lr_n * threads);
  std::vector<float> lr_y(lr_n * threads);
  std::vector<float> lr_residual(lr_n * threads);
  ForChunks(per_thread, threads, [&](size_t t) {
    std::mt19937 rng(static_cast<unsigned>(t) * 104729u + 3u);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (size_t i = 0; i < lr_n; ++i) lr_x[t * lr_n + i] = dist(rng);
    return absl::OkStatus();
  });
  std::vector<LowRankCase> lr_cases;
  for (uint32_t rank : lr_ranks) {
    for (v1::Codec factor : {v1::CODEC_FP32, v1::CODEC_INT4_BLOCKWISE}) {
      LowRankCase& lr = lr_cases.emplace_back();
      lr.rank = rank;
      lr.factor = factor;
      lr.label =
          absl::StrFormat("lowrank r%d %s", rank, factor == v1::CODEC_FP32 ? "fp32" : "int4");
      ConfigureLowRank(&lr, threads, lr_rows, lr_cols, block4);
    }
  }
  auto lr_encode = [&](LowRankCase* lr, bool with_residual) {
    return [&, lr, with_residual] {
      return ForChunks(per_thread, threads, [&, lr, with_residual](size_t t) {
        lr->chunks[t].clear();
        return lr->encoders[t]->EncodeLayer(0, absl::MakeConstSpan(lr_x.data() + t * lr_n, lr_n),
                                            with_residual ? lr_residual.data() + t * lr_n : nullptr,
                                            &lr->chunks[t], kMaxChunkBytes);
      });
    };
  };
  auto lr_decode = [&](LowRankCase* lr) {
    return [&, lr] {
      return ForChunks(per_thread, threads, [&, lr](size_t t) -> absl::Status {
        for (const EncodedChunk& c : lr->chunks[t]) {
          absl::StatusOr<size_t> elements = EncodedElementCount(c.codec, c.payload);
          if (!elements.ok()) return elements.status();
          absl::Status s = DecodeChunk(
              c.codec, c.payload, absl::MakeSpan(lr_y.data() + t * lr_n + c.offset, *elements));
          if (!s.ok()) return s;
        }
        return absl::OkStatus();
      });
    };
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
  const size_t first_lr_op = ops.size();
  for (LowRankCase& lr : lr_cases) {
    ops.push_back({nullptr, lr_encode(&lr, false)});
    ops.push_back({nullptr, lr_encode(&lr, true)});
    ops.push_back({nullptr, lr_decode(&lr)});
  }
  std::vector<std::string> lr_names;
  for (const LowRankCase& lr : lr_cases) {
    lr_names.push_back(lr.label + " encode");
    lr_names.push_back(lr.label + " encode + residual");
    lr_names.push_back(lr.label + " decode");
  }
  for (size_t i = first_lr_op; i < ops.size(); ++i) ops[i].name = lr_names[i - first_lr_op].c_str();
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
  const double int4_roundtrip_s = ops[12].best_seconds;

  const double fp32_bytes = 4.0 * static_cast<double>(n);
  std::printf(
      "tensor %zu MiB fp32 (%zu values), %zu chunks of %zu values, %d threads, "
      "int8 block %zu, int4 block %zu, best of %d interleaved rounds\n",
      static_cast<size_t>(fp32_bytes) >> 20, n, ch.count, chunk, threads, block, block4, reps);
  const double lr_bytes = 4.0 * static_cast<double>(lr_n) * threads;
  std::printf("low-rank: %d matrices of %u x %u (one per thread), int4 factor block %zu\n", threads,
              lr_rows, lr_cols, block4);
  std::printf("%-36s %10s %12s %8s\n", "operation", "ms", "GB/s fp32", "/memcpy");
  const double memcpy_gbps_row = fp32_bytes / memcpy_s / 1e9;
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    const double gbps = (i < first_lr_op ? fp32_bytes : lr_bytes) / op.best_seconds / 1e9;
    std::printf("%-36s %10.2f %12.2f %8.2f\n", op.name, op.best_seconds * 1e3, gbps,
                gbps / memcpy_gbps_row);
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

  // Low-rank: wire bytes of one matrix's push (every chunk repeats Q) and the decode's
  // relative Frobenius error ||M - P Q^T|| / ||M|| of thread 0's matrix.
  auto lr_wire_bytes = [](const LowRankCase& lr) {
    double bytes = 0;
    for (const EncodedChunk& c : lr.chunks[0]) bytes += static_cast<double>(c.payload.size());
    return bytes;
  };
  for (size_t k = 0; k < lr_cases.size(); ++k) {
    const LowRankCase& lr = lr_cases[k];
    if (!ops[first_lr_op + 3 * k + 2].run()) return 1;
    double err = 0, norm = 0;
    for (size_t i = 0; i < lr_n; ++i) {
      const double d = static_cast<double>(lr_x[i]) - lr_y[i];
      err += d * d;
      norm += static_cast<double>(lr_x[i]) * lr_x[i];
    }
    std::printf("compression: %s %.1fx of fp32 bytes (%zu chunks), relative error %.4f\n",
                lr.label.c_str(), 4.0 * static_cast<double>(lr_n) / lr_wire_bytes(lr),
                lr.chunks[0].size(), std::sqrt(err / norm));
  }

  const double roundtrip_gbps = fp32_bytes / roundtrip_s / 1e9;
  const double memcpy_gbps = fp32_bytes / memcpy_s / 1e9;
  const double int4_roundtrip_gbps = fp32_bytes / int4_roundtrip_s / 1e9;
  // The largest rank with int4 factors: the last case.
  const size_t last = lr_cases.size() - 1;
  const LowRankCase& lr_last = lr_cases[last];
  std::printf(
      "codec: int8_encode_decode_gbps=%.2f ratio=%.2f (memcpy %.2f GB/s) "
      "int4_encode_decode_gbps=%.2f int4_ratio=%.2f lowrank_r%u_int4_encode_gbps=%.2f "
      "lowrank_r%u_int4_decode_gbps=%.2f lowrank_r%u_int4_compression=%.1f\n",
      roundtrip_gbps, roundtrip_gbps / memcpy_gbps, memcpy_gbps, int4_roundtrip_gbps,
      int4_roundtrip_gbps / memcpy_gbps, lr_last.rank,
      lr_bytes / ops[first_lr_op + 3 * last].best_seconds / 1e9, lr_last.rank,
      lr_bytes / ops[first_lr_op + 3 * last + 2].best_seconds / 1e9, lr_last.rank,
      4.0 * static_cast<double>(lr_n) / lr_wire_bytes(lr_last));
  return 0;
}

}  // namespace
}  // namespace aloe::kernels

int main(int argc, char** argv) {
  aloe::SetUsage("Throughput of the bf16, int8 and int4 wire codecs vs memcpy of the same bytes");
  absl::ParseCommandLine(argc, argv);
  return aloe::kernels::Main();
}
