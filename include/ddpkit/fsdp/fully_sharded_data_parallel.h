// FullyShardedDataParallel for libtorch (torch.distributed.fsdp.FullyShardedDataParallel): each
// unit's parameters, gradients and optimizer state are split across the ranks, so a rank holds
// 1/W of the model plus the units it is computing.
//
//   auto pg = ddpkit::init_process_group();
//   auto model = std::make_shared<Net>();                     // any torch::nn::Module
//   ddpkit::FullyShardedDataParallel fsdp(model, pg,          // rank 0's values, sharded
//       ddpkit::FullyShardedDataParallelOptions().auto_wrap_policy(ddpkit::size_based_auto_wrap_policy(1e6)));
//   torch::optim::Adam adam(fsdp.parameters(), 1e-3);         // steps the shards: state sharded too
//   auto loss = criterion(fsdp.forward(x), y);                // same call as model->forward
//   loss.backward();                                          // each shard's .grad is the average
//   adam.step();
//
// Units. Every unit is one flat parameter (its module's parameters, not those of units nested in
// it), padded to a multiple of the world size; rank r keeps elements [r*S, (r+1)*S). Before a
// unit runs forward, and again before its backward, the shards are all-gathered and the module's
// parameters point into the result; afterwards that memory is freed. Gradients are reduce-scattered
// into the shard's .grad. Parameters in no unit form the root unit, gathered for the whole step.
// Devices: every parameter on the CPU with a Gloo group (shared memory within a host), or every
// one on one CUDA device with an NCCL group; shards and state live on the parameters' device.
// Where the units come from:
//  - auto_wrap_policy: a child of a torch::nn::Sequential or ModuleList (at any depth) becomes a
//    unit when the policy says so. A Sequential calls its children itself, so those units need
//    nothing more (each must take and return one tensor, as Sequential children do).
//  - unit_modules: any module, named explicitly.
// A ModuleList, or a custom module's member, is called by its owner's forward: that call is marked
// with fsdp::forward_unit, one per unit:
//
//   at::Tensor forward(at::Tensor x) {               // the owner's forward
//     for (auto& block : *blocks) x = ddpkit::fsdp::forward_unit(block->as<Block>(), x);
//     return head(x);
//   }
//
// Under mixed precision the floating-point tensors a unit is called with are cast to param_dtype.
// forward_unit is a plain call when no FullyShardedDataParallel runs the module, so the same model
// trains without FSDP. A unit's module called any other way finds its parameters sharded (empty):
// the forward fails, and the error names the units that were sharded.
//
// Threading (docs/fsdp.md): forward and backward run on the training thread; every collective goes
// through the shard group's ordered sequencer, issued in the same order on every rank because every
// rank runs the same units in the same order (checked on the first forward). Every rank must call
// the same units in an iteration, as with PyTorch's FSDP.
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/ddp/distributed_data_parallel.h>  // detail::collect_tensors, module_ptr
#include <ddpkit/hooks/fsdp_hooks.h>
#include <ddpkit/hooks/hook_state.h>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>

#include <ddpkit/compat.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ddpkit {

enum class ShardingStrategy {
  kFullShard,    // parameters, gradients, optimizer state sharded; parameters freed after forward
  kShardGradOp,  // the same, but parameters stay gathered from forward to the end of backward
  kNoShard,      // DDP: everything replicated, gradients allreduced
  kHybridShard,  // kFullShard within a host (shared memory), replicated across hosts (Gloo)
};
// "full_shard" | "shard_grad_op" | "no_shard" | "hybrid_shard".
ShardingStrategy parse_sharding_strategy(const std::string& name);
std::string to_string(ShardingStrategy strategy);

enum class BackwardPrefetch {
  kNone,
  kBackwardPre,   // when a unit's backward starts, all-gather the unit whose backward comes next
  kBackwardPost,  // once a unit's gradients are in (less memory in flight, less overlap)
};

