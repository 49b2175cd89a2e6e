// The environment's switch for every shared-memory path (internal): process groups between ranks
// on one host, and the parameter server's data between a trainer and its server on one host.
#pragma once

#include <cstdlib>
#include <cstring>

namespace ddpkit {

// False when DDPKIT_SHM=0 is set.
inline bool shared_memory_allowed_by_environment() {
  const char* env = std::getenv("DDPKIT_SHM");
  return !(env && std::strcmp(env, "0") == 0);
}

}  // namespace ddpkit
