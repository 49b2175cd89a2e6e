// DistributedDataParallel for any torch::nn::Module, with PyTorch's semantics:
//
//   auto pg = ddpkit::init_process_group();                 // torchrun-style env
//   auto model = std::make_shared<Net>();
//   ddpkit::DistributedDataParallel ddp(model, pg);          // broadcasts rank 0's state
//   ddp.register_comm_hook(ddpkit::hooks::fp16_compress_hook(pg), "fp16");  // optional
//   auto loss = criterion(ddp.forward(x), y);               // same call as model->forward
//   loss.backward();                                        // gradients averaged on return
//
// forward() wraps the module's own forward(...), so any signature works; the tensors it returns
// are what find_unused_parameters searches.
#pragma once

#include <ddpkit/comm/process_group.h>
#include <ddpkit/ddp/online_tuning.h>
#include <ddpkit/reducer/reducer.h>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace ddpkit {

struct DistributedDataParallelOptions {
  // Unset: kDefaultBucketCapMb (25, PyTorch's), or, once a hook is registered under one of
  // hooks::build_hook's names, hooks::default_bucket_cap_mb(name). `ddpkit train` always gives one:
  // --bucket-cap-mb, else default_bucket_cap_mb(--hook) (it registers wrapped hooks, "fp16+adam").
  TORCH_ARG(std::optional<double>, bucket_cap_mb) = std::nullopt;
  // Smaller first bucket so communication starts early in backward (PyTorch: 1 MiB).
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  // Broadcast buffers (e.g. BatchNorm statistics) from rank 0 before every forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  TORCH_ARG(bool, find_unused_parameters) = false;
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  // On one host with shared memory and the built-in allreduce: gradients are born in memory the
  // local ranks share, so their allreduce copies nothing (docs/shared_memory.md). Off: they are
  // copied through the buckets.
  TORCH_ARG(bool, gradients_in_shared_memory) = true;
  // The set of used parameters is the same every iteration: found once, then no per-iteration
  // search or used-map allreduce.
  TORCH_ARG(bool, static_graph) = false;
  // Per parameter (in named_parameters order): produces a sparse gradient. Empty: detected from
  // Embedding/EmbeddingBag modules constructed with sparse(true).
  TORCH_ARG(std::vector<bool>, expect_sparse_gradients) = {};
  // Trials of other bucket caps (and piece sizes) during the first steps; the fastest stays
  // (ddpkit/ddp/online_tuning.h). Default: none, bucket_cap_mb is used as given.
  TORCH_ARG(OnlineTuningOptions, online_tuning) = {};
};

struct JoinOptions {
  // Average by the initial world size (joined ranks contribute zeros), as PyTorch's default.
  // false: divide by the number of ranks still training (no-hook path only; hooks use pg size).
  TORCH_ARG(bool, divide_by_initial_world_size) = true;
};

namespace detail {
inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void collect_tensors(const std::vector<at::Tensor>& v, std::vector<at::Tensor>& out) {
  out.insert(out.end(), v.begin(), v.end());
}
template <typename... T>
void collect_tensors(const std::tuple<T...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... e) { (collect_tensors(e, out), ...); }, t);
}
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
  collect_tensors(p.first, out);
  collect_tensors(p.second, out);
}
template <typename T>
void collect_tensors(const T&, std::vector<at::Tensor>&) {}

template <typename M>
std::shared_ptr<torch::nn::Module> module_ptr(const M& m) {
  if constexpr (torch::detail::is_module_holder<M>::value) {
    return m.ptr();
  } else {
    return m;
  }
}
}  // namespace detail

// While alive, forward/backward accumulate gradients locally without communication: what DDP's
// and FSDP's no_sync() return. It clears the wrapper's sync flag and restores it when it ends.
class NoSyncGuard {
 public:
  explicit NoSyncGuard(bool& require_sync) : flag_(&require_sync), previous_(require_sync) { require_sync = false; }
  ~NoSyncGuard() {
    if (flag_) *flag_ = previous_;
  }
  NoSyncGuard(NoSyncGuard&& other) noexcept : flag_(other.flag_), previous_(other.previous_) { other.flag_ = nullptr; }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  bool* flag_;
  bool previous_;
};

class DistributedDataParallelBase {
 public:
  DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<ProcessGroup> pg,
                              DistributedDataParallelOptions options = {});
  virtual ~DistributedDataParallelBase();

  // Once per instance; `name` appears in errors. Without a hook, gradients are divided by the
  // world size while being copied into buckets and SUM-allreduced.
  void register_comm_hook(CommHook hook, std::string name = "user hook");
  NoSyncGuard no_sync() { return NoSyncGuard(require_backward_grad_sync_); }
  // Runs `train_loop` (this rank's iterations); when it returns, this rank shadows the others'
  // collectives until every rank has finished, then all ranks take the model of a rank that
  // trained longest. Uneven numbers of batches per rank thus finish instead of hanging.
  void join(const std::function<void()>& train_loop, JoinOptions options = {});

  ProcessGroup& process_group() { return *pg_; }
  std::shared_ptr<ProcessGroup> process_group_ptr() { return pg_; }
  Reducer& reducer() { return *reducer_; }
  const std::vector<std::string>& parameter_names() const { return names_; }
  // Collectives issued and bus bytes sent on this instance's process group so far.
  CommStats comm_stats() const { return pg_->stats(); }
  // Per bucket: bytes sent/received by its hook and the compression ratio against allreduce.
  std::vector<BucketTraffic> bucket_traffic() const { return reducer_->bucket_traffic(); }
  bool require_backward_grad_sync() const { return require_backward_grad_sync_; }
  // What online tuning tried and chose (done: the choice is in force).
  const OnlineTuningResult& online_tuning() const { return tuner_->result(); }

  // Runs `forward` (any callable returning the module's output) between DDP's pre- and
  // post-forward steps: for modules whose forward is not reachable through the template below.
  template <typename F>
  auto forward_with(F&& forward) {
    pre_forward();
    auto out = forward();
    std::vector<at::Tensor> tensors;
    detail::collect_tensors(out, tensors);
    post_forward(tensors);
    return out;
  }

 protected:
  void pre_forward();
  void post_forward(const std::vector<at::Tensor>& outputs);

 private:
  void verify_parameter_shapes();
  void broadcast_coalesced(const std::vector<at::Tensor>& tensors, int root);
  std::vector<at::Tensor> buffers() const;

  std::shared_ptr<torch::nn::Module> module_base_;
  std::shared_ptr<ProcessGroup> pg_;
  DistributedDataParallelOptions options_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::unique_ptr<Reducer> reducer_;
  std::unique_ptr<OnlineTuner> tuner_;
  bool require_backward_grad_sync_ = true;
  bool join_mode_ = false;
  JoinOptions join_options_;
  int64_t active_steps_ = 0;
};

// M: a ModuleHolder (e.g. torch::nn::Sequential, or a TORCH_MODULE type) or a
// std::shared_ptr<SomeModuleImpl>.
template <typename M>
class DistributedDataParallel : public DistributedDataParallelBase {
 public:
  DistributedDataParallel(M module, std::shared_ptr<ProcessGroup> pg,
                          DistributedDataParallelOptions options = {})
      : DistributedDataParallelBase(detail::module_ptr(module), std::move(pg), std::move(options)),
        module_(std::move(module)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    return forward_with([&] { return module_->forward(std::forward<Args>(args)...); });
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  M& module() { return module_; }

 private:
  M module_;
};

}  // namespace ddpkit
