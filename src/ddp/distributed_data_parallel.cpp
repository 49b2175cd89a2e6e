#include <ddpkit/ddp/distributed_data_parallel.h>

#include <ddpkit/hooks/default_hooks.h>

#include <torch/nn/modules/embedding.h>

#include <ATen/core/grad_mode.h>

#include <map>
#include <sstream>
#include <unordered_set>

namespace ddpkit {

DistributedDataParallelBase::DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                                                         std::shared_ptr<ProcessGroup> pg,
                                                         DistributedDataParallelOptions options)
    : module_base_(std::move(module)), pg_(std::move(pg)), options_(std::move(options)) {
  DDPKIT_CHECK(module_base_, "DistributedDataParallel: module is null");
  DDPKIT_CHECK(pg_, "DistributedDataParallel: process group is null (call ddpkit::init_process_group)");
  DDPKIT_CHECK(options_.bucket_cap_mb().value_or(kDefaultBucketCapMb) > 0, "bucket_cap_mb must be positive, got ",
               options_.bucket_cap_mb().value_or(kDefaultBucketCapMb));
  DDPKIT_CHECK(options_.first_bucket_cap_mb() > 0, "first_bucket_cap_mb must be positive, got ",
               options_.first_bucket_cap_mb());

  // Parameters that require grad, each once (a parameter shared by two modules appears once).
  std::unordered_set<const void*> seen;
  std::vector<bool> all_sparse;
  std::map<const void*, bool> sparse_weights;
  for (const auto& m : module_base_->modules(/*include_self=*/true)) {
    if (auto e = std::dynamic_pointer_cast<torch::nn::EmbeddingImpl>(m)) {
      sparse_weights[e->weight.unsafeGetTensorImpl()] = e->options.sparse();
    } else if (auto eb = std::dynamic_pointer_cast<torch::nn::EmbeddingBagImpl>(m)) {
      sparse_weights[eb->weight.unsafeGetTensorImpl()] = eb->options.sparse();
    }
  }
  size_t position = 0;
  std::vector<bool> expect_sparse;
  const auto& given = options_.expect_sparse_gradients();
  for (const auto& item : module_base_->named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    const size_t my_position = position++;
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    params_.push_back(p);
    names_.push_back(item.key());
    if (!given.empty()) {
      DDPKIT_CHECK(my_position < given.size(), "expect_sparse_gradients has ", given.size(),
                   " entries but the module has more parameters");
      expect_sparse.push_back(given[my_position]);
    } else {
      auto it = sparse_weights.find(p.unsafeGetTensorImpl());
      expect_sparse.push_back(it != sparse_weights.end() && it->second);
    }
  }
  DDPKIT_CHECK(!params_.empty(), "DistributedDataParallel: the module has no parameter that requires grad");
  if (pg_->backend_name() == "gloo") {
    for (size_t i = 0; i < params_.size(); ++i)
      DDPKIT_CHECK(params_[i].device().is_cpu(), "parameter '", names_[i], "' is on ", params_[i].device(),
                   "; the gloo backend takes CPU tensors (use nccl for CUDA)");
  }

  verify_parameter_shapes();
  {
    // Every rank starts from rank 0's parameters and buffers.
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> state(params_.begin(), params_.end());
    for (auto& b : buffers()) state.push_back(b);
    broadcast_coalesced(state, 0);
  }

  ReducerOptions ro;
  ro.first_bucket_bytes = static_cast<size_t>(options_.first_bucket_cap_mb() * 1024 * 1024);
  ro.bucket_bytes_cap = static_cast<size_t>(options_.bucket_cap_mb().value_or(kDefaultBucketCapMb) * 1024 * 1024);
  ro.find_unused_parameters = options_.find_unused_parameters();
  ro.gradient_as_bucket_view = options_.gradient_as_bucket_view();
  ro.static_graph = options_.static_graph();
  ro.gradients_in_shared_memory = options_.gradients_in_shared_memory();
  reducer_ = std::make_unique<Reducer>(params_, names_, expect_sparse, pg_, ro);
  tuner_ = std::make_unique<OnlineTuner>(options_.online_tuning(), *reducer_, *pg_);
}

