// FullyShardedDataParallel: units, sharding and the public API. The per-step path (gathers, the
// forward and backward schedule, reductions) is in fsdp_step.cpp; state dicts, norm clipping and
// optimizer state in fsdp_state.cpp.
#include "fsdp_impl.h"

#include <ddpkit/compat.h>

#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <functional>
#include <mutex>
#include <set>
#include <sstream>

namespace ddpkit {

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  if (name == "full_shard") return ShardingStrategy::kFullShard;
  if (name == "shard_grad_op") return ShardingStrategy::kShardGradOp;
  if (name == "no_shard") return ShardingStrategy::kNoShard;
  if (name == "hybrid_shard") return ShardingStrategy::kHybridShard;
  DDPKIT_CHECK(false, "sharding strategy must be full_shard, shard_grad_op, no_shard or hybrid_shard, got '", name, "'");
}

std::string to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard: return "full_shard";
    case ShardingStrategy::kShardGradOp: return "shard_grad_op";
    case ShardingStrategy::kNoShard: return "no_shard";
    case ShardingStrategy::kHybridShard: return "hybrid_shard";
  }
  return "?";
}

AutoWrapPolicy size_based_auto_wrap_policy(int64_t min_num_params) {
  DDPKIT_CHECK(min_num_params >= 1, "size_based_auto_wrap_policy: min_num_params must be positive, got ", min_num_params);
  return [min_num_params](const torch::nn::Module&, const std::string&, int64_t unwrapped) {
    return unwrapped >= min_num_params;
  };
}

namespace detail {

at::Tensor BufferPool::take(int64_t numel, at::ScalarType dtype, c10::Device device) {
  if (!device.is_cpu()) return at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  auto& blocks = blocks_[bytes];
  for (auto& b : blocks)
    if (b.storage().use_count() == 1) return b.view(dtype);
  blocks.push_back(at::empty({bytes}, at::kByte));
  return blocks.back().view(dtype);
}


thread_local FsdpImpl* t_active = nullptr;

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<const torch::nn::Module*, std::string>& registry() {
  static std::unordered_map<const torch::nn::Module*, std::string> r;
  return r;
}

std::string unit_label(const FlatUnit& u) { return u.name.empty() ? std::string("(root)") : "'" + u.name + "'"; }

namespace {

bool is_container(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::SequentialImpl*>(&m) || dynamic_cast<const torch::nn::ModuleListImpl*>(&m);
}

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}


// A Sequential child that is a unit: runs it inside its unit's scope.
struct UnitCallImpl : torch::nn::Module {
  explicit UnitCallImpl(torch::nn::AnyModule wrapped) : wrapped(std::move(wrapped)) {}
  at::Tensor forward(at::Tensor x) {
    fsdp::UnitScope scope(*wrapped.ptr());
    at::Tensor out = wrapped.forward<at::Tensor>(scope.cast(x));
    if (scope.active()) scope.finish({out});
    return out;
  }
  torch::nn::AnyModule wrapped;
};

}  // namespace

FsdpImpl::FsdpImpl(std::shared_ptr<torch::nn::Module> module_in, std::shared_ptr<ProcessGroup> pg_in,
                   FullyShardedDataParallelOptions options_in)
    : module(std::move(module_in)), pg(std::move(pg_in)), options(std::move(options_in)) {
  DDPKIT_CHECK(module, "FullyShardedDataParallel: the module is null");
  DDPKIT_CHECK(pg, "FullyShardedDataParallel: the process group is null");
  const MixedPrecision& mp = options.mixed_precision();
  compute_dtype = mp.param_dtype().value_or(at::kFloat);
  reduce_dtype = mp.reduce_dtype().value_or(compute_dtype);
  for (auto t : {compute_dtype, reduce_dtype})
    DDPKIT_CHECK(at::isFloatingType(t), "FullyShardedDataParallel: mixed precision dtypes must be floating point, got ", t);
  make_groups();
  build_units();
  check_device();
  check_same_units_on_every_rank();
  shard_parameters();
  wrap_sequential_children();
#ifdef __GLIBC__
  // The module's full-size parameters were just freed. Under a raised trim threshold (ddpkit's
  // allocator tuning) glibc keeps them, and the holes they leave are a little too small for the
  // padded unit buffers that follow: hand their pages back (4 ranks, 92M-parameter MLP: 216 MB
  // less resident per rank in training).
  malloc_trim(0);
#endif
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (const auto& u : units)
    if (u.module) registry()[u.module] = u.name;
}

