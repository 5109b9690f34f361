// Hostile input over real gRPC: 1,000 malformed pushes, drawn deterministically from 23 kinds of
// damage (bad layer ids, offsets, sizes, codecs, encodings, NaN/Inf and oversized values,
// stale or foreign headers, broken stream framing), each sent to a live aloe-server by a raw
// client. Every one must be rejected with the right status code and a message naming the
// problem, counted in aloe_updates_rejected_total, and leave the model bytes unchanged; the
// well-formed push that follows is applied.
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "common/push_wire.h"
#include "common/raw_push.h"
#include "common/tensor_codec.h"
#include "tests/integration/loopback_cluster.h"
#include "tests/testing/subprocess.h"
#include "worker/client.h"

namespace aloe {
namespace {

using ::aloe::testing::FreePort;
using ::aloe::testing::HttpGet;
using ::aloe::testing::RawClientTest;
using ::aloe::testing::RawExchange;

constexpr int kPushes = 1000;

// One malformed push: the messages exactly as sent, and what the server must answer.
struct Malformed {
  std::string what;
  std::vector<v1::PushChunk> messages;
  grpc::StatusCode code = grpc::StatusCode::INVALID_ARGUMENT;
  std::string message;  // a substring of the error message
};

class HostileInputTest : public RawClientTest {
 protected:
  // Sends `messages` as one Push stream, as they are (no header added).
  grpc::Status PushRaw(const std::vector<v1::PushChunk>& messages) {
    grpc::ClientContext context;
    v1::PushReply reply;
    auto writer = parameters_->Push(&context, &reply);
    for (const v1::PushChunk& m : messages) {
      if (!writer->Write(m)) break;  // the server already answered
    }
    writer->WritesDone();
    return writer->Finish();
  }

