#include "server/app/process_support.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/corpus_manifest.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/tls_stream.h"
#include "server/core/server_metrics.h"

namespace aloe::server {

absl::StatusOr<Corpus> LoadCorpus(const v1::ServerConfig& config) {
  ALOE_ASSIGN_OR_RETURN(std::vector<CorpusShardInfo> manifest,
                        LoadCorpusManifest(config.corpus_dir()));
  Corpus corpus;
  for (const CorpusShardInfo& shard : manifest) {
    if (shard.heldout) {
      if (corpus.heldout_file.empty()) corpus.heldout_file = shard.file;
    } else {
      corpus.train.push_back(DataShard{shard.name, shard.file, shard.tokens});
    }
  }
  if (corpus.heldout_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(config.corpus_dir(), "/manifest.tsv has no heldout shard"));
  }
  // The built-in model must cover the corpus's token ids (an imported model's vocab_size is
  // checked by the workers, against the data they read). A server may hold only the manifest:
  // without a vocab_size line or the first shard there is nothing to check against.
  const absl::StatusOr<uint32_t> vocab = CorpusVocabSize(config.corpus_dir());
  if (!vocab.ok() && vocab.status().code() != absl::StatusCode::kNotFound) return vocab.status();
  const uint32_t corpus_vocab = vocab.ok() ? *vocab : 0;
  if (config.model_file().empty() && config.model().vocab_size() < corpus_vocab) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model.vocab_size %d is smaller than the vocabulary of the corpus in %s (%d token ids): "
        "set model { vocab_size: %d } or prepare the corpus with the model's tokenizer",
        config.model().vocab_size(), config.corpus_dir(), corpus_vocab, corpus_vocab));
  }
  return corpus;
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& what, const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(what, " ", path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

bool IsLoopback(const std::string& address) {
  const std::string host = address.substr(0, address.rfind(':'));
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "[::1]" || host == "::1";
}

absl::Status CheckAdvertised(const char* flag, const char* listen_flag, const std::string& given,
                             const std::string& listen) {
  const std::string address = given.empty() ? listen : given;
  const size_t colon = address.rfind(':');
  const std::string host = colon == std::string::npos ? "" : address.substr(0, colon);
  const std::string port = colon == std::string::npos ? "" : address.substr(colon + 1);
  if (host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]" || host == "*") {
    if (given.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s %s listens on every interface, and workers cannot dial that address: pass %s "
          "HOST:PORT, the name or address of this host as workers reach it",
          listen_flag, listen, flag));
    }
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s %s is not an address workers can dial (give this host's name or address and the "
        "port)",
        flag, address));
  }
  int number = 0;
  if (!absl::SimpleAtoi(port, &number) || number <= 0 || number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s %s needs HOST:PORT with a port in [1, 65535]", flag, address));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const v1::ServerConfig& config, const std::string& listen_address) {
  const v1::SecurityConfig& security = config.security();
  const bool tls = !security.tls_cert_file().empty();
  if (!IsLoopback(listen_address) && !security.insecure() &&
      (!tls || security.token_file().empty())) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "refusing to listen on non-loopback address %s without TLS (security.tls_cert_file) "
        "and a token file (security.token_file); pass --insecure to do it anyway",
        listen_address));
  }
  if (!tls) return grpc::InsecureServerCredentials();
  if (security.tls_key_file().empty()) {
    return absl::InvalidArgumentError("security.tls_key_file is required with tls_cert_file");
  }
  grpc::SslServerCredentialsOptions options;
  ALOE_ASSIGN_OR_RETURN(std::string cert,
                        ReadWholeFile("TLS certificate", security.tls_cert_file()));
  ALOE_ASSIGN_OR_RETURN(std::string key, ReadWholeFile("TLS key", security.tls_key_file()));
  options.pem_key_cert_pairs.push_back({key, cert});
  if (!security.tls_client_ca_file().empty()) {
    ALOE_ASSIGN_OR_RETURN(options.pem_root_certs,
                          ReadWholeFile("TLS client CA", security.tls_client_ca_file()));
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::unique_ptr<Authenticator>> LoadAuthenticator(const v1::ServerConfig& config) {
  if (config.security().token_file().empty()) return std::make_unique<Authenticator>();
  return Authenticator::FromTokenFile(config.security().token_file());
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpc(
    const std::string& address, std::shared_ptr<grpc::ServerCredentials> credentials,
    const std::vector<grpc::Service*>& services, const v1::ServerConfig& config, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, credentials, port);
  // Chunks are <= 1 MiB; anything much larger is hostile or broken.
  builder.SetMaxReceiveMessageSize(2 << 20);
  // Fixed receive windows unless probed (see receive_window_kib and receive_window_probe): the
  // probe sizes the connection's window and every stream's from the measured bandwidth-delay
  // product, starting from receive_window_kib.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, config.receive_window_probe() ? 1 : 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                             static_cast<int>(config.receive_window_kib() << 10));
  for (grpc::Service* service : services) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address, " (address in use?)"));
  }
  return server;
}

