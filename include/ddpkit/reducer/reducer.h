// The Reducer: autograd post-accumulate hooks -> buckets -> comm hook -> futures -> .grad.
//
// Each parameter's grad accumulator gets a post hook (the accumulator is kept alive here: the
// variable holds it only weakly, and a dropped accumulator silently drops its hooks). When the
// last gradient of a bucket is ready, the bucket is launched if every bucket before it has been:
// buckets launch strictly in index order, so communication overlaps the rest of backward and every
// rank issues the same collectives in the same order. An autograd-engine final callback waits for
// the futures at the end of backward and writes results into .grad. See docs/design.md.
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/reducer/bucket_assignment.h>
#include <ddpkit/reducer/grad_bucket.h>

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ddpkit {

// The bucket cap when none is given: PyTorch's, for the built-in allreduce and every hook that sends
// its buckets whole. Hooks that compress element by element default to their own
// (hooks::default_bucket_cap_mb), which DistributedDataParallel applies when they are registered.
constexpr double kDefaultBucketCapMb = 25.0;

struct ReducerOptions {
  size_t first_bucket_bytes = 1024 * 1024;   // the first bucket's cap: gets communication going early
  size_t bucket_bytes_cap = static_cast<size_t>(kDefaultBucketCapMb * 1024 * 1024);
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool static_graph = false;
  // Built-in allreduce in shared memory: autograd's gradients are born in a GradientArena.
  bool gradients_in_shared_memory = true;
};

// Traffic of one bucket since the process group's stats were last reset.
struct BucketTraffic {
  size_t index = 0;
  int64_t numel = 0;
  CommStats traffic;              // what its hook's collectives sent and received
  uint64_t allreduce_bytes = 0;   // what a ring allreduce of the uncompressed buckets would have sent
  // allreduce_bytes / bytes sent (over the network and through shared memory): 1 for allreduce,
  // ~2 for fp16, ~4 for int8 (0 before any traffic).
  double compression_ratio() const {
    const uint64_t sent = traffic.bytes_sent + traffic.shm_bytes_sent;
    return sent ? static_cast<double>(allreduce_bytes) / static_cast<double>(sent) : 0.0;
  }
};

// Where one rank's Reducer spent its time, summed over the synchronized backward passes since
// construction or reset_traffic(): what DDP adds to a backward beyond autograd's own work.
struct ReducerTimes {
  int64_t iterations = 0;
  double copy_in_ms = 0;    // gradients into bucket slots (and the no-hook path's scaling)
  double launch_ms = 0;     // issuing each bucket: the comm hook's call, or the built-in allreduce
  double wait_ms = 0;       // end of backward: waiting for the buckets' results
  double copy_out_ms = 0;   // end of backward: results into .grad
};

// One bucket on its way across replicas outside the process group (set_cross_replica_reduction).
struct BucketCrossing {
  size_t index = 0;           // launch order, as GradBucket::index()
  size_t bucket_count = 0;
  at::Tensor buffer;          // the bucket's flat buffer
  // On the built-in path: the gradients where they lie (or their views in the buffer), reduced in
  // place, with `buffer` as the staging area (ProcessGroup::allreduce_parts). Empty under a comm
  // hook: the value of `group` is the bucket's result.
  std::vector<at::Tensor> parts;
  FuturePtr group;            // the reduction inside the process group (built-in or comm hook)
};
// A second reduction of every bucket, across replicas outside the process group.
struct CrossReplicaReduction {
  // Returns the future the reducer waits for: the bucket reduced across the replicas too. Its
  // value: `buffer` on the built-in path (the parts hold the result), else a tensor like the hook's.
  std::function<FuturePtr(const BucketCrossing&)> reduce;
  // Optional. Asked before each backward on the built-in path when the reducer has no arena of its
  // own (a process group of one rank): where this backward's gradients are born, so that `reduce`
  // sums them where they lie (the cross-replica group's shared memory). May return null.
  std::function<std::shared_ptr<GradientArena>()> gradient_arena;
};

class Reducer {
 public:
  // params: leaf tensors that require grad; names: for error messages; expect_sparse: per param.
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          std::vector<bool> expect_sparse, std::shared_ptr<ProcessGroup> pg, ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Registers the hook that communicates every bucket. Once only.
  void register_comm_hook(CommHook hook, std::string name);
  bool has_comm_hook() const { return static_cast<bool>(hook_); }

  // Before forward: if the first synchronized iteration has finished and buckets were not rebuilt
  // yet, rebuilds them in gradient-ready order as recorded by `source_rank` (a broadcast: every
  // rank must call this at the same point). Also errors if the last backward never finished.
  void prepare_for_forward(int source_rank = 0);
  // After a forward whose backward must synchronize gradients; outputs are searched for the
  // parameters they depend on when unused parameters must be found.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);
  // For a rank that has run out of data (join): issue exactly the collectives one synchronized
  // backward issues (used-parameter map, every bucket through the hook) with zero gradients.
  void shadow_backward();

  // A second reduction of every bucket, across replicas outside the process group (replica groups
  // of fault-tolerant training, ft::Manager::cross_group_reduction), started as each bucket's
  // group reduction completes. On the built-in path the gradients stay where they lie through both.
  // Before the first backward; once.
  void set_cross_replica_reduction(CrossReplicaReduction reduction);

  // The divisor of the no-hook path (world size by default).
  void set_divisor(int64_t divisor);
  // Keeps the current buckets for good: no rebuild in gradient-ready order after the first
  // iteration. For code that lays data out by bucket (the ZeRO hooks). Every rank must call it at
  // the same point.
  void freeze_bucket_layout();
  // Current bucket assignment: parameter indices per bucket, in launch order.
  std::vector<std::vector<size_t>> bucket_indices() const;
  // Resuming from a checkpoint: takes the assignment bucket_indices() returned then, for good (no
  // rebuild follows), so bucket-indexed hook state lines up with the same buckets. Between steps
  // only; every rank must pass the same one.
  void restore_bucket_layout(const std::vector<std::vector<size_t>>& buckets);
  // Rebuckets the current order under another cap; the first bucket keeps its own. Before the first
  // iteration the order is the registration order, and the rebuild in gradient-ready order after it
  // keeps the new cap; after the rebuild (online tuning) it is the gradient-ready order. Between
  // steps, every rank at the same point, and not once a layout was frozen or restored (code laid
  // out by bucket).
  void set_bucket_cap(size_t bucket_bytes_cap);
  size_t bucket_cap() const;
  // The buckets set_bucket_cap(cap) would make, without making them.
  std::vector<std::vector<size_t>> bucket_indices_for_cap(size_t bucket_bytes_cap) const;
  // A layout was frozen or restored: the buckets never change again.
  bool layout_fixed() const;
  int64_t iterations() const { return iterations_; }
  bool buckets_rebuilt() const { return rebuilt_; }
  // Parameters found globally unused in the last synchronized iteration (find_unused/static_graph).
  std::vector<size_t> unused_parameters() const;
  const std::vector<at::Tensor>& parameters() const { return params_; }
  // Bytes per bucket of the current assignment (keys = bucket index in the process group's
  // TrafficScope accounting).
  std::vector<BucketTraffic> bucket_traffic() const;
  // Zeroes the counters above, times() and the process group's stats.
  void reset_traffic();
  ReducerTimes times() const;

 private:
  struct Bucket {
    std::vector<size_t> vars;
    std::vector<int64_t> offsets;
    std::vector<std::vector<int64_t>> shapes;
    at::Tensor buffer;               // dense: flat contents; sparse: set when ready
    std::vector<at::Tensor> views;   // dense: per-var views of buffer
    // Built-in allreduce of a bucket that sums in place in shared memory (and .grad is not the
    // bucket's view): per var, the flat gradient itself, reduced where it lies, or its view.
    std::vector<at::Tensor> parts;
    bool in_place = false;           // pg_->sums_in_place(buffer)
    bool sparse = false;
    size_t pending = 0;
    FuturePtr future;
  };

  void build_buckets(const BucketAssignment& assignment);
  BucketAssignment assignment_for_cap(size_t bucket_bytes_cap) const;  // mutex_ held
  void autograd_hook(size_t var);
  void on_backward_start();
  void mark_var_ready(size_t var, bool unused);
  void place_gradient(Bucket& bucket, size_t slot, size_t var, bool has_grad);
  void launch_ready_buckets();
  void launch_bucket(size_t index);
  // The bucket's reduction inside the process group: the built-in allreduce or the comm hook.
  FuturePtr reduce_in_group(Bucket& bucket, size_t index);
  bool reduces_gradients_in_place(const Bucket& bucket) const;
  // One rank, no hook, divisor 1: the built-in allreduce would hand every gradient back as it is,
  // so gradients stay where autograd put them (no copy into the bucket and back).
  bool reduction_is_identity() const;
  // The built-in path may have gradients born in an arena (its own or the cross reduction's).
  bool gradients_born_in_arenas() const;
  void finalize_backward();
  void apply_used_map();  // waits for the used-map allreduce; records globally unused parameters
  void reset_iteration_state();
  std::vector<bool> find_used_parameters(const std::vector<at::Tensor>& outputs) const;
  at::Tensor wait_bucket(size_t index);
  std::string hook_name() const;

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<bool> expect_sparse_;
  std::shared_ptr<ProcessGroup> pg_;
  ReducerOptions options_;
  std::vector<compat::GradAccumulatorPtr> accumulators_;
  std::vector<uintptr_t> hook_keys_;

  CommHook hook_;
  std::string hook_name_;
  CrossReplicaReduction cross_;

  mutable std::mutex mutex_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> locator_;  // var -> (bucket, slot)

  // Per-iteration state.
  bool expect_hooks_ = false;
  bool backward_started_ = false;
  std::vector<bool> var_ready_;
  size_t next_bucket_ = 0;
  std::vector<bool> locally_used_;      // valid when used_map_needed_
  bool used_map_needed_ = false;
  FuturePtr used_map_future_;
  at::Tensor used_map_;
  at::Tensor divisor_;                  // 0-dim, for the no-hook path
  double divisor_value_ = 1;            // the same, as a number

  // Across iterations.
  int64_t iterations_ = 0;
  bool rebuilt_ = false;
  bool rebuild_pending_ = false;
  bool layout_fixed_ = false;
  std::vector<size_t> ready_order_;
  std::vector<bool> globally_unused_;   // from the last used-map allreduce
  bool static_unused_known_ = false;
  std::vector<uint64_t> allreduce_bytes_;  // per bucket index
  ReducerTimes times_;
  // Where the built-in allreduce reduces gradients in place: memory they are born in, which
  // every local rank maps (made at the first forward; dropped when a hook is registered).
  std::shared_ptr<GradientArena> arena_;
  bool arena_considered_ = false;
  // This backward's arena from cross_.gradient_arena, when arena_ is null.
  std::shared_ptr<GradientArena> cross_arena_;
  void stop_using_arenas();  // on the calling thread
  void make_arena(std::unique_lock<std::mutex>& lock);  // collective over the host's ranks, at the first forward
};

}  // namespace ddpkit
