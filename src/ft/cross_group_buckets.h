// The cross-group average of DDP's buckets, overlapped with backward
// (ft::Manager::cross_group_reduction, registered with Reducer::set_cross_replica_reduction).
//
// Each bucket is first reduced inside the replica group (DDP's built-in allreduce or its comm
// hook); when that completes, the bucket is averaged across the groups of the quorum on the
// cross-group process group. The cross-group collectives are issued in bucket order on every rank
// whatever order the group reductions complete in (an order that differed between ranks would
// pair buckets of different sizes).
//
// Memory an aborted collective may still write into later (abortable_transport.cpp) is never
// memory a later step reads: on the built-in path the gradients are reduced where they lie (a
// step's gradients are new tensors, and the aborted work holds the old ones), staged, where the
// transport does not sum in place, through a scratch buffer of this object's rather than the
// reducer's bucket; under a comm hook the hook's result is averaged in such a scratch copy. After
// a failure the scratch is dropped, the remaining buckets return their in-group result and the step
// is marked not to commit, so none of it is applied.
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/ft/lighthouse.h>
#include <ddpkit/reducer/reducer.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ddpkit {
namespace ft {

// What this group adds to a step's cross-group sums and what every group divides them by: the one
// rule each cross-group reduction follows (DDP's buckets, Manager::allreduce, hence ZeRO-2's
// shards and FSDP's gradients). A group healing that step (under the async quorum) adds zeros, and
// the sum is divided by the groups that add their own gradients, not by the quorum's size, so the
// average is the contributors' and every group applies the same.
struct Contribution {
  bool contributes = true;  // false: this group's gradients are of a state being replaced
  int contributors = 1;     // groups whose gradients are in the sum
  // The quorum's rule: a participant contributes when it is at the quorum's step, not healing
  // a copy named earlier, and heals from nobody, or from a group that asked to be copied (the
  // first quorum of groups starting together) while asking itself: then both waited for the quorum
  // in start_step and it loaded the copy before its forward. `async`: false means every group
  // healed in start_step (QuorumMode::kSync), so all contribute.
  static Contribution of(const Quorum& q, int replica, bool async);
  // `tensor`, this group's part of a sum, as it goes in: zeroed when the group does not contribute.
  void prepare(at::Tensor& tensor) const;
  // The sum `tensor` divided by the contributors, in place.
  void average(at::Tensor& sum) const;
};

// What a step's buckets cross on.
struct Crossing {
  std::shared_ptr<ProcessGroup> group;  // null: the step does not cross (alone, or failed already)
  // float32 staging for the built-in path, from group->allreduce_buffer when the group was made
  // (collective, so not here in a callback): bucket i uses the elements after buckets 0..i-1, so
  // on one host the gradients sum in shared memory without a private staging copy. May be
  // undefined or too small (then the scratch below stages).
  at::Tensor staging;
  Contribution contribution;
};

class CrossGroupBuckets : public std::enable_shared_from_this<CrossGroupBuckets> {
 public:
  // Calls back with this step's crossing once it is known: at once, or later from another
  // thread (the Manager's async quorum, whose round may still be going when backward's first
  // bucket is ready; the buckets' crossings are then issued as it ends, while backward goes on).
  using WhenCrossing = std::function<void(std::function<void(Crossing)>)>;
  // `when_crossing`: this step's crossing. `fail`: marks the step not to commit, with why.
  // `issued`: called once a step, when the first bucket's cross-group collective is on its way
  // (may be null).
  CrossGroupBuckets(WhenCrossing when_crossing, std::function<void(const std::string&)> fail,
                    std::function<void()> issued = nullptr);

  FuturePtr operator()(const BucketCrossing& bucket);

 private:
  struct Slot {
    BucketCrossing bucket;
    int64_t offset = 0;  // in the staging: the elements of the buckets before it
    FuturePtr result;  // what the reducer waits for
    bool ready = false;
  };
  void on_group_done(size_t index);
  void on_crossing_known(uint64_t generation, Crossing crossing);
  // Issues bucket `index`'s cross-group average (or completes it with the in-group result).
  // Returns the completion to run once the lock is released.
  std::function<void()> launch(size_t index);
  at::Tensor scratch_for(size_t index, const at::Tensor& like);
  at::Tensor staging_for(size_t index, const at::Tensor& buffer, const ProcessGroup& group);
  void on_crossing_failed(const std::string& why);

  WhenCrossing when_crossing_;
  std::function<void(const std::string&)> fail_;
  std::function<void()> issued_;

  std::mutex mu_;
  // This step's. The group only weakly: its last owner must be the Manager's reaper thread, as
  // destroying a group whose collective was aborted waits for that collective's own end.
  std::weak_ptr<ProcessGroup> group_;
  at::Tensor staging_;
  Contribution contribution_;
  bool known_ = false;     // this step's crossing is known (the fields above)
  bool crossing_ = false;  // this step crosses
  uint64_t generation_ = 0;  // backwards begun: a late crossing of an earlier one is ignored
  std::vector<Slot> slots_;
  size_t next_ = 0;      // the next bucket to cross, in order
  bool failed_ = false;  // this step's crossing failed: the rest return their in-group result
  std::vector<at::Tensor> scratch_;
};

}  // namespace ft
}  // namespace ddpkit