FsdpImpl::~FsdpImpl() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    for (const auto& u : units)
      if (u.module) registry().erase(u.module);
  }
  for (auto& u : units) {
    if (u.gather) {
      try {
        u.gather->wait();  // its buffers must outlive the collective
      } catch (...) {
      }
    }
    if (u.reduce) {
      try {
        u.reduce->wait();
      } catch (...) {
      }
    }
  }
  stop_gradient_places();
  unwrap_sequential_children();
  if (t_active == this) t_active = nullptr;
}

void FsdpImpl::make_groups() {
  const ShardingStrategy s = options.sharding_strategy();
  shard_pg = pg;
  if (s == ShardingStrategy::kHybridShard) {
    if (options.shard_group() || options.replicate_group()) {
      DDPKIT_CHECK(options.shard_group() && options.replicate_group(),
                   "FullyShardedDataParallel: kHybridShard needs both shard_group and replicate_group, or neither");
      shard_pg = options.shard_group();
      replicate_pg = options.replicate_group();
      DDPKIT_CHECK(shard_pg->size() * replicate_pg->size() == pg->size(),
                   "FullyShardedDataParallel: shard group (", shard_pg->size(), " ranks) x replicate group (",
                   replicate_pg->size(), " ranks) must cover the ", pg->size(), " ranks of the process group");
    } else {
      // Shard over this host's ranks (shared memory), replicate over the same local rank on every host.
      const HostTopology& topo = pg->topology();
      const int local = topo.local_size();
      for (const auto& h : topo.ranks_of_host)
        DDPKIT_CHECK(static_cast<int>(h.size()) == local, "FullyShardedDataParallel: kHybridShard needs the same "
                     "number of ranks on every host; host sizes differ (", h.size(), " vs ", local,
                     "): pass shard_group and replicate_group");
      ProcessGroupOptions within = pg->options(), across = pg->options();
      within.group_name("fsdp-shard-host" + std::to_string(topo.host()));
      across.group_name("fsdp-replicate-" + std::to_string(topo.local_rank())).shared_memory(false);
      shard_pg = pg->new_subgroup(topo.local_rank(), local, within);
      replicate_pg = pg->new_subgroup(topo.host(), topo.hosts(), across);
    }
  }
  if (s == ShardingStrategy::kNoShard) {
    shard_world = 1;
    shard_rank = 0;
  } else {
    shard_world = shard_pg->size();
    shard_rank = shard_pg->rank();
  }
  default_state = std::make_unique<fsdp::DefaultState>(s == ShardingStrategy::kNoShard ? pg : shard_pg);
}

