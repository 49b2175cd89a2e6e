// ddpkit bench: the parameter-server benchmark (PyTorch's benchmarks/distributed/rpc/
// parameter_server) with ddpkit's DDP, hooks and gRPC servers. Ranks 0..T-1 are trainers, T..T+S-1
// parameter servers; launched locally, or joined from a torchrun-style environment.
#include "cli.h"

#include <ddpkit/ps/parameter_server.h>
#include <ddpkit/ps/trainer_hooks.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>

namespace ddpkit {
namespace cli {

const char* kBenchUsage = R"(usage: ddpkit bench [flags]

Trains the parameter-server benchmark's model with every trainer's gradients averaged by --hook,
then prints per-trainer / per-server metric tables and one JSON summary line.

flags:
  --trainers N           trainer processes (default 2)
  --servers N            parameter-server processes; trainers split into N equal groups (default 1)
  --hook NAME            allreduce | rpc | sparse_rpc | hybrid | any `ddpkit train --hook` name
  --model NAME           dummy (dense EmbeddingBag) | dummy_sparse (sparse EmbeddingBag)
  --server-class NAME    average | average_batch
  --iterations N         measured iterations (default 20)
  --warmup N             iterations before the servers are reset and timing starts (default 3)
  --batch-size N         samples per trainer per iteration (default 16)
  --dim N                embeddings, their width, dense layer width and classes (default 1024,
                         the seed's size)
  --layers N             dense layers (default 8)
  --sample-length N      indices per sample (default 1024)
  --sample-count N       samples in the data set (default 1024)
  --sparsity N           percent of index values never used (default 20)
  --bucket-cap-mb X      DDP bucket size (default 25)
  --lr X                 SGD learning rate (default 1e-4)
  --seed N               model and data seed (default 0)
  --threads N            intra-op threads per trainer (default 1)
  --timeout-s N          bound on every collective, RPC and rendezvous (default 300)
  --token-file PATH      shared secret for the servers (also DDPKIT_PS_TOKEN)
  --out-dir DIR          also write metrics.csv, metrics.json and summary.json there
)";

namespace {

// DummyData of the seed: sample_count rows of sample_length indices drawn from a random subset
// of (100 - sparsity)% of 0..max_val-1; targets uniform in 0..max_val-1.
struct DummyData {
  at::Tensor input, target;
  DummyData(int64_t max_val, int64_t count, int64_t length, int sparsity, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<int64_t> values(max_val);
    std::iota(values.begin(), values.end(), 0);
    std::shuffle(values.begin(), values.end(), rng);
    const int64_t used = std::max<int64_t>(1, max_val * (100 - sparsity) / 100);
    input = at::empty({count, length}, at::kLong);
    auto* p = input.data_ptr<int64_t>();
    std::uniform_int_distribution<int64_t> pick(0, used - 1), label(0, max_val - 1);
    for (int64_t i = 0; i < count * length; ++i) p[i] = values[pick(rng)];
    target = at::empty({count}, at::kLong);
    for (int64_t i = 0; i < count; ++i) target.data_ptr<int64_t>()[i] = label(rng);
  }
};

// DummyModel / DummyModelSparse: EmbeddingBag(mean) then `layers` Linear(dim, dim), softmax.
struct DummyModelImpl : torch::nn::Module {
  DummyModelImpl(int64_t num_embeddings, int64_t dim, int64_t layers, bool sparse) {
    bag = register_module("embedding", torch::nn::EmbeddingBag(
                                           torch::nn::EmbeddingBagOptions(num_embeddings, dim).mode(torch::kMean).sparse(sparse)));
    for (int64_t i = 0; i < layers; ++i) dense->push_back(torch::nn::Linear(dim, dim));
    register_module("dense_seq", dense);
  }
  at::Tensor forward(const at::Tensor& x) { return torch::softmax(dense->forward(bag(x)), 1); }
  torch::nn::EmbeddingBag bag{nullptr};
  torch::nn::Sequential dense;
};

struct Summary {
  double step_mean_ms = 0, step_p50_ms = 0;
  int64_t gradients = 0, buckets = 0, bytes_in = 0;
  double server_seconds = 0;
};

}  // namespace

int run_bench(const std::vector<std::string>& args, const std::vector<std::string>& argv) {
  Flags f(args,
          {{"trainers", "2"}, {"servers", "1"}, {"hook", "rpc"}, {"model", "dummy_sparse"},
           {"server-class", "average"}, {"iterations", "20"}, {"warmup", "3"}, {"batch-size", "16"},
           {"dim", "1024"}, {"layers", "8"}, {"sample-length", "1024"}, {"sample-count", "1024"},
           {"sparsity", "20"}, {"bucket-cap-mb", "25"}, {"lr", "1e-4"}, {"seed", "0"}, {"threads", "1"},
           {"timeout-s", "300"}, {"token-file", ""}, {"out-dir", ""}},
          {"quiet"});
  const int ntrainer = f.integer("trainers"), nserver = f.integer("servers");
  const std::string hook_name = f.str("hook"), model_name = f.str("model");
  if (ntrainer < 1) throw UsageError("--trainers must be >= 1");
  if (nserver < 0) throw UsageError("--servers must be >= 0");
  const bool uses_server = hook_name == "rpc" || hook_name == "sparse_rpc";
  if (uses_server && nserver < 1) throw UsageError("--hook " + hook_name + " needs --servers >= 1");
  if (nserver > 0 && ntrainer % nserver)
    throw UsageError("--trainers " + std::to_string(ntrainer) + " is not a multiple of --servers " + std::to_string(nserver));
  if (model_name != "dummy" && model_name != "dummy_sparse")
    throw UsageError("--model must be dummy or dummy_sparse, got '" + model_name + "'");
  if (hook_name != "allreduce" && hook_name != "rpc" && hook_name != "sparse_rpc" && hook_name != "hybrid") {
    const auto names = hooks::hook_names();
    if (std::find(names.begin(), names.end(), hook_name) == names.end())
      throw UsageError("--hook '" + hook_name + "' is unknown (rpc, sparse_rpc, hybrid, or a ddpkit train hook)");
  }
  ps::ServerKind kind;
  try {
    kind = ps::server_kind_from_name(f.str("server-class"));
  } catch (const c10::Error&) {
    throw UsageError("--server-class must be average or average_batch, got '" + f.str("server-class") + "'");
  }
  const int iterations = f.integer("iterations"), warmup = f.integer("warmup"), batch = f.integer("batch-size");
  const int64_t dim = f.integer("dim"), layers = f.integer("layers");
  if (iterations < 1 || warmup < 0 || batch < 1 || dim < 1 || layers < 1 || f.integer("sample-length") < 1 ||
      f.integer("sample-count") < batch || f.integer("sparsity") < 0 || f.integer("sparsity") > 99)
    throw UsageError("--iterations, --batch-size, --dim, --layers, --sample-length must be >= 1, --warmup >= 0, "
                     "--sample-count >= --batch-size, --sparsity in 0..99");
  const auto timeout = std::chrono::seconds(f.integer("timeout-s"));
  if (timeout.count() < 1) throw UsageError("--timeout-s must be >= 1");
  const std::string token = read_token(f.str("token-file"));

  if (!in_distributed_env()) return launch_local(ntrainer + nserver, argv);

  auto world = init_process_group(InitOptions().timeout(timeout).gloo_threads(1));
  if (world->size() != ntrainer + nserver)
    throw UsageError("WORLD_SIZE is " + std::to_string(world->size()) + ", --trainers + --servers is " +
                     std::to_string(ntrainer + nserver));
  const int rank = world->rank();
  auto store = world->store();
  store->setTimeout(timeout);

  // ---- a server rank ----
  if (rank >= ntrainer) {
    const int s = rank - ntrainer;
    const char* host_env = std::getenv("DDPKIT_PS_HOST");
    const std::string host = host_env ? host_env : (std::getenv("MASTER_ADDR") ? std::getenv("MASTER_ADDR") : "127.0.0.1");
    ps::ParameterServer server(ps::ServerOptions()
                                   .address(host + ":0")
                                   .trainer_ids(ps::trainers_of_server(s, ntrainer, nserver))
                                   .kind(kind)
                                   .rank(rank)
                                   .token(token)
                                   .bucket_timeout(timeout));
    server.start();
    store->set("bench/server/" + std::to_string(s), std::vector<uint8_t>(server.address().begin(), server.address().end()));
    // Serve until the trainers are done (trainer 0 sets the key after collecting metrics); a
    // trainer that never finishes surfaces as the store's timeout scaled by the run length.
    store->wait({"bench/done"}, timeout * (iterations + warmup + 1));
    server.shutdown();
    return 0;
  }

  // ---- a trainer rank ----
  at::set_num_threads(f.integer("threads"));
  auto pg = std::make_shared<ProcessGroup>(store, rank, ntrainer,
                                           ProcessGroupOptions().timeout(timeout).group_name("trainers").gloo_hostname(world->options().gloo_hostname()));
  auto log = std::make_shared<metrics::MetricsLogger>(rank);
  auto server_address = [&](int s) {
    auto v = store->get("bench/server/" + std::to_string(s));
    return std::string(v.begin(), v.end());
  };
  auto client_options = [&](int s, int trainer) {
    return ps::ClientOptions().address(server_address(s)).trainer_id(trainer).timeout(timeout).token(token);
  };

  torch::manual_seed(f.integer("seed"));
  const bool sparse = model_name == "dummy_sparse";
  auto model = std::make_shared<DummyModelImpl>(dim, dim, layers, sparse);
  DummyData data(dim, f.integer("sample-count"), f.integer("sample-length"), f.integer("sparsity"),
                 static_cast<uint64_t>(f.integer("seed")));
  DistributedDataParallel<std::shared_ptr<DummyModelImpl>> ddp(model, pg,
                                                               DistributedDataParallelOptions().bucket_cap_mb(f.real("bucket-cap-mb")));
  std::shared_ptr<ps::ParameterServerClient> client;
  std::shared_ptr<ProcessGroup> sparse_pg;
  if (uses_server) client = std::make_shared<ps::ParameterServerClient>(client_options(ps::server_for_trainer(rank, ntrainer, nserver), rank));
  if (hook_name == "rpc") {
    ddp.register_comm_hook(ps::rpc_hook(client, log), hook_name);
  } else if (hook_name == "sparse_rpc") {
    ddp.register_comm_hook(ps::sparse_rpc_hook(client, pg, log), hook_name);
  } else if (hook_name == "hybrid") {
    sparse_pg = std::make_shared<ProcessGroup>(store, rank, ntrainer, ProcessGroupOptions(pg->options()).group_name("trainers_sparse"));
    ddp.register_comm_hook(ps::hybrid_hook(sparse_pg, pg, log), hook_name);
  } else {
    ddp.register_comm_hook(ps::timed_hook(hooks::make_hook(hook_name, pg), log, "gloo_" + hook_name), hook_name);
  }
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(f.real("lr")));

