#include "common/tls_stream.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "common/status_matchers.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(10);

// Two certificate authorities from scripts/make-test-ca.sh, each with a server certificate (for
// localhost and 127.0.0.1) and a client certificate: "ca" is the job's, "other" a stranger's.
class TlsStreamTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(::testing::TempDir() + "/aloe_tls_" + std::to_string(getpid()));
    for (const char* ca : {"ca", "other"}) {
      const std::string command = std::string(ALOE_SOURCE_DIR) + "/scripts/make-test-ca.sh " +
                                  *dir_ + "/" + ca + " > /dev/null";
      ASSERT_EQ(std::system(command.c_str()), 0) << command;
    }
  }
  static void TearDownTestSuite() {
    std::system(("rm -rf " + *dir_).c_str());
    delete dir_;
  }

  static std::string Pem(const std::string& name) {
    std::ifstream in(*dir_ + "/" + name);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  // The server with the job's certificate; `client_ca` "" = no client certificates.
  static std::shared_ptr<const TlsContext> Server(const std::string& client_ca) {
    absl::StatusOr<std::shared_ptr<const TlsContext>> ctx = TlsContext::ForServer(
        {Pem("ca/server.pem"), Pem("ca/server.key"), client_ca.empty() ? "" : Pem(client_ca)});
    EXPECT_THAT(ctx, IsOk());
    return ctx.value_or(nullptr);
  }
  // A client trusting `ca_dir`'s CA, presenting `cert_dir`'s client certificate ("" = none).
  static std::shared_ptr<const TlsContext> Client(const std::string& ca_dir,
                                                  const std::string& cert_dir,
                                                  const std::string& server_name = "") {
    TlsClientOptions options{Pem(ca_dir + "/ca.pem"), "", "", server_name};
    if (!cert_dir.empty()) {
      options.cert_pem = Pem(cert_dir + "/client.pem");
      options.key_pem = Pem(cert_dir + "/client.key");
    }
    absl::StatusOr<std::shared_ptr<const TlsContext>> ctx = TlsContext::ForClient(options);
    EXPECT_THAT(ctx, IsOk());
    return ctx.value_or(nullptr);
  }

  // Both handshakes over a connected socket pair, the server's on a thread of its own.
  struct Session {
    absl::StatusOr<std::unique_ptr<TlsStream>> server;
    absl::StatusOr<std::unique_ptr<TlsStream>> client;
  };
  Session Handshake(const TlsContext& server, const TlsContext& client, const std::string& host) {
    Session session{absl::UnknownError("unset"), absl::UnknownError("unset")};
    std::thread accept([&] { session.server = server.Accept(fds_[0], kTimeout); });
    session.client = client.Connect(fds_[1], host, kTimeout);
    accept.join();
    return session;
  }

  void SetUp() override { ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds_), 0); }
  void TearDown() override {
    close(fds_[0]);
    close(fds_[1]);
  }

  static std::string* dir_;
  int fds_[2] = {-1, -1};
};

std::string* TlsStreamTest::dir_ = nullptr;

TEST_F(TlsStreamTest, MutualTls13CarriesBytesBothWays) {
  Session s = Handshake(*Server("ca/ca.pem"), *Client("ca", "ca"), "localhost");
  ASSERT_THAT(s.server, IsOk());
  ASSERT_THAT(s.client, IsOk());
  EXPECT_EQ((*s.client)->protocol(), "TLSv1.3");
  EXPECT_EQ((*s.server)->protocol(), "TLSv1.3");
  // 8 MiB in one write: more than the socket buffers hold, so each side waits for the other.
  std::string sent(8 << 20, '\0');
  for (size_t i = 0; i < sent.size(); ++i) sent[i] = static_cast<char>(i * 131 + 7);
  std::thread writer([&] {
    EXPECT_THAT((*s.client)->WriteAll(sent.data(), sent.size()), IsOk());
    EXPECT_THAT((*s.client)->WriteAll("0123456789", 10), IsOk());
  });
  std::string got(sent.size(), '\0');
  ASSERT_THAT((*s.server)->ReadExactly(got.data(), got.size()), IsOk());
  writer.join();
  EXPECT_TRUE(got == sent);
  // Bytes already taken off the socket wait in the stream, where poll() does not see them.
  char four[4];
  ASSERT_THAT((*s.server)->ReadExactly(four, 4), IsOk());
  EXPECT_EQ(std::string(four, 4), "0123");
  EXPECT_TRUE((*s.server)->HasBuffered());
  char six[6];
  ASSERT_THAT((*s.server)->ReadExactly(six, 6), IsOk());
  EXPECT_EQ(std::string(six, 6), "456789");
  EXPECT_FALSE((*s.server)->HasBuffered());
  ASSERT_THAT((*s.server)->WriteAll("reply", 5), IsOk());
  char reply[5];
  ASSERT_THAT((*s.client)->ReadExactly(reply, 5), IsOk());
  EXPECT_EQ(std::string(reply, 5), "reply");
  // A peer that says goodbye reads as a closed connection; one that stays silent, as a timeout.
  (*s.server)->set_timeout(absl::Milliseconds(50));
  EXPECT_THAT((*s.server)->ReadExactly(four, 1),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("no progress")));
  (*s.client)->Close();
  EXPECT_THAT((*s.server)->ReadExactly(four, 1),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("closed")));
}

