// A rank's state, served to the matching rank of a healing replica group (internal; the
// StateTransfer service of proto/lighthouse.proto). The server holds one encoded snapshot at a
// time, tagged with its step, in a memory file (a memfd, gone with the process: nothing is left in
// a shared namespace) it encodes straight into; a fetch asks for a step and gets the bytes in
// chunks over several connections at once, or, on the server's own host, maps the server's memory
// file and decodes from it: no copy of the bytes on either side. Both map their memory populated at
// once (MAP_POPULATE): one call instead of a page fault per page.
#pragma once

#include <ddpkit/ft/lighthouse.h>
#include <ddpkit/training/checkpoint.h>

#include <chrono>
#include <cstdint>
#include <memory>
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
  // Replaces what is served with the encoding of `snapshot`, the state after `step` committed steps.
  void publish(int64_t step, const TensorDict& snapshot);
  // Serves nothing until the next publish.
  void clear();

 struct Impl;  // internal (the gRPC service reaches it)

 private:
  std::unique_ptr<Impl> impl_;
};

struct FetchOptions {
  std::string token;
  int connections = 4;           // parallel streams over the network
  bool try_memory_file = false;  // the server is on this host: read its memory file if allowed
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};  // the whole fetch
};

struct Fetched {
  std::shared_ptr<const char> data;  // the encoded state (decode_tensors), mapped or in the heap
  size_t size = 0;
  bool through_memory_file = false;
};

// The state after `step` steps from the server at `address`; waits (within the timeout) while the
// server still holds another step. Throws CommError naming the address on failure.
Fetched fetch_state(const std::string& address, int64_t step, const FetchOptions& options);

}  // namespace ft
}  // namespace ddpkit
