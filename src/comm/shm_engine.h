// A group's shared-memory engine (internal), used by the shared-memory and hierarchical
// transports: this host's segment (shm::Domain), the thread that runs its collectives in the
// order the sequencer hands them over, and the allocations every local rank maps.
#pragma once

#include "group_core.h"
#include "job_thread.h"
#include "shm_domain.h"

#include <functional>
#include <memory>
#include <mutex>
#include <string>

namespace ddpkit {

class ShmEngine {
 public:
  // The engine of this group's host, or null where the group does not use shared memory. Every
  // rank publishes whether it wants it and all read all: the choice is the group's (a host whose
  // ranks disagreed would run other algorithms than its peers and hang). Used when every rank
  // wants it (option shared_memory, a gloo group, DDPKIT_SHM not 0), a host has two or more
  // ranks, and (several hosts) every host has the same number, which hierarchical allreduce needs.
  static std::shared_ptr<ShmEngine> create(GroupCore& core, const HostTopology& topology,
                                           const c10::intrusive_ptr<c10d::Store>& store);

  shm::Domain& domain() { return *domain_; }
  const shm::Domain& domain() const { return *domain_; }

  // Runs `op` on the engine's thread in issue order, after `account` (counts its bytes; may reject
  // it by throwing) on the sequencer; the future completes with `value`, or fails naming `what`.
  FuturePtr issue(const std::string& what, const at::Tensor& value, std::function<void()> account,
                  std::function<void()> op);
  // issue() for a collective that moves bus_bytes through shared memory.
  FuturePtr issue(const std::string& what, uint64_t bus_bytes, const at::Tensor& value, std::function<void()> op);

  // One allocation over this host's ranks (shm::Domain::allocate), numbered alike on every rank.
  // Null when the memory cannot be reserved or shared, with one warning per group: "rank R:
  // <instead> (<why>)". A peer that does not take part is a CommError naming `what`.
  std::shared_ptr<shm::SharedBuffer> allocate(size_t bytes, const std::string& what, const std::string& instead,
                                              bool one_region = false, bool reserve = true);

 private:
  explicit ShmEngine(GroupCore& core) : core_(core) {}

  GroupCore& core_;
  std::unique_ptr<shm::Domain> domain_;
  c10::intrusive_ptr<c10d::Store> store_;  // the group's: allocations meet there
  std::string key_;                        // this host's prefix in it
  std::mutex allocate_mutex_;
  int64_t allocations_ = 0;  // numbers them alike on every local rank
  bool warned_ = false;
  JobThread thread_;  // last: stopped (drained) first
};

}  // namespace ddpkit
