// The ddpkit command line. Thin: parse flags, call the library.
#include "cli.h"

#include <ddpkit/codecs/cast.h>
#include <ddpkit/error.h>
#include <torch/version.h>

#include <malloc.h>

#include <cstdlib>
#include <cstring>
#include <iostream>

namespace ddpkit {
namespace cli {
extern const char* kTrainUsage;
int run_train(const std::vector<std::string>& args, const std::vector<std::string>& argv);
#ifdef DDPKIT_WITH_PS
extern const char* kPsServerUsage;
extern const char* kBenchUsage;
int run_ps_server(const std::vector<std::string>& args);
int run_bench(const std::vector<std::string>& args, const std::vector<std::string>& argv);
#endif
}  // namespace cli
}  // namespace ddpkit

namespace {
const char* kUsage = R"(usage: ddpkit <command> [flags]

commands:
  train     data-parallel training (ddpkit train --help)
  bench     the parameter-server benchmark: trainers + gRPC servers (ddpkit bench --help)
  ps-server a gradient-averaging parameter server (ddpkit ps-server --help)
  version   versions of ddpkit, libtorch, and the codec SIMD level
)";
}

// Gradients and activations of a large model are tens of MB each. glibc serves blocks above its
// mmap threshold (at most 32 MB by default) with fresh mappings, so every step re-faults them page
// by page: on the 25M-parameter MLP a quarter of the step went to page faults. Keep large blocks in
// the heap for reuse instead. A process-wide choice, so the program makes it, not the library; an
// explicit MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ or --no-malloc-tuning wins.
void tune_allocator(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--no-malloc-tuning")) return;
  if (!std::getenv("MALLOC_MMAP_THRESHOLD_")) mallopt(M_MMAP_THRESHOLD, 1 << 30);
  if (!std::getenv("MALLOC_TRIM_THRESHOLD_")) mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

int main(int argc, char** argv) {
  using namespace ddpkit::cli;
  tune_allocator(argc, argv);
  std::vector<std::string> all(argv, argv + argc);
  all[0] = "ddpkit";
  if (argc < 2 || all[1] == "--help" || all[1] == "-h" || all[1] == "help") {
    std::cout << kUsage;
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = all[1];
  std::vector<std::string> args(all.begin() + 2, all.end());
  const char* usage = kUsage;
  try {
    if (cmd == "train") {
      usage = kTrainUsage;
      for (const auto& a : args)
        if (a == "--help" || a == "-h") {
          std::cout << kTrainUsage;
          return 0;
        }
      return run_train(args, all);
    }
#ifdef DDPKIT_WITH_PS
    if (cmd == "ps-server" || cmd == "bench") {
      usage = cmd == "bench" ? kBenchUsage : kPsServerUsage;
      for (const auto& a : args)
        if (a == "--help" || a == "-h") {
          std::cout << usage;
          return 0;
        }
      return cmd == "bench" ? run_bench(args, all) : run_ps_server(args);
    }
#endif
    if (cmd == "version") {
      std::cout << "ddpkit 0.1.0, libtorch " << TORCH_VERSION << ", codecs " << ddpkit::codecs::simd_level_name() << "\n";
      return 0;
    }
    throw UsageError("unknown command '" + cmd + "'");
  } catch (const UsageError& e) {
    std::cerr << "ddpkit: " << e.what() << "\n\n" << usage;
    return 2;
  } catch (const ddpkit::CommError& e) {
    std::cerr << e.what() << "\n";
    return 3;
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "ddpkit: " << e.what() << "\n";
    return 1;
  }
}