// Compute in lower precision; the fp32 shards stay the master copy the optimizer steps.
struct MixedPrecision {
  // dtype of the gathered parameters (and of the forward's floating-point inputs); none: fp32.
  TORCH_ARG(compat::optional<at::ScalarType>, param_dtype) = compat::nullopt;
  // dtype gradients are reduced in; none: param_dtype's.
  TORCH_ARG(compat::optional<at::ScalarType>, reduce_dtype) = compat::nullopt;
  // dtype of floating-point buffers during training; none: unchanged.
  TORCH_ARG(compat::optional<at::ScalarType>, buffer_dtype) = compat::nullopt;
};

// Whether `module` (at path `name`), with `unwrapped_params` parameters not already in units nested
// in it, becomes a unit.
using AutoWrapPolicy =
    std::function<bool(const torch::nn::Module& module, const std::string& name, int64_t unwrapped_params)>;
// A unit from every container child of at least `min_num_params` parameters (PyTorch's policy).
AutoWrapPolicy size_based_auto_wrap_policy(int64_t min_num_params = 1000000);

struct FullyShardedDataParallelOptions {
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kFullShard;
  TORCH_ARG(MixedPrecision, mixed_precision) = {};
  // Applied to the children of every Sequential and ModuleList; null: no automatic units.
  TORCH_ARG(AutoWrapPolicy, auto_wrap_policy) = size_based_auto_wrap_policy();
  // Modules that are units in any case (e.g. a custom module's members).
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, unit_modules) = {};
  // While a unit computes forward, all-gather the next one (in the first iteration's order).
  TORCH_ARG(bool, forward_prefetch) = false;
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::kBackwardPre;
  // At most two units gathered at once besides the root, counting prefetched ones (PyTorch's
  // limit_all_gathers): a prefetch that would pass it is skipped, and that unit gathered when needed.
  TORCH_ARG(bool, limit_all_gathers) = true;
  // Start from rank 0's parameters and buffers (broadcast at construction).
  TORCH_ARG(bool, sync_module_states) = true;
  // kHybridShard: the group a unit is sharded over and the group its shards are replicated over.
  // Unset: this host's ranks, and the ranks with this local rank on every host (equal-sized hosts),
  // made anew for each instance (ProcessGroup::new_subgroup) and gone with it.
  TORCH_ARG(std::shared_ptr<ProcessGroup>, shard_group) = nullptr;
  TORCH_ARG(std::shared_ptr<ProcessGroup>, replicate_group) = nullptr;
};

// Communication hooks, one type per shape, so the type says what a hook takes. Each returns a future
// that completes when its result is there; the FSDP hooks of hooks/fsdp_hooks.h have one of these
// shapes once bound to their state (the template register_comm_hook does that).
// Sharded strategies: average `grad` (the unit's flat gradient, padded to the shard group's size
// times `output`'s) into `output`, this rank's shard.
struct FsdpReduceScatterHook {
  std::function<FuturePtr(const at::Tensor& grad, const at::Tensor& output)> fn;
};
// kNoShard: average `grad` in place.
struct FsdpAllreduceHook {
  std::function<FuturePtr(const at::Tensor& grad)> fn;
};

namespace detail {
class FsdpImpl;
}

// A unit as FSDP laid it out (for tools and tests).
struct FsdpUnitInfo {
  std::string name;              // module path ("" for the root unit)
  std::vector<std::string> parameters;  // full names, in flat order
  int64_t numel = 0;             // elements, without padding
  int64_t shard_numel = 0;       // elements of each rank's shard
};

class FullyShardedDataParallelBase {
 public:
  FullyShardedDataParallelBase(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<ProcessGroup> pg,
                               FullyShardedDataParallelOptions options = {});
  virtual ~FullyShardedDataParallelBase();
  FullyShardedDataParallelBase(const FullyShardedDataParallelBase&) = delete;
  FullyShardedDataParallelBase& operator=(const FullyShardedDataParallelBase&) = delete;

  // This rank's shards, one per unit (fp32 leaves): what the optimizer steps.
  std::vector<at::Tensor> parameters() const;
  // The shards by unit name ("" for the root unit is named "_root").
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  const std::vector<FsdpUnitInfo>& units() const;