  // Sends `messages` as one Push stream of raw message bytes, which need not parse.
  grpc::Status PushBytes(const std::vector<std::string>& messages) {
    grpc::ClientContext context;
    v1::PushReply reply;
    const grpc::internal::RpcMethod method(kPushMethod, grpc::internal::RpcMethod::CLIENT_STREAMING,
                                           channel_);
    std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
        grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel_.get(), method,
                                                                      &context, &reply));
    for (const std::string& m : messages) {
      grpc::Slice slice(m);
      if (!writer->Write(grpc::ByteBuffer(&slice, 1))) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  // Writes float `value` over element `index` of a float32 chunk.
  static void PutFloat(v1::PushChunk* chunk, size_t index, float value) {
    chunk->mutable_data()->replace(index * 4, 4, reinterpret_cast<const char*>(&value), 4);
  }

  // The i-th malformed push, damaging a well-formed one (`header` + `chunks`) with kind i % 23.
  Malformed Make(int i, std::mt19937_64& rng, const v1::PushHeader& header,
                 const std::vector<v1::PushChunk>& good) {
    Malformed m;
    v1::PushHeader h = header;
    std::vector<v1::PushChunk> c = good;
    auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
    const size_t r = pick(c.size());
    const size_t elements = c[r].data().size() / 4;
    bool with_header = true;
    switch (i % 23) {
      case 0:
        m.what = "unknown layer id";
        c[r].set_layer_id(spec_.layers_size() + static_cast<uint32_t>(pick(1000000)));
        m.message = "unknown layer";
        break;
      case 1:
        m.what = "chunk offset skips elements";
        c[r].set_offset(c[r].offset() + 1 + pick(1000));
        m.message = "expected offset";
        break;
      case 2:
        m.what = "payload not a whole number of float32";
        c[r].mutable_data()->resize(c[r].data().size() - 1 - pick(3));
        m.message = "not float32";
        break;
      case 3:
        m.what = "chunk runs past the layer's end";
        c.back().mutable_data()->append(std::string(4 * (1 + pick(64)), '\0'));
        m.message = "wrong size";
        break;
      case 4:
        m.what = "a chunk is missing";
        c.erase(c.begin() + r);
        m.message = "layer";  // "incomplete" or "expected offset", both naming the layer
        break;
      case 5:
        m.what = "NaN";
        PutFloat(&c[r], pick(elements), std::nanf(""));
        m.message = "non-finite";
        break;
      case 6:
        m.what = "infinity";
        PutFloat(&c[r], pick(elements), pick(2) ? INFINITY : -INFINITY);
        m.message = "non-finite";
        break;
      case 7: {
        m.what = "finite value beyond the magnitude limit";
        const float big = pick(4) == 0 ? FLT_MAX : 1e6f * static_cast<float>(2 + pick(1000));
        PutFloat(&c[r], pick(elements), pick(2) ? big : -big);
        m.message = "magnitude limit";
        break;
      }
      case 8:
        m.what = "stale base version";
        h.set_base_version(header.base_version() + 1 + pick(1000));
        m.code = grpc::StatusCode::FAILED_PRECONDITION;
        m.message = "stale version";
        break;
      case 9:
        m.what = "task that is not the worker's";
        h.set_task_id(header.task_id() + 1 + pick(1000));
        m.code = grpc::StatusCode::FAILED_PRECONDITION;
        m.message = "no open training task";
        break;
      case 10:
        m.what = "unknown worker";
        h.set_worker_id(header.worker_id() + 1000 + pick(1000000));
        m.code = grpc::StatusCode::NOT_FOUND;
        m.message = "not a live member";
        break;
      case 11:
        m.what = "unknown chunk codec";
        c[r].set_codec(static_cast<v1::Codec>(v1::Codec_ARRAYSIZE + pick(1000)));
        m.message = "unknown codec";
        break;
      case 12:
        m.what = "unknown header codec";
        h.set_codec(static_cast<v1::Codec>(v1::Codec_ARRAYSIZE + pick(1000)));
        m.message = "unsupported codec";
        break;
      case 13:
        m.what = "absurd step count";
        h.set_steps_done(pick(2) ? 0 : 1000 * header.steps_done() + 1 + pick(1000));
        m.message = "steps_done";
        break;
      case 14:
        m.what = "non-finite loss or negative compute time";
        if (pick(2)) {
          h.set_train_loss(pick(2) ? std::nan("") : INFINITY);
        } else {
          h.set_compute_seconds(-1.0 - static_cast<double>(pick(100)));
        }
        m.message = "must be finite";
        break;
      case 15: {
        m.what = "header repeated in a later message";
        v1::PushChunk again;
        *again.mutable_header() = h;
        c.insert(c.begin() + pick(c.size() + 1), again);
        m.message = "header repeated";
        break;
      }
      case 16:
        m.what = "no header";
        with_header = false;
        m.message = "must carry the header";
        break;
      case 17:
        m.what = "empty stream";
        with_header = false;
        c.clear();
        m.message = "empty push stream";
        break;
      case 18:
        m.what = "chunk sent twice";
        c.insert(c.begin() + r, c[r]);
        m.message = "expected offset";
        break;
      case 19: {
        m.what = "int8 payload that is not a framed int8 buffer";
        std::string junk(1 + pick(64), '\0');
        for (char& b : junk) b = static_cast<char>(rng());
        c[r].set_codec(v1::CODEC_INT8_BLOCKWISE);
        *c[r].mutable_data() = junk;
        m.message = "INT8";
        break;
      }
      case 20:
        m.what = "bf16 payload of an odd byte count";
        c[r].set_codec(v1::CODEC_BF16);
        c[r].mutable_data()->resize(2 * pick(elements) + 1);
        m.message = "BF16";
        break;
      case 21: {
        m.what = "int4 payload that is not a framed int4 buffer";
        std::string junk(1 + pick(64), '\0');
        for (char& b : junk) b = static_cast<char>(rng());
        c[r].set_codec(v1::CODEC_INT4_BLOCKWISE);
        *c[r].mutable_data() = junk;
        m.message = "INT4";
        break;
      }
      case 22: {
        m.what = "int4 chunk with a NaN, Inf or negative scale, or cut short";
        std::vector<float> g(elements);
        std::memcpy(g.data(), c[r].data().data(), elements * sizeof(float));
        std::string encoded;
        EXPECT_TRUE(EncodeChunk(v1::CODEC_INT4_BLOCKWISE, g, 64, &encoded, nullptr).ok());
        const float bad_scales[] = {NAN, INFINITY, -0.5f};
        const size_t bad = pick(4);
        if (bad < 3) {
          const size_t block = pick((elements + 63) / 64);
          encoded.replace(16 + 4 * block, 4, reinterpret_cast<const char*>(&bad_scales[bad]), 4);
          m.message = "invalid scale";
        } else {
          encoded.resize(pick(encoded.size()));
          m.message = "int4 buffer";
        }
        c[r].set_codec(v1::CODEC_INT4_BLOCKWISE);
        *c[r].mutable_data() = encoded;
        break;
      }
    }
    if (with_header) {
      v1::PushChunk first;
      *first.mutable_header() = h;
      m.messages.push_back(first);
    }
    m.messages.insert(m.messages.end(), c.begin(), c.end());
    return m;
  }

  void Heartbeat(uint64_t worker) {
    grpc::ClientContext context;
    v1::HeartbeatRequest request;
    request.set_worker_id(worker);
    v1::HeartbeatReply reply;
    ASSERT_TRUE(coordinator_->Heartbeat(&context, request, &reply).ok());
  }

  // Sum over every series of aloe_updates_rejected_total in a fresh scrape.
  // Starts a server with outer SGD at lr 0.5, `extra_config` and a raw push listener at
  // *push_address, and connects to it; returns the gRPC port (0 when it did not start).
  int StartRawPushServer(const std::string& extra_config, std::string* push_address) {
    *push_address = absl::StrCat("127.0.0.1:", FreePort());
    const int port = StartServer(extra_config, "outer_optimizer { type: OUTER_SGD lr: 0.5 }",
                                 {"--push_listen=" + *push_address});
    if (port > 0) Connect(port);
    return port;
  }

  double RejectedTotal() {
    double sum = 0;
    for (absl::string_view line : absl::StrSplit(HttpGet(metrics_port_, "/metrics"), '\n')) {
      if (!absl::StartsWith(line, "aloe_updates_rejected_total{")) continue;
      double value = 0;
      if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value)) sum += value;
    }
    return sum;
  }
};

