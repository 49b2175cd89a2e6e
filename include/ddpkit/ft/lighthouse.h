// The lighthouse: the quorum service of a fault-tolerant job (gRPC; `ddpkit lighthouse`).
//
// A fault-tolerant job is R replica groups, each an ordinary ddpkit process group (DDP, ZeRO or
// FSDP inside). Each group's rank 0 heartbeats the lighthouse for its whole group (its ranks beat
// to it through the group's store, and it says how long ago it heard from each) and asks it for a
// quorum before every step. A step whose quorum has the participants of the one before gets a
// reply without them (the client holds them): the lighthouse's work per step grows with the
// groups, not with their square (docs/scale.md). A quorum forms when every live group has asked (or, after join_timeout, with
// those that have, if they are at least min_replicas): it names the participants (ordered by
// group id: the index is the replica rank), the highest committed step among them, who heals from
// whom, and a quorum id that changes only when the participants do. A group whose heartbeats stop
// for heartbeat_timeout is out of every quorum from then on, and the heartbeat replies of the
// others name it, so a survivor blocked in a collective with it aborts that collective at once.
//
// The lighthouse also serves the c10d TCPStores the cross-group process groups meet through, one
// per quorum (Quorum::store_address), so that keys do not outlive the quorum after next.
//
//   ddpkit::ft::Lighthouse lh(ddpkit::ft::LighthouseOptions().address("0.0.0.0:29510").min_replicas(2));
//   lh.start();   // lh.address() is what the groups are given
#pragma once