  const int64_t rows = data.input.size(0);
  const bool lead = rank == 0, quiet = f.on("quiet");
  for (int it = 0; it < warmup + iterations; ++it) {
    if (it == warmup) {
      // Everybody is between iterations: reset the servers and the clocks.
      ProcessGroup::wait(pg->barrier());
      if (lead)
        for (int s = 0; s < nserver; ++s) ps::ParameterServerClient(client_options(s, 0).open_session(false)).reset_state();
      ProcessGroup::wait(pg->barrier());
      log->clear();
    }
    const int64_t start = ((static_cast<int64_t>(it) * ntrainer + rank) * batch) % (rows - batch + 1);
    at::Tensor x = data.input.narrow(0, start, batch), y = data.target.narrow(0, start, batch);
    const std::string key = std::to_string(it);
    log->record_start("batch_level_metric", key, "batch_all");
    log->record_start("forward_metric", key, "forward_pass");
    at::Tensor loss = torch::nn::functional::cross_entropy(ddp.forward(x), y);
    log->record_end("forward_metric", key);
    log->record_start("backward_metric", key, "backward");
    loss.backward();
    log->record_end("backward_metric", key);
    optimizer.step();
    optimizer.zero_grad();
    log->record_end("batch_level_metric", key);
    if (lead && !quiet && it >= warmup) std::cerr << "\rbench: iteration " << (it - warmup + 1) << "/" << iterations << std::flush;
  }
  if (lead && !quiet) std::cerr << "\n";

