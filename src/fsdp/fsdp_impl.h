// FullyShardedDataParallel's machinery (internal). One FlatUnit per unit: its parameters laid out
// flat, this rank's fp32 shard, and the gathered buffer the module's parameters point into while
// the unit computes. docs/fsdp.md describes the memory timeline and the order of collectives.
#pragma once

#include <ddpkit/comm/gradient_arena.h>
#include <ddpkit/fsdp/fully_sharded_data_parallel.h>

#include <torch/csrc/autograd/function.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace ddpkit {
namespace detail {

// One parameter of a unit: the module's own tensor (a leaf whose data FSDP swaps) and its place in
// the unit's flat layout.
struct FlatParam {
  at::Tensor param;
  std::vector<std::string> names;  // full names; more than one when a module ties it twice
  std::vector<int64_t> shape;
  int64_t offset = 0;
  int64_t numel = 0;
  compat::GradAccumulatorPtr accumulator;  // autograd holds it weakly: we keep it
  bool grad_in = false;  // this backward: its gradient was copied into the unit's flat gradient
};

// The large buffers FSDP needs every step (gathered units, flat gradients, reduce outputs, low-
// precision shard copies), kept for reuse by size. A block is free again once nothing but the pool
// holds its storage, so a collective may drop its reference on its own thread. Freed and allocated
// afresh, these blocks grew glibc's heap by about a unit a step under ddpkit's raised trim
// threshold (1.5 GB -> 2.0 GB over 8 steps at W=4) and were faulted in again at glibc's defaults.
// On CUDA the caching allocator is that pool already, and c10d's NCCL work keeps a block from reuse
// until its stream is done with it (a block of ours could be handed out while NCCL still reads it):
// there every take is a plain allocation.
class BufferPool {
 public:
  // Contiguous, uninitialized, [numel] of `dtype` on `device`.
  at::Tensor take(int64_t numel, at::ScalarType dtype, c10::Device device);

 private:
  std::map<int64_t, std::vector<at::Tensor>> blocks_;  // kByte tensors, by size
};

struct FlatUnit {
  enum class State { kSharded, kGathering, kGathered };

  int index = 0;
  std::string name;                          // module path; "" for the root unit
  const torch::nn::Module* module = nullptr; // null for the root unit
  std::vector<FlatParam> params;
  bool trainable = true;
  int64_t numel = 0;        // without padding
  int64_t shard_numel = 0;  // S: padded numel = S * shard world
  at::Tensor shard;         // fp32 leaf [S], this rank's elements: what the optimizer steps
  // [S * shard world] in the compute dtype. Its storage points at a pool block while gathered and
  // at nothing (0 bytes) while sharded, and is refilled in place: tensors autograd saved from the
  // parameters' views stay valid.
  at::Tensor full;
  at::Tensor full_block;  // the memory behind `full` while gathered: a pool block, or host_full
  // [S * shard world] fp32 in memory this host's ranks share, where every rank's shard of the unit
  // lies (place_shards_in_shared_memory): gathered by pointing `full` at it. Undefined elsewhere.
  at::Tensor host_full;
  // One rank's unit in fp32 (kNoShard, or a shard group of one): `full` is the shard itself, so a
  // gather only points the parameters at it.
  bool aliases_shard = false;
  // kNoShard in fp32, or nothing to gather: the parameters point at the shard for life. A sharded
  // unit of one rank is not: its parameters are empty outside its calls as at any world size, so
  // a call that bypasses forward_unit fails at W=1 as it does at W=2.
  bool stays_gathered = false;
  State state = State::kSharded;
  FuturePtr gather;         // in flight
  at::Tensor gather_input;  // the low-precision copy of the shard being gathered

  // This backward.
  int grads_in = 0;
  int trainable_params = 0;
  bool reduce_launched = false;
  bool used_in_backward = false;
  at::Tensor grad_out;   // [S], reduce dtype
  bool reduces_into_grad = false;  // grad_out becomes the shard's .grad
  FuturePtr reduce;
  // CPU: the flat gradient, taken when the unit's backward begins, with a place per parameter
  // that autograd's gradient of it is born in (GradientArena) while this unit's backward runs.
  at::Tensor grad_block;
  std::shared_ptr<GradientArena> grad_arena;
};

class FsdpImpl {
 public:
  FsdpImpl(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<ProcessGroup> pg,
           FullyShardedDataParallelOptions options);
  ~FsdpImpl();

  // ---- forward (training thread) ----
  void root_pre_forward();
  void root_post_forward(const std::vector<at::Tensor>& outputs);
  std::string describe_forward_failure(const std::string& what);
  int unit_of(const torch::nn::Module& module) const;  // -1: not a unit of this instance
  at::Tensor cast_input(const at::Tensor& t) const;     // to the compute dtype under mixed precision
  void unit_pre_forward(int unit);
  void unit_post_forward(int unit, const std::vector<at::Tensor>& outputs);
  void unit_forward_aborted(int unit);

