#include <gmock/gmock.h>
#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "worker/client.h"

namespace aloe::worker {
namespace {

// The integer arguments of a worker channel, by name.
std::map<std::string, int> IntArguments() {
  const grpc::ChannelArguments args = WorkerChannelArguments();
  const grpc_channel_args c = args.c_channel_args();
  std::map<std::string, int> out;
  for (size_t i = 0; i < c.num_args; ++i) {
    if (c.args[i].type == GRPC_ARG_INTEGER) out[c.args[i].key] = c.args[i].value.integer;
  }
  return out;
}

TEST(WorkerChannelArgumentsTest, ReconnectWithinASecondOfTheServer) {
  const std::map<std::string, int> ints = IntArguments();
  // Without these gRPC waits 1 s, then 1.6x longer after each failed attempt, up to 120 s.
  ASSERT_EQ(ints.count(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS), 1u);
  EXPECT_EQ(ints.at(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS), 1000);
  ASSERT_EQ(ints.count(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS), 1u);
  EXPECT_EQ(ints.at(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS), 100);
  EXPECT_EQ(ints.at(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH), 2 << 20);
}

}  // namespace
}  // namespace aloe::worker
