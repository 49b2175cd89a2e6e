#include "cli.h"

#include <ddpkit/comm/launch_environment.h>
#include <ddpkit/compat.h>
#include <ddpkit/error.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <thread>
#include <tuple>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

extern char** environ;

namespace ddpkit {
namespace cli {

// ---- flags ---------------------------------------------------------------------------------------
Flags::Flags(std::vector<std::string> args, std::map<std::string, std::string> defaults, std::vector<std::string> switches)
    : values_(std::move(defaults)) {
  for (const auto& s : switches) switches_[s] = false;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    if (a.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + a + "'");
    a = a.substr(2);
    std::string value;
    bool has_value = false;
    if (auto eq = a.find('='); eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
      has_value = true;
    }
    if (switches_.count(a)) {
      if (has_value) throw UsageError("--" + a + " takes no value");
      switches_[a] = true;
      continue;
    }
    if (!values_.count(a)) throw UsageError("unknown flag --" + a);
    if (!has_value) {
      if (i + 1 >= args.size()) throw UsageError("--" + a + " needs a value");
      value = args[++i];
    }
    values_[a] = value;
  }
}

std::string Flags::str(const std::string& name) const { return values_.at(name); }

int Flags::integer(const std::string& name) const {
  const std::string& v = values_.at(name);
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end) throw UsageError("--" + name + " expects an integer, got '" + v + "'");
  return static_cast<int>(x);
}

double Flags::real(const std::string& name) const {
  const std::string& v = values_.at(name);
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end) throw UsageError("--" + name + " expects a number, got '" + v + "'");
  return x;
}

bool Flags::on(const std::string& name) const { return switches_.at(name); }