// Units: the policy over container children, post-order (a unit's count excludes units inside it),
// plus the modules named in unit_modules. Each parameter belongs to the nearest unit above it.
void FsdpImpl::build_units() {
  std::set<const torch::nn::Module*> explicit_units;
  for (const auto& m : options.unit_modules()) {
    DDPKIT_CHECK(m, "FullyShardedDataParallel: unit_modules holds a null module");
    explicit_units.insert(m.get());
  }
  std::set<const torch::nn::Module*> chosen;
  std::set<const torch::nn::Module*> found_explicit;
  // Returns the parameters under `m` that are in no unit under it (counted once per tensor).
  std::function<int64_t(const torch::nn::Module&, const std::string&, bool)> choose =
      [&](const torch::nn::Module& m, const std::string& path, bool container_child) -> int64_t {
    int64_t count = 0;
    for (const auto& p : m.named_parameters(/*recurse=*/false)) count += p.value().numel();
    for (const auto& c : m.named_children()) count += choose(*c.value(), join(path, c.key()), is_container(m));
    if (&m == module.get()) return count;
    const bool by_policy = container_child && options.auto_wrap_policy() && options.auto_wrap_policy()(m, path, count);
    if (explicit_units.count(&m)) found_explicit.insert(&m);
    if (by_policy || explicit_units.count(&m)) {
      chosen.insert(&m);
      return 0;
    }
    return count;
  };
  choose(*module, "", false);
  DDPKIT_CHECK(found_explicit.size() == explicit_units.size(),
               "FullyShardedDataParallel: ", explicit_units.size() - found_explicit.size(),
               " of unit_modules are not submodules of the wrapped module");

  units.clear();
  units.emplace_back();  // root
  std::unordered_map<const at::TensorImpl*, std::pair<int, size_t>> seen;  // tensor -> unit, param
  std::function<void(const torch::nn::Module&, const std::string&, int)> assign =
      [&](const torch::nn::Module& m, const std::string& path, int unit) {
        if (chosen.count(&m)) {
          FlatUnit u;
          u.index = static_cast<int>(units.size());
          u.name = path;
          u.module = &m;
          DDPKIT_CHECK(!unit_by_module.count(&m), "FullyShardedDataParallel: module '", path,
                       "' appears twice in the module tree: a unit must have one place");
          unit_by_module[&m] = u.index;
          units.push_back(std::move(u));
          unit = static_cast<int>(units.size()) - 1;
        }
        for (const auto& p : m.named_parameters(/*recurse=*/false)) {
          const std::string full_name = join(path, p.key());
          const at::TensorImpl* key = p.value().unsafeGetTensorImpl();
          auto it = seen.find(key);
          if (it != seen.end()) {
            FlatUnit& owner = units[it->second.first];
            DDPKIT_CHECK(it->second.first == unit, "FullyShardedDataParallel: parameter '", full_name, "' (also '",
                         owner.params[it->second.second].names.front(), "') is shared by units ", unit_label(owner),
                         " and ", unit_label(units[unit]), ": put the modules that share it in one unit");
            owner.params[it->second.second].names.push_back(full_name);
            continue;
          }
          FlatParam fp;
          fp.param = p.value();
          fp.names.push_back(full_name);
          fp.shape = p.value().sizes().vec();
          fp.numel = p.value().numel();
          DDPKIT_CHECK(p.value().layout() == at::kStrided && at::isFloatingType(p.value().scalar_type()),
                       "FullyShardedDataParallel: parameter '", full_name, "' is ", p.value().scalar_type(), " (",
                       p.value().layout(), "): dense floating-point parameters only");
          if (seen.empty()) device = p.value().device();
          DDPKIT_CHECK(p.value().device() == device, "FullyShardedDataParallel: parameter '", full_name, "' is on ",
                       p.value().device(), ", the first parameter on ", device,
                       ": move the whole model to one device before wrapping it");
          seen[key] = {unit, units[unit].params.size()};
          units[unit].params.push_back(std::move(fp));
        }
        for (const auto& c : m.named_children()) assign(*c.value(), join(path, c.key()), unit);
      };
  assign(*module, "", 0);

  for (auto& u : units) {
    int64_t offset = 0;
    int training = 0;
    for (auto& fp : u.params) {
      fp.offset = offset;
      offset += fp.numel;
      training += fp.param.requires_grad() ? 1 : 0;
    }
    DDPKIT_CHECK(training == 0 || training == static_cast<int>(u.params.size()), "FullyShardedDataParallel: unit ",
                 unit_label(u), " mixes frozen and trainable parameters (", training, " of ", u.params.size(),
                 " train): make the frozen ones a unit of their own");
    u.trainable = training > 0;
    u.trainable_params = training;
    u.numel = offset;
    u.shard_numel = shard_world == 1 ? offset : (offset + shard_world - 1) / shard_world;
    FsdpUnitInfo info;
    info.name = u.name;
    for (const auto& fp : u.params) info.parameters.push_back(fp.names.front());
    info.numel = u.numel;
    info.shard_numel = u.shard_numel;
    infos.push_back(std::move(info));
  }
  position_in_order.assign(units.size(), -1);
}

// NCCL moves CUDA tensors and Gloo (with ddpkit's shared memory) CPU ones: each group of this
// instance must be of the kind the parameters need, or the first collective fails far from here.
void FsdpImpl::check_device() {
  DDPKIT_CHECK(device.is_cpu() || device.is_cuda(), "FullyShardedDataParallel: parameters on ", device,
               ": CPU (gloo) or CUDA (nccl) only");
  const std::string needed = device.is_cuda() ? "nccl" : "gloo";
  for (const auto* group : {&pg, &shard_pg, &replicate_pg}) {
    if (!*group) continue;
    const std::string& backend = (*group)->options().backend();
    DDPKIT_CHECK(backend == needed, "FullyShardedDataParallel: the parameters are on ", device, " but process group '",
                 (*group)->options().group_name(), "' is ", backend, ": ", needed, " carries ",
                 device.is_cuda() ? "CUDA" : "CPU", " tensors (move the model, or make the group with backend(\"",
                 needed, "\"))");
  }
}

