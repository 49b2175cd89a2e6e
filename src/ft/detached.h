// Work that the training path does not wait for (internal): destroying a group whose transport's
// work ends only by its timeout, a heal stream that outlives the wait that started it, a
// rendezvous given up on. Each thread holds what it uses, so nothing it touches goes before it.
#pragma once

#include <ddpkit/error.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ddpkit {
namespace ft {

// Threads joined once they have finished (at the next start) or, at the latest, by join_all or
// the destructor.
class DetachedThreads {
 public:
  DetachedThreads() = default;
  DetachedThreads(const DetachedThreads&) = delete;
  DetachedThreads& operator=(const DetachedThreads&) = delete;
  ~DetachedThreads() { join_all(); }

  void start(std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = threads_.begin(); it != threads_.end();) {
      if (!*it->done) {
        ++it;
        continue;
      }
      it->thread.join();
      it = threads_.erase(it);
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    threads_.push_back({std::thread([fn = std::move(fn), done]() mutable {
                          fn();
                          fn = nullptr;  // what it held goes on this thread
                          *done = true;
                        }),
                        done});
  }

  // Waits up to `limit` for every thread started so far to finish; false if one still runs.
  bool wait_all_done(std::chrono::milliseconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        bool all_done = true;
        for (const auto& e : threads_) all_done = all_done && *e.done;
        if (all_done) return true;
      }
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  void join_all() {
    std::vector<Entry> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      all.swap(threads_);
    }
    for (auto& e : all) e.thread.join();
  }

 private:
  struct Entry {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::mutex mu_;
  std::vector<Entry> threads_;
};

// Runs make() on a thread of `detached` and waits for it while stop() names no reason (polled
// every 10 ms). Given a reason, sets `abandoned` (which make()'s store, a PollingStore, watches:
// it then ends at once), leaves the thread to finish alone (what it still makes is destroyed
// there) and throws CommError(reason). What make() throws is rethrown. For rendezvous, which
// nothing else interrupts: a peer that stops before joining would otherwise hold this caller until
// the store's timeout.
template <typename T>
T run_unless(std::function<T()> make, const std::function<std::string()>& stop, DetachedThreads& detached,
             const std::shared_ptr<std::atomic<bool>>& abandoned = nullptr) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false, abandoned = false;
    T result{};
    std::exception_ptr error;
  };
  auto shared = std::make_shared<Shared>();
  detached.start([shared, make = std::move(make)] {
    T made{};
    std::exception_ptr error;
    try {
      made = make();
    } catch (...) {
      error = std::current_exception();
    }
    std::unique_lock<std::mutex> lock(shared->mu);
    shared->done = true;
    if (!shared->abandoned) {
      shared->result = std::move(made);
      shared->error = error;
    }
    shared->cv.notify_all();
    lock.unlock();
    // An abandoned result goes here, with `made`.
  });
  std::unique_lock<std::mutex> lock(shared->mu);
  while (!shared->done) {
    lock.unlock();
    const std::string why = stop ? stop() : "";
    lock.lock();
    if (!why.empty() && !shared->done) {
      shared->abandoned = true;
      if (abandoned) *abandoned = true;
      throw CommError(why);
    }
    if (!shared->done) shared->cv.wait_for(lock, std::chrono::milliseconds(10));
  }
  if (shared->error) std::rethrow_exception(shared->error);
  return std::move(shared->result);
}

}  // namespace ft
}  // namespace ddpkit
