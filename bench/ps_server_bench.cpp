// Parameter-server engine throughput, no model: T trainer threads (each its own client and
// connection) send B batches of one bucket of S bytes each to one in-process server; prints
// size, time per round, gradients averaged per second and payload GB/s per direction.
//
//   build/ps_server_bench [trainers=2] [batches=20] [sizes_mb=1,4,16,64]
#include <ddpkit/ps/parameter_server.h>
#include <ddpkit/runtime/runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <thread>
#include <vector>

using namespace ddpkit;

int main(int argc, char** argv) {
  tune_allocator_for_training();  // as the ddpkit CLI does: keep large blocks in the heap for reuse
  const int trainers = argc > 1 ? std::atoi(argv[1]) : 2;
  const int batches = argc > 2 ? std::atoi(argv[2]) : 20;
  std::vector<double> sizes_mb{1, 4, 16, 64};
  if (argc > 3) {
    sizes_mb.clear();
    std::stringstream list(argv[3]);
    for (std::string item; std::getline(list, item, ',');) sizes_mb.push_back(std::atof(item.c_str()));
  }
  std::vector<int> ids;
  for (int t = 0; t < trainers; ++t) ids.push_back(t);
  ps::ParameterServer server(ps::ServerOptions().trainer_ids(ids));
  server.start();
  std::vector<std::unique_ptr<ps::ParameterServerClient>> clients;
  for (int t = 0; t < trainers; ++t)
    clients.push_back(std::make_unique<ps::ParameterServerClient>(ps::ClientOptions().address(server.address()).trainer_id(t)));
  std::printf("# %d trainers (threads), 1 server, %d batches per size; GB/s = payload bytes per direction\n", trainers, batches);
  std::printf("%10s %12s %12s %12s %10s\n", "size_MB", "round_ms_p50", "round_ms_min", "gradients/s", "GB/s");
  int64_t batch = 0;
  for (double mb : sizes_mb) {
    const int64_t n = static_cast<int64_t>(mb * 1024 * 1024 / 4);
    std::vector<at::Tensor> grads;
    for (int t = 0; t < trainers; ++t) grads.push_back(at::full({n}, static_cast<float>(t)));
    std::vector<double> rounds;
    for (int b = 0; b < batches + 2; ++b, ++batch) {
      const auto start = std::chrono::steady_clock::now();
      std::vector<std::thread> threads;
      for (int t = 0; t < trainers; ++t)
        threads.emplace_back([&, t] { ProcessGroup::wait(clients[t]->average(batch, 0, grads[t], grads[t])); });
      for (auto& th : threads) th.join();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (b >= 2) rounds.push_back(ms);  // the first two warm the connections and allocator
    }
    std::sort(rounds.begin(), rounds.end());
    const double p50 = rounds[rounds.size() / 2];
    std::printf("%10.1f %12.2f %12.2f %12.1f %10.2f\n", mb, p50, rounds.front(), trainers * 1000.0 / p50,
                trainers * mb * 1024 * 1024 / 1e9 / (p50 / 1000));
  }
  return 0;
}
