// The ddpkit command line. Thin: parse flags, call the library.
#include "cli.h"

#include <ddpkit/codecs/cast.h>
#include <ddpkit/error.h>
#include <ddpkit/runtime/program.h>
#include <ddpkit/runtime/runtime.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include <unistd.h>

namespace ddpkit {
namespace cli {
extern const char* kTrainUsage;
int run_train(const std::vector<std::string>& args, const std::vector<std::string>& argv);
extern const char* kPlanUsage;
int run_plan(const std::vector<std::string>& args);
extern const char* kTuneUsage;
int run_tune(const std::vector<std::string>& args);
#ifdef DDPKIT_WITH_PS
extern const char* kPsServerUsage;
extern const char* kBenchUsage;
int run_ps_server(const std::vector<std::string>& args);
int run_bench(const std::vector<std::string>& args, const std::vector<std::string>& argv);
extern const char* kLighthouseUsage;
int run_lighthouse(const std::vector<std::string>& args);
#endif
}  // namespace cli
}  // namespace ddpkit

namespace {
const char* kUsage = R"(usage: ddpkit <command> [flags]

commands:
  train     data-parallel training (ddpkit train --help)
  plan      predicted step time and memory per rank of each strategy and hook (ddpkit plan --help)
  tune      short trials of the plan's best configurations; prints the fastest (ddpkit tune --help)
  launch    run N local ranks of any program, torchrun-style (ddpkit launch --help)
  bench     the parameter-server benchmark: trainers + gRPC servers (ddpkit bench --help)
  ps-server a gradient-averaging parameter server (ddpkit ps-server --help)
  lighthouse the quorum service of fault-tolerant training (ddpkit lighthouse --help)
  version   versions of ddpkit, libtorch, and the codec SIMD level
)";
}

// Allocator thresholds that keep large blocks in the heap (include/ddpkit/runtime/runtime.h);
// --no-malloc-tuning, DDPKIT_MALLOC_TUNING=0 or glibc's own MALLOC_*_THRESHOLD_ variables opt out.
void tune_allocator(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--no-malloc-tuning")) return;
  ddpkit::tune_allocator_for_training();
}

int main(int argc, char** argv) {
  using namespace ddpkit::cli;
  tune_allocator(argc, argv);
  // Once per job: by ddpkit's launcher (or a lone process), or by rank 0 of another launcher's job.
  bool lead = true;
  try {
    lead = !std::getenv("DDPKIT_LAUNCHED") && is_lead_process();
  } catch (const c10::Error&) {
    // A contradictory launch environment: named by the command that reads it, below.
  }
  std::vector<std::string> all(argv, argv + argc);
  all[0] = "ddpkit";
  // Only where matrices are multiplied: not the lighthouse or the parameter server, say, whose
  // first line scripts read for the address.
  const bool multiplies = argc >= 2 && (all[1] == "train" || all[1] == "bench" || all[1] == "plan" ||
                                        all[1] == "tune" || all[1] == "launch");
  if (multiplies && !std::getenv("OPENBLAS_CORETYPE")) {
    // OpenBLAS reads OPENBLAS_CORETYPE as it loads: set it and start this program again, so that
    // it and every rank it starts (which inherit it, as they inherit OMP_NUM_THREADS) run the
    // kernels the CPU has. Said once, by the process that leads the job.
    const std::string core = ddpkit::blas_coretype_for_this_cpu();
    if (!core.empty() && ::setenv("OPENBLAS_CORETYPE", core.c_str(), 1) == 0) {
      if (lead)
        ddpkit::print_error("ddpkit: OpenBLAS did not recognise this CPU (it chose its generic Prescott kernels); "
                            "running with OPENBLAS_CORETYPE=" + core + ", as do the ranks this command starts; set "
                            "OPENBLAS_CORETYPE yourself to choose\n");
      ::execv("/proc/self/exe", argv);
      // Not restarted (no /proc): the advice, as below.
      ::unsetenv("OPENBLAS_CORETYPE");
    }
  }
  if (lead && multiplies) {
    const std::string blas = ddpkit::blas_kernel_advice();
    if (!blas.empty()) ddpkit::print_error("ddpkit: " + blas + "\n");
  }
  if (argc < 2 || all[1] == "--help" || all[1] == "-h" || all[1] == "help") {
    std::cout << kUsage;
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = all[1];
  std::vector<std::string> args(all.begin() + 2, all.end());
  const char* usage = kUsage;
  return ddpkit::run_main("ddpkit", [&]() -> int {
    // --help anywhere among a subcommand's flags prints its usage.
    const bool help = std::any_of(args.begin(), args.end(), [](const std::string& a) { return a == "--help" || a == "-h"; });
    if (cmd == "train") {
      usage = kTrainUsage;
      if (help) {
        std::cout << usage;
        return 0;
      }
      return run_train(args, all);
    }
#ifdef DDPKIT_WITH_PS
    if (cmd == "ps-server" || cmd == "bench") {
      usage = cmd == "bench" ? kBenchUsage : kPsServerUsage;
      if (help) {
        std::cout << usage;
        return 0;
      }
      return cmd == "bench" ? run_bench(args, all) : run_ps_server(args);
    }
    if (cmd == "lighthouse") {
      usage = kLighthouseUsage;
      if (help) {
        std::cout << usage;
        return 0;
      }
      return run_lighthouse(args);
    }
#endif
    if (cmd == "plan" || cmd == "tune") {
      usage = cmd == "plan" ? kPlanUsage : kTuneUsage;
      if (help) {
        std::cout << usage;
        return 0;
      }
      return cmd == "plan" ? run_plan(args) : run_tune(args);
    }
    if (cmd == "launch") {
      usage = kLaunchUsage;
      if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
        std::cout << kLaunchUsage;
        return 0;
      }
      return run_launch(args);
    }
    if (cmd == "version") {
      std::cout << "ddpkit 0.1.0, libtorch " << TORCH_VERSION << ", codecs " << ddpkit::codecs::simd_level_name() << "\n";
      return 0;
    }
    throw UsageError("unknown command '" + cmd + "'");
  }, [&] { return std::string(usage); });
}
