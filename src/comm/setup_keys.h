// The store keys a process group's construction writes (Gloo's rendezvous, the host topology, the
// shared-memory choice), recorded as they pass so that each rank can delete its own once every
// rank has finished construction: no rank reads them after that. Without it each group left its
// keys in the job's store for good, and a later group of the same name met them. Not installed.
#pragma once

#include <ddpkit/compat.h>

#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace ddpkit {
namespace detail {

class SetupKeysStore final : public compat::ForwardingStore {
 public:
  using compat::ForwardingStore::ForwardingStore;

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    note(key);
    inner_->set(key, value);
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    note(key);
    return inner_->compareSet(key, expected, desired);
  }
  int64_t add(const std::string& key, int64_t value) override {
    note(key);
    return inner_->add(key, value);
  }

  // Ends the recording, once this rank has finished construction: waits (up to `timeout`) until
  // every rank has, deletes the keys this rank wrote, and the last rank to do so deletes the
  // count and the flag this meeting used. Keys written afterwards (shared buffers, NCCL's lazy
  // rendezvous) are not recorded: the code that writes them clears them.
  void finish(int world_size, std::chrono::milliseconds timeout) {
    std::set<std::string> keys;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      recording_ = false;
      keys.swap(keys_);
    }
    const std::string constructed = "ddpkit/setup/constructed", all_done = "ddpkit/setup/all-constructed",
                      released = "ddpkit/setup/released";
    if (inner_->add(constructed, 1) == world_size) inner_->set(all_done, std::vector<uint8_t>{'1'});
    inner_->wait({all_done}, timeout);
    for (const auto& k : keys) inner_->deleteKey(k);
    if (inner_->add(released, 1) == world_size)
      for (const auto& k : {constructed, all_done, released}) inner_->deleteKey(k);
  }

 private:
  void note(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (recording_) keys_.insert(key);
  }

  std::mutex mutex_;
  bool recording_ = true;
  std::set<std::string> keys_;
};

}  // namespace detail
}  // namespace ddpkit