absl::StatusOr<std::unique_ptr<MetricsSink>> StartMetrics(const v1::ServerConfig& config, int* port,
                                                          PrometheusMetrics** endpoint) {
  *port = 0;
  if (endpoint != nullptr) *endpoint = nullptr;
  if (config.metrics_address() == "off") return std::make_unique<NullMetrics>();
  ALOE_ASSIGN_OR_RETURN(
      auto prometheus, PrometheusMetrics::Start(config.metrics_address(), ServerMetricCatalogue()));
  *port = prometheus->port();
  if (endpoint != nullptr) *endpoint = prometheus.get();
  // The payload counters have a series per codec from the start, at 0: a series born with its
  // first push's bytes in it would hide them from rate() (and put the shards' raw share, raw
  // bytes over received bytes, above 1 for a minute).
  for (const v1::Codec codec : {v1::CODEC_FP32, v1::CODEC_BF16, v1::CODEC_INT8_BLOCKWISE,
                                v1::CODEC_INT4_BLOCKWISE, v1::CODEC_LOWRANK}) {
    prometheus->Add(kReceivedBytes, 0, {CodecLabel(codec)});
    prometheus->Add(kSentBytes, 0, {CodecLabel(codec)});
  }
  return prometheus;
}

absl::StatusOr<std::unique_ptr<RawPushListener>> StartRawPushes(const v1::ServerConfig& config,
                                                                const std::string& push_listen,
                                                                RawPushListener::Handler handler) {
  if (push_listen.empty()) return nullptr;
  const v1::SecurityConfig& security = config.security();
  const bool tls = !security.tls_cert_file().empty();
  if (!IsLoopback(push_listen) && !security.insecure() && (!tls || security.token_file().empty())) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "refusing raw pushes on non-loopback address %s without TLS (security.tls_cert_file) "
        "and a token file (security.token_file); pass --insecure (security.insecure) on a "
        "trusted network",
        push_listen));
  }
  RawPushListener::Options options;
  if (tls) {
    if (security.tls_key_file().empty()) {
      return absl::InvalidArgumentError("security.tls_key_file is required with tls_cert_file");
    }
    TlsServerOptions files;
    ALOE_ASSIGN_OR_RETURN(files.cert_pem,
                          ReadWholeFile("TLS certificate", security.tls_cert_file()));
    ALOE_ASSIGN_OR_RETURN(files.key_pem, ReadWholeFile("TLS key", security.tls_key_file()));
    if (!security.tls_client_ca_file().empty()) {
      ALOE_ASSIGN_OR_RETURN(files.client_ca_pem,
                            ReadWholeFile("TLS client CA", security.tls_client_ca_file()));
    }
    ALOE_ASSIGN_OR_RETURN(options.tls, TlsContext::ForServer(files));
  }
  return RawPushListener::Start(push_listen, std::move(handler), options);
}

absl::Status WritePortFile(const std::string& path, int grpc_port, int metrics_port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << "grpc=" << grpc_port << " metrics=" << metrics_port << "\n";
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

void WriteCheckpoint(CheckpointStore& store, const v1::ServerCheckpoint& checkpoint,
                     MetricsSink& metrics) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> path = store.Write(checkpoint);
  if (!path.ok()) {
    ALOE_LOG_ERROR("server", "checkpoint of version %d failed: %s", checkpoint.version(),
                   path.status().message());
    return;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  metrics.Observe(kCheckpointSeconds, seconds);
  metrics.Set(kCheckpointTimestamp, absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  metrics.Set(kCheckpointVersion, static_cast<double>(checkpoint.version()));
  ALOE_LOG_INFO("server", "checkpoint of version %d written to %s (%.1f MB, %.0f ms)",
                checkpoint.version(), *path, checkpoint.ByteSizeLong() / 1e6, seconds * 1e3);
}

}  // namespace aloe::server