// Every rank must have the same units over the same parameters: a 64-bit digest of the layout,
// the unit count and the parameter count are compared across the group.
void FsdpImpl::check_same_units_on_every_rank() {
  if (pg->size() == 1) return;
  uint64_t digest = 1469598103934665603ull;
  auto mix = [&](const std::string& s) {
    for (unsigned char c : s) digest = (digest ^ c) * 1099511628211ull;
    digest = (digest ^ 0xff) * 1099511628211ull;
  };
  int64_t total = 0;
  for (const auto& u : units) {
    mix(u.name);
    for (const auto& fp : u.params) {
      mix(fp.names.front());
      mix(std::to_string(fp.numel));
    }
    total += u.numel;
  }
  at::Tensor mine =
      at::tensor({static_cast<int64_t>(digest >> 1), static_cast<int64_t>(units.size()), total}, at::kLong).to(device);
  at::Tensor all = at::empty({pg->size() * 3}, on_device(at::kLong));
  ProcessGroup::wait(pg->allgather_into_tensor(all, mine));
  auto rows = all.view({pg->size(), 3});
  for (int r = 0; r < pg->size(); ++r) {
    DDPKIT_CHECK(rows[r].equal(mine), "FullyShardedDataParallel: units differ across ranks: rank ", pg->rank(), " has ",
                 units.size(), " units over ", total, " parameters, rank ", r, " has ", rows[r][1].item<int64_t>(),
                 " over ", rows[r][2].item<int64_t>(),
                 " (or the same counts with other names or shapes): build the same model and options on every rank");
  }
}

// Flattens each unit (rank 0's values when sync_module_states), keeps this rank's shard, and
// turns the module's parameters into empty placeholders of the compute dtype.
void FsdpImpl::shard_parameters() {
  torch::NoGradGuard no_grad;
  const bool sync = options.sync_module_states() && pg->size() > 1;
  for (auto& u : units) {
    // Parameter by parameter (rank 0's values), each rank keeping only its range of the flat
    // layout: no unit is ever held whole twice.
    u.shard = at::zeros({u.shard_numel}, on_device(at::kFloat));
    const int64_t begin = shard_rank * u.shard_numel, end = begin + u.shard_numel;
    for (const auto& fp : u.params) {
      at::Tensor data = fp.param.detach();
      if (sync) ProcessGroup::wait(pg->broadcast(data, 0));
      const int64_t from = std::max(begin, fp.offset), to = std::min(end, fp.offset + fp.numel);
      if (to > from) u.shard.narrow(0, from - begin, to - from).copy_(data.reshape({-1}).narrow(0, from - fp.offset, to - from));
    }
    u.shard.set_requires_grad(u.trainable);
    // Without sharding in fp32, or with nothing to gather, the parameters are views of the shard.
    u.aliases_shard = (shard_world == 1 && compute_dtype == at::kFloat) || u.numel == 0;
    u.stays_gathered =
        u.numel == 0 || (u.aliases_shard && options.sharding_strategy() == ShardingStrategy::kNoShard);
    if (u.aliases_shard) {
      u.full = u.shard.detach();
    } else {
      u.full = at::empty({u.shard_numel * shard_world}, on_device(compute_dtype));
      detach_full(u);
    }
    for (size_t i = 0; i < u.params.size(); ++i) {
      FlatParam& fp = u.params[i];
      // The accumulator records the parameter's shape and dtype when made: make it as the
      // parameter will be in backward, and keep it (autograd holds it weakly).
      if (fp.param.scalar_type() != compute_dtype) fp.param.set_data(at::empty(fp.shape, on_device(compute_dtype)));
      if (u.trainable) {
        fp.accumulator = torch::autograd::impl::grad_accumulator(fp.param);
        const int unit = u.index, param = static_cast<int>(i);
        std::weak_ptr<int> token = alive;
        fp.accumulator->add_post_hook(std::make_unique<compat::LambdaPostHook>([this, unit, param, token] {
          if (token.lock()) param_grad_ready(unit, param);
        }));
      }
      fp.param.mutable_grad() = at::Tensor();
    }
    if (u.stays_gathered) {
      u.state = FlatUnit::State::kGathered;
      point_params_at_full(u);
    } else {
      for (auto& fp : u.params) fp.param.set_data(at::empty({0}, on_device(compute_dtype)));
    }
  }
  place_shards_in_shared_memory();
  // Buffers: rank 0's, in buffer_dtype while training.
  for (auto& b : module->named_buffers(/*recurse=*/true)) {
    at::Tensor t = b.value();
    if (!t.defined()) continue;
    if (sync) ProcessGroup::wait(pg->broadcast(t, 0));
    const auto bd = options.mixed_precision().buffer_dtype();
    if (bd && at::isFloatingType(t.scalar_type()) && t.scalar_type() != *bd) {
      buffer_dtypes.emplace_back(b.key(), t.scalar_type());
      t.set_data(t.detach().to(*bd));
    }
  }
}

