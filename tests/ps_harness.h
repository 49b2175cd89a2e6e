// What the parameter-server tests share: an in-process server on a free loopback port, and
// clients connected to it.
#pragma once

#include <ddpkit/ps/parameter_server.h>

#include <memory>
#include <vector>

namespace ddpkit {
namespace testing {

inline std::unique_ptr<ps::ParameterServer> start_server(std::vector<int> trainers,
                                                         ps::ServerKind kind = ps::ServerKind::kAverage,
                                                         ps::ServerOptions options = {}) {
  auto server = std::make_unique<ps::ParameterServer>(options.trainer_ids(std::move(trainers)).kind(kind));
  server->start();
  return server;
}

inline std::shared_ptr<ps::ParameterServerClient> connect(const ps::ParameterServer& server, int trainer,
                                                          ps::ClientOptions options = {}) {
  return std::make_shared<ps::ParameterServerClient>(options.address(server.address()).trainer_id(trainer));
}

}  // namespace testing
}  // namespace ddpkit
