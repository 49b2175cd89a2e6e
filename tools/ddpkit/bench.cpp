// ddpkit bench: PyTorch's parameter-server benchmark (benchmarks/distributed/rpc/parameter_server)
// with ddpkit's DDP, hooks and gRPC servers. Ranks 0..T-1 train, T..T+S-1 serve. Without a
// torchrun-style environment it launches every rank locally, once per hook, and writes a report.
#include "bench.h"
#include "training.h"

#include <ddpkit/ps/parameter_server.h>
#include <ddpkit/ps/trainer_hooks.h>
#include <ddpkit/training/divergence_guard.h>
#include <ddpkit/runtime/memory_sampler.h>
#include <ddpkit/runtime/runtime.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#ifndef DDPKIT_BENCH_CONFIG_DIR
#define DDPKIT_BENCH_CONFIG_DIR "configs/bench"
#endif
#ifndef DDPKIT_INSTALLED_CONFIG_DIR
#define DDPKIT_INSTALLED_CONFIG_DIR DDPKIT_BENCH_CONFIG_DIR
#endif

namespace ddpkit {
namespace cli {

namespace {
// The checkout's configs/bench when this binary runs from its build tree, else the installed copy.
std::string default_config_dir() {
  return std::filesystem::is_directory(DDPKIT_BENCH_CONFIG_DIR) ? DDPKIT_BENCH_CONFIG_DIR : DDPKIT_INSTALLED_CONFIG_DIR;
}
}  // namespace

const char* kBenchUsage = R"(usage: ddpkit bench [flags]

Compares communication hooks on one workload, one run each: 2 trainers and 1 parameter server on
this host. With no flags it trains an MLP on Fashion-MNIST (the default workload learns, so the
loss curves show what each hook's compression costs) with allreduce, fp16, int8, powersgd and
rpc, prints a comparison table with each hook's time to --target-loss, and writes a report to
bench-report/ (report.html, comparison.json, and per hook metrics.csv, metrics.json,
summary.json, trace.json). --seed-workload runs the seed benchmark instead.

flags:
  --seed-workload         the seed's workload: DummyModelSparse on DummyData, trainer DdpTrainer
                          (lr 1e-4; its loss stays at 6.93, so only timings mean anything), batch
                          16, 20 iterations, hooks as below plus sparse_rpc, no target loss
  --trainers N            trainer processes (default 2)
  --servers N             parameter servers; trainers split into N equal groups (default 1)
  --backend NAME          trainers' process group backend: gloo (the bench trains on CPU)
  --hook NAME             run one hook: allreduce | rpc | sparse_rpc | hybrid | any `ddpkit train`
                          hook (fp16, int8, powersgd, ...; sparse buckets are then allreduced)
  --hooks LIST            compare these hooks, one run each (default allreduce,fp16,int8,powersgd,rpc)
  --data ID               entry of the data configuration (default FashionMNIST)
  --model ID              entry of the model configuration (default MLP)
  --trainer ID            entry of the trainer configuration (default DdpTrainerFast)
  --server ID             entry of the server configuration (default AverageParameterServer)
  --target-loss X         time-to-target column: wall-clock seconds of training until the mean loss
                          of the last 20 iterations is at most X (default 0.6)
  --config-dir DIR        where data.json, model.json, trainer.json, server.json are
                          (default: the ones shipped in configs/bench)
  --data-config F, --model-config F, --trainer-config F, --server-config F
                          a file in place of the one in --config-dir
  --iteration-step NAME   overrides the trainer configuration's (basic_iteration_step)
  --epochs N              passes over the data (default 1), capped by --max-iterations
  --max-iterations N      measured iterations at most (default 300; 0: no cap)
  --warmup N              iterations before the servers are reset and timing starts (default 3)
  --batch-size N          samples per trainer per iteration (default 64)
  --seed N                model and data seed (default 0)
  --threads N             intra-op threads per trainer (default 1)
  --timeout-s N           bound on every collective, RPC and rendezvous (default 300)
  --token-file PATH       shared secret for the servers (also DDPKIT_PS_TOKEN)
  --out-dir DIR           report directory (default bench-report)
  --report-only           write the comparison and report.html from the runs already in --out-dir
                          (bench/netns_bench.sh runs the ranks itself, then calls this)
  --no-tables             do not print the per-trainer/per-server tables (still written as files)
  --quiet                 no progress bar or tables, only the JSON lines
)";

namespace {

using bench::ConfigEntry;
using nlohmann::json;

const std::vector<std::string> kServerHooks{"rpc", "sparse_rpc"};

struct Setup {
  ConfigEntry data, model, trainer, server;
  bench::TrainerConfig trainer_config;
  bench::ServerConfig server_config;
  int ntrainer = 2, nserver = 1, warmup = 3, batch = 16, epochs = 1, max_iterations = 20, threads = 1;
  std::vector<std::string> hooks;
  std::string out_dir, token, backend;
  std::chrono::seconds timeout{300};
  uint64_t seed = 0;
  double target_loss = 0;  // 0: none (no time-to-target column)
  bool quiet = false, report_only = false, tables = true;
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

Setup parse(const std::vector<std::string>& args) {
  Flags f(args,
          {{"trainers", "2"}, {"servers", "1"}, {"backend", "gloo"}, {"hook", ""}, {"hooks", ""}, {"data", ""},
           {"model", ""}, {"trainer", ""}, {"server", "AverageParameterServer"}, {"target-loss", ""},
           {"config-dir", default_config_dir()}, {"data-config", ""}, {"model-config", ""}, {"trainer-config", ""},
           {"server-config", ""}, {"iteration-step", ""}, {"epochs", "1"}, {"max-iterations", ""}, {"warmup", "3"},
           {"batch-size", ""}, {"seed", "0"}, {"threads", "1"}, {"timeout-s", "300"}, {"token-file", ""},
           {"out-dir", "bench-report"}},
          {"quiet", "report-only", "no-tables", "seed-workload"});
  Setup s;
  // Two workloads. The default learns (an MLP on Fashion-MNIST), so the loss curves show what
  // each hook's compression costs; --seed-workload is the seed benchmark's (DummyModelSparse on
  // DummyData at lr 1e-4, whose loss stays at ln 1024 = 6.93: a timing workload only).
  const bool seed = f.on("seed-workload");
  auto or_default = [&](const char* flag, const char* learning, const char* seeds) {
    return f.str(flag).empty() ? std::string(seed ? seeds : learning) : f.str(flag);
  };
  auto file = [&](const char* kind) {
    const std::string own = f.str(std::string(kind) + "-config");
    return own.empty() ? f.str("config-dir") + "/" + kind + ".json" : own;
  };
  s.data = bench::load_entry(file("data"), "data", or_default("data", "FashionMNIST", "DummyData"));
  s.model = bench::load_entry(file("model"), "model", or_default("model", "MLP", "DummyModelSparse"));
  s.trainer = bench::load_entry(file("trainer"), "trainer", or_default("trainer", "DdpTrainerFast", "DdpTrainer"));
  s.server = bench::load_entry(file("server"), "server", f.str("server"));
  s.trainer_config = bench::trainer_config(s.trainer);
  if (!f.str("iteration-step").empty()) {
    const auto& known = bench::iteration_steps();
    if (std::find(known.begin(), known.end(), f.str("iteration-step")) == known.end())
      throw UsageError("--iteration-step '" + f.str("iteration-step") + "' is unknown (known: basic_iteration_step)");
    s.trainer_config.iteration_step = f.str("iteration-step");
  }
  s.server_config = bench::server_config(s.server);
  s.ntrainer = f.integer("trainers");
  s.nserver = f.integer("servers");
  if (s.ntrainer < 1) throw UsageError("--trainers must be >= 1");
  if (s.nserver < 0) throw UsageError("--servers must be >= 0");
  if (s.nserver > 0 && s.ntrainer % s.nserver)
    throw UsageError("--trainers " + std::to_string(s.ntrainer) + " is not a multiple of --servers " +
                     std::to_string(s.nserver) + " (each server serves trainers/servers trainers)");
  // sparse_rpc differs from allreduce only for sparse gradients, which the MLP has none of.
  const std::string hooks = or_default("hooks", "allreduce,fp16,int8,powersgd,rpc", "allreduce,fp16,int8,powersgd,rpc,sparse_rpc");
  s.hooks = f.str("hook").empty() ? split_list(hooks) : std::vector<std::string>{f.str("hook")};
  if (s.hooks.empty()) throw UsageError("--hooks is empty");
  const auto train_hooks = hooks::hook_names();
  for (const auto& h : s.hooks) {
    const bool known = h == "rpc" || h == "sparse_rpc" || h == "hybrid" ||
                       std::find(train_hooks.begin(), train_hooks.end(), h) != train_hooks.end();
    if (!known) {
      std::string names = "rpc, sparse_rpc, hybrid";
      for (const auto& n : train_hooks) names += ", " + n;
      throw UsageError("hook '" + h + "' is unknown (" + names + ")");
    }
    if (std::find(kServerHooks.begin(), kServerHooks.end(), h) != kServerHooks.end() && s.nserver < 1)
      throw UsageError("hook " + h + " needs --servers >= 1");
  }
  s.warmup = f.integer("warmup");
  // Numbers the user left out take the workload's default; given ones are parsed by Flags.
  auto given = [&](const char* flag) { return !f.str(flag).empty(); };
  s.batch = given("batch-size") ? f.integer("batch-size") : seed ? 16 : 64;
  s.epochs = f.integer("epochs");
  s.max_iterations = given("max-iterations") ? f.integer("max-iterations") : seed ? 20 : 300;
  s.target_loss = given("target-loss") ? f.real("target-loss") : seed ? 0 : 0.6;
  if (given("target-loss") && !(s.target_loss > 0)) throw UsageError("--target-loss must be positive");
  if (s.warmup < 0 || s.batch < 1 || s.epochs < 1 || s.max_iterations < 0)
    throw UsageError("--batch-size and --epochs must be >= 1, --warmup and --max-iterations >= 0");
  s.threads = f.integer("threads");
  if (s.threads < 1) throw UsageError("--threads must be >= 1");
  s.timeout = std::chrono::seconds(f.integer("timeout-s"));
  if (s.timeout.count() < 1) throw UsageError("--timeout-s must be >= 1");
  s.token = read_token(f.str("token-file"));
  s.out_dir = f.str("out-dir");
  s.backend = f.str("backend");
  if (s.backend != "gloo")
    throw UsageError("--backend " + s.backend + ": ddpkit bench trains on CPU tensors, so only gloo applies "
                     "(placing the model on CUDA for nccl is not implemented)");
  s.seed = static_cast<uint64_t>(f.integer("seed"));
  s.quiet = f.on("quiet");
  s.report_only = f.on("report-only");
  s.tables = !f.on("no-tables") && !s.quiet;
  return s;
}

// argv without the flags named (in --name value or --name=value form).
std::vector<std::string> without_flags(const std::vector<std::string>& argv, const std::vector<std::string>& names) {
  std::vector<std::string> out{argv[0], argv[1]};
  for (size_t i = 2; i < argv.size(); ++i) {
    bool drop = false;
    for (const auto& n : names) {
      if (argv[i] == "--" + n) {
        drop = true;
        ++i;  // and its value
      } else if (argv[i].rfind("--" + n + "=", 0) == 0) {
        drop = true;
      }
      if (drop) break;
    }
    if (!drop) out.push_back(argv[i]);
  }
  return out;
}

// Strings through the rendezvous store (server addresses, metrics, the data size).
void store_put(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}
std::string store_get(c10d::Store& store, const std::string& key) {
  const auto v = store.get(key);
  return std::string(v.begin(), v.end());
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("missing " + path);
  return json::parse(in);
}

void write_report(const Setup& s, const std::vector<json>& runs) {
  std::cout << "\n";
  bench::write_comparison(std::cout, runs);
  std::ofstream out(s.out_dir + "/comparison.json");
  out << json(runs).dump(2) << "\n";
  std::ofstream html(s.out_dir + "/report.html");
  bench::write_html_report(html, runs, "ddpkit bench: " + s.model.id + " on " + s.data.id);
  std::cout << "report: " << s.out_dir << "/report.html" << std::endl;
}

// The runs of --hooks already in --out-dir (written by ranks launched elsewhere).
int report_existing(const Setup& s) {
  std::vector<json> runs;
  for (const auto& hook : s.hooks) {
    const std::string path = s.out_dir + "/" + hook + "/summary.json";
    try {
      runs.push_back(read_json(path));
    } catch (const std::exception& e) {
      throw UsageError("--report-only: no run of hook " + hook + " (" + path + ": " + e.what() + ")");
    }
  }
  write_report(s, runs);
  return 0;
}

// ---- the parent: one local launch per hook, then the report -------------------------------------
int run_sweep(const Setup& s, const std::vector<std::string>& argv) {
  // Build the workload once here so a model/data mismatch fails before any process starts.
  const std::string workload = bench::make_workload(s.data, s.model, s.seed).description;
  std::filesystem::create_directories(s.out_dir);
  if (!s.quiet)
    std::cerr << "bench: " << workload << "; " << s.ntrainer << " trainers, " << s.nserver << " servers; hooks";
  for (const auto& h : s.hooks)
    if (!s.quiet) std::cerr << " " << h;
  if (!s.quiet) std::cerr << "\n";
  const auto base = without_flags(argv, {"hook", "hooks", "out-dir"});
  std::vector<json> runs;
  std::vector<std::string> failed;
  for (size_t i = 0; i < s.hooks.size(); ++i) {
    const std::string& hook = s.hooks[i];
    auto child = base;
    child.insert(child.end(), {"--hook", hook, "--out-dir", s.out_dir + "/" + hook});
    if (s.hooks.size() > 1) child.push_back("--no-tables");  // a comparison prints its own table
    if (!s.quiet) std::cerr << "bench: [" << i + 1 << "/" << s.hooks.size() << "] " << hook << "\n";
    const int rc = launch_local(s.ntrainer + s.nserver, child);
    try {
      if (rc != 0) throw std::runtime_error("exit status " + std::to_string(rc));
      runs.push_back(read_json(s.out_dir + "/" + hook + "/summary.json"));
    } catch (const std::exception& e) {
      std::cerr << "bench: hook " << hook << " failed (" << e.what() << ")\n";
      failed.push_back(hook);
    }
  }
  write_report(s, runs);
  if (!failed.empty()) {
    std::cerr << "bench: " << failed.size() << " hook(s) failed: " << failed.front() << (failed.size() > 1 ? ", ..." : "") << "\n";
    return 1;
  }
  return 0;
}

// ---- one rank ------------------------------------------------------------------------------------
int run_server_rank(const Setup& s, ProcessGroup& world, int iterations) {
  const int index = world.rank() - s.ntrainer;
  const char* host_env = std::getenv("DDPKIT_PS_HOST");
  const char* master = std::getenv("MASTER_ADDR");
  const std::string host = host_env ? host_env : master ? master : "127.0.0.1";
  ps::ParameterServer server(ps::ServerOptions()
                                 .address(host + ":0")
                                 .trainer_ids(ps::trainers_of_server(index, s.ntrainer, s.nserver))
                                 .kind(ps::server_kind_from_name(s.server_config.server_class))
                                 .rank(world.rank())
                                 .token(s.token)
                                 .max_message_bytes(static_cast<int64_t>(s.server_config.max_message_mb * 1024 * 1024))
                                 .bucket_timeout(std::chrono::milliseconds(static_cast<int64_t>(s.server_config.bucket_timeout_s * 1000)))
                                 .trace_events(true));
  server.start();
  store_put(*world.store(), "bench/server/" + std::to_string(index), server.address());
  // Serve until trainer 0 has collected the metrics; a trainer that never finishes surfaces as the
  // store's timeout scaled by the run length.
  world.store()->wait({"bench/done"}, s.timeout * (iterations + s.warmup + 1));
  server.shutdown();
  return 0;
}

CommHook make_trainer_hook(const Setup& s, const std::string& name, const std::shared_ptr<ProcessGroup>& pg,
                           const std::shared_ptr<ProcessGroup>& sparse_pg,
                           const std::shared_ptr<ps::ParameterServerClient>& client,
                           const std::shared_ptr<metrics::MetricsLogger>& log) {
  if (name == "rpc") return ps::rpc_hook(client, log);
  if (name == "sparse_rpc") return ps::sparse_rpc_hook(client, pg, log);
  if (name == "hybrid") return ps::hybrid_hook(sparse_pg, pg, log);
  hooks::HookOptions options;
  options.powersgd(hooks::PowerSGDOptions()
                       .matrix_approximation_rank(s.trainer_config.powersgd_rank)
                       .start_powerSGD_iter(s.trainer_config.powersgd_start_iter));
  CommHook dense = hooks::make_hook(name, pg, options);
  // Compression hooks take dense buckets: a sparse embedding's bucket is allreduced sparse.
  CommHook sparse = hooks::allreduce_hook(pg);
  CommHook either = [dense, sparse](GradBucket& b) { return b.is_sparse() ? sparse(b) : dense(b); };
  return ps::timed_hook(either, log, pg->backend_name() + "_" + name);
}

int run_trainer_rank(const Setup& s, ProcessGroup& world, const std::string& hook_name, int iterations,
                     bench::Workload& w) {
  const int rank = world.rank();
  PeakMemorySampler memory;
  set_compute_threads(s.threads);
  auto store = world.store();
  // The trainers are the world's first ranks (servers make no subgroups, so the trainers agree).
  auto pg = world.new_subgroup(
      rank, s.ntrainer,
      ProcessGroupOptions().backend(s.backend).timeout(s.timeout).group_name("trainers").gloo_hostname(world.options().gloo_hostname()));
  std::shared_ptr<ProcessGroup> sparse_pg;
  if (hook_name == "hybrid")
    sparse_pg = world.new_subgroup(rank, s.ntrainer, ProcessGroupOptions(pg->options()).backend("gloo").group_name("trainers_sparse"));
  auto log = std::make_shared<metrics::MetricsLogger>(rank);
  auto client_options = [&](int server, int trainer) {
    return ps::ClientOptions()
        .address(store_get(*store, "bench/server/" + std::to_string(server))).trainer_id(trainer).timeout(s.timeout).token(s.token);
  };
  const bool uses_server = std::find(kServerHooks.begin(), kServerHooks.end(), hook_name) != kServerHooks.end();
  std::shared_ptr<ps::ParameterServerClient> client;
  if (uses_server)
    client = std::make_shared<ps::ParameterServerClient>(client_options(ps::server_for_trainer(rank, s.ntrainer, s.nserver), rank));

  DistributedDataParallelBase ddp(w.module, pg, DistributedDataParallelOptions().bucket_cap_mb(s.trainer_config.bucket_cap_mb));
  ddp.register_comm_hook(make_trainer_hook(s, hook_name, pg, sparse_pg, client, log), hook_name);
  torch::optim::SGD optimizer(w.module->parameters(), torch::optim::SGDOptions(s.trainer_config.lr));

  const int64_t rows = w.inputs.size(0);
  const bool lead = rank == 0;
  Progress progress(lead && !s.quiet);
  std::vector<double> losses, step_ms;
  DivergenceGuard guard(pg);  // trainers check the loss together every 20 iterations
  CommStats comm_base;
  ps::ParameterServerClient::Traffic ps_base;
  for (int it = 0; it < s.warmup + iterations; ++it) {
    if (it == s.warmup) {
      // Everybody is between iterations: reset the servers, the clocks and the byte counters.
      ProcessGroup::wait(pg->barrier());
      if (lead)
        for (int srv = 0; srv < s.nserver; ++srv)
          ps::ParameterServerClient(client_options(srv, 0).open_session(false)).reset_state();
      ProcessGroup::wait(pg->barrier());
      log->clear();
      comm_base = pg->stats();
      if (sparse_pg) comm_base.bytes_sent += sparse_pg->stats().bytes_sent;
      if (client) ps_base = client->traffic();
    }
    const int64_t start = ((static_cast<int64_t>(it) * s.ntrainer + rank) * s.batch) % std::max<int64_t>(1, rows - s.batch + 1);
    const at::Tensor x = w.inputs.narrow(0, start, std::min<int64_t>(s.batch, rows)),
                     y = w.targets.narrow(0, start, std::min<int64_t>(s.batch, rows));
    const std::string key = std::to_string(it);
    const auto t0 = std::chrono::steady_clock::now();
    // basic_iteration_step: forward, loss, backward (hooks run inside), optimizer step.
    log->record_start("batch_level_metric", key, "batch_all");
    log->record_start("forward_metric", key, "forward_pass");
    at::Tensor loss = w.loss(ddp.forward_with([&] { return w.forward(x); }), y);
    log->record_end("forward_metric", key);
    log->record_start("backward_metric", key, "backward");
    loss.backward();
    log->record_end("backward_metric", key);
    optimizer.step();
    optimizer.zero_grad();
    log->record_end("batch_level_metric", key);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (auto d = guard.observe(loss.item<double>())) {
      std::ostringstream os;
      os << "training diverged with hook " << hook_name << ": " << d->what << ". ";
      if (hook_name.find("powersgd") != std::string::npos)
        os << "Raise powersgd_rank (now " << s.trainer_config.powersgd_rank << ") or powersgd_start_iter (now "
           << s.trainer_config.powersgd_start_iter << ") in the trainer configuration, or lower its lr (now "
           << s.trainer_config.lr << ")";
      else
        os << "Lower lr in the trainer configuration (now " << s.trainer_config.lr << ")";
      throw std::runtime_error(os.str());
    }
    if (it >= s.warmup) {
      losses.push_back(loss.item<double>());
      step_ms.push_back(ms);
      progress.update("bench " + hook_name, it - s.warmup + 1, iterations, losses.back(), ms);
    }
  }
  progress.finish();
  CommStats comm = pg->stats();
  if (sparse_pg) comm.bytes_sent += sparse_pg->stats().bytes_sent;
  auto ps_moved = [](const ps::ParameterServerClient::Traffic& t) { return t.bytes_sent + t.shm_bytes_sent; };
  const int64_t ps_sent = client ? ps_moved(client->traffic()) - ps_moved(ps_base) : 0;
  // Over the network and through shared memory (trainers on one host share it): what each hook moves.
  const double bytes_per_step = static_cast<double>(comm.bytes_sent - comm_base.bytes_sent + comm.shm_bytes_sent -
                                                    comm_base.shm_bytes_sent + ps_sent) /
                                iterations;

  // ---- hand the metrics to trainer 0, which reports ----
  memory.stop();
  store_put(*store, "bench/peak_rss/" + std::to_string(rank), std::to_string(process_resources().peak_rss_bytes));
  store_put(*store, "bench/peak_pss/" + std::to_string(rank), std::to_string(memory.peak_pss_bytes()));
  store_put(*store, "bench/series/" + std::to_string(rank), metrics::series_to_json(log->processed()));
  store_put(*store, "bench/events/" + std::to_string(rank), metrics::events_to_json(log->events()));
  if (lead) {
    std::vector<std::pair<std::string, std::vector<metrics::Summary>>> tables;
    std::vector<std::pair<std::string, std::vector<metrics::Event>>> timeline;
    std::vector<metrics::Series> trainers, servers;
    for (int t = 0; t < s.ntrainer; ++t) {
      trainers.push_back(metrics::series_from_json(store_get(*store, "bench/series/" + std::to_string(t))));
      tables.emplace_back("trainer" + std::to_string(t), metrics::summarize(trainers.back()));
      timeline.emplace_back("trainer " + std::to_string(t), metrics::events_from_json(store_get(*store, "bench/events/" + std::to_string(t))));
    }
    tables.emplace_back("all_trainers", metrics::summarize(metrics::merge(trainers)));
    int64_t gradients = 0, bytes_in = 0;
    double server_seconds = 0;
    for (int srv = 0; srv < s.nserver; ++srv) {
      auto m = ps::ParameterServerClient(client_options(srv, 0).open_session(false)).get_metrics();
      servers.push_back(m.series);
      tables.emplace_back("server" + std::to_string(srv), metrics::summarize(m.series));
      timeline.emplace_back("server " + std::to_string(srv), m.events);
      gradients += m.counters.gradients_received;
      bytes_in += m.counters.bytes_received + m.counters.shm_bytes_received;
      server_seconds = std::max(server_seconds, m.counters.seconds_since_reset);
    }
    if (s.nserver > 0) tables.emplace_back("all_servers", metrics::summarize(metrics::merge(servers)));
    store->set("bench/done", std::vector<uint8_t>{1});

    double step_mean = 0, step_p50 = 0;
    for (const auto& row : tables[s.ntrainer].second)
      if (row.name == "batch_all") {
        step_mean = row.mean;
        step_p50 = row.p50;
      }
    json summary = {{"hook", hook_name},
                    {"workload", w.description},
                    {"data", s.data.id},
                    {"model", s.model.id},
                    {"trainer", s.trainer.id},
                    {"server", s.server.id},
                    {"server_class", s.server_config.server_class},
                    {"backend", s.backend},
                    {"trainers", s.ntrainer},
                    {"servers", s.nserver},
                    {"batch_size", s.batch},
                    {"warmup", s.warmup},
                    {"iterations", iterations},
                    {"step_ms_mean", step_mean},
                    {"step_ms_p50", step_p50},
                    {"bytes_sent_per_step", bytes_per_step},
                    {"server_gradients_averaged", gradients},
                    {"server_gradients_per_s", server_seconds > 0 ? gradients / server_seconds : 0.0},
                    {"server_MB_in_per_s", server_seconds > 0 ? bytes_in / server_seconds / 1e6 : 0.0},
                    {"final_loss", losses.empty() ? 0.0 : losses.back()}};
    // The largest trainer's resident-memory high-water mark, and its peak with shared pages in proportion.
    int64_t peak_rss = 0, peak_pss = 0, pss_sum = 0;
    for (int t = 0; t < s.ntrainer; ++t) {
      peak_rss = std::max<int64_t>(peak_rss, std::stoll(store_get(*store, "bench/peak_rss/" + std::to_string(t))));
      const int64_t pss = std::stoll(store_get(*store, "bench/peak_pss/" + std::to_string(t)));
      peak_pss = std::max(peak_pss, pss);
      pss_sum += pss;
    }
    summary["peak_rss_bytes"] = peak_rss;
    summary["peak_pss_bytes"] = peak_pss;
    summary["mean_peak_pss_bytes"] = s.ntrainer > 0 ? pss_sum / s.ntrainer : 0;
    if (s.target_loss > 0) summary["target_loss"] = s.target_loss;
    summary["loss"] = losses;
    summary["step_ms"] = step_ms;
    if (auto t = bench::time_to_target_s(summary)) summary["time_to_target_s"] = *t;
    // One line, without the per-iteration arrays.
    json line = summary;
    line.erase("loss");
    line.erase("step_ms");
    std::cout << line.dump() << std::endl;
    if (s.tables)
      for (const auto& [source, rows] : tables) {
        metrics::write_table(std::cout, source, rows);
        std::cout << "\n";
      }
    std::filesystem::create_directories(s.out_dir);
    std::ofstream csv(s.out_dir + "/metrics.csv"), js(s.out_dir + "/metrics.json"), sum(s.out_dir + "/summary.json"),
        trace(s.out_dir + "/trace.json");
    metrics::write_csv(csv, tables);
    metrics::write_json(js, tables);
    sum << summary.dump(2) << "\n";
    trace << bench::trace_json(timeline).dump() << "\n";
  }
  ProcessGroup::wait(pg->barrier());
  return 0;
}

}  // namespace

int run_bench(const std::vector<std::string>& args, const std::vector<std::string>& argv) {
  const Setup s = parse(args);
  if (s.report_only) return report_existing(s);
  if (!in_distributed_env()) return run_sweep(s, argv);
  if (s.hooks.size() != 1)
    throw UsageError("in a torchrun-style environment, give one --hook (the comparison of --hooks launches locally)");
  auto world = init_process_group(InitOptions().timeout(s.timeout).gloo_threads(1));
  if (world->size() != s.ntrainer + s.nserver)
    throw UsageError("WORLD_SIZE is " + std::to_string(world->size()) + ", --trainers + --servers is " +
                     std::to_string(s.ntrainer + s.nserver));
  world->store()->setTimeout(s.timeout);
  // Iterations: --epochs passes over the data, at most --max-iterations.
  const bool serving = world->rank() >= s.ntrainer;
  bench::Workload w;
  int64_t rows = 0;
  if (!serving) {
    w = bench::make_workload(s.data, s.model, s.seed);
    rows = w.inputs.size(0);
  }
  const std::string key = "bench/rows";
  if (world->rank() == 0) store_put(*world->store(), key, std::to_string(rows));
  rows = std::stoll(store_get(*world->store(), key));
  const int64_t per_epoch = std::max<int64_t>(1, rows / (static_cast<int64_t>(s.batch) * s.ntrainer));
  int iterations = static_cast<int>(per_epoch * s.epochs);
  if (s.max_iterations > 0) iterations = std::min(iterations, s.max_iterations);
  if (serving) return run_server_rank(s, *world, iterations);
  return run_trainer_rank(s, *world, s.hooks.front(), iterations, w);
}

}  // namespace cli
}  // namespace ddpkit