DistributedDataParallelBase::~DistributedDataParallelBase() = default;

void DistributedDataParallelBase::register_comm_hook(CommHook hook, std::string name) {
  // No cap given: the hook's own default, applied before the first iteration (a layout frozen
  // already, as ZeRO's, keeps its buckets).
  if (!options_.bucket_cap_mb() && reducer_->iterations() == 0 && !reducer_->layout_fixed()) {
    const auto cap = static_cast<size_t>(hooks::default_bucket_cap_mb(name) * 1024 * 1024);
    if (cap != reducer_->bucket_cap()) reducer_->set_bucket_cap(cap);
  }
  reducer_->register_comm_hook(std::move(hook), std::move(name));
}

std::vector<at::Tensor> DistributedDataParallelBase::buffers() const {
  std::vector<at::Tensor> out;
  for (const auto& b : module_base_->buffers(/*recurse=*/true))
    if (b.defined()) out.push_back(b);
  return out;
}

// Flattens tensors per dtype/device into one buffer each, broadcasts, and copies back.
void DistributedDataParallelBase::broadcast_coalesced(const std::vector<at::Tensor>& tensors, int root) {
  if (tensors.empty() || pg_->size() == 1) return;
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
  std::vector<std::pair<at::Tensor, std::vector<at::Tensor>>> flats;
  std::vector<FuturePtr> futures;
  for (auto& kv : groups) {
    std::vector<at::Tensor> pieces;
    for (const auto& t : kv.second) pieces.push_back(t.detach().reshape({-1}));
    at::Tensor flat = at::cat(pieces);
    futures.push_back(pg_->broadcast(flat, root));
    flats.emplace_back(flat, kv.second);
  }
  for (size_t i = 0; i < futures.size(); ++i) {
    ProcessGroup::wait(futures[i]);
    if (pg_->rank() == root) continue;
    int64_t off = 0;
    at::NoGradGuard no_grad;
    for (auto& t : flats[i].second) {
      t.detach().view({-1}).copy_(flats[i].first.narrow(0, off, t.numel()));
      off += t.numel();
    }
  }
}

void DistributedDataParallelBase::verify_parameter_shapes() {
  // Describe this rank's parameters as int64s: count, then (dtype, ndim, dims...) each.
  std::vector<int64_t> meta{static_cast<int64_t>(params_.size())};
  for (const auto& p : params_) {
    meta.push_back(static_cast<int64_t>(p.scalar_type()));
    meta.push_back(p.dim());
    for (auto d : p.sizes()) meta.push_back(d);
  }
  const int world = pg_->size();
  if (world == 1) return;
  at::Tensor len = at::full({1}, static_cast<int64_t>(meta.size()), at::kLong);
  ProcessGroup::wait(pg_->allreduce(len, c10d::ReduceOp::MAX));
  const int64_t max_len = len.item<int64_t>();
  at::Tensor mine = at::full({max_len}, -1, at::kLong);
  std::copy(meta.begin(), meta.end(), mine.data_ptr<int64_t>());
  std::vector<at::Tensor> all;
  for (int r = 0; r < world; ++r) all.push_back(at::empty({max_len}, at::kLong));
  ProcessGroup::wait(pg_->allgather(all, mine));

  auto describe = [&](const int64_t* m, int64_t& pos) {
    std::ostringstream os;
    const auto dtype = static_cast<c10::ScalarType>(m[pos++]);
    const int64_t ndim = m[pos++];
    os << "[";
    for (int64_t d = 0; d < ndim; ++d) os << (d ? ", " : "") << m[pos++];
    os << "] " << dtype;
    return os.str();
  };
  const int64_t* ref = all[0].data_ptr<int64_t>();
  for (int r = 1; r < world; ++r) {
    const int64_t* other = all[r].data_ptr<int64_t>();
    if (std::equal(ref, ref + max_len, other)) continue;
    DDPKIT_CHECK(ref[0] == other[0], "DistributedDataParallel: rank 0 has ", ref[0], " parameters but rank ", r,
                 " has ", other[0], "; every rank must build the same model");
    int64_t p0 = 1, p1 = 1;
    for (int64_t i = 0; i < ref[0]; ++i) {
      const std::string a = describe(ref, p0), b = describe(other, p1);
      DDPKIT_CHECK(a == b, "DistributedDataParallel: parameter ", i, " ('",
                   static_cast<size_t>(i) < names_.size() ? names_[i] : "?", "') differs across ranks: rank 0 has ", a,
                   ", rank ", r, " has ", b);
    }
  }
}

