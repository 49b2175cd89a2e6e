// Test harness: ranks as threads in one process, each with its own Gloo process group over a
// shared in-memory c10d::HashStore. The first exception thrown by any rank is rethrown.
#pragma once

#include <ddpkit/ddpkit.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <dirent.h>
#include <execinfo.h>
#include <csignal>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ddpkit {
namespace testing {

// A test that crashes prints where (ctest only says "SegFault"): the frames, then the signal's
// default action, so the exit status stays the crash's.
inline void print_crash_trace(int sig) {
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  const char header[] = "\n*** crashed; the frames (addr2line -e <binary> turns +offsets into lines):\n";
  if (::write(STDERR_FILENO, header, sizeof header - 1) < 0) {
  }
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}
inline const bool kCrashTracesInstalled = [] {
  for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE}) std::signal(sig, print_crash_trace);
  return true;
}();

inline std::shared_ptr<ProcessGroup> make_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                int gloo_threads = 2,
                                                std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  return std::make_shared<ProcessGroup>(
      store, rank, world, ProcessGroupOptions().gloo_hostname("127.0.0.1").gloo_threads(gloo_threads).timeout(timeout));
}

using GroupFactory = std::function<std::shared_ptr<ProcessGroup>(const c10::intrusive_ptr<c10d::Store>&, int rank)>;
using RankFn = std::function<void(int, std::shared_ptr<ProcessGroup>)>;

// Runs fn(rank, make(store, rank)) on `world` threads over one in-memory store; rethrows the first
// exception any rank threw.
inline void spawn_groups(int world, const GroupFactory& make, const RankFn& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  std::mutex mu;
  std::exception_ptr first;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, make(store, r));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// Runs fn(rank, pg) on `world` threads, each with a Gloo group and one intra-op thread.
inline void spawn_ranks(int world, const RankFn& fn, int gloo_threads = 2) {
  spawn_groups(
      world,
      [&](const c10::intrusive_ptr<c10d::Store>& store, int r) {
        set_compute_threads(1);  // OpenBLAS too: libtorch 2.6 no longer limits it
        return make_group(store, r, world, gloo_threads);
      },
      fn);
}

// Like spawn_ranks, with groups made from `options` (on 127.0.0.1).
inline void spawn_ranks_with(int world, ProcessGroupOptions options, const RankFn& fn) {
  spawn_groups(
      world,
      [&](const c10::intrusive_ptr<c10d::Store>& store, int r) {
        set_compute_threads(1);
        return std::make_shared<ProcessGroup>(store, r, world, ProcessGroupOptions(options).gloo_hostname("127.0.0.1"));
      },
      fn);
}

// Entries in /dev/shm that process `pid` left under ddpkit's old naming, ddpkit-<pid>-<random>.
// ddpkit names nothing there (its shared memory is unnamed memfds, src/comm/peer_memory.h): the
// tests check that this stays so after a rank is killed. Other tests run at once, hence the pid.
inline std::vector<std::string> shm_segments(int pid) {
  std::vector<std::string> names;
  const std::string prefix = "ddpkit-" + std::to_string(pid) + "-";
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d))
      if (std::string(e->d_name).rfind(prefix, 0) == 0) names.push_back(e->d_name);
    closedir(d);
  }
  return names;
}

// Whether t's memory lies in one of this process's mappings of a shared buffer (a memfd that
// /proc/self/maps names "/memfd:ddpkit-buffer (deleted)").
inline bool in_shared_memory(const at::Tensor& t) {
  const auto at = reinterpret_cast<uintptr_t>(t.data_ptr());
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2 && at >= lo && at < hi)
      return line.find("/memfd:ddpkit-buffer") != std::string::npos;
  }
  return false;
}

// Gathers a tensor from every rank (for comparing ranks inside a rank's thread).
inline std::vector<at::Tensor> allgather(ProcessGroup& pg, const at::Tensor& t) {
  std::vector<at::Tensor> out;
  for (int r = 0; r < pg.size(); ++r) out.push_back(at::empty_like(t));
  ProcessGroup::wait(pg.allgather(out, t.contiguous()));
  return out;
}

// torch::manual_seed is process-wide: rank threads that seed and build models take this lock.
inline std::mutex& seed_mutex() {
  static std::mutex m;
  return m;
}

// An MLP with ReLUs between Linear layers of the given sizes, initialized from `seed`.
inline torch::nn::Sequential make_mlp(uint64_t seed, std::vector<int64_t> dims = {8, 16, 16, 4}) {
  std::lock_guard<std::mutex> lock(seed_mutex());
  torch::manual_seed(seed);
  torch::nn::Sequential seq;
  for (size_t i = 0; i + 1 < dims.size(); ++i) {
    seq->push_back(torch::nn::Linear(dims[i], dims[i + 1]));
    if (i + 2 < dims.size()) seq->push_back(torch::nn::Functional(torch::relu));
  }
  return seq;
}

// Largest |a - b| over the largest |b|, per tensor (both on one device).
inline double relative_error(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-12);
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>() / scale;
}

inline at::Tensor seeded_randn(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen);
}

// Seed 002's model (PyTorch's hook tests): p * x^(1+rank), averaged.
struct SeedTask : torch::nn::Module {
  SeedTask() { p = register_parameter("p", seeded_randn({40, 20}, 0)); }
  at::Tensor forward(const at::Tensor& x, int rank) { return p * x.pow(1 + rank); }
  at::Tensor p;
};

// p's gradient after one DDP step of SeedTask with hook `hook` ("" for none).
inline at::Tensor seed_grads(int rank, std::shared_ptr<ProcessGroup> pg, const std::string& hook) {
  auto model = std::make_shared<SeedTask>();
  DistributedDataParallel<std::shared_ptr<SeedTask>> ddp(model, pg);
  if (!hook.empty()) ddp.register_comm_hook(hooks::make_hook(hook, pg), hook);
  ddp.forward(seeded_randn({40, 20}, 2020), rank).mean().backward();
  return model->p.grad().clone();
}

inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace testing
}  // namespace ddpkit