TEST_F(HostileInputTest, AThousandMalformedPushesAreRejectedAndChangeNothing) {
  const int port = StartServer("local_steps: 3\n");
  ASSERT_GT(port, 0);
  Connect(port);
  v1::JoinReply joined;
  v1::Task task;
  ASSERT_NO_FATAL_FAILURE(JoinTrainer("hostile", &joined, &task));
  const auto before = PullLatest(joined.worker_id());
  const v1::PushHeader header = HeaderFor(joined, task);
  const std::vector<v1::PushChunk> good = FullUpdate(0.25f);

  std::mt19937_64 rng(20261123);
  std::map<std::string, int> rejected_by_kind;
  for (int i = 0; i < kPushes; ++i) {
    const Malformed m = Make(i, rng, header, good);
    const grpc::Status status = PushRaw(m.messages);
    ASSERT_EQ(status.error_code(), m.code)
        << "push " << i << " (" << m.what << "): " << status.error_message();
    ASSERT_TRUE(absl::StrContains(status.error_message(), m.message))
        << "push " << i << " (" << m.what << "): \"" << status.error_message()
        << "\" does not name the problem (\"" << m.message << "\")";
    ++rejected_by_kind[m.what];
    if (i % 100 == 99) {
      ASSERT_EQ(PullLatest(joined.worker_id()), before) << "model changed by push " << i;
      ASSERT_NO_FATAL_FAILURE(Heartbeat(joined.worker_id()));  // keep the lease
    }
  }
  EXPECT_EQ(rejected_by_kind.size(), 23u);
  for (const auto& [what, n] : rejected_by_kind) EXPECT_GE(n, kPushes / 23) << what;
  EXPECT_EQ(RejectedTotal(), kPushes);
  EXPECT_EQ(Scraped("aloe_model_version"), 0);
  EXPECT_EQ(Scraped("aloe_updates_applied_total"), 0);
  EXPECT_EQ(PullLatest(joined.worker_id()), before);

  // The task is still open: its well-formed push goes through and moves the model.
  const grpc::Status ok = PushRaw([&] {
    std::vector<v1::PushChunk> messages(1);
    *messages[0].mutable_header() = header;
    messages.insert(messages.end(), good.begin(), good.end());
    return messages;
  }());
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(Scraped("aloe_model_version"), 1);
  EXPECT_NE(PullLatest(joined.worker_id()), before);
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0));
}