TEST_F(TlsStreamTest, AnIpAddressTheCertificateListsIsAccepted) {
  // 127.0.0.1 is in the certificate as an IP address.
  Session by_ip = Handshake(*Server(""), *Client("ca", ""), "127.0.0.1");
  EXPECT_THAT(by_ip.client, IsOk());
  EXPECT_THAT(by_ip.server, IsOk());
}

TEST_F(TlsStreamTest, ANameTheCertificateDoesNotListIsRefused) {
  Session wrong = Handshake(*Server(""), *Client("ca", ""), "shard-0.example");
  EXPECT_THAT(wrong.client, StatusIs(absl::StatusCode::kUnauthenticated,
                                     AllOf(HasSubstr("certificate verify failed"),
                                           HasSubstr("hostname mismatch"))));
  EXPECT_THAT(wrong.server, StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("alert")));
}

TEST_F(TlsStreamTest, TheServerNameOverridesTheHostDialled) {
  Session named = Handshake(*Server(""), *Client("ca", "", "localhost"), "10.1.2.3");
  EXPECT_THAT(named.client, IsOk());
  EXPECT_THAT(named.server, IsOk());
}

TEST_F(TlsStreamTest, AnIpAddressTheCertificateDoesNotNameIsRefused) {
  Session wrong = Handshake(*Server(""), *Client("ca", ""), "10.1.2.3");
  EXPECT_THAT(wrong.client,
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("IP address mismatch")));
}

TEST_F(TlsStreamTest, AServerFromAnotherCaIsRefused) {
  Session s = Handshake(*Server(""), *Client("other", ""), "localhost");
  EXPECT_THAT(s.client, StatusIs(absl::StatusCode::kUnauthenticated,
                                 AllOf(HasSubstr("certificate verify failed"),
                                       HasSubstr("unable to get local issuer certificate"))));
  EXPECT_THAT(s.server,
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("alert unknown ca")));
}

TEST_F(TlsStreamTest, MutualTlsRefusesAClientWithoutACertificate) {
  Session s = Handshake(*Server("ca/ca.pem"), *Client("ca", ""), "localhost");
  EXPECT_THAT(s.server, StatusIs(absl::StatusCode::kUnauthenticated,
                                 HasSubstr("peer did not return a certificate")));
  // Under TLS 1.3 the client learns it at its first read.
  ASSERT_THAT(s.client, IsOk());
  EXPECT_THAT((*s.client)->WriteAll("ALRP", 4), IsOk());
  char byte;
  EXPECT_THAT((*s.client)->ReadExactly(&byte, 1),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("alert certificate required")));
}

TEST_F(TlsStreamTest, MutualTlsRefusesAClientCertificateOfAnotherCa) {
  Session s = Handshake(*Server("ca/ca.pem"), *Client("ca", "other"), "localhost");
  EXPECT_THAT(s.server,
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("certificate verify failed")));
  ASSERT_THAT(s.client, IsOk());
  char byte;
  EXPECT_THAT((*s.client)->ReadExactly(&byte, 1),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("alert unknown ca")));
}

TEST_F(TlsStreamTest, ATls12ClientIsRefused) {
  std::shared_ptr<const TlsContext> server = Server("");
  absl::StatusOr<std::unique_ptr<TlsStream>> accepted = absl::UnknownError("unset");
  std::thread accept([&] { accepted = server->Accept(fds_[0], kTimeout); });
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  SSL_CTX_set_max_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, nullptr);
  SSL* ssl = SSL_new(ctx);
  SSL_set_fd(ssl, fds_[1]);
  EXPECT_NE(SSL_connect(ssl), 1);
  accept.join();
  SSL_free(ssl);
  SSL_CTX_free(ctx);
  EXPECT_THAT(accepted,
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("unsupported protocol")));
}

TEST_F(TlsStreamTest, CertificatesThatCannotBeUsedAreNamed) {
  EXPECT_THAT(TlsContext::ForServer({Pem("ca/server.pem"), Pem("ca/client.key"), ""}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the private key is not the certificate's")));
  EXPECT_THAT(TlsContext::ForServer({"", Pem("ca/server.key"), ""}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the certificate holds no PEM certificate")));
  EXPECT_THAT(
      TlsContext::ForServer({Pem("ca/server.pem"), "not a key", ""}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("the private key does not parse")));
  EXPECT_THAT(
      TlsContext::ForClient({"garbage", "", "", ""}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("the CA holds no PEM certificate")));
}

}  // namespace
}  // namespace aloe
