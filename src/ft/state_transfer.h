// A rank's state, served to the matching rank of a healing replica group (internal; the
// StateTransfer service of proto/lighthouse.proto). The server holds one encoded snapshot at a
// time, tagged with its step; a fetch asks for a step and gets the bytes in chunks over several
// connections at once, or, on the server's own host, reads them from the server's memory file
// (a memfd, gone with the process: nothing is left in a shared namespace).
#pragma once

#include <ddpkit/ft/lighthouse.h>

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
  // Replaces what is served with `bytes`, the state after `step` committed steps.
  void publish(int64_t step, std::string bytes);
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
  std::string bytes;
  bool through_memory_file = false;
};

// The state after `step` steps from the server at `address`; waits (within the timeout) while the
// server still holds another step. Throws CommError naming the address on failure.
Fetched fetch_state(const std::string& address, int64_t step, const FetchOptions& options);

}  // namespace ft
}  // namespace ddpkit
