// Error types and checks. Bad arguments throw c10::Error via DDPKIT_CHECK (a TORCH_CHECK with a
// "ddpkit: " prefix); peer loss, timeouts and failed collectives throw ddpkit::CommError, which
// callers can catch separately.
#pragma once

#include <c10/util/Exception.h>

#include <stdexcept>
#include <string>

#define DDPKIT_CHECK(cond, ...) TORCH_CHECK((cond), "ddpkit: ", __VA_ARGS__)

namespace ddpkit {

// A collective or rendezvous failed: a peer died, timed out, or the backend reported an error.
// what() names the operation, this rank and the world size, then the backend's own message.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad arguments to a program (a flag, a value, a launcher it needs and was started without):
// ddpkit::run_main prints it with the program's usage and exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Formats "ddpkit: <op> failed on rank R of W: <cause>" from a caught exception.
std::string describe_comm_failure(const std::string& op, int rank, int world_size,
                                  std::exception_ptr cause);

}  // namespace ddpkit
