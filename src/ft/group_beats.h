// Heartbeats through the replica group: one lighthouse beat per group, not one per rank.
//
// A thousand groups of eight ranks beating every 100 ms are 80,000 calls a second at the
// lighthouse; through the group they are 10,000 (bench/lighthouse_scale.py measures both). Each
// rank above 0 bumps a counter in the group's own store; rank 0 reads the counters, beats for the
// group with how long ago it last saw each one move (so a silent rank still makes its group lost
// after the heartbeat timeout, at most one interval later than beating directly), and posts the
// lighthouse's reply, numbered, where the other ranks read it at their next beat.
#pragma once

#include <ddpkit/ft/lighthouse.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace ddpkit {
namespace ft {

class GroupBeats {
 public:
  // `store`: the replica group's store; keys go under ddpkit-ft/beat/<group_id>/.
  GroupBeats(const c10::intrusive_ptr<c10d::Store>& store, const std::string& group_id, int rank, int size);

  // Before any rank's first beat (the Manager's constructor runs it, then a collective): the reply
  // key exists, so no rank's read of it blocks.
  void prepare();

  // One beat. Rank 0: asks the lighthouse for the group and posts the reply. Other ranks: bump
  // their counter and read rank 0's latest reply. The reply when it is new since this rank's
  // last beat, nullopt otherwise (rank 0 has not beaten since). Throws what the store or the
  // lighthouse throws.
  std::optional<LighthouseClient::Beat> beat(LighthouseClient& client, const std::string& incarnation);

 private:
  using Clock = std::chrono::steady_clock;
  void post(const LighthouseClient::Beat& b);  // rank 0: the next numbered reply, for the others to read

  c10::intrusive_ptr<c10d::Store> store_;
  std::string group_id_;
  int rank_, size_;
  int64_t read_ = 0;                    // other ranks: the newest reply read
  std::vector<int64_t> counts_;         // rank 0: each rank's counter as last read
  std::vector<Clock::time_point> seen_;  // rank 0: when it last moved
};

}  // namespace ft
}  // namespace ddpkit
