// ZeroRedundancyOptimizer (torch.distributed.optim.ZeroRedundancyOptimizer): wraps a torch::optim
// optimizer so that each rank keeps optimizer state for its shard of the parameters only.
//
//   auto zero = std::make_shared<ddpkit::ZeroRedundancyOptimizer>(
//       model->parameters(), ddpkit::optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)), pg);
//   ... loss.backward(); zero->step(); zero->zero_grad();
//
// ZeRO-1: parameters are partitioned whole (sorted-greedy: largest first, each to the rank with the
// fewest elements so far); step() runs the wrapped optimizer on this rank's shard, then every rank
// broadcasts its updated shard. Overlapping that with DDP's backward, and ZeRO-2 (gradients
// reduce-scattered so each rank keeps only its shard's gradients): zero/ddp_zero_hook.h.
//
// Parameter order: "parameter i" below is the i-th parameter over the param groups in the order
// given (group 0's, then group 1's, ...); partitions and state dicts are keyed by it.
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/optim/adam.h>
#include <ddpkit/optim/sgd.h>

#include <torch/arg.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ddpkit {

// How ZeRO creates the wrapped optimizer and recreates its per-parameter state on another rank
// (state travels as bytes in consolidate_state_dict). optimizer_factory<O> fills it for torch::optim's
// SGD (and ddpkit::optim::SGD), Adam, AdamW, Adagrad and RMSprop; for another optimizer, fill it by hand.
struct OptimizerFactory {
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)> create;
  std::function<std::unique_ptr<torch::optim::OptimizerParamState>()> new_state;
  std::function<std::unique_ptr<torch::optim::OptimizerOptions>()> new_options;
  // The tensors a state holds (for state-size accounting); may be left empty.
  std::function<std::vector<at::Tensor>(const torch::optim::OptimizerParamState&)> state_tensors;
};

template <class Optimizer>
struct optimizer_types;  // Options, State
template <>
struct optimizer_types<torch::optim::SGD> {
  using Options = torch::optim::SGDOptions;
  using State = torch::optim::SGDParamState;
  static std::vector<at::Tensor> tensors(const State& s) { return {s.momentum_buffer()}; }
};
template <>
struct optimizer_types<optim::SGD> : optimizer_types<torch::optim::SGD> {};  // same options and state
template <>
struct optimizer_types<torch::optim::Adam> {
  using Options = torch::optim::AdamOptions;
  using State = torch::optim::AdamParamState;
  static std::vector<at::Tensor> tensors(const State& s) { return {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}; }
};
template <>
struct optimizer_types<torch::optim::AdamW> {
  using Options = torch::optim::AdamWOptions;
  using State = torch::optim::AdamWParamState;
  static std::vector<at::Tensor> tensors(const State& s) { return {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}; }
};
template <>
struct optimizer_types<optim::Adam> : optimizer_types<torch::optim::Adam> {};  // same options and state
template <>
struct optimizer_types<optim::AdamW> : optimizer_types<torch::optim::AdamW> {};
template <>
struct optimizer_types<torch::optim::Adagrad> {
  using Options = torch::optim::AdagradOptions;
  using State = torch::optim::AdagradParamState;
  static std::vector<at::Tensor> tensors(const State& s) { return {s.sum()}; }
};
template <>
struct optimizer_types<torch::optim::RMSprop> {
  using Options = torch::optim::RMSpropOptions;
  using State = torch::optim::RMSpropParamState;
  static std::vector<at::Tensor> tensors(const State& s) { return {s.square_avg(), s.momentum_buffer(), s.grad_avg()}; }
};

template <class Optimizer>
OptimizerFactory optimizer_factory(typename optimizer_types<Optimizer>::Options defaults) {
  using T = optimizer_types<Optimizer>;
  OptimizerFactory f;
  f.create = [defaults](std::vector<torch::optim::OptimizerParamGroup> groups) {
    return std::unique_ptr<torch::optim::Optimizer>(new Optimizer(std::move(groups), defaults));
  };
  f.new_state = [] { return std::unique_ptr<torch::optim::OptimizerParamState>(new typename T::State()); };
  f.new_options = [defaults] { return std::unique_ptr<torch::optim::OptimizerOptions>(new typename T::Options(defaults)); };
  f.state_tensors = [](const torch::optim::OptimizerParamState& s) {
    return T::tensors(static_cast<const typename T::State&>(s));
  };
  return f;
}