  // ---- collect and report (trainer 0) ----
  const std::string mine = metrics::series_to_json(log->processed());
  store->set("bench/trainer/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  if (lead) {
    std::vector<std::pair<std::string, std::vector<metrics::Summary>>> tables;
    std::vector<metrics::Series> trainers, servers;
    for (int t = 0; t < ntrainer; ++t) {
      auto v = store->get("bench/trainer/" + std::to_string(t));
      trainers.push_back(metrics::series_from_json(std::string(v.begin(), v.end())));
      tables.emplace_back("trainer" + std::to_string(t), metrics::summarize(trainers.back()));
    }
    tables.emplace_back("all_trainers", metrics::summarize(metrics::merge(trainers)));
    Summary sum;
    for (int s = 0; s < nserver; ++s) {
      auto m = ps::ParameterServerClient(client_options(s, 0).open_session(false)).get_metrics();
      servers.push_back(m.series);
      tables.emplace_back("server" + std::to_string(s), metrics::summarize(m.series));
      sum.gradients += m.counters.gradients_received;
      sum.buckets += m.counters.buckets_averaged;
      sum.bytes_in += m.counters.bytes_received;
      sum.server_seconds = std::max(sum.server_seconds, m.counters.seconds_since_reset);
    }
    if (nserver > 0) tables.emplace_back("all_servers", metrics::summarize(metrics::merge(servers)));
    store->set("bench/done", {1});
    if (!quiet)
      for (const auto& [source, rows] : tables) {
        metrics::write_table(std::cout, source, rows);
        std::cout << "\n";
      }
    for (const auto& row : tables[ntrainer].second)
      if (row.name == "batch_all") {
        sum.step_mean_ms = row.mean;
        sum.step_p50_ms = row.p50;
      }
    nlohmann::ordered_json j = {
        {"hook", hook_name}, {"model", model_name}, {"server_class", ps::server_kind_name(kind)},
        {"trainers", ntrainer}, {"servers", nserver}, {"iterations", iterations}, {"batch_size", batch},
        {"step_ms_mean", sum.step_mean_ms}, {"step_ms_p50", sum.step_p50_ms},
        {"server_gradients_averaged", sum.gradients},
        {"server_gradients_per_s", sum.server_seconds > 0 ? sum.gradients / sum.server_seconds : 0.0},
        {"server_MB_in_per_s", sum.server_seconds > 0 ? sum.bytes_in / sum.server_seconds / 1e6 : 0.0}};
    std::cout << j.dump() << std::endl;
    if (!f.str("out-dir").empty()) {
      std::filesystem::create_directories(f.str("out-dir"));
      std::ofstream csv(f.str("out-dir") + "/metrics.csv"), js(f.str("out-dir") + "/metrics.json"),
          summary(f.str("out-dir") + "/summary.json");
      metrics::write_csv(csv, tables);
      metrics::write_json(js, tables);
      summary << j.dump(2) << "\n";
    }
  }
  ProcessGroup::wait(pg->barrier());
  return 0;
}

}  // namespace cli
}  // namespace ddpkit