  // Before the first forward, once. `state` lives as long as the hook; a hook taking (state, grad,
  // output) reduce-scatters (sharded strategies), one taking (state, grad) allreduces (kNoShard).
  // A hook of the other shape than the strategy's is an error here, naming the shape it needs.
  //   fsdp.register_comm_hook(std::make_shared<fsdp::DefaultState>(fsdp.shard_group()),
  //                           fsdp::reduce_scatter_hook);
  template <class State, class Hook>
  void register_comm_hook(std::shared_ptr<State> state, Hook hook, const std::string& name = "user hook");
  // The same with the state bound already.
  void register_comm_hook(FsdpReduceScatterHook hook, const std::string& name = "user hook");
  void register_comm_hook(FsdpAllreduceHook hook, const std::string& name = "user hook");

  // While the guard lives, backward keeps unsharded gradients in .grad and communicates nothing.
  NoSyncGuard no_sync();
  // Scales every shard's gradient so that their global 2-norm (or `norm_type`, inf too) is at most
  // max_norm, and returns that norm before scaling. Collective; after backward.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);

  // Collective. Full parameters and buffers under the module's own names, at full precision, on
  // rank 0 only (rank0_only) or on every rank. One unit is gathered at a time.
  torch::OrderedDict<std::string, at::Tensor> full_state_dict(bool rank0_only = true);
  // Every rank passes the same full dict (names as full_state_dict's; any world size wrote it) and
  // keeps its shards. A missing, unexpected or mis-shaped entry is an error naming it.
  void load_full_state_dict(const torch::OrderedDict<std::string, at::Tensor>& dict);
  // This rank's shards and the buffers, with the layout they need ("shard/<unit>", "buffer/<name>",
  // "layout/..."): reload with the same units and world size (load checks both and names the difference).
  TensorDict sharded_state_dict() const;
  void load_sharded_state_dict(const TensorDict& dict);
  // The optimizer's state of the shards, gathered into full flat tensors per unit (collective; every
  // rank gets it), so it reloads under another world size. SGD (momentum), Adam and AdamW.
  TensorDict full_optimizer_state_dict(torch::optim::Optimizer& optimizer);
  // Every rank passes the same dict; keeps its shard of each state tensor.
  void load_full_optimizer_state_dict(torch::optim::Optimizer& optimizer, const TensorDict& dict);

  // The whole group, as given at construction.
  std::shared_ptr<ProcessGroup> process_group() const;
  // The group a unit is sharded over: what a hook's state reduces over. The whole group, except
  // under kHybridShard (a host's ranks by default).
  std::shared_ptr<ProcessGroup> shard_group() const;
  // kHybridShard: the group each shard is replicated over (averaged across after the
  // reduce-scatter); nullptr under the other strategies.
  std::shared_ptr<ProcessGroup> replicate_group() const;
  const FullyShardedDataParallelOptions& options() const;
  bool require_backward_grad_sync() const;
  // The largest number of units gathered at once so far (limit_all_gathers keeps it at 2 + root).
  int max_units_gathered() const;
  // The last backward's gradients that were copied into their unit's flat gradient, rather than
  // born in place there (CPU; docs/fsdp.md, "Gradients born in place").
  int gradients_copied() const;

  // Runs `forward` (a callable returning the module's output) as the root unit's forward: the
  // root is gathered, units called inside are gathered and freed around their calls.
  template <typename F>
  auto forward_with(F&& forward) {
    pre_forward();
    try {
      auto out = forward();
      std::vector<at::Tensor> tensors;
      detail::collect_tensors(out, tensors);
      post_forward(tensors);
      return out;
    } catch (...) {
      forward_failed();  // rethrows, naming the units that were sharded
    }
  }

  // Casts a floating-point tensor to the compute dtype (mixed precision); anything else passes.
  at::Tensor cast_input(const at::Tensor& t) const;
  template <typename T, typename = std::enable_if_t<!std::is_same<std::decay_t<T>, at::Tensor>::value>>
  T&& cast_input(T&& value) const {
    return std::forward<T>(value);
  }


 protected:
  void pre_forward();
  void post_forward(const std::vector<at::Tensor>& outputs);
  [[noreturn]] void forward_failed();

 private:
  std::unique_ptr<detail::FsdpImpl> impl_;
};