// Messages that are not PushChunks at all (the server parses push messages itself,
// common/push_wire.h): refused as malformed, first or later in the stream, and nothing changes.
TEST_F(HostileInputTest, UnparsableMessagesAreRejectedAndChangeNothing) {
  const int port = StartServer("local_steps: 3\n");
  ASSERT_GT(port, 0);
  Connect(port);
  v1::JoinReply joined;
  v1::Task task;
  ASSERT_NO_FATAL_FAILURE(JoinTrainer("garbled", &joined, &task));
  const auto before = PullLatest(joined.worker_id());
  v1::PushChunk first;
  *first.mutable_header() = HeaderFor(joined, task);
  std::vector<std::string> good = {first.SerializeAsString()};
  for (const v1::PushChunk& c : FullUpdate(0.25f)) good.push_back(c.SerializeAsString());
  const std::vector<std::pair<std::string, std::string>> garbage = {
      {std::string("\x22\x7f"
                   "abc",
                   5),
       "truncated length-delimited field (field 4)"},
      {std::string("\x10\xff\xff", 3), "bad varint (field 2)"},
      {std::string("\x0a\x02\x08\xff", 4), "bad header (field 1)"},
      {std::string("\x27", 1), "wire type 7"},
      {std::string("\x02\x00", 2), "field number 0"},
  };
  int pushes = 0;
  for (const auto& [bytes, says] : garbage) {
    for (size_t at : {size_t{0}, size_t{1}, good.size()}) {
      std::vector<std::string> messages = good;
      messages.insert(messages.begin() + at, bytes);
      const grpc::Status status = PushBytes(messages);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << says << " at " << at;
      EXPECT_TRUE(absl::StrContains(status.error_message(), "malformed push message: " + says))
          << status.error_message();
      ++pushes;
    }
  }
  EXPECT_EQ(RejectedTotal(), pushes);
  EXPECT_EQ(Scraped("aloe_model_version"), 0);
  EXPECT_EQ(PullLatest(joined.worker_id()), before);
  // The same stream without the garbage is applied.
  const grpc::Status ok = PushBytes(good);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(Scraped("aloe_model_version"), 1);
  EXPECT_NE(PullLatest(joined.worker_id()), before);
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0));
}

// Requests of the unary Coordinator methods that do not parse are INVALID_ARGUMENT naming the
// method and the message type (gRPC's generated handlers answer INTERNAL with no message); the
// methods go on serving well-formed requests, sent as bytes or through the stub.
TEST_F(HostileInputTest, UnparsableCoordinatorRequestsAreRefusedNamingTheMethod) {
  const int port = StartServer("local_steps: 3\n");
  ASSERT_GT(port, 0);
  Connect(port);
  auto call = [&](const std::string& name, const std::string& bytes, grpc::ByteBuffer* response) {
    grpc::ClientContext context;
    const std::string path = "/aloe.v1.Coordinator/" + name;
    const grpc::internal::RpcMethod method(path.c_str(), grpc::internal::RpcMethod::NORMAL_RPC,
                                           channel_);
    grpc::Slice slice(bytes);
    const grpc::ByteBuffer request(&slice, 1);
    return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel_.get(), method, &context, request, response);
  };
  const std::vector<std::pair<std::string, std::string>> methods = {
      {"Join", "JoinRequest"},        {"Heartbeat", "HeartbeatRequest"},
      {"RequestTask", "TaskRequest"}, {"ReportEval", "EvalReport"},
      {"Leave", "LeaveRequest"},
  };
  const std::vector<std::string> garbage = {std::string("\x10\xff\xff", 3),   // bad varint
                                            std::string("\x27\x00\x00", 3)};  // wire type 7
  for (const auto& [name, type] : methods) {
    for (const std::string& bytes : garbage) {
      grpc::ByteBuffer response;
      const grpc::Status status = call(name, bytes, &response);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << name;
      EXPECT_EQ(status.error_message(),
                absl::StrCat(name, ": the request (3 bytes) does not parse as aloe.v1.", type));
    }
  }
  v1::JoinReply joined;
  v1::Task task;
  ASSERT_NO_FATAL_FAILURE(JoinTrainer("after garbage", &joined, &task));
  EXPECT_EQ(task.kind(), v1::Task::TRAIN);
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_worker_id(joined.worker_id());
  grpc::ByteBuffer response;
  ASSERT_TRUE(call("Heartbeat", heartbeat.SerializeAsString(), &response).ok());
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string reply_bytes;
  for (const grpc::Slice& slice : slices) {
    reply_bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  v1::HeartbeatReply reply;
  ASSERT_TRUE(reply.ParseFromString(reply_bytes));
  EXPECT_EQ(reply.version(), 0u);
  EXPECT_EQ(Scraped("aloe_workers_joined_total"), 1);
  grpc::ClientContext context;
  v1::LeaveRequest leave;
  leave.set_worker_id(joined.worker_id());
  v1::LeaveReply left;
  ASSERT_TRUE(coordinator_->Leave(&context, leave, &left).ok());
  EXPECT_EQ(Scraped("aloe_workers_left_total"), 1);
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0));
}