void DistributedDataParallelBase::pre_forward() {
  int source = 0;
  if (join_mode_) {
    // One allreduce per iteration tells joined ranks that someone still trains, whether this
    // iteration synchronizes gradients, and which rank is the lowest still active.
    const int world = pg_->size();
    at::Tensor flags = at::zeros({world + 1}, at::kFloat);
    flags[pg_->rank()] = 1;
    flags[world] = (require_backward_grad_sync_ && at::GradMode::is_enabled()) ? 1 : 0;
    ProcessGroup::wait(pg_->allreduce(flags));
    auto* f = flags.data_ptr<float>();
    int active = 0;
    source = -1;
    for (int r = 0; r < world; ++r)
      if (f[r] > 0) {
        ++active;
        if (source < 0) source = r;
      }
    if (!join_options_.divide_by_initial_world_size()) reducer_->set_divisor(active);
  }
  reducer_->prepare_for_forward(source);
  if (!join_mode_) {
    const bool training = at::GradMode::is_enabled();
    tuner_->step(training, training && require_backward_grad_sync_);
  }
  if (options_.broadcast_buffers()) {
    at::NoGradGuard no_grad;
    broadcast_coalesced(buffers(), source);
  }
}

void DistributedDataParallelBase::post_forward(const std::vector<at::Tensor>& outputs) {
  if (at::GradMode::is_enabled() && require_backward_grad_sync_) {
    reducer_->prepare_for_backward(outputs);
  }
  ++active_steps_;
}

void DistributedDataParallelBase::join(const std::function<void()>& train_loop, JoinOptions options) {
  DDPKIT_CHECK(!join_mode_, "join: already inside join");
  // Trials switch layouts at agreed steps, which ranks that run out of data would not reach.
  DDPKIT_CHECK(tuner_->done(), "join: online tuning has not finished (",
               tuner_->result().steps, " trial steps so far); run the tuning steps before join() or turn it off");
  join_mode_ = true;
  join_options_ = options;
  const int64_t steps_before = active_steps_;
  try {
    train_loop();
  } catch (...) {
    join_mode_ = false;
    throw;
  }
  const int world = pg_->size();
  // Shadow the others' iterations until nobody is active.
  for (;;) {
    at::Tensor flags = at::zeros({world + 1}, at::kFloat);
    ProcessGroup::wait(pg_->allreduce(flags));
    auto* f = flags.data_ptr<float>();
    int active = 0, source = -1;
    for (int r = 0; r < world; ++r)
      if (f[r] > 0) {
        ++active;
        if (source < 0) source = r;
      }
    if (active == 0) break;
    reducer_->prepare_for_forward(source);
    if (options_.broadcast_buffers()) {
      at::NoGradGuard no_grad;
      broadcast_coalesced(buffers(), source);
    }
    if (f[world] > 0) {
      if (!join_options_.divide_by_initial_world_size()) reducer_->set_divisor(active);
      reducer_->shadow_backward();
    }
  }
  join_mode_ = false;
  reducer_->set_divisor(world);
  // The model of a rank that ran the most iterations is authoritative (it took every step).
  at::Tensor key = at::full({1}, static_cast<double>((active_steps_ - steps_before) * world + pg_->rank()), at::kDouble);
  ProcessGroup::wait(pg_->allreduce(key, c10d::ReduceOp::MAX));
  const int authoritative = static_cast<int>(static_cast<int64_t>(key.item<double>()) % world);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> state(params_.begin(), params_.end());
  for (auto& b : buffers()) state.push_back(b);
  broadcast_coalesced(state, authoritative);
}

}  // namespace ddpkit
