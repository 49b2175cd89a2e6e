// What the ProcessGroup's translation units share (process_group.cpp, shm_group.cpp,
// two_phase.cpp): the group's shared-memory engine and the helpers that name tensors and fail
// futures. Not installed.
#pragma once

#include <ddpkit/comm/process_group.h>

#include "job_thread.h"
#include "shm_domain.h"

#include <exception>
#include <memory>
#include <mutex>
#include <string>

namespace ddpkit {

// The shared-memory engine of a group: its segment, the thread that runs its collectives in the
// order the sequencer handed them over, and for hierarchical allreduce the group of the ranks
// with this local rank on every host.
struct ProcessGroup::Shm {
  std::unique_ptr<shm::Domain> domain;
  std::shared_ptr<ProcessGroup> across;  // null on one host
  c10::intrusive_ptr<c10d::Store> store;  // the group's: allreduce_buffer's allocations meet there
  std::string key;                        // this host's prefix in it
  std::mutex allocate_mutex;
  int64_t allocations = 0;  // numbers them alike on every local rank
  bool warned = false;
  JobThread thread;  // last: stopped (drained) first

  // One allocation over this host's ranks (shm::Domain::allocate), numbered alike on every rank.
  // Null when the memory cannot be reserved or shared, with one warning per group: "rank R:
  // <instead> (<why>)". A peer that does not take part is a CommError naming `what`.
  std::shared_ptr<shm::SharedBuffer> allocate(size_t bytes, const std::string& what, int rank, int world,
                                              const std::string& instead, bool one_region = false);
};

namespace detail {

// Completes `result` with a CommError describing `cause` (the one way failures enter futures here).
void fail(const FuturePtr& result, const std::string& op, int rank, int world_size, std::exception_ptr cause);

// "<bytes> B <dtype>", for operation names in errors.
std::string describe_tensor(const at::Tensor& t);

inline uint64_t bytes_of(const at::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(t.element_size());
}

}  // namespace detail
}  // namespace ddpkit