struct ZeroOptions {
  // Each rank's shard lives in one flat buffer and the parameters are views into it, so the
  // post-step broadcast sends that buffer as is (no flatten / unflatten copies).
  TORCH_ARG(bool, parameters_as_bucket_view) = false;
  // The step is done by a DDP hook (zero/ddp_zero_hook.h); step() then does nothing.
  TORCH_ARG(bool, overlap_with_ddp) = false;
};

// A consolidated state dict: what a plain torch::optim optimizer over all parameters would hold.
struct ZeroStateDict {
  struct Group {
    std::vector<int64_t> params;  // keys of `state`
    std::shared_ptr<torch::optim::OptimizerOptions> options;
  };
  // "parameters": keys are parameter indices. "bucket_shards" (ZeRO-2): key b*world+r is rank r's
  // shard of DDP bucket b; loadable only with the same world size and buckets (shard_numel).
  std::string layout = "parameters";
  std::vector<int64_t> shard_numel;  // bucket_shards: elements per shard, by bucket
  std::vector<Group> param_groups;
  std::map<int64_t, std::shared_ptr<torch::optim::OptimizerParamState>> state;

  void save(std::ostream& out) const;
  // `factory` recreates the optimizer-specific state and options types.
  static ZeroStateDict load(std::istream& in, const OptimizerFactory& factory);
};

namespace detail {
class ZeroOverlapRunner;
}