// M: a ModuleHolder (a TORCH_MODULE type, torch::nn::Sequential) or std::shared_ptr<SomeImpl>.
template <typename M>
class FullyShardedDataParallel : public FullyShardedDataParallelBase {
 public:
  FullyShardedDataParallel(M module, std::shared_ptr<ProcessGroup> pg, FullyShardedDataParallelOptions options = {})
      : FullyShardedDataParallelBase(ddpkit::detail::module_ptr(module), std::move(pg), std::move(options)),
        module_(std::move(module)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    return forward_with([&] { return module_->forward(cast_input(std::forward<Args>(args))...); });
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }
  M& module() { return module_; }

 private:
  M module_;
};

namespace fsdp {

// Marks a unit's call inside its owner's forward (see the top of this file): gathers `module`'s
// unit, runs module->forward(args...), registers the gather for backward, frees it. Outside any
// FullyShardedDataParallel's forward it is a plain call.
class UnitScope {
 public:
  explicit UnitScope(const torch::nn::Module& module);
  ~UnitScope();
  UnitScope(const UnitScope&) = delete;
  UnitScope& operator=(const UnitScope&) = delete;
  void finish(const std::vector<at::Tensor>& outputs);
  bool active() const { return impl_ != nullptr; }
  // Under mixed precision, a floating-point input in the compute dtype (PyTorch's
  // cast_forward_inputs); anything else passes.
  at::Tensor cast(const at::Tensor& t) const;
  template <typename T, typename = std::enable_if_t<!std::is_same<std::decay_t<T>, at::Tensor>::value>>
  T&& cast(T&& value) const {
    return std::forward<T>(value);
  }

 private:
  ddpkit::detail::FsdpImpl* impl_ = nullptr;
  int unit_ = -1;
  bool finished_ = false;
};

namespace detail {
inline const torch::nn::Module& module_ref(const torch::nn::Module& m) { return m; }
inline const torch::nn::Module& module_ref(const torch::nn::Module* m) { return *m; }
template <typename T>
const torch::nn::Module& module_ref(const std::shared_ptr<T>& m) { return *m; }
template <typename T>
const torch::nn::Module& module_ref(const torch::nn::ModuleHolder<T>& m) { return *m.ptr(); }
template <typename M>
auto& callable(M& m) {
  if constexpr (std::is_pointer<std::decay_t<M>>::value) return *m;
  else if constexpr (std::is_base_of<torch::nn::Module, std::decay_t<M>>::value) return m;
  else return *m;  // shared_ptr or ModuleHolder
}
}  // namespace detail

template <typename M, typename... Args>
auto forward_unit(M&& module, Args&&... args) {
  UnitScope scope(detail::module_ref(module));
  auto out = detail::callable(module).forward(scope.cast(std::forward<Args>(args))...);
  if (scope.active()) {
    std::vector<at::Tensor> tensors;
    ddpkit::detail::collect_tensors(out, tensors);
    scope.finish(tensors);
  }
  return out;
}

}  // namespace fsdp

template <class State, class Hook>
void FullyShardedDataParallelBase::register_comm_hook(std::shared_ptr<State> state, Hook hook, const std::string& name) {
  DDPKIT_CHECK(state, "FullyShardedDataParallel::register_comm_hook: the state is null");
  if constexpr (std::is_base_of<fsdp::DefaultState, State>::value) {
    DDPKIT_CHECK(state->process_group && state->process_group->size() == shard_group()->size(),
                 "FullyShardedDataParallel::register_comm_hook: the hook state's group has ",
                 state->process_group ? state->process_group->size() : 0,
                 " ranks but units are sharded over ", shard_group()->size(),
                 ": make the state with fsdp.shard_group()");
  }
  if constexpr (std::is_invocable<Hook&, State&, const at::Tensor&, const at::Tensor&>::value) {
    register_comm_hook(FsdpReduceScatterHook{[state, hook](const at::Tensor& grad, const at::Tensor& output) mutable {
                         return hook(*state, grad, output);
                       }},
                       name);
  } else {
    static_assert(std::is_invocable<Hook&, State&, const at::Tensor&>::value,
                  "an FSDP comm hook takes (state, grad, output) or (state, grad)");
    register_comm_hook(FsdpAllreduceHook{[state, hook](const at::Tensor& grad) mutable { return hook(*state, grad); }}, name);
  }
}

}  // namespace ddpkit
