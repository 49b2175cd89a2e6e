// A gradient-averaging parameter server over gRPC, with the semantics of PyTorch's RPC
// parameter-server benchmark (AverageParameterServer / AverageBatchParameterServer), fixed to
// return the average (PyTorch's discards its division and returns the sum).
//
//   ParameterServer server(ServerOptions().trainer_ids({0, 1}));   // listens on 127.0.0.1
//   server.start();                                                   // server.port()
//   ...
//   ParameterServerClient client(ClientOptions().address(server.address()).trainer_id(0));
//   at::Tensor avg = ParameterServer::wait(client.average(batch, bucket, gradient));
//
// Per (batch number, bucket index) the server collects one gradient from each of its trainers
// and answers every one of them with the average when the last arrives; a large bucket goes as
// chunks on parallel calls (ClientOptions::chunk_bytes), each chunk averaged the same way. Requests are served by
// gRPC's callback API: a waiting trainer costs a pending reply, not a thread. A newer batch
// number drops older state (and fails whoever still waits on it). Rejected, with a status that
// names the problem and without touching the sum: an unknown trainer id, a second gradient from
// one trainer for the same (batch, bucket), a stale batch, a shape/dtype/layout that differs from
// the other trainers', a payload whose size disagrees with its shape, a message over
// max_message_bytes, and a missing or wrong token. A trainer whose connection drops, or a bucket
// still incomplete after bucket_timeout, fails its batch for the trainers waiting on it.
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/metrics/metrics_logger.h>

#include <torch/arg.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit {
namespace ps {

enum class ServerKind {
  // Adds each gradient into the bucket's sum as it arrives.
  kAverage,
  // Keeps the gradients and sums them at the end, in trainer-id order: the result does not depend
  // on arrival order.
  kAverageBatch,
};
ServerKind server_kind_from_name(const std::string& name);  // "average" | "average_batch"
const char* server_kind_name(ServerKind kind);

struct TlsFiles {
  TORCH_ARG(std::string, certificate) = "";  // PEM; server: its chain, client: unused
  TORCH_ARG(std::string, private_key) = "";  // PEM; server only
  TORCH_ARG(std::string, root_certificate) = "";  // PEM; client: the CA that signed the server
};

struct ServerOptions {
  // host:port; port 0 picks a free one (see ParameterServer::port()).
  TORCH_ARG(std::string, address) = "127.0.0.1:0";
  // The trainers this server serves; each (batch, bucket) completes when all have sent.
  TORCH_ARG(std::vector<int>, trainer_ids) = {};
  TORCH_ARG(ServerKind, kind) = ServerKind::kAverage;
  // Rank reported in metrics.
  TORCH_ARG(int, rank) = 0;
  // Largest request accepted (and reply sent); 100 MB buckets need at least ~100 MB.
  TORCH_ARG(int64_t, max_message_bytes) = int64_t(1) << 30;
  // A bucket some trainers sent but others did not within this time fails for the senders.
  TORCH_ARG(std::chrono::milliseconds, bucket_timeout) = std::chrono::seconds(60);
  // A trainer whose session ended is gone (buckets waiting for it fail at once, naming it) after
  // this long without a new session: a restarted trainer, or a new client whose session opens a
  // moment after its peer's first request, is not mistaken for a dead one.
  TORCH_ARG(std::chrono::milliseconds, reconnect_grace) = std::chrono::seconds(2);
  // Non-empty: every call must carry metadata "authorization: Bearer <token>".
  TORCH_ARG(std::string, token) = "";
  // Certificate and key set: TLS; otherwise plaintext.
  TORCH_ARG(TlsFiles, tls) = {};
  // Keep every metric event (for a trace) until the next reset; off for a long-running server.
  TORCH_ARG(bool, trace_events) = false;
};

class ParameterServer {
 public:
  explicit ParameterServer(ServerOptions options);
  ~ParameterServer();  // shuts down, failing calls still waiting
  ParameterServer(const ParameterServer&) = delete;
  ParameterServer& operator=(const ParameterServer&) = delete;

  // Binds and starts serving; throws if the address cannot be bound.
  void start();
  int port() const;
  std::string address() const;  // host:port actually bound
  // Stops accepting calls and fails the waiting ones with UNAVAILABLE, within `grace`.
  void shutdown(std::chrono::milliseconds grace = std::chrono::seconds(2));
  // Blocks until shutdown() (from another thread or a signal handler's thread).
  void wait();

