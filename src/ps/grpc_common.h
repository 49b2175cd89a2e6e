// What the server and the client share about gRPC itself.
#pragma once

#include <ddpkit/error.h>

#include <absl/synchronization/mutex.h>
#include <grpc/grpc.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <fstream>
#include <memory>
#include <sstream>
#include <string>


namespace ddpkit {
namespace ps {

// gRPC shuts itself down when its last object goes, on a detached thread; if main() returns
// meanwhile, that thread races the exit's static destructors and crashes. Every server and client
// calls this first: it keeps gRPC initialised until static destruction, where it shuts down
// blocking.
//
// It also turns off Abseil's mutex deadlock detection, which Debian builds Abseil with (no NDEBUG)
// and gRPC's release builds do not: it records a lock graph on every gRPC mutex acquisition, 7 %
// of a lighthouse's CPU at 1,000 groups (perf, bench/lighthouse_scale.py).
inline void hold_grpc_runtime() {
  struct Runtime {
    Runtime() {
      absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
      grpc_init();
    }
    ~Runtime() { grpc_shutdown_blocking(); }
  };
  static Runtime runtime;
}

// HTTP/2 settings for multi-megabyte messages, applied to both ends (`set(name, value)`):
// gRPC's defaults (16 KB frames, a 64 KB initial window grown by BDP probing) cap a loopback
// connection well below memory bandwidth for gradient-sized messages (build/ps_server_bench
// compares).
template <typename Set>
void apply_bulk_transport_args(Set&& set) {
  set(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 * 1024 * 1024 - 1);
  set(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 * 1024 * 1024);
  set(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 64 * 1024 * 1024);
  set(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 16 * 1024 * 1024);
  set(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 1024 * 1024);
  set(GRPC_ARG_HTTP2_BDP_PROBE, 0);
}

// Constant-time: the token is a secret.
inline bool same_secret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < b.size(); ++i) diff |= static_cast<unsigned char>(a[i % (a.size() ? a.size() : 1)] ^ b[i]);
  return diff == 0 && !a.empty();
}

// The client's side of the token: "authorization: Bearer <token>" on the call (none when empty).
inline void add_token(grpc::ClientContext& ctx, const std::string& token) {
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
}

// What a call's "authorization: Bearer <token>" metadata says against `token` (empty: none needed):
// empty when it may pass, else why not (`who` names the service in the message).
template <typename Metadata>
std::string token_refusal(const Metadata& md, const std::string& token, const std::string& who) {
  if (token.empty()) return "";
  auto it = md.find("authorization");
  if (it == md.end()) return "this " + who + " requires a token (metadata 'authorization: Bearer <token>')";
  const std::string value(it->second.data(), it->second.size());
  const std::string prefix = "Bearer ";
  if (value.compare(0, prefix.size(), prefix) != 0 || !same_secret(value.substr(prefix.size()), token))
    return "wrong token for this " + who;
  return "";
}

// A PEM file's contents; `what` names it in the error ("certificate", "private key", ...).
inline std::string read_pem_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  DDPKIT_CHECK(in, "cannot read the TLS ", what, " '", path, "'");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// A server's credentials: TLS from PEM files when a certificate is given (with its key), else
// plaintext.
inline std::shared_ptr<grpc::ServerCredentials> server_credentials(const std::string& certificate,
                                                                   const std::string& private_key) {
  if (certificate.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({read_pem_file(private_key, "private key"), read_pem_file(certificate, "certificate")});
  return grpc::SslServerCredentials(ssl);
}

// A client's credentials: TLS trusting `root_certificate` (PEM) when given, else plaintext.
inline std::shared_ptr<grpc::ChannelCredentials> channel_credentials(const std::string& root_certificate) {
  if (root_certificate.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = read_pem_file(root_certificate, "root certificate");
  return grpc::SslCredentials(ssl);
}

}  // namespace ps
}  // namespace ddpkit