  // ---- backward (autograd thread, which is the training thread on CPU) ----
  void unit_pre_backward(int unit);
  void param_grad_ready(int unit, int param);
  void finish_backward();

  // ---- state (between steps) ----
  at::Tensor gather_full_fp32(FlatUnit& u, const at::Tensor& shard_like);  // [numel] on every rank
  at::Tensor shard_of_full(const FlatUnit& u, const at::Tensor& full_flat) const;  // [S] slice, padded with 0

  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<ProcessGroup> pg;             // the whole group
  std::shared_ptr<ProcessGroup> shard_pg;       // units are sharded over it (hybrid: this host)
  std::shared_ptr<ProcessGroup> replicate_pg;   // hybrid only: shards averaged across it
  FullyShardedDataParallelOptions options;
  int shard_world = 1, shard_rank = 0;  // kNoShard: 1, 0
  c10::Device device = c10::kCPU;  // every parameter's: CPU (gloo) or one CUDA device (nccl)
  at::TensorOptions on_device(at::ScalarType dtype) const { return at::TensorOptions().dtype(dtype).device(device); }
  at::ScalarType compute_dtype = at::kFloat, reduce_dtype = at::kFloat;
  std::vector<FlatUnit> units;  // [0]: the root unit
  std::vector<FsdpUnitInfo> infos;
  std::unordered_map<const torch::nn::Module*, int> unit_by_module;
  std::vector<std::pair<std::string, at::ScalarType>> buffer_dtypes;  // original dtype of cast buffers

  // The registered hook, as the sharded strategies call it (an allreduce hook ignores `output`).
  std::function<FuturePtr(const at::Tensor& grad, const at::Tensor& output)> hook;
  std::string hook_name;
  std::unique_ptr<fsdp::DefaultState> default_state;

  bool require_sync = true;
  bool in_forward = false;
  int64_t iteration = 0;            // forwards begun
  std::vector<int> forward_order;   // unit indices as first called, recorded in iteration 0
  std::vector<int> order_this_iteration;
  std::vector<int> position_in_order;  // unit -> first position in forward_order (-1: never)
  bool backward_queued = false;
  std::shared_ptr<int> alive = std::make_shared<int>(0);  // hooks hold it weakly
  int gathered_units = 0;  // gathered or gathering, the root and units that stay gathered excluded
  bool gathers_in_place = false;  // every unit has host_full: each forward begins with a host barrier
  BufferPool pool;
  // The arena autograd's allocations on this thread go to between FSDP's hooks (the unit whose
  // backward runs); FSDP's own allocations in its hooks never do (OwnAllocations).
  std::shared_ptr<GradientArena> active_arena;
  int max_gathered = 0;
  int gradients_copied = 0, copied_this_backward = 0;

 private:
  void build_units();
  void check_device();
  void check_same_units_on_every_rank();
  void shard_parameters();
  void place_shards_in_shared_memory();
  void make_groups();
  void wrap_sequential_children();
  void unwrap_sequential_children();

  void start_gather(FlatUnit& u);
  void wait_gather(FlatUnit& u);
  void gather_now(FlatUnit& u);
  void prefetch(int unit);
  void point_params_at_full(FlatUnit& u);
  void attach_full(FlatUnit& u);
  void detach_full(FlatUnit& u);
  void reshard(FlatUnit& u);
  bool frees_after_forward(const FlatUnit& u) const;
  void register_pre_backward(int unit, const std::vector<at::Tensor>& outputs);
  void queue_finish_backward();
  void launch_reduce(FlatUnit& u);
  void prepare_gradient_places(FlatUnit& u);
  at::Tensor take_gradient_block(FlatUnit& u);
  at::Tensor new_gradient_block(const FlatUnit& u);
  void stop_gradient_places();
  void check_forward_order();
  std::string failure_context() const;
  int failed_in_unit_ = -1;
  std::string failed_context_;

  // Sequential entries replaced by unit wrappers: restored at destruction.
  struct Wrapped {
    std::shared_ptr<torch::nn::Module> sequential;
    size_t position;
    std::shared_ptr<void> original;  // torch::nn::AnyModule
  };
  std::vector<Wrapped> wrapped_;
};

// The instance whose forward runs on this thread (null outside one).
extern thread_local FsdpImpl* t_active;
// Every unit module of every live instance, for a named error when one runs outside its FSDP.
std::mutex& registry_mutex();
std::unordered_map<const torch::nn::Module*, std::string>& registry();
// "'blocks.0'", or "(root)": a unit as errors name it.
std::string unit_label(const FlatUnit& u);

}  // namespace detail
}  // namespace ddpkit
