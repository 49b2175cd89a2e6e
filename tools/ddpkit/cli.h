// Shared pieces of the ddpkit command line: flag parsing, launcher, data sets.
#pragma once

#include <ddpkit/comm/launch_environment.h>
#include <ddpkit/error.h>

#include <ATen/ATen.h>

#include <atomic>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace ddpkit {
namespace cli {

// A usage error: main prints it with the subcommand's usage and exits 2 (ddpkit::run_main).
using UsageError = ddpkit::UsageError;

// --name value / --name=value / --flag. Known flags are declared up front; anything else is a
// UsageError naming it.
class Flags {
 public:
  Flags(std::vector<std::string> args, std::map<std::string, std::string> defaults, std::vector<std::string> switches);
  std::string str(const std::string& name) const;
  int integer(const std::string& name) const;
  double real(const std::string& name) const;
  bool on(const std::string& name) const;
  std::vector<int64_t> int_list(const std::string& name) const;
  // "name=value" for every flag and switch not in `skip`, sorted: what a run was started with.
  std::vector<std::string> settings(const std::vector<std::string>& skip) const;

 private:
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> switches_;
};

// Runs `nproc` copies of `program` (default: this program) with torchrun-style variables
// (MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE) and arguments `argv`
// (argv[0] included). If one fails, the others are stopped. Then, as torchrun's --max-restarts,
// up to `max_restarts` times a new set is started (with `restart_args` appended to `argv`, and
// TORCHELASTIC_RESTART_COUNT set). Returns the exit code to use (0, or the last attempt's first
// failure's). `stop`, when it turns true, stops the ranks and returns kStoppedByCaller.
// As torchrun does, OMP_NUM_THREADS=1 is given to every rank when the environment leaves it unset
// and more than one rank runs on this host: `ranks_on_host` of them (0: nproc; the replica groups
// of --fault-tolerant launch several sets at once).
int launch_local(int nproc, const std::vector<std::string>& argv, const std::string& program = "/proc/self/exe",
                 int max_restarts = 0, const std::vector<std::string>& restart_args = {},
                 const std::atomic<bool>* stop = nullptr, int ranks_on_host = 0);
constexpr int kStoppedByCaller = 143;
// `ddpkit launch`: launch_local for any program, found on PATH like a shell would.
extern const char* kLaunchUsage;
int run_launch(const std::vector<std::string>& args);
// The engine that started this process (detected once; docs/launching.md).
const LaunchEnvironment& launch_environment();
// True when the environment names this process's rank (torchrun, srun, mpirun, ...).
bool in_distributed_env();
// Rank 0 of such an environment, or a process outside one.
bool is_lead_process();
// A service's shared secret: the first line of `path`, or the environment variable `env` when
// `path` is empty ("" when neither is set). UsageError for an unreadable or empty file.
std::string read_token(const std::string& path, const char* env = "DDPKIT_PS_TOKEN");
// Servers that run until SIGINT/SIGTERM: catch_stop_signals() first (before the server starts, so
// a signal meanwhile is kept), then wait_for_stop_signal() returns the signal's number.
void catch_stop_signals();
int wait_for_stop_signal();

struct Dataset {
  at::Tensor inputs;   // [N, features] float32; a language model's: [N, T] uint8 bytes (widen per batch)
  at::Tensor labels;   // [N] int64; a language model's: [N, T] uint8, the next byte of each input
  int64_t num_classes = 0;
};
struct Split {
  Dataset train, test;
};
// Fashion-MNIST from IDX files (gzip or plain) in `dir`; pixels scaled to [0,1] and normalised.
Split load_fashion_mnist(const std::string& dir);
// Every regular file in `dir` whose name has no '.' (the fortune files of Debian's fortunes
// package: plain English text), concatenated in name order, as byte sequences of `length` (the
// labels: the same shifted by one). The last `test_fraction` of the text is the test split.
Split load_text_corpus(const std::string& dir, int64_t length, double test_fraction = 0.05);
// Inputs from N(0,1), labels = argmax of a fixed random linear teacher: learnable, deterministic.
Split make_synthetic(int64_t features, int64_t classes, int64_t train_size, int64_t test_size, uint64_t seed);

}  // namespace cli
}  // namespace ddpkit
