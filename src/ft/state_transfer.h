// A rank's state, served to the matching rank of a healing replica group (internal; the
// StateTransfer service of proto/lighthouse.proto).
//
// The server serves its live tensors, not a copy: publish() takes the snapshot's tensors (views of
// the model's parameters and the optimizer's state) and the caller must not change them until
// wait_released() returns, as torchft's source holds its step while a peer reads its state dict.
// A healer reads the description (keys, dtypes, sizes, addresses), then the bytes into tensors of
// its own: on the server's host with one kernel copy per tensor from the server's memory
// (process_vm_readv, the single-copy path of MPI's shared-memory transports); elsewhere, or where
// the kernel refuses that, over a process group of the two ranks made for this heal (Gloo between
// hosts, shared memory on one), which sends the server's tensors as they lie into the healer's in
// 4 MiB broadcasts spread over the group's connections. A copy counts only once the server
// accepts its Release: a server that gave up waiting (the healer was lost) refuses it, so a healer
// never keeps bytes read while the server had moved on.
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/training/checkpoint.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>

namespace ddpkit {
namespace ft {

// The process group of one heal, rank 0 the server's rank and rank 1 its healer's, met under
// `name` (the healer picks it, unique per heal); `peer` names the other end's group. Both ends
// must make it on the same store: the Manager makes it on the store its cross-group groups meet
// at, and gives it up (CommError) when the peer is lost meanwhile.
using PairGroupFactory =
    std::function<std::shared_ptr<ProcessGroup>(const std::string& name, int rank, const std::string& peer)>;

class StateServer {
 public:
  // Listens on `host`:0 (a free port). `pair_group` makes the groups it streams over.
  StateServer(const std::string& host, const std::string& token, PairGroupFactory pair_group);
  ~StateServer();
  StateServer(const StateServer&) = delete;
  StateServer& operator=(const StateServer&) = delete;

  std::string address() const;
  // Serves `snapshot`, the state after `step` committed steps, to the healing groups `healers`,
  // from the snapshot's own tensors (CPU and contiguous ones as they are; others copied once).
  void publish(int64_t step, const TensorDict& snapshot, const std::set<std::string>& healers);
  // Blocks until every healer has released the state, the rest are `gone` (polled), or the
  // deadline; then serves nothing. Returns how many released. Streams the state to the healers
  // that ask for it meanwhile (on threads of its own, each a group of the pair; a stream to a
  // healer found `gone` is aborted).
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
  bool same_host = false;  // the server is on this host: copy from its memory if the kernel allows
  std::string source;           // the server's group (the pair group's peer)
  PairGroupFactory pair_group;  // makes the heal's group where the bytes are streamed
  // Polled while the bytes are streamed: a reason (the source was lost, say) gives the heal up at
  // once rather than by the timeout.
  std::function<std::string()> stop;
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};  // the whole fetch
};

struct Fetched {
  TensorDict state;  // fresh tensors, the server's bytes
  int64_t bytes = 0;
  double waited_seconds = 0;  // for the server to publish the step (its next step boundary, under the async quorum)
  bool single_copy = false;  // read from the server's memory, not streamed
  std::string single_copy_refused;  // same_host, yet streamed: why
  // The pair group it was streamed over (none when single_copy), still to be destroyed: that
  // waits for its transport's threads to end, which a caller may leave off its path. The tensors
  // are complete either way.
  std::shared_ptr<ProcessGroup> pair;
};

// The state after `step` steps from the server at `address`; waits (within the timeout) while the
// server still holds another step. Throws CommError naming the address and what went wrong.
Fetched fetch_state(const std::string& address, int64_t step, const FetchOptions& options);

}  // namespace ft
}  // namespace ddpkit