#include <ddpkit/error.h>
#include <ddpkit/ps/parameter_server.h>  // TlsFiles

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit {
namespace ft {

using ps::TlsFiles;

struct LighthouseOptions {
  // host:port to listen on; port 0 picks a free one (see Lighthouse::address()).
  TORCH_ARG(std::string, address) = "127.0.0.1:0";
  // The host the groups reach this machine at (for the store address it hands out); empty: the
  // listening address's host, or this machine's host name when that is 0.0.0.0.
  TORCH_ARG(std::string, advertise_host) = "";
  // Fewest groups a quorum may have; fewer live groups and the quorum waits (callers time out).
  TORCH_ARG(int, min_replicas) = 1;
  // A group is lost when any of its ranks has not heartbeated for this long.
  TORCH_ARG(std::chrono::milliseconds, heartbeat_timeout) = std::chrono::milliseconds(1000);
  // How long a quorum waits for a live group that has not asked yet (a slow or wedged one).
  TORCH_ARG(std::chrono::milliseconds, join_timeout) = std::chrono::seconds(10);
  // The groups a job starts with (0: not known): the first quorum waits up to join_timeout for
  // that many, so that groups starting a moment apart start together rather than one healing.
  TORCH_ARG(int, expected_groups) = 0;
  // Non-empty: every call must carry metadata "authorization: Bearer <token>".
  TORCH_ARG(std::string, token) = "";
  // Certificate and key set: TLS; otherwise plaintext.
  TORCH_ARG(TlsFiles, tls) = {};
  // Called with a line for each change an operator watches: "group G lost: rank R silent for
  // N ms" as the heartbeat timeout expires for a group of the last quorum, "quorum Q: groups
  // [...]" (with those dropped and joined) when a quorum's participants differ from the last's,
  // "group G left after step S" (Manager::close) and "job finished at step S: ..." when the last
  // of a quorum's groups has left, "group G: refused a second process ...: a duplicate group id",
  // and "group G refused: the job has finished ..." (a group asking from an older step after that).
  // Called in order on the lighthouse's ticker thread, outside its lock (within ~20 ms of the
  // change; a slow callback delays only quorums formed by join_timeout). `ddpkit lighthouse`
  // prints them with a UTC time.
  TORCH_ARG(std::function<void(const std::string& event)>, on_event) = nullptr;

 public:
  // A lighthouse for DiLoCo sites whose Managers wait `site_quorum_timeout` for a quorum
  // (ManagerOptions::quorum_timeout). A live site asks for a quorum only every H / P inner steps,
  // so a quorum must wait for it as long as the sites wait for the quorum: join_timeout equals
  // it. With a shorter one, a quorum formed without a slow site lets sites that committed
  // different syncs go on apart.
  static LighthouseOptions for_diloco(std::chrono::milliseconds site_quorum_timeout) {
    return LighthouseOptions().join_timeout(site_quorum_timeout);
  }
};

// A replica group as its rank 0 describes itself (and as a quorum lists it).
struct GroupInfo {
  std::string group_id;          // 1-128 characters of [A-Za-z0-9_.-]
  int64_t step = 0;              // steps committed
  int world_size = 1;            // ranks in the group
  std::vector<std::string> state_addresses;  // each rank's state service, host:port
  std::vector<std::string> hosts;            // each rank's host name
  std::string incarnation;       // new each time the group's processes start
  // Asks to copy its state from another group at the quorum's step although it is not behind (its
  // first quorum under ManagerOptions::init_sync, or its state was found to differ): the quorum
  // names a source for it, as for a group behind (see Quorum::heal_sources).
  bool heal = false;
  // Loads, at the end of this step, the state a heal named at the previous quorum is copying
  // (async quorum): `step` is the step it will hold then. It adds zeros to this step's cross-group
  // sums and is no heal source.
  bool healing = false;
};

struct Quorum {
  int64_t quorum_id = -1;
  std::vector<GroupInfo> participants;  // ordered by group_id; index = replica rank
  int64_t max_step = 0;
  std::string store_address;            // host:port of the lighthouse's TCPStore
  // Per participant: the index of the group it heals from, or -1. A participant heals when it is
  // behind max_step, or asked to (GroupInfo::heal); its source is a participant at max_step that
  // did not ask and is not healing (spread over them in turn), or, when every one at max_step asked (the first quorum
  // of a job whose groups start together), the first of them by group_id, which copies nothing.
  std::vector<int> heal_sources;
  std::vector<std::string> dropped;     // groups of the previous quorum not in this one

  // Index of `group_id` in participants, or -1.
  int replica_rank(const std::string& group_id) const;
};

class Lighthouse {
 public:
  explicit Lighthouse(LighthouseOptions options);  // checks the options
  ~Lighthouse();                                   // shuts down; waiting callers get UNAVAILABLE
  Lighthouse(const Lighthouse&) = delete;
  Lighthouse& operator=(const Lighthouse&) = delete;

  void start();
  std::string address() const;  // host:port as the groups reach it
  int port() const;
  void shutdown();

  // Quorums formed so far (each with the participants it had).
  int64_t quorums_formed() const;

  // The TCPStores the cross groups meet in: one per quorum id, the last two kept (older ones go
  // with their keys), and the keys they hold.
  struct StoreUse {
    int stores = 0;
    int64_t keys = 0;
  };
  StoreUse store_use() const;

  // The lighthouse's own part of the last 1,024 quorum rounds whose replies were all deltas (every
  // caller held the last quorum: the steady state): `intake`, from a round's first ask to the ask
  // that completed it (the groups' spread plus the lighthouse taking their asks in); `replies`,
  // from the quorum formed to its last reply handed to gRPC (a write per group's connection).
  // What a group waits beyond these is its network and its own process. Rounds where a caller got
  // the whole quorum (the first; a restarted group's) are counted apart, with their longest replies.
  struct RoundTimes {
    int64_t rounds = 0;   // delta rounds so far
    int64_t sampled = 0;  // of which the percentiles are over (the last 1,024 at most)
    double intake_p50_ms = 0, intake_p99_ms = 0;
    double replies_p50_ms = 0, replies_p99_ms = 0, replies_max_ms = 0;
    int64_t whole_rounds = 0;
    double whole_replies_max_ms = 0;
  };
  RoundTimes round_times() const;

 struct Impl;  // internal (the gRPC service reaches it)

 private:
  std::unique_ptr<Impl> impl_;
};

struct LighthouseClientOptions {
  TORCH_ARG(std::string, address) = "";  // host:port
  TORCH_ARG(std::string, token) = "";
  TORCH_ARG(TlsFiles, tls) = {};         // root_certificate set: TLS
  // Every call's deadline besides quorum()'s own wait.
  TORCH_ARG(std::chrono::milliseconds, rpc_timeout) = std::chrono::seconds(5);
};

// A quorum refused because the job has finished: every group of its last quorum left after its
// last step (Manager::close), and this group, lost before the end (killed, then restarted), is
// behind that step with no live group to heal from. Its work is done; what() names the groups and
// the step. (Groups that left, resuming from a checkpoint, start a new run and are not refused.)
class JobFinished : public CommError {
 public:
  using CommError::CommError;
};

class LighthouseClient {
 public:
  explicit LighthouseClient(LighthouseClientOptions options);
  ~LighthouseClient();
  LighthouseClient(const LighthouseClient&) = delete;
  LighthouseClient& operator=(const LighthouseClient&) = delete;

  // Blocks until the quorum that includes `self` forms, or throws CommError after `timeout`
  // (naming what the lighthouse said: too few live groups for min_replicas, a refused request, a
  // duplicate group id), JobFinished when the job it would join has finished. A lighthouse that
  // cannot be reached is asked again every 100 ms until the timeout; the first refusal is printed
  // to stderr at once (a wrong address shows then, not at the timeout).
  // `broken`: this group's cross-group collective failed, so the quorum gets a new id.
  Quorum quorum(const GroupInfo& self, std::chrono::milliseconds timeout, bool broken = false);
  struct Beat {
    int64_t quorum_id = -1;
    std::vector<std::string> lost;  // groups of the newest quorum whose heartbeats stopped, or that restarted since
  };
  Beat heartbeat(const std::string& group_id, int rank, const std::string& incarnation);
  // One beat for a whole group, sent by its rank 0, which hears its ranks beat through the group:
  // rank_ages_ms[r] is how long ago it last heard from rank r (its own: 0). A rank whose age
  // passes the lighthouse's heartbeat timeout makes the group lost, as a silent rank does.
  Beat heartbeat_for_group(const std::string& group_id, const std::string& incarnation,
                           const std::vector<int64_t>& rank_ages_ms);
  // This group ran its last step (`step` committed): it leaves every quorum at once. Throws
  // CommError when the lighthouse cannot be told within the rpc timeout.
  void leave(const std::string& group_id, const std::string& incarnation, int64_t step);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ft
}  // namespace ddpkit