// Where this host's ranks share memory and compute in fp32, each unit's flat parameter lies once in
// memory they all map, every rank's shard a slice of it: a gather is then no copy at all, only the
// parameters pointed there, once a host barrier at each forward has seen every rank's optimizer
// step (docs/fsdp.md, "Gathers on one host").
void FsdpImpl::place_shards_in_shared_memory() {
  if (shard_world == 1 || compute_dtype != at::kFloat || !device.is_cpu()) return;
  int64_t total = 0;
  for (const auto& u : units) total += u.aliases_shard ? 0 : u.shard_numel * shard_world;
  if (total == 0) return;
  at::Tensor region = shard_pg->host_shared_tensor(total, at::kFloat);  // collective over the host
  if (!region.defined()) return;
  int64_t offset = 0;
  for (auto& u : units) {
    if (u.aliases_shard) continue;
    u.host_full = region.narrow(0, offset, u.shard_numel * shard_world);
    // A tensor of its own over the region (not a view): the shard stays a plain leaf. This rank
    // touches its slice first, so its pages are charged to this rank.
    at::Tensor shard = at::from_blob(region.data_ptr<float>() + offset + shard_rank * u.shard_numel, {u.shard_numel},
                                     [region](void*) {}, region.options());
    shard.copy_(u.shard.detach());
    shard.set_requires_grad(u.trainable);
    u.shard = shard;
    offset += u.shard_numel * shard_world;
  }
  gathers_in_place = true;
}

void FsdpImpl::wrap_sequential_children() {
  std::function<void(torch::nn::Module&)> visit = [&](torch::nn::Module& m) {
    for (auto& child : m.children()) visit(*child);
    auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&m);
    if (!seq) return;
    size_t pos = 0;
    for (auto it = seq->begin(); it != seq->end(); ++it, ++pos) {
      if (!unit_by_module.count(it->ptr().get())) continue;
      auto original = std::make_shared<torch::nn::AnyModule>(*it);
      *it = torch::nn::AnyModule(std::make_shared<UnitCallImpl>(*original));
      wrapped_.push_back({seq->shared_from_this(), pos, original});
    }
  };
  visit(*module);
}

void FsdpImpl::unwrap_sequential_children() {
  for (auto& w : wrapped_) {
    auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(w.sequential.get());
    auto it = seq->begin() + static_cast<std::ptrdiff_t>(w.position);
    *it = *std::static_pointer_cast<torch::nn::AnyModule>(w.original);
  }
  wrapped_.clear();
}

at::Tensor FsdpImpl::cast_input(const at::Tensor& t) const {
  if (t.defined() && options.mixed_precision().param_dtype() && at::isFloatingType(t.scalar_type()) &&
      t.scalar_type() != compute_dtype)
    return t.to(compute_dtype);
  return t;
}

int FsdpImpl::unit_of(const torch::nn::Module& m) const {
  auto it = unit_by_module.find(&m);
  return it == unit_by_module.end() ? -1 : it->second;
}

bool FsdpImpl::frees_after_forward(const FlatUnit& u) const {
  if (u.stays_gathered) return false;
  if (!at::GradMode::is_enabled()) return true;  // no backward will need it
  if (u.index == 0) return false;                // the root is needed first in backward
  const ShardingStrategy s = options.sharding_strategy();
  return s == ShardingStrategy::kFullShard || s == ShardingStrategy::kHybridShard;
}

}  // namespace detail

// ---- public API ----