// A single-process server receives at most max_staged_updates pushes at once (each holds a
// staging buffer of its whole update): here 1. A second push waits unread while the first is
// open, and is applied once the first ends.
TEST_F(HostileInputTest, PushesBeyondTheStagingSlotsWaitUntilOneEnds) {
  const int port = StartServer(
      "local_steps: 3\nmax_staged_updates: 1\n"
      "aggregation { mode: AGGREGATION_ASYNC min_workers: 1 grace_seconds: 0 }\n");
  ASSERT_GT(port, 0);
  Connect(port);
  v1::JoinReply joined_a, joined_b;
  v1::Task task_a, task_b;
  ASSERT_NO_FATAL_FAILURE(JoinTrainer("slow", &joined_a, &task_a));
  ASSERT_NO_FATAL_FAILURE(JoinTrainer("queued", &joined_b, &task_b));

  // The first push sends its header and holds the stream open: its slot stays taken.
  grpc::ClientContext context_a;
  v1::PushReply reply_a;
  auto writer_a = parameters_->Push(&context_a, &reply_a);
  v1::PushChunk first;
  *first.mutable_header() = HeaderFor(joined_a, task_a);
  ASSERT_TRUE(writer_a->Write(first));
  absl::SleepFor(absl::Milliseconds(300));  // the server has read the header and taken the slot

  absl::Notification b_done;
  grpc::Status status_b;
  std::thread b([&] {
    status_b = Push(HeaderFor(joined_b, task_b), FullUpdate(0.5f));
    b_done.Notify();
  });
  EXPECT_FALSE(b_done.WaitForNotificationWithTimeout(absl::Seconds(2)))
      << "a second push was received while the only slot was taken: " << status_b.error_message();
  EXPECT_EQ(Scraped("aloe_model_version"), 0);

  for (const v1::PushChunk& c : FullUpdate(0.25f)) ASSERT_TRUE(writer_a->Write(c));
  ASSERT_TRUE(writer_a->WritesDone());
  const grpc::Status status_a = writer_a->Finish();
  ASSERT_TRUE(status_a.ok()) << status_a.error_message();
  EXPECT_TRUE(b_done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  b.join();
  ASSERT_TRUE(status_b.ok()) << status_b.error_message();
  EXPECT_EQ(Scraped("aloe_model_version"), 2);
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0));
}