std::vector<std::string> Flags::settings(const std::vector<std::string>& skip) const {
  std::vector<std::string> out;
  auto skipped = [&](const std::string& n) { return std::find(skip.begin(), skip.end(), n) != skip.end(); };
  for (const auto& kv : values_)
    if (!skipped(kv.first)) out.push_back(kv.first + "=" + kv.second);
  for (const auto& kv : switches_)
    if (!skipped(kv.first)) out.push_back(kv.first + "=" + (kv.second ? "on" : "off"));
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int64_t> Flags::int_list(const std::string& name) const {
  std::vector<int64_t> out;
  const std::string& v = values_.at(name);
  size_t start = 0;
  while (start <= v.size() && !v.empty()) {
    size_t comma = v.find(',', start);
    const std::string item = v.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    char* end = nullptr;
    const long long x = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end || x <= 0) throw UsageError("--" + name + " expects positive integers separated by commas, got '" + v + "'");
    out.push_back(x);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// ---- launcher ------------------------------------------------------------------------------------
const LaunchEnvironment& launch_environment() {
  static const LaunchEnvironment detected = detect_launch_environment();
  return detected;
}

bool in_distributed_env() {
  const LaunchEnvironment& e = launch_environment();
  return e.found() && !e.per_node;
}

bool is_lead_process() { return !in_distributed_env() || launch_environment().rank == 0; }

namespace {

volatile sig_atomic_t g_interrupted = 0;
void on_signal(int) { g_interrupted = 1; }
// SIGTERM/SIGUSR1: an engine preempting the job. Passed on to the ranks, which checkpoint and
// exit (ddpkit train --checkpoint-dir); the launcher waits for them and does not restart.
volatile sig_atomic_t g_preempted = 0;
void on_preemption(int sig) { g_preempted = sig; }
constexpr auto kPreemptionGrace = std::chrono::seconds(120);

// torchrun's default for several workers on one host: without it every rank of a libtorch program
// starts an intra-op pool (and OpenBLAS, which falls back to OMP_NUM_THREADS, another) as wide as
// the host, and N ranks run N x cores compute threads. The user's own setting wins. Said once.
std::string compute_threads_entry(int ranks_on_host) {
  if (ranks_on_host <= 1 || std::getenv("OMP_NUM_THREADS")) return "";
  static std::once_flag said;
  std::call_once(said, [ranks_on_host] {
    std::cerr << "ddpkit: OMP_NUM_THREADS is unset: setting it to 1 for each of the " << ranks_on_host
              << " ranks on this host so that they do not oversubscribe its cores (as torchrun does); set it "
                 "yourself to give each rank more\n";
  });
  return "OMP_NUM_THREADS=1";
}

// One set of ranks, from start to the last one's exit.
int run_attempt(int nproc, const std::vector<std::string>& argv, const std::string& program, int restart_count,
                int max_restarts, const std::atomic<bool>* stop, int ranks_on_host) {
  // The launcher serves the rendezvous store itself, on a port the kernel picks and that stays
  // bound: choosing a free port and letting rank 0 bind it later raced with every other process
  // binding ephemeral ports meanwhile (Gloo and gRPC listeners of concurrent jobs).
  c10::intrusive_ptr<c10d::TCPStore> store;
  std::string port, host = "127.0.0.1";
  // A node of a multi-node job (launch_environment().per_node): its ranks are numbered from
  // node_rank * nproc, and rank 0 (on node 0) serves the store at the engine's address.
  const LaunchEnvironment& node = launch_environment();
  const int first_rank = node.per_node ? node.node_rank * nproc : 0;
  const int world = node.per_node ? node.nnodes * nproc : nproc;
  if (node.per_node) {
    host = node.master_addr;
    port = std::to_string(node.master_port);
  } else if (const char* given = std::getenv("MASTER_PORT")) {
    port = given;
  } else {
    c10d::TCPStoreOptions so = compat::tcp_store_options();
    so.port = 0;
    so.isServer = true;
    so.waitWorkers = false;
    store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
    port = std::to_string(store->getPort());
  }
  // Everything the children need is built before fork(): between fork() and exec() a child of a
  // multithreaded process (the store's thread, libtorch's pools) may only make async-signal-safe
  // calls, and setenv/malloc are not.
  std::vector<std::string> exec_args(argv.begin(), argv.end());
  std::vector<char*> args;
  for (auto& a : exec_args) args.push_back(a.data());
  args.push_back(nullptr);
  std::vector<std::vector<std::string>> envs(nproc);
  std::vector<std::vector<char*>> envps(nproc);
  const std::string threads_entry = compute_threads_entry(ranks_on_host);
  const std::vector<std::string> ours{"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                      "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_USE_AGENT_STORE",
                                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "DDPKIT_LAUNCHED"};
  for (int r = 0; r < nproc; ++r) {
    for (char** e = environ; *e; ++e) {
      const std::string entry(*e);
      const std::string name = entry.substr(0, entry.find('='));
      if (std::find(ours.begin(), ours.end(), name) == ours.end()) envs[r].push_back(entry);
    }
    envs[r].push_back("MASTER_ADDR=" + host);
    envs[r].push_back("MASTER_PORT=" + port);
    envs[r].push_back("RANK=" + std::to_string(first_rank + r));
    envs[r].push_back("LOCAL_RANK=" + std::to_string(r));
    envs[r].push_back("WORLD_SIZE=" + std::to_string(world));
    envs[r].push_back("LOCAL_WORLD_SIZE=" + std::to_string(nproc));
    if (node.per_node) envs[r].push_back("GROUP_RANK=" + std::to_string(node.node_rank));
    envs[r].push_back("TORCHELASTIC_RESTART_COUNT=" + std::to_string(restart_count));
    envs[r].push_back("TORCHELASTIC_MAX_RESTARTS=" + std::to_string(max_restarts));
    if (store) envs[r].push_back("TORCHELASTIC_USE_AGENT_STORE=True");
    envs[r].push_back("DDPKIT_LAUNCHED=1");  // what the launcher said once, its ranks need not repeat
    if (!threads_entry.empty()) envs[r].push_back(threads_entry);
    for (auto& e : envs[r]) envps[r].push_back(e.data());
    envps[r].push_back(nullptr);
  }
  const std::string exec_failed = "ddpkit: cannot execute " + program + "\n";
  std::vector<pid_t> children;
  const pid_t launcher = getpid();
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = fork();
    DDPKIT_CHECK(pid >= 0, "fork(): ", std::strerror(errno));
    if (pid == 0) {
      // Each rank leads its own process group, so stopping it also stops what it started
      // (a shell's children, a data loader): signals go to the group, as torchrun does.
      setpgid(0, 0);
      // A launcher that dies without stopping its ranks (SIGKILL, the OOM killer) takes them
      // along rather than leaving them training on, orphaned, with nobody to restart or stop
      // them. The signal comes when the forking thread ends: this one, which reaps them.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher) _exit(128 + SIGKILL);  // it died before the line above
      execve(program.c_str(), args.data(), envps[r].data());
      (void)!write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
      _exit(127);
    }
    setpgid(pid, pid);  // also here: whichever of parent and child runs first
    children.push_back(pid);
  }
  const std::vector<pid_t> groups = children;
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_preemption);
  signal(SIGUSR1, on_preemption);
  int exit_code = 0;
  bool preemption_passed_on = false;
  size_t alive = children.size();
  bool stopping = false;
  auto stop_all = [&](int sig) {
    for (pid_t g : groups) {
      kill(-g, sig);  // exited ranks' leftovers too; ESRCH when none
      // A stopped rank (SIGSTOP, a debugger detached badly) holds a SIGTERM until it runs again:
      // wake it, or the job lingers until the SIGKILL 10 s later.
      if (sig != SIGKILL) kill(-g, SIGCONT);
    }
  };
  using clock = std::chrono::steady_clock;
  auto stop_deadline = clock::time_point::max();
  // After a rank fails, the others get a moment to notice on their own (a dead peer is an error
  // in their collective within milliseconds) and report what they were doing, before SIGTERM.
  auto term_deadline = clock::time_point::max();
  while (alive > 0) {
    int status = 0;
    // Only this set's own children: several sets may run at once in one process (the replica
    // groups of `ddpkit train --fault-tolerant`), each reaping its own.
    pid_t pid = 0;
    for (pid_t c : children)
      if (c > 0 && (pid = waitpid(c, &status, WNOHANG)) > 0) break;
    if (pid > 0) {
      for (auto& c : children)
        if (c == pid) c = -1;
      --alive;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0 && exit_code == 0) {
        exit_code = code;
        if (!stopping) {
          std::cerr << "ddpkit: a rank exited with status " << code
                    << (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL
                            ? " (killed by SIGKILL, which the kernel's out-of-memory killer sends when a process or its "
                              "cgroup runs out of memory: see dmesg)"
                            : "")
                    << "; stopping the others\n";
          stopping = true;
          term_deadline = clock::now() + std::chrono::seconds(3);
        }
      }
      continue;
    }
    if (g_preempted && !preemption_passed_on) {
      // The ranks decide together when to stop (a checkpoint first, with --checkpoint-dir): no
      // SIGTERM of our own, only a SIGKILL if they outlast the grace period.
      preemption_passed_on = stopping = true;
      stop_all(g_preempted);
      stop_deadline = std::min(stop_deadline, clock::now() + kPreemptionGrace);
    }
    const bool told_to_stop = stop && stop->load();
    if ((g_interrupted || told_to_stop) && !stopping) {
      stopping = true;
      exit_code = g_interrupted ? 130 : kStoppedByCaller;
      term_deadline = clock::now();
    }
    if (clock::now() >= term_deadline) {
      stop_all(SIGTERM);
      term_deadline = clock::time_point::max();
      stop_deadline = clock::now() + std::chrono::seconds(10);
    }
    if (clock::now() > stop_deadline) {
      stop_all(SIGKILL);
      stop_deadline = clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return exit_code;
}

}  // namespace

int launch_local(int nproc, const std::vector<std::string>& argv, const std::string& program, int max_restarts,
                 const std::vector<std::string>& restart_args, const std::atomic<bool>* stop, int ranks_on_host) {
  DDPKIT_CHECK(nproc >= 1, "--nproc must be >= 1, got ", nproc);
  DDPKIT_CHECK(max_restarts >= 0, "--max-restarts must be >= 0, got ", max_restarts);
  if (launch_environment().per_node) {
    // One node of several: a restart here alone could not meet the other nodes' ranks again.
    if (max_restarts > 0)
      throw UsageError("--max-restarts restarts one machine's ranks; under " + launch_environment().engine +
                       " the engine restarts the pods (restartPolicy), which resume with --resume");
    nproc = launch_environment().local_world_size;
    std::cerr << launch_environment().summary << std::endl;
  }
  std::vector<std::string> args = argv;
  for (int attempt = 0;; ++attempt) {
    const int code = run_attempt(nproc, args, program, attempt, max_restarts, stop, ranks_on_host > 0 ? ranks_on_host : nproc);
    const bool told_to_stop = stop && stop->load();
    if (code == 0 || g_interrupted || g_preempted || told_to_stop || attempt >= max_restarts) {
      if (code != 0 && max_restarts > 0 && !g_interrupted && !g_preempted && !told_to_stop)
        std::cerr << "ddpkit: the job failed after " << attempt << " restart" << (attempt == 1 ? "" : "s")
                  << " (--max-restarts " << max_restarts << ")\n";
      return code;
    }
    std::cerr << "ddpkit: restarting every rank (restart " << attempt + 1 << " of " << max_restarts << ")\n";
    if (attempt == 0)
      for (const auto& a : restart_args)
        if (std::find(args.begin(), args.end(), a) == args.end()) args.push_back(a);
  }
}

const char* kLaunchUsage = R"(usage: ddpkit launch [--nproc 2] [--max-restarts 0] [--] PROGRAM [ARGS...]

Runs --nproc local copies of PROGRAM with torchrun's variables (MASTER_ADDR, MASTER_PORT, RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE; the rendezvous store is served by the launcher, as
torchrun's TORCHELASTIC_USE_AGENT_STORE). A program that calls ddpkit::init_process_group() joins
them. If a rank fails, the others are stopped; the exit status is the first failure's. With
--max-restarts K, a failed set is replaced by a new one up to K times, with
TORCHELASTIC_RESTART_COUNT counting restarts (torchrun's meaning): the program resumes itself.
SIGTERM and SIGUSR1 are passed on to the ranks (preemption: docs/launching.md), and the launcher
exits with their status. With more than one rank and OMP_NUM_THREADS unset, each rank gets
OMP_NUM_THREADS=1 (torchrun's default; the launcher says so once). Under a per-node engine (Kubeflow's PET_NNODES/PET_NODE_RANK/
PET_NPROC_PER_NODE) it starts this node's PET_NPROC_PER_NODE ranks of the whole job.
)";

namespace {
// PROGRAM as execvp would find it, resolved and checked before fork (the child may only exec).
std::string resolve_program(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    if (access(name.c_str(), X_OK) != 0) throw UsageError("launch: '" + name + "' is not an executable file");
    return name;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  for (;;) {
    const size_t colon = dirs.find(':', start);
    std::string dir = dirs.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  throw UsageError("launch: program '" + name + "' is not found on PATH");
}
}  // namespace

int run_launch(const std::vector<std::string>& args) {
  int nproc = 2, max_restarts = 0;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      ++i;
      break;
    }
    bool matched = false;
    for (auto [flag, target, least] : {std::tuple<const char*, int*, long>{"--nproc", &nproc, 1},
                                       std::tuple<const char*, int*, long>{"--max-restarts", &max_restarts, 0}}) {
      const std::string f = flag;
      if (a != f && a.rfind(f + "=", 0) != 0) continue;
      std::string v = a == f ? (i + 1 < args.size() ? args[++i] : "") : a.substr(f.size() + 1);
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end || n < least)
        throw UsageError(f + " expects an integer >= " + std::to_string(least) + ", got '" + v + "'");
      *target = static_cast<int>(n);
      matched = true;
    }
    if (matched) continue;
    if (a.rfind("--", 0) == 0) throw UsageError("unknown flag " + a);
    break;  // the program
  }
  if (i >= args.size()) throw UsageError("launch: no program given");
  std::vector<std::string> argv(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  return launch_local(nproc, argv, resolve_program(argv[0]), max_restarts);
}

}  // namespace cli
}  // namespace ddpkit
