#include <ddpkit/hooks/post_local_sgd_hook.h>

#include <torch/csrc/autograd/grad_mode.h>

#include <map>

namespace ddpkit {
namespace hooks {

PostLocalSGDState::PostLocalSGDState(std::shared_ptr<ProcessGroup> pg, std::shared_ptr<ProcessGroup> subgroup,
                                     int64_t start_localSGD_iter)
    : pg_(std::move(pg)), subgroup_(std::move(subgroup)), start_(start_localSGD_iter) {
  DDPKIT_CHECK(pg_, "PostLocalSGDState: process group is null");
  DDPKIT_CHECK(start_ >= 0, "PostLocalSGDState: start_localSGD_iter must be >= 0, got ", start_);
}

int64_t PostLocalSGDState::iteration() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return iter_;
}

TensorDict PostLocalSGDState::state_dict() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {{"iter", int_entry(iter_)}};
}

void PostLocalSGDState::load_state_dict(const TensorDict& state) {
  const int64_t iter = int_of(state, "iter", "PostLocalSGDState::load_state_dict");
  DDPKIT_CHECK(iter >= 0 && state.size() == 1, "PostLocalSGDState::load_state_dict: expects one non-negative 'iter'");
  std::lock_guard<std::mutex> lock(mutex_);
  iter_ = iter;
}

CommHook post_localSGD_hook(std::shared_ptr<PostLocalSGDState> state) {
  DDPKIT_CHECK(state, "post_localSGD_hook: state is null");
  return [state](GradBucket& bucket) -> FuturePtr {
    bool global;
    {
      std::lock_guard<std::mutex> lock(state->mutex_);
      global = state->iter_ < state->start_;
      if (global && bucket.is_last()) ++state->iter_;
    }
    const at::Tensor buffer = bucket.buffer();
    ProcessGroup* group = global ? state->pg_.get() : state->subgroup_.get();
    if (!group) return completed_future(buffer);  // local SGD: keep the local gradient
    buffer.div_(group->size());
    return group->allreduce(buffer);
  };
}

void average_parameters(const std::vector<at::Tensor>& params, ProcessGroup& pg, std::vector<at::Tensor>* cache) {
  if (params.empty() || pg.size() == 1) return;
  at::NoGradGuard no_grad;
  // One flat buffer per dtype, in first-appearance order (the same on every rank).
  std::vector<std::pair<at::ScalarType, std::vector<at::Tensor>>> groups;
  for (const auto& p : params) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == p.scalar_type(); });
    if (it == groups.end()) {
      groups.push_back({p.scalar_type(), {p}});
    } else {
      it->second.push_back(p);
    }
  }
  if (cache) cache->resize(groups.size());
  for (size_t k = 0; k < groups.size(); ++k) {
    auto& g = groups[k];
    std::vector<at::Tensor> flat;
    int64_t numel = 0;
    for (const auto& p : g.second) {
      flat.push_back(p.detach().reshape({-1}));
      numel += p.numel();
    }
    at::Tensor buffer;
    if (cache) {
      at::Tensor& kept = (*cache)[k];
      if (!kept.defined() || kept.numel() != numel || kept.scalar_type() != g.first)
        kept = at::empty({numel}, g.second.front().options());
      buffer = at::cat_out(kept, flat);
    } else {
      buffer = at::cat(flat);
    }
    buffer.div_(pg.size());
    ProcessGroup::wait(pg.allreduce(buffer));
    int64_t off = 0;
    for (const auto& p : g.second) {
      p.detach().copy_(buffer.narrow(0, off, p.numel()).view(p.sizes()));
      off += p.numel();
    }
  }
}

PeriodicModelAverager::PeriodicModelAverager(int64_t period, int64_t warmup_steps, std::shared_ptr<ProcessGroup> pg)
    : period_(period), warmup_(warmup_steps), pg_(std::move(pg)) {
  DDPKIT_CHECK(period_ >= 1, "PeriodicModelAverager: period must be >= 1, got ", period_);
  DDPKIT_CHECK(warmup_ >= 0, "PeriodicModelAverager: warmup_steps must be >= 0, got ", warmup_);
  DDPKIT_CHECK(pg_, "PeriodicModelAverager: process group is null");
}

void PeriodicModelAverager::set_step(int64_t step) {
  DDPKIT_CHECK(step >= 0, "PeriodicModelAverager::set_step: step must be >= 0, got ", step);
  step_ = step;
}

bool PeriodicModelAverager::average_parameters(const std::vector<at::Tensor>& params) {
  const bool now = step_ >= warmup_ && (step_ - warmup_) % period_ == 0;
  if (now) hooks::average_parameters(params, *pg_, &flat_);
  ++step_;
  return now;
}

}  // namespace hooks
}  // namespace ddpkit