// A single-process server with --push_listen takes raw pushes of every layer's float32 values
// (JoinReply.push_address tells workers where) with the same rules as gRPC pushes: a wrong
// payload size, another codec, a NaN, a stranger's update or one of an unknown worker is refused
// naming the problem and changes nothing; a good one is applied as an outer SGD step.
TEST_F(HostileInputTest, RawPushesToTheSingleProcessServerAreScreenedAndApplied) {
  std::string push_address;
  const int port = StartRawPushServer("local_steps: 3\n", &push_address);
  ASSERT_GT(port, 0);
  v1::JoinReply joined;
  v1::Task task;
  ASSERT_NO_FATAL_FAILURE(JoinTrainer("raw", &joined, &task));
  EXPECT_EQ(joined.push_address(), push_address);
  EXPECT_EQ(joined.shard_addresses_size(), 0);
  const std::vector<std::vector<float>> before = PullLatest(joined.worker_id());

  // g[l][i] = 0.001 * (i % 7) - 0.002 * l: every element of every layer in the payload.
  std::vector<std::vector<float>> g(spec_.layers_size());
  std::string payload;
  for (int l = 0; l < spec_.layers_size(); ++l) {
    g[l].resize(spec_.layers(l).num_elements());
    for (size_t i = 0; i < g[l].size(); ++i) {
      g[l][i] = 0.001f * static_cast<float>(i % 7) - 0.002f * static_cast<float>(l);
    }
    payload.append(reinterpret_cast<const char*>(g[l].data()), g[l].size() * sizeof(float));
  }
  const v1::PushHeader header = HeaderFor(joined, task);
  auto raw = [&](const v1::PushHeader& h, const std::string& bytes, uint64_t declared) {
    absl::Status carried;
    v1::PushReply reply;
    const absl::Status transport =
        RawExchange(push_address, EncodeRawPushPrelude("", h, declared) + bytes, &carried, &reply);
    EXPECT_TRUE(transport.ok()) << transport;
    return carried;
  };
  struct Bad {
    std::string what;
    absl::Status status;
    std::string message;
  };
  std::vector<Bad> bad;
  bad.push_back({"short payload", raw(header, payload.substr(4), payload.size() - 4),
                 absl::StrFormat("payload of %d bytes, but the server expects %d",
                                 payload.size() - 4, payload.size())});
  v1::PushHeader bf16 = header;
  bf16.set_codec(v1::CODEC_BF16);
  bad.push_back({"bf16", raw(bf16, payload, payload.size()), "raw pushes carry float32 only"});
  std::string nan = payload;
  const float qnan = std::nanf("");
  const size_t at = spec_.layers(0).num_elements() + 5;  // layer 1, element 5
  std::memcpy(&nan[at * sizeof(float)], &qnan, sizeof(float));
  bad.push_back({"NaN", raw(header, nan, nan.size()), "layer 1"});
  v1::PushHeader stranger = header;
  stranger.set_worker_id(joined.worker_id() + 1000);
  bad.push_back({"unknown worker", raw(stranger, payload, payload.size()), ""});
  v1::PushHeader sliced = header;
  sliced.set_slices(2);
  sliced.set_slice(2);
  bad.push_back({"bad slice", raw(sliced, payload, payload.size()), "slice"});
  for (const Bad& b : bad) {
    EXPECT_FALSE(b.status.ok()) << b.what;
    EXPECT_TRUE(absl::StrContains(b.status.message(), b.message)) << b.what << ": " << b.status;
  }
  EXPECT_EQ(bad[0].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad[2].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RejectedTotal(), static_cast<double>(bad.size()));
  EXPECT_EQ(Scraped("aloe_model_version"), 0);
  EXPECT_EQ(PullLatest(joined.worker_id()), before);

  // The good push: theta - 0.5 * g, every element.
  ASSERT_TRUE(raw(header, payload, payload.size()).ok());
  EXPECT_EQ(Scraped("aloe_model_version"), 1);
  EXPECT_EQ(Scraped("aloe_raw_push_bytes_total"), static_cast<double>(payload.size()));
  const std::vector<std::vector<float>> after = PullLatest(joined.worker_id());
  ASSERT_EQ(after.size(), before.size());
  for (size_t l = 0; l < after.size(); ++l) {
    ASSERT_EQ(after[l].size(), g[l].size());
    for (size_t i = 0; i < g[l].size(); ++i) {
      ASSERT_EQ(after[l][i], before[l][i] - 0.5f * g[l][i]) << "layer " << l << " element " << i;
    }
  }
  // A pull in parts (three concurrent streams on connections of their own, each one slice of
  // every layer) delivers exactly what one stream does: the same version, values and bytes.
  for (const uint32_t parts : {1u, 3u}) {
    worker::ClientOptions options;
    options.address = absl::StrCat("127.0.0.1:", port);
    options.pull_streams = parts;
    worker::ServerClient client(options);
    std::vector<std::vector<float>> pulled;
    uint64_t bytes = 0;
    absl::StatusOr<uint64_t> version =
        client.Pull(joined.worker_id(), 0, /*latest=*/true, spec_, &pulled, &bytes);
    ASSERT_TRUE(version.ok()) << parts << " streams: " << version.status();
    EXPECT_EQ(*version, 1u) << parts << " streams";
    EXPECT_EQ(pulled, after) << parts << " streams";
    EXPECT_EQ(bytes, payload.size()) << parts << " streams";
  }
  // A retry of the same update is refused as a duplicate and changes nothing.
  EXPECT_FALSE(raw(header, payload, payload.size()).ok());
  EXPECT_EQ(Scraped("aloe_model_version"), 1);
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0));
}

