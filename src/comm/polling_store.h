// A store whose waits poll (internal). A TCPStore client runs one call at a time, and a wait for a
// peer's key blocks its others: the pairs of a lazily connected group, made over one store client,
// would then time out waiting on each other's keys in a cycle (gloo_pairs_transport.cpp). And a
// poll can stop early: given an `abandoned` flag, a wait ends at once (CommError) when it is set,
// so the thread of a rendezvous given up on (ft::Manager) ends within ~20 ms instead of holding
// on until the store's timeout.
#pragma once

#include <ddpkit/compat.h>
#include <ddpkit/error.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ddpkit {

class PollingStore final : public compat::ForwardingStore {
 public:
  explicit PollingStore(c10::intrusive_ptr<c10d::Store> inner, std::shared_ptr<std::atomic<bool>> abandoned = nullptr)
      : compat::ForwardingStore(std::move(inner)), abandoned_(std::move(abandoned)) {}
  std::vector<uint8_t> get(const std::string& key) override {
    wait({key}, getTimeout());
    return inner_->get(key);
  }
#if DDPKIT_TORCH_AT_LEAST(2, 1)
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys) override {
    wait(keys, getTimeout());
    return inner_->multiGet(keys);
  }
#endif
  void wait(const std::vector<std::string>& keys) override { wait(keys, getTimeout()); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::microseconds(500);
    while (!inner_->check(keys)) {
      if (abandoned_ && *abandoned_)
        throw CommError("ddpkit: a rendezvous given up on (waiting for '" + keys.front() + "')");
      if (std::chrono::steady_clock::now() >= deadline)
        throw std::runtime_error("timed out after " + std::to_string(timeout.count()) + " ms waiting for " +
                                 std::to_string(keys.size()) + " key(s), first '" + keys.front() + "'");
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(20000));
    }
  }

 private:
  std::shared_ptr<std::atomic<bool>> abandoned_;
};

}  // namespace ddpkit
