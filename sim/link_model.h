// The simulator's network model: each simulated worker has a link to the server with an uplink
// (pushes) and a downlink (pulls), each a FIFO of transfers in virtual time.
//
// A transfer of B bytes that is ready at time `at` starts when the transfers enqueued before it
// on the same direction have arrived, at max(at, the previous arrival), and arrives
// latency + B / rate later. Its bytes are received evenly over the last B / rate of that time
// (after the latency). Transfers do not pipeline: each pays the full latency. The two
// directions are independent (full duplex). Workers share nothing unless the server has a link
// of its own: then every transfer also queues on the server link's direction (a FIFO across all
// workers, in the order transfers are ready) and arrives when both links have delivered it. Not
// modelled: TCP slow start and congestion control, fair sharing of a link between transfers
// (they queue instead), packet loss, protocol framing (protobuf, gRPC, HTTP/2 headers), and the
// latency of control messages (task requests, heartbeats, push acknowledgements).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "proto/aloe.pb.h"

namespace aloe::sim {

// One worker's link, or the server's (its up rate then carries the pushes into the server, its
// down rate the pulls out of it: directions are named from the workers' side). The default is
// infinitely fast with zero latency: every transfer arrives when it is ready.
struct LinkSpec {
  double up_bytes_per_second = std::numeric_limits<double>::infinity();    // > 0
  double down_bytes_per_second = std::numeric_limits<double>::infinity();  // > 0
  double latency_seconds = 0;                                              // one way, >= 0
};

// Parses --links: comma-separated items, one per worker (or a single item for every worker),
// each RATE_MBIT:LATENCY_MS or UP_MBIT/DOWN_MBIT:LATENCY_MS, e.g. "100:20" or "10/100:35.5,inf:0".
// Rates are in Mbit/s (10^6 bits per second; "inf" = infinitely fast) and must be > 0; the
// latency is one way, in milliseconds, finite and >= 0. Empty text gives no links.
// kInvalidArgument naming the bad item otherwise.
absl::StatusOr<std::vector<LinkSpec>> ParseLinks(const std::string& text);

// Bytes of a pull of the spec's layers at `layers` (indices into spec.layers(); empty = every
// layer, the whole model): 4 bytes (float32) per parameter. Precondition: the indices are valid.
uint64_t PullBytes(const v1::ModelSpec& spec, absl::Span<const size_t> layers = {});
// The codec `layer` is pushed with: its transport.layer_codecs entry, else transport.codec;
// UNSPECIFIED = FP32.
v1::Codec LayerPushCodec(const v1::TransportConfig& transport, const v1::LayerSpec& layer);

// Bytes of a push of the pseudo-gradient of the layers at `layers` (empty = every layer) as the
// workers encode it: each layer with its codec (LayerPushCodec), in the chunks the worker sends
// (common/tensor_codec.h): FP32 4 bytes per value, BF16 2, INT8 blockwise 1 and INT4 blockwise
// 1/2 (rounded up) plus a 4-byte scale per block and a 16-byte header per chunk. A CODEC_LOWRANK
// layer (common/low_rank_push.h) at its configured rank r: per tensor that the encoder
// compresses, the chunks of its factors, (rows + cols) r values in the factor codec plus the
// chunk headers (common/low_rank_wire.h); every other tensor in the fallback codec
// (LowRankFallbackCodec). Payload bytes only. This is the planning estimate; the simulator moves
// the bytes of each push as encoded (sim/push_codec.h), which equal it for fixed-rank codecs.
uint64_t PushBytes(const v1::ModelSpec& spec, const v1::TransportConfig& transport,
                   absl::Span<const size_t> layers = {});

// One direction of a link: a FIFO of transfers (see the file comment). Not thread-safe.
class Link {
 public:
  // rate > 0 (infinity allowed), latency >= 0 and finite; the caller validates.
  Link(double bytes_per_second, double latency_seconds);

  // Enqueues a transfer of `bytes` ready at `at` and returns its arrival time. Transfers are
  // served in the order they are enqueued. With `shared` (the server's link, which every worker's
  // transfers of this direction also pass) the transfer is enqueued there too, from the same
  // `at`, and arrives when both links have delivered it: at the later of the two arrivals. This
  // link is busy until then and receives the bytes over the last bytes / rate before it.
  absl::Duration Enqueue(uint64_t bytes, absl::Duration at, Link* shared = nullptr);

  // The arrival time of the last transfer (zero before the first).
  absl::Duration busy_until() const { return busy_until_; }
  uint64_t bytes() const { return bytes_; }
  size_t transfers() const { return transfers_.size(); }

  // The most bytes received within any closed window [t, t + window] of virtual time, divided
  // by the window's seconds. A transfer's bytes count in proportion to the part of its
  // receiving time the window covers; an instant transfer (infinite rate) counts whole in every
  // window that contains its arrival. 0 without transfers. `window` must be > 0.
  double PeakBytesPerSecond(absl::Duration window) const;

 private:
  struct Transfer {
    double begin = 0;  // seconds: first byte received (start + latency)
    double end = 0;    // seconds: arrival
    uint64_t bytes = 0;
  };
  // Bytes received up to and including x (or strictly before x when `before`).
  double ReceivedBy(double x, bool before) const;

  double bytes_per_second_;
  absl::Duration latency_;
  absl::Duration busy_until_;
  uint64_t bytes_ = 0;
  std::vector<Transfer> transfers_;
  std::vector<double> prefix_;  // prefix_[i] = bytes of transfers_[0, i)
};

}  // namespace aloe::sim