// Partial synchronization (partial_sync.groups 2): a group push carries exactly its group's
// layers, over gRPC and raw pushes alike; anything else is refused naming the problem and
// changes nothing; a pull by group streams only the group's layers with its version.
TEST_F(HostileInputTest, GroupPushesCarryExactlyTheirGroupsLayers) {
  std::string push_address;
  const int port =
      StartRawPushServer("local_steps: 3\npartial_sync { groups: 2 }\n", &push_address);
  ASSERT_GT(port, 0);
  v1::JoinReply joined;
  v1::Task task;
  ASSERT_NO_FATAL_FAILURE(JoinTrainer("grouped", &joined, &task));
  ASSERT_EQ(joined.layer_groups_size(), spec_.layers_size());
  EXPECT_EQ(joined.partial_sync().groups(), 2u);
  const std::vector<uint32_t> groups(joined.layer_groups().begin(), joined.layer_groups().end());
  int other = -1;  // a layer of group 1
  for (int l = 0; l < spec_.layers_size() && other < 0; ++l) {
    if (groups[l] == 1) other = l;
  }
  ASSERT_GE(other, 0);
  const std::vector<std::vector<float>> before = PullLatest(joined.worker_id());

  worker::ClientOptions options;
  options.address = absl::StrCat("127.0.0.1:", port);
  options.raw_push = false;
  worker::ServerClient client(options);
  absl::StatusOr<v1::Task> granted = client.StartGroup(joined.worker_id(), 0);
  ASSERT_TRUE(granted.ok()) << granted.status();
  ASSERT_EQ(granted->kind(), v1::Task::TRAIN);
  EXPECT_EQ(granted->group_versions(0), 0u);
  // A pull of group 0: its layers only, at its version.
  std::vector<std::vector<float>> pulled(spec_.layers_size());
  uint64_t bytes = 0;
  absl::StatusOr<uint64_t> group_version = client.PullGroup(
      joined.worker_id(), 0, granted->group_versions(0), spec_, groups, &pulled, &bytes);
  ASSERT_TRUE(group_version.ok()) << group_version.status();
  EXPECT_EQ(*group_version, 0u);
  uint64_t group0_values = 0;
  for (int l = 0; l < spec_.layers_size(); ++l) {
    if (groups[l] == 0) {
      EXPECT_EQ(pulled[l], before[l]) << "layer " << l;
      group0_values += before[l].size();
    } else {
      EXPECT_TRUE(pulled[l].empty()) << "layer " << l;
    }
  }
  EXPECT_EQ(bytes, group0_values * sizeof(float));
  EXPECT_FALSE(client.PullGroup(joined.worker_id(), 7, 0, spec_, groups, &pulled, &bytes).ok());

  // g = 0.001 everywhere; the payload of group 0, and of the whole model.
  std::string group0, whole;
  std::vector<v1::PushChunk> group0_chunks, whole_chunks = FullUpdate(0.001f);
  for (const v1::PushChunk& c : whole_chunks) {
    if (groups[c.layer_id()] == 0) group0_chunks.push_back(c);
  }
  for (int l = 0; l < spec_.layers_size(); ++l) {
    std::string floats;
    AppendFloats(std::vector<float>(spec_.layers(l).num_elements(), 0.001f), &floats);
    whole += floats;
    if (groups[l] == 0) group0 += floats;
  }
  v1::PushHeader header = HeaderFor(joined, task);
  header.set_base_version(0);
  header.set_group(0);
  header.set_task_continues(true);
  auto raw = [&](const v1::PushHeader& h, const std::string& bytes) {
    absl::Status carried;
    v1::PushReply reply;
    const absl::Status transport = RawExchange(
        push_address, EncodeRawPushPrelude("", h, bytes.size()) + bytes, &carried, &reply);
    EXPECT_TRUE(transport.ok()) << transport;
    return carried;
  };
  v1::PushHeader group7 = header;
  group7.set_group(7);
  const grpc::Status whole_over_grpc = Push(header, whole_chunks);
  EXPECT_EQ(whole_over_grpc.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(whole_over_grpc.error_message(),
                                absl::StrFormat("belongs to layer group 1, but this push carries "
                                                "layer group 0")))
      << whole_over_grpc.error_message();
  const grpc::Status wrong_group = Push(group7, group0_chunks);
  EXPECT_EQ(wrong_group.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(wrong_group.error_message(), "layer group 7"))
      << wrong_group.error_message();
  const absl::Status whole_raw = raw(header, whole);
  EXPECT_EQ(whole_raw.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(whole_raw.message(), "in layer group 0")) << whole_raw;
  const absl::Status group7_raw = raw(group7, group0);
  EXPECT_TRUE(absl::StrContains(group7_raw.message(), "raw push of layer group 7")) << group7_raw;
  // Group 1 was not taken: refused by the server whichever transport.
  v1::PushHeader untaken = header;
  untaken.set_group(1);
  std::vector<v1::PushChunk> group1_chunks;
  for (const v1::PushChunk& c : whole_chunks) {
    if (groups[c.layer_id()] == 1) group1_chunks.push_back(c);
  }
  const grpc::Status not_taken = Push(untaken, group1_chunks);
  EXPECT_EQ(not_taken.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(Scraped("aloe_model_version"), 0);
  EXPECT_EQ(PullLatest(joined.worker_id()), before);

  // The good push of group 0, raw: theta - 0.5 * g on group 0's layers, the others unchanged.
  ASSERT_TRUE(raw(header, group0).ok());
  EXPECT_EQ(Scraped("aloe_model_version"), 1);
  const std::vector<std::vector<float>> after = PullLatest(joined.worker_id());
  for (int l = 0; l < spec_.layers_size(); ++l) {
    for (size_t i = 0; i < after[l].size(); ++i) {
      const float expected = groups[l] == 0 ? before[l][i] - 0.5f * 0.001f : before[l][i];
      ASSERT_EQ(after[l][i], expected) << "layer " << l << " element " << i;
    }
  }
  group_version = client.PullGroup(joined.worker_id(), 0, 1, spec_, groups, &pulled, &bytes);
  ASSERT_TRUE(group_version.ok()) << group_version.status();
  EXPECT_EQ(*group_version, 1u);

  // aloe-worker's client pushes group 1 raw (only its layers' bytes), and the push without
  // task_continues ends the task.
  worker::ClientOptions raw_options = options;
  raw_options.raw_push = true;
  worker::ServerClient raw_client(raw_options);
  ASSERT_TRUE(raw_client.SetShards({}, {}, push_address).ok());
  granted = raw_client.StartGroup(joined.worker_id(), 1);
  ASSERT_TRUE(granted.ok()) << granted.status();
  std::vector<std::vector<float>> g1(spec_.layers_size());
  uint64_t group1_values = 0;
  for (int l = 0; l < spec_.layers_size(); ++l) {
    if (groups[l] != 1) continue;
    g1[l].assign(spec_.layers(l).num_elements(), 0.002f);
    group1_values += g1[l].size();
  }
  v1::PushHeader last = header;
  last.set_update_id(2);
  last.set_group(1);
  last.set_task_continues(false);
  const double raw_before = Scraped("aloe_raw_push_bytes_total");
  uint64_t pushed = 0;
  absl::StatusOr<v1::PushReply> reply =
      raw_client.PushGroup(last, spec_, groups, g1, {}, 64, nullptr, &pushed);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->group_version(), 1u);
  EXPECT_EQ(pushed, group1_values * sizeof(float));
  EXPECT_EQ(Scraped("aloe_raw_push_bytes_total") - raw_before,
            static_cast<double>(group1_values * sizeof(float)));
  const std::vector<std::vector<float>> final_params = PullLatest(joined.worker_id());
  for (int l = 0; l < spec_.layers_size(); ++l) {
    const float step = groups[l] == 0 ? 0.5f * 0.001f : 0.5f * 0.002f;
    for (size_t i = 0; i < final_params[l].size(); ++i) {
      ASSERT_EQ(final_params[l][i], before[l][i] - step) << "layer " << l << " element " << i;
    }
  }
  EXPECT_TRUE(client.Leave(joined.worker_id()).ok());  // the server need not wait for its task
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0));
}

