// A rank's state, served to the matching rank of a healing replica group (internal; the
// StateTransfer service of proto/lighthouse.proto).
//
// The server serves its live tensors, not a copy: publish() takes the snapshot's tensors (views of
// the model's parameters and the optimizer's state) and the caller must not change them until
// wait_released() returns, as torchft's source holds its step while a peer reads its state dict.
// A healer reads the description (keys, dtypes, sizes, addresses), then the bytes into tensors of
// its own: on the server's host with one kernel copy per tensor from the server's memory
// (process_vm_readv, the single-copy path of MPI's shared-memory transports), elsewhere in 4 MiB
// chunks over several connections at once, each with a checksum. A copy counts only once the
// server accepts its Release: a server that gave up waiting (the healer was lost) refuses it, so
// a healer never keeps bytes read while the server had moved on.
#pragma once

#include <ddpkit/training/checkpoint.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>

namespace ddpkit {
namespace ft {

class StateServer {
 public:
  // Listens on `host`:0 (a free port).
  StateServer(const std::string& host, const std::string& token);
  ~StateServer();
  StateServer(const StateServer&) = delete;
  StateServer& operator=(const StateServer&) = delete;

  std::string address() const;
  // Serves `snapshot`, the state after `step` committed steps, to the healing groups `healers`,
  // from the snapshot's own tensors (CPU and contiguous ones as they are; others copied once).
  void publish(int64_t step, const TensorDict& snapshot, const std::set<std::string>& healers);
  // Blocks until every healer has released the state, the rest are `gone` (polled), or the
  // deadline; then serves nothing. Returns how many released.
  size_t wait_released(std::chrono::steady_clock::time_point deadline,
                       const std::function<bool(const std::string& healer)>& gone);
  // Serves nothing until the next publish.
  void clear();

  struct Impl;  // internal (the gRPC service reaches it)

 private:
  std::unique_ptr<Impl> impl_;
};

struct FetchOptions {
  std::string token;
  std::string healer;      // this rank's group, named in the Release
  int connections = 4;     // parallel streams over the network (threads of the copy on one host)
  bool same_host = false;  // the server is on this host: copy from its memory if the kernel allows
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};  // the whole fetch
};

struct Fetched {
  TensorDict state;  // fresh tensors, the server's bytes
  int64_t bytes = 0;
  bool single_copy = false;  // read from the server's memory, not over the network
  std::string single_copy_refused;  // same_host, yet read over the network: why
};

// The state after `step` steps from the server at `address`; waits (within the timeout) while the
// server still holds another step. Throws CommError naming the address and what went wrong.
Fetched fetch_state(const std::string& address, int64_t step, const FetchOptions& options);

}  // namespace ft
}  // namespace ddpkit