  // What GetMetrics returns, locally.
  struct Counters {
    int64_t buckets_averaged = 0;
    int64_t gradients_received = 0;
    int64_t bytes_received = 0;  // in messages
    int64_t bytes_sent = 0;
    // Through trainers' shared-memory regions (trainers on this host), not in the two above.
    int64_t shm_bytes_received = 0;
    int64_t shm_bytes_sent = 0;
    double seconds_since_reset = 0;
    // Most gradient data (waiting requests, sums) held at once: a chunked bucket keeps this to a
    // few chunks per trainer, not the bucket.
    int64_t peak_bytes_held = 0;
  };
  Counters counters() const;
  metrics::Series metrics() const;
  std::vector<metrics::Event> events() const;  // with trace_events
  void reset_state();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

struct ClientOptions {
  TORCH_ARG(std::string, address) = "127.0.0.1:0";
  TORCH_ARG(int, trainer_id) = 0;
  // Deadline of each AverageGradient call, measured from when it is sent: it covers waiting for
  // the slowest trainer, so make it longer than a step.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::seconds(120);
  TORCH_ARG(int64_t, max_message_bytes) = int64_t(1) << 30;
  TORCH_ARG(std::string, token) = "";
  TORCH_ARG(TlsFiles, tls) = {};
  // Open a session so that the server notices when this trainer dies (see the file comment).
  TORCH_ARG(bool, open_session) = true;
  // Time to wait for the server to come up (connect) before the first call fails.
  TORCH_ARG(std::chrono::milliseconds, connect_timeout) = std::chrono::seconds(30);
  // A dense gradient of more than chunk_bytes travels as chunks of that size, each its own call
  // (with its own deadline), at most chunks_in_flight at once: the server sums and answers each
  // chunk as it lands, so transfer, sum and reply overlap and the server holds chunks, not
  // whole buckets. A sparse one (sparse_dim 1) of more than chunk_bytes when dense goes as row
  // ranges that fit chunk_bytes dense. 0: always whole.
  TORCH_ARG(int64_t, chunk_bytes) = 1 << 20;
  TORCH_ARG(int, chunks_in_flight) = 4;
  // On the server's host, chunks (and buckets of up to chunk_bytes) travel through a
  // shared-memory region of `shared_memory_slots` slots of chunk_bytes that this trainer offers
  // when its session opens; gRPC then carries only their dtype, shape, place and, sparse, indices. The server takes
  // the offer only where it can map the region (same host and PID namespace); otherwise, and
  // while every slot is busy, data goes in the messages. Needs open_session and chunk_bytes > 0.
  // DDPKIT_SHM=0 in the trainer's or the server's environment turns it off.
  TORCH_ARG(bool, shared_memory) = true;
  TORCH_ARG(int, shared_memory_slots) = 16;
};

// Errors from the server arrive as CommError, whose what() holds the gRPC status code name and
// the server's message, e.g. "ddpkit ps: AverageGradient(batch 3, bucket 0) on 127.0.0.1:4001
// failed: ALREADY_EXISTS: trainer 1 already sent bucket 0 of batch 3".
class ParameterServerClient {
 public:
  explicit ParameterServerClient(ClientOptions options);
  ~ParameterServerClient();
  ParameterServerClient(const ParameterServerClient&) = delete;
  ParameterServerClient& operator=(const ParameterServerClient&) = delete;

  // Sends `gradient` (dense, or sparse COO: coalesced on the way) and returns a future of the
  // average. Dense: `into` (optional, same numel and dtype) receives the average and is the
  // future's value; otherwise a new tensor shaped like `gradient`. The future completes on one
  // of the client's threads (gRPC's, or its doorbell thread): destroy the client elsewhere.
  FuturePtr average(int64_t batch_number, int64_t bucket_index, const at::Tensor& gradient,
                    at::Tensor into = at::Tensor());
  void reset_state();
  struct ServerMetrics {
    int server_rank = 0;
    metrics::Series series;
    std::vector<metrics::Event> events;
    ParameterServer::Counters counters;
  };
  ServerMetrics get_metrics();
  int trainer_id() const;
  const std::string& address() const;
  // AverageGradient traffic of this client: serialized bytes sent and received, gradient bytes
  // that went through shared memory instead, calls completed.
  struct Traffic {
    int64_t bytes_sent = 0;
    int64_t bytes_received = 0;
    int64_t shm_bytes_sent = 0;
    int64_t shm_bytes_received = 0;
    int64_t calls = 0;
    // Of `calls`, those whose request and reply went through the shared-memory region's
    // mailboxes instead of gRPC (same host; their bytes count in bytes_sent/received).
    int64_t doorbell_calls = 0;
  };
  Traffic traffic() const;
  // Whether the server took this trainer's shared-memory region; if not, why ("" when not offered).
  bool uses_shared_memory() const;
  const std::string& shared_memory_refused() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Which server a trainer talks to: trainers are split into nserver consecutive groups of
// ntrainer / nserver (ntrainer must be a multiple of nserver), as in the seed benchmark.
int server_for_trainer(int trainer, int ntrainer, int nserver);
std::vector<int> trainers_of_server(int server, int ntrainer, int nserver);

}  // namespace ps
}  // namespace ddpkit
