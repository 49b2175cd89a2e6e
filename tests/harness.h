// Test harness: ranks as threads in one process, each with its own Gloo process group over a
// shared in-memory c10d::HashStore. The first exception thrown by any rank is rethrown.
#pragma once

#include <ddpkit/ddpkit.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ddpkit {
namespace testing {

inline std::shared_ptr<ProcessGroup> make_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                int gloo_threads = 2,
                                                std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  return std::make_shared<ProcessGroup>(
      store, rank, world, ProcessGroupOptions().gloo_hostname("127.0.0.1").gloo_threads(gloo_threads).timeout(timeout));
}

// Runs fn(rank, pg) on `world` threads.
inline void spawn_ranks(int world, const std::function<void(int, std::shared_ptr<ProcessGroup>)>& fn,
                        int gloo_threads = 2) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  std::mutex mu;
  std::exception_ptr first;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        at::set_num_threads(1);
        auto pg = make_group(store, r, world, gloo_threads);
        fn(r, pg);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
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
