// A gRPC server for tests: serves fakes on 127.0.0.1 at a port the OS chose, in plaintext, until
// destroyed. Header-only: the test binaries that use it link gRPC themselves (aloe_testing
// does not).
#pragma once

#include <grpcpp/grpcpp.h>

#include <initializer_list>
#include <memory>
#include <string>

namespace aloe::testing {

class LoopbackServer {
 public:
  explicit LoopbackServer(std::initializer_list<grpc::Service*> services) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    for (grpc::Service* service : services) builder.RegisterService(service);
    server_ = builder.BuildAndStart();
    address_ = "127.0.0.1:" + std::to_string(port_);
  }
  ~LoopbackServer() {
    if (server_ != nullptr) server_->Shutdown();
  }
  LoopbackServer(const LoopbackServer&) = delete;
  LoopbackServer& operator=(const LoopbackServer&) = delete;

  // 0 when the server did not start.
  int port() const { return port_; }
  const std::string& address() const { return address_; }
  // A plaintext channel to it.
  std::shared_ptr<grpc::Channel> Channel() const {
    return grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
  }

 private:
  int port_ = 0;
  std::string address_;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace aloe::testing