// A server that synchronizes the whole model refuses group pushes and pulls by group.
TEST_F(HostileInputTest, GroupPushesAndPullsToAWholeModelServerAreRefused) {
  std::string push_address;
  const int port = StartRawPushServer("local_steps: 3\n", &push_address);
  ASSERT_GT(port, 0);
  v1::JoinReply joined;
  v1::Task task;
  ASSERT_NO_FATAL_FAILURE(JoinTrainer("whole", &joined, &task));
  EXPECT_EQ(joined.layer_groups_size(), 0);
  const std::vector<std::vector<float>> before = PullLatest(joined.worker_id());
  v1::PushHeader header = HeaderFor(joined, task);
  header.set_group(1);
  header.set_task_continues(true);
  const grpc::Status pushed = Push(header, FullUpdate(0.001f));
  EXPECT_EQ(pushed.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(pushed.error_message(), "synchronizes the whole model"))
      << pushed.error_message();
  std::string whole;
  for (const v1::LayerSpec& layer : spec_.layers()) {
    AppendFloats(std::vector<float>(layer.num_elements(), 0.001f), &whole);
  }
  absl::Status carried;
  v1::PushReply reply;
  ASSERT_TRUE(RawExchange(push_address, EncodeRawPushPrelude("", header, whole.size()) + whole,
                          &carried, &reply)
                  .ok());
  EXPECT_EQ(carried.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(carried.message(), "names a layer group")) << carried;
  worker::ClientOptions options;
  options.address = absl::StrCat("127.0.0.1:", port);
  worker::ServerClient client(options);
  std::vector<std::vector<float>> pulled;
  uint64_t bytes = 0;
  const std::vector<uint32_t> groups(spec_.layers_size(), 0);
  const absl::StatusOr<uint64_t> by_group =
      client.PullGroup(joined.worker_id(), 0, 0, spec_, groups, &pulled, &bytes);
  EXPECT_EQ(by_group.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(by_group.status().message(), "synchronizes the whole model"))
      << by_group.status();
  const absl::StatusOr<v1::Task> start = client.StartGroup(joined.worker_id(), 0);
  EXPECT_EQ(start.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Scraped("aloe_model_version"), 0);
  EXPECT_EQ(PullLatest(joined.worker_id()), before);
  EXPECT_TRUE(client.Leave(joined.worker_id()).ok());  // the server need not wait for its task
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0));
}

}  // namespace
}  // namespace aloe