FullyShardedDataParallelBase::FullyShardedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                                                           std::shared_ptr<ProcessGroup> pg,
                                                           FullyShardedDataParallelOptions options)
    : impl_(std::make_unique<detail::FsdpImpl>(std::move(module), std::move(pg), std::move(options))) {}

FullyShardedDataParallelBase::~FullyShardedDataParallelBase() = default;

std::vector<at::Tensor> FullyShardedDataParallelBase::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& u : impl_->units)
    if (u.numel > 0) out.push_back(u.shard);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallelBase::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& u : impl_->units)
    if (u.numel > 0) out.emplace_back(u.name.empty() ? "_root" : u.name, u.shard);
  return out;
}

const std::vector<FsdpUnitInfo>& FullyShardedDataParallelBase::units() const { return impl_->infos; }

namespace {

void check_hook_registration(const detail::FsdpImpl& impl, bool empty, bool reduce_scatters) {
  DDPKIT_CHECK(!empty, "FullyShardedDataParallel::register_comm_hook: the hook is empty");
  DDPKIT_CHECK(!impl.hook, "FullyShardedDataParallel::register_comm_hook: a hook ('", impl.hook_name,
               "') is registered already: once per instance");
  DDPKIT_CHECK(impl.iteration == 0, "FullyShardedDataParallel::register_comm_hook: register the hook before the first "
               "forward (", impl.iteration, " forwards ran)");
  const bool no_shard = impl.options.sharding_strategy() == ShardingStrategy::kNoShard;
  DDPKIT_CHECK(reduce_scatters != no_shard, "FullyShardedDataParallel::register_comm_hook: ",
               no_shard ? "kNoShard allreduces: its hook takes (state, grad), an FsdpAllreduceHook, e.g. "
                          "fsdp::allreduce_hook"
                        : "a sharded strategy reduce-scatters: its hook takes (state, grad, output), an "
                          "FsdpReduceScatterHook, e.g. fsdp::reduce_scatter_hook");
}

}  // namespace

void FullyShardedDataParallelBase::register_comm_hook(FsdpReduceScatterHook hook, const std::string& name) {
  check_hook_registration(*impl_, !hook.fn, /*reduce_scatters=*/true);
  impl_->hook = std::move(hook.fn);
  impl_->hook_name = name;
}

void FullyShardedDataParallelBase::register_comm_hook(FsdpAllreduceHook hook, const std::string& name) {
  check_hook_registration(*impl_, !hook.fn, /*reduce_scatters=*/false);
  impl_->hook = [fn = std::move(hook.fn)](const at::Tensor& grad, const at::Tensor&) { return fn(grad); };
  impl_->hook_name = name;
}

std::shared_ptr<ProcessGroup> FullyShardedDataParallelBase::process_group() const { return impl_->pg; }

std::shared_ptr<ProcessGroup> FullyShardedDataParallelBase::shard_group() const {
  return impl_->options.sharding_strategy() == ShardingStrategy::kNoShard ? impl_->pg : impl_->shard_pg;
}

std::shared_ptr<ProcessGroup> FullyShardedDataParallelBase::replicate_group() const { return impl_->replicate_pg; }

const FullyShardedDataParallelOptions& FullyShardedDataParallelBase::options() const { return impl_->options; }
bool FullyShardedDataParallelBase::require_backward_grad_sync() const { return impl_->require_sync; }
NoSyncGuard FullyShardedDataParallelBase::no_sync() { return NoSyncGuard(impl_->require_sync); }
int FullyShardedDataParallelBase::max_units_gathered() const { return impl_->max_gathered; }
int FullyShardedDataParallelBase::gradients_copied() const { return impl_->gradients_copied; }

at::Tensor FullyShardedDataParallelBase::cast_input(const at::Tensor& t) const { return impl_->cast_input(t); }

void FullyShardedDataParallelBase::pre_forward() { impl_->root_pre_forward(); }
void FullyShardedDataParallelBase::post_forward(const std::vector<at::Tensor>& outputs) {
  impl_->root_post_forward(outputs);
}

void FullyShardedDataParallelBase::forward_failed() {
  std::string what;
  try {
    throw;
  } catch (const c10::Error& e) {
    what = e.what_without_backtrace();
  } catch (const CommError&) {
    impl_->describe_forward_failure("");
    throw;
  } catch (const std::exception& e) {
    what = e.what();
  }
  DDPKIT_CHECK(false, impl_->describe_forward_failure(what));
}

}  // namespace ddpkit
