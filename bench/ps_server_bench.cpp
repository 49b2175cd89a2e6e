// Parameter-server engine throughput, no model: each trainer sends one bucket of S MB per round
// and waits for the average; prints size, time per round, gradients averaged per second and
// payload GB/s per direction.
//
//   build/ps_server_bench [--trainers 2] [--batches 20] [--warmup 10] [--sizes 1,4,16,64] [--chunk-kb K] [--window W]
//       trainers are threads of this process, each with its own client and connection, against
//       one in-process server;
//   build/ps_server_bench --connect HOST:PORT --trainer-id T [--batches B] [--sizes ...] [--first-batch N]
//       one trainer against a running `ddpkit ps-server` (trainer 0 prints one JSON line per
//       size), as bench/ps_vs_pytorch.py --sizes runs it beside PyTorch's RPC server.
// Each size first runs --warmup rounds that are not measured (connections, allocator, threads).
// DDPKIT_SHM=0 keeps the data in gRPC messages (no shared-memory region).
#include <ddpkit/error.h>
#include <ddpkit/ps/parameter_server.h>
#include <ddpkit/runtime/program.h>
#include <ddpkit/runtime/runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace ddpkit;

namespace {

double p50(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

constexpr const char* kUsage =
    "usage: ps_server_bench [--trainers N] [--batches B] [--warmup W] [--sizes MB,MB,...] [--chunk-kb K] [--window W]\n"
    "       ps_server_bench --connect HOST:PORT --trainer-id T [--batches B] [--sizes ...] [--chunk-kb K] [--window W]\n"
    "                       [--first-batch N]   (batch numbers start at N: later runs against the same server)\n";

}  // namespace

static int program_main(int argc, char** argv) {
  tune_allocator_for_training();  // as the ddpkit CLI does: keep large blocks in the heap for reuse
  int trainers = 2, batches = 20, warmup = 10, trainer_id = -1;
  int64_t first_batch = 0;
  int64_t chunk_bytes = ps::ClientOptions().chunk_bytes();
  int window = ps::ClientOptions().chunks_in_flight();
  std::string connect, sizes = "1,4,16,64";
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) throw UsageError(std::string(argv[i]) + " needs a value");
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--trainers") trainers = std::atoi(value.c_str());
    else if (flag == "--batches") batches = std::atoi(value.c_str());
    else if (flag == "--warmup") warmup = std::atoi(value.c_str());
    else if (flag == "--sizes") sizes = value;
    else if (flag == "--chunk-kb") chunk_bytes = std::atoll(value.c_str()) * 1024;
    else if (flag == "--window") window = std::atoi(value.c_str());
    else if (flag == "--connect") connect = value;
    else if (flag == "--first-batch") first_batch = std::atoll(value.c_str());
    else if (flag == "--trainer-id") trainer_id = std::atoi(value.c_str());
    else throw UsageError("unknown flag " + flag);
  }
  if (trainers < 1 || batches < 1 || warmup < 0 || chunk_bytes < 0 || window < 1 || first_batch < 0 || connect.empty() != (trainer_id < 0))
    throw UsageError("--trainers, --batches and --window must be positive, --warmup, --chunk-kb and --first-batch "
                     "non-negative, and --connect and --trainer-id given together");
  std::vector<double> sizes_mb;
  std::stringstream list(sizes);
  for (std::string item; std::getline(list, item, ',');) sizes_mb.push_back(std::atof(item.c_str()));

  std::unique_ptr<ps::ParameterServer> server;
  std::vector<int> ids;
  if (connect.empty()) {
    for (int t = 0; t < trainers; ++t) ids.push_back(t);
    server = std::make_unique<ps::ParameterServer>(ps::ServerOptions().trainer_ids(ids));
    server->start();
    connect = server->address();
  } else {
    ids = {trainer_id};
  }
  std::vector<std::unique_ptr<ps::ParameterServerClient>> clients;
  for (int t : ids)
    clients.push_back(std::make_unique<ps::ParameterServerClient>(
        ps::ClientOptions().address(connect).trainer_id(t).chunk_bytes(chunk_bytes).chunks_in_flight(window)));
  if (server) {
    std::printf("# %d trainers (threads), 1 server, %d batches per size, chunks of %lld KiB; GB/s = payload bytes per direction\n",
                trainers, batches, static_cast<long long>(chunk_bytes / 1024));
    std::printf("%10s %12s %12s %12s %10s\n", "size_MB", "round_ms_p50", "round_ms_min", "gradients/s", "GB/s");
  }
  int64_t batch = first_batch;
  for (double mb : sizes_mb) {
    const int64_t n = static_cast<int64_t>(mb * 1024 * 1024 / 4);
    std::vector<at::Tensor> grads;
    for (int t : ids) grads.push_back(at::full({n}, static_cast<float>(t)));
    std::vector<double> rounds;
    for (int b = 0; b < warmup + batches; ++b, ++batch) {
      const auto start = std::chrono::steady_clock::now();
      std::vector<std::thread> threads;
      for (size_t t = 0; t < clients.size(); ++t)
        threads.emplace_back([&, t] { ProcessGroup::wait(clients[t]->average(batch, 0, grads[t], grads[t])); });
      for (auto& th : threads) th.join();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (b >= warmup) rounds.push_back(ms);
    }
    const double mid = p50(rounds), best = *std::min_element(rounds.begin(), rounds.end());
    if (server) {
      std::printf("%10.1f %12.2f %12.2f %12.1f %10.2f\n", mb, mid, best, trainers * 1000.0 / mid,
                  trainers * mb * 1024 * 1024 / 1e9 / (mid / 1000));
    } else if (trainer_id == 0) {  // a round ends for every trainer when the server answers the last one
      std::printf("{\"impl\": \"ddpkit\", \"size_mb\": %g, \"round_ms_p50\": %.3f, \"round_ms_min\": %.3f}\n", mb, mid, best);
      std::fflush(stdout);
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  return ddpkit::run_main("ps_server_bench", [&] { return program_main(argc, argv); }, [] { return std::string(kUsage); });
}