class ZeroRedundancyOptimizer {
 public:
  ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups, OptimizerFactory factory,
                          std::shared_ptr<ProcessGroup> pg, ZeroOptions options = {});
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, OptimizerFactory factory, std::shared_ptr<ProcessGroup> pg,
                          ZeroOptions options = {});
  ~ZeroRedundancyOptimizer();
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  // Collective. Steps this rank's shard with the parameters' .grad (parameters without a gradient
  // are skipped, as torch::optim does), then syncs every shard. Does nothing when overlap_with_ddp.
  void step();
  // All parameters' gradients (and ZeRO-2's gradient shards): reset (set_to_none) or zeroed.
  void zero_grad(bool set_to_none = true);
  // Adds a group; earlier parameters keep their ranks (the greedy partition continues). Every rank
  // must add the same group. Not after a DDP hook has re-partitioned the parameters.
  void add_param_group(const torch::optim::OptimizerParamGroup& group);

  // Collective: gathers every rank's state on rank `to`, where state_dict() then returns it.
  void consolidate_state_dict(int to = 0);
  const ZeroStateDict& state_dict() const;
  // Every rank passes the full dict and keeps the state of its own shard and the group options.
  // A "parameters" dict loads under any world size or partition.
  void load_state_dict(const ZeroStateDict& dict);

  int rank() const;
  int world_size() const;
  ProcessGroup& process_group() { return *pg_; }
  const ZeroOptions& options() const { return options_; }
  const OptimizerFactory& factory() const { return factory_; }
  const std::vector<at::Tensor>& parameters() const { return params_; }
  // Parameter indices each rank steps, by rank (ZeRO-1). ZeRO-2 shards elements, not parameters:
  // then every rank lists every parameter.
  std::vector<std::vector<size_t>> partition() const;
  // Elements of optimizer state this rank holds, in bytes (needs factory().state_tensors).
  int64_t local_state_bytes() const;
  // Elements of the parameters (or, for ZeRO-2, of the shards) this rank's optimizer steps.
  int64_t local_numel() const;
  torch::optim::Optimizer& local_optimizer() { return *local_; }
  bool sharded_gradients() const { return mode_ == Mode::kBucketShards; }
  // ZeRO-2: this rank's reduced gradient shard of each bucket, what step() applies (the tensors
  // themselves: averaging them further, e.g. across replica groups, changes the step).
  std::vector<at::Tensor> gradient_shards() const;

  // ---- Internal: the DDP hooks of ddp_zero_hook.h call these (step_bucket on the sequencer). ----
  // ZeRO-2: one DDP bucket, its parameters laid out flat and split into world equal shards.
  struct BucketShard {
    std::vector<size_t> params;  // in bucket order
    int64_t numel = 0;           // elements of the bucket
    int64_t shard_numel = 0;     // ceil(numel / world)
    at::Tensor flat_params;      // world * shard_numel; the parameters are views into it
    at::Tensor shard;            // this rank's slice of flat_params: what the optimizer steps
    at::Tensor grad_shard;       // the reduced gradient of `shard`
    at::Tensor padded_grad;      // scratch: the bucket's local gradients padded to world * shard_numel
  };
  // ZeRO-1 overlap: re-partition by DDP bucket (ZeRO parameter indices per bucket).
  void overlap_partition(const std::vector<std::vector<size_t>>& buckets, bool shard_buckets);
  // ZeRO-2: lay each bucket out flat and shard it; the optimizer then steps shards.
  void shard_gradients(const std::vector<std::vector<size_t>>& buckets);
  // Steps this rank's part of `bucket` (ZeRO-1: with reduced_grads, by parameter index; ZeRO-2:
  // with its gradient shard) and starts the sync; the future completes with `reduced` after it.
  FuturePtr step_bucket(size_t bucket, const at::Tensor& reduced, const std::vector<at::Tensor>& reduced_grads);
  BucketShard& bucket_shard(size_t bucket);

 private:
  friend class detail::ZeroOverlapRunner;
  enum class Mode { kParameters, kBucketShards };
  // A set of parameters one rank steps and then sends to the others as one tensor.
  struct Unit {
    int owner = 0;
    std::vector<size_t> params;
    at::Tensor flat;  // parameters_as_bucket_view: the parameters are views into it
    // Otherwise the broadcast's buffer, kept: allocated afresh each step, these buffers left
    // each rank's heap in a different shape and its peak 10-15 % apart from run to run.
    at::Tensor staging;
  };

  void validate_new_params(const std::vector<at::Tensor>& params, const std::string& where) const;
  void assign_greedy(const std::vector<size_t>& indices);
  void build_units();
  at::Tensor lay_out_flat(const std::vector<size_t>& params, int64_t min_numel);
  void rebuild_local_optimizer();
  std::unique_ptr<torch::optim::OptimizerParamGroup> local_group(size_t group) const;
  void require_no_state(const std::string& what) const;
  FuturePtr sync_unit(Unit& unit);
  void step_local(const std::vector<std::pair<at::Tensor, at::Tensor>>& shadow_grads);
  FuturePtr sync_bucket_shard(BucketShard& b);


  std::shared_ptr<ProcessGroup> pg_;
  OptimizerFactory factory_;
  ZeroOptions options_;
  Mode mode_ = Mode::kParameters;
  bool overlap_partitioned_ = false;

  std::vector<at::Tensor> params_;
  std::vector<size_t> group_of_;
  std::vector<std::shared_ptr<torch::optim::OptimizerOptions>> group_options_;  // null: the defaults
  std::vector<int> owner_;
  std::vector<int64_t> rank_sizes_;  // running totals of the greedy partition
  std::vector<Unit> units_;
  std::vector<std::vector<size_t>> units_of_bucket_;  // overlap: unit indices per DDP bucket
  std::vector<BucketShard> bucket_shards_;

  // The wrapped optimizer steps "shadows": tensors sharing each owned parameter's storage but with
  // a gradient slot of their own, so a subset can be stepped while autograd still writes .grad.
  std::vector<at::Tensor> shadow_;  // by parameter; undefined where not owned
  std::unique_ptr<torch::optim::Optimizer> local_;

  std::unique_ptr<ZeroStateDict> consolidated_;
  int consolidated_to_ = -1;
  bool warned_step_ = false;
};

}  // namespace ddpkit
