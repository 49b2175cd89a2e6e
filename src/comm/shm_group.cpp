// The group's shared-memory side: choosing it at creation, buffers DDP sums in place, handing
// collectives to the shm thread, and hierarchical allreduce across hosts (docs/shared_memory.md).
#include <ddpkit/codecs/cast.h>
#include <ddpkit/comm/gradient_arena.h>
#include <ddpkit/comm/process_group.h>

#include "process_group_internal.h"
#include "shm_switch.h"

#include <algorithm>
#include <iostream>

namespace ddpkit {

using detail::fail;


// Every rank publishes whether it wants shared memory and all read all: the choice is the
// group's (a host whose ranks disagreed would run other algorithms than its peers and hang).
// Used when every rank wants it, a host has two or more ranks, and (several hosts) every host
// has the same number, which hierarchical allreduce needs.
void ProcessGroup::setup_shared_memory(const c10::intrusive_ptr<c10d::Store>& group_store) {
  c10d::Store& store = *group_store;
  const bool want = options_.shared_memory() && options_.backend() == "gloo" && shared_memory_allowed_by_environment();
  if (world_size_ == 1) return;
  DDPKIT_CHECK(options_.shm_slot_bytes() >= 4096 && options_.shm_slot_bytes() % 64 == 0,
               "shm_slot_bytes must be a multiple of 64 and at least 4096, got ", options_.shm_slot_bytes());
  const std::string prefix = "ddpkit/shm/";
  store.set(prefix + "want/" + std::to_string(rank_), std::vector<uint8_t>{static_cast<uint8_t>(want ? '1' : '0')});
  bool all = true;
  for (int r = 0; r < world_size_ && all; ++r) {
    const std::string key = prefix + "want/" + std::to_string(r);
    store.wait({key}, options_.timeout());
    all = store.get(key) == std::vector<uint8_t>{'1'};
  }
  const auto& hosts = topology_.ranks_of_host;
  const size_t local = hosts[topology_.host_of_rank[rank_]].size();
  bool uniform = true;
  for (const auto& h : hosts) uniform = uniform && h.size() == local;
  if (!all || local < 2 || !uniform) return;
  shm::DomainOptions o;
  o.local_rank = topology_.local_rank();
  o.local_size = static_cast<int>(local);
  o.group_ranks = hosts[topology_.host_of_rank[rank_]];
  o.timeout = options_.timeout();
  o.slot_bytes = options_.shm_slot_bytes();
  auto engine = std::make_unique<Shm>();
  engine->store = group_store;
  engine->key = prefix + "host" + std::to_string(topology_.host_of_rank[rank_]);
  try {
    engine->domain = shm::Domain::create(store, engine->key, o);
  } catch (const std::exception&) {
    throw CommError(describe_comm_failure("shared-memory setup of process group '" + options_.group_name() + "'",
                                          rank_, world_size_, std::current_exception()));
  }
  if (hosts.size() > 1) {
    // Rank h of this group is the rank with this local rank on host h: it allreduces shards.
    ProcessGroupOptions across = options_;
    across.shared_memory(false).group_name("across-hosts-" + std::to_string(o.local_rank));
    engine->across = new_subgroup(topology_.host_of_rank[rank_], static_cast<int>(hosts.size()), across);
  }
  shm_ = std::move(engine);
}

bool ProcessGroup::uses_shared_memory() const { return shm_ != nullptr; }
bool ProcessGroup::hierarchical() const { return shm_ && shm_->across; }

void ProcessGroup::set_piece_bytes(int64_t bytes) {
  DDPKIT_CHECK(bytes >= 1, "piece_bytes must be >= 1, got ", bytes);
  piece_bytes_.store(bytes, std::memory_order_relaxed);
  if (shm_ && shm_->across) shm_->across->set_piece_bytes(bytes);
}

std::shared_ptr<shm::SharedBuffer> ProcessGroup::Shm::allocate(size_t bytes, const std::string& what, int rank,
                                                                int world, const std::string& instead,
                                                                bool one_region) {
  std::lock_guard<std::mutex> lock(allocate_mutex);
  const int64_t id = allocations++;
  std::string why;
  std::shared_ptr<shm::SharedBuffer> buffer;
  try {
    buffer = domain->allocate(*store, key + "/buffer", id, bytes, &why, one_region);
  } catch (const std::exception&) {
    throw CommError(describe_comm_failure(what + " in shared memory", rank, world, std::current_exception()));
  }
  if (!buffer && !warned) {
    std::cerr << "ddpkit: rank " << rank << ": " << instead << " (" << why << ")\n";
    warned = true;
  }
  return buffer;
}

at::Tensor ProcessGroup::allreduce_buffer(int64_t numel, at::ScalarType dtype) {
  DDPKIT_CHECK(numel >= 0, "allreduce_buffer: numel must be >= 0, got ", numel);
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  // Summing in place needs every rank of the group in one domain (no hierarchical step).
  if (!shm_ || shm_->across || numel == 0) return at::zeros({numel}, options);
  std::shared_ptr<shm::SharedBuffer> buffer = shm_->allocate(
      static_cast<size_t>(numel) * c10::elementSize(dtype),
      "allreduce_buffer of " + std::to_string(numel) + " " + c10::toString(dtype) + " elements", rank_, world_size_,
      "allreduce buffers stay in private memory; allreduce still goes through shared memory, with one more copy "
      "each way");
  if (!buffer) return at::zeros({numel}, options);
  // The tensor owns the mappings: they outlive the group if the tensor does.
  return at::from_blob(buffer->base[shm_->domain->local_rank()], {numel}, [buffer](void*) {}, options);
}

at::Tensor ProcessGroup::host_shared_tensor(int64_t numel, at::ScalarType dtype) {
  DDPKIT_CHECK(numel >= 0, "host_shared_tensor: numel must be >= 0, got ", numel);
  if (!shm_ || shm_->across || numel == 0) return at::Tensor();
  std::shared_ptr<shm::SharedBuffer> region = shm_->allocate(
      static_cast<size_t>(numel) * c10::elementSize(dtype),
      "host_shared_tensor of " + std::to_string(numel) + " " + c10::toString(dtype) + " elements", rank_, world_size_,
      "no memory is shared between this host's ranks for their tensors; each keeps its own", /*one_region=*/true);
  if (!region) return at::Tensor();
  return at::from_blob(region->base[0], {numel}, [region](void*) {}, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

std::shared_ptr<GradientArena> ProcessGroup::gradient_arena(const std::vector<int64_t>& block_bytes) {
  if (!shm_ || shm_->across || block_bytes.empty()) return nullptr;
  size_t capacity = 0, largest = 0;
  std::vector<size_t> sizes;
  for (int64_t b : block_bytes) {
    DDPKIT_CHECK(b > 0, "gradient_arena: block sizes must be positive, got ", b);
    const size_t rounded = (static_cast<size_t>(b) + 4095) / 4096 * 4096;
    capacity += rounded;
    largest = std::max(largest, rounded);
    sizes.push_back(static_cast<size_t>(b));
  }
  capacity += largest;  // a transient gradient beside the kept ones (gradients accumulated in .grad)
  std::shared_ptr<shm::SharedBuffer> buffer =
      shm_->allocate(capacity, "gradient_arena of " + std::to_string(capacity) + " bytes", rank_, world_size_,
                     "gradients stay in private memory; their allreduce copies them through the buckets");
  if (!buffer) return nullptr;
  return std::make_shared<GradientArena>(buffer, buffer->base[shm_->domain->local_rank()], std::move(sizes));
}

bool ProcessGroup::sums_in_place(const at::Tensor& buffer) const {
  return shm_ && !shm_->across && buffer.defined() && buffer.device().is_cpu() && !buffer.is_sparse() &&
         buffer.is_contiguous() && codecs::sums_raw(buffer.scalar_type()) &&
         shm_->domain->holds(buffer.data_ptr(), static_cast<int64_t>(detail::bytes_of(buffer)));
}

FuturePtr ProcessGroup::allreduce_parts(const at::Tensor& buffer, const std::vector<at::Tensor>& parts, double scale) {
  DDPKIT_CHECK(buffer.defined() && !buffer.is_sparse() && buffer.is_contiguous(),
               "allreduce_parts: the buffer must be a dense contiguous tensor");
  int64_t total = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& p = parts[i];
    DDPKIT_CHECK(p.defined() && !p.is_sparse() && p.is_contiguous() && p.scalar_type() == buffer.scalar_type() &&
                     p.device() == buffer.device(),
                 "allreduce_parts: part ", i, " is ", (p.defined() ? detail::describe_tensor(p) : "undefined"),
                 "; every part must be dense, contiguous, and of the buffer's dtype and device (",
                 detail::describe_tensor(buffer), ")");
    total += p.numel();
  }
  DDPKIT_CHECK(total == buffer.numel(), "allreduce_parts: the parts hold ", total, " elements, the buffer ",
               buffer.numel());
  const std::string what = "allreduce (" + detail::describe_tensor(buffer) + " in " + std::to_string(parts.size()) +
                           " parts)";
  if (sums_in_place(buffer)) {
    const uint64_t n = static_cast<uint64_t>(world_size_);
    return shm_issue(what, 2 * (n - 1) * detail::bytes_of(buffer) / n, buffer, [this, buffer, parts, scale] {
      std::vector<shm::Part> spans;
      int64_t at = 0;
      for (const at::Tensor& p : parts) {
        spans.push_back({at, p.numel(), p.data_ptr()});
        at += p.numel();
      }
      shm_->domain->allreduce_parts(buffer.data_ptr(), buffer.numel(), buffer.scalar_type(), scale, spans);
    });
  }
  // Elsewhere: through the buffer. A part that already is its place in the buffer is not copied.
  const at::Tensor flat = buffer.view({-1});
  auto places = std::make_shared<std::vector<std::pair<at::Tensor, at::Tensor>>>();  // (part, its place)
  int64_t at = 0;
  for (const at::Tensor& p : parts) {
    at::Tensor place = flat.narrow(0, at, p.numel());
    at += p.numel();
    if (p.numel() == 0 || p.data_ptr() == place.data_ptr()) continue;
    place.copy_(p.view({-1}));
    places->emplace_back(p, place);
  }
  auto result = make_tensor_future(buffer.device());
  const int rank = rank_, world = world_size_;
  allreduce(buffer)->addCallback([=](c10::ivalue::Future& f) {
    if (f.hasError()) return result->setError(f.exception_ptr());
    try {
      if (scale != 1.0) flat.mul_(scale);
      for (auto& [part, place] : *places) part.view({-1}).copy_(place);
      result->markCompleted(c10::IValue(buffer));
    } catch (...) {
      fail(result, what, rank, world, std::current_exception());
    }
  });
  return result;
}

bool ProcessGroup::shm_takes(const at::Tensor& t) const {
  return shm_ && !shm_->across && t.device().is_cpu() && !t.is_sparse();
}

FuturePtr ProcessGroup::shm_issue(const std::string& what, uint64_t bus_bytes, const at::Tensor& value,
                                  std::function<void()> op) {
  return shm_issue(what, value, [this, bus_bytes] { count(bus_bytes, bus_bytes, /*shared_memory=*/true); }, std::move(op));
}

FuturePtr ProcessGroup::shm_issue(const std::string& what, const at::Tensor& value, std::function<void()> account,
                                  std::function<void()> op) {
  auto result = make_tensor_future(value.device());
  post([this, what, value, result, account = std::move(account), op = std::move(op)] {
    const int rank = rank_, world = world_size_;
    try {
      account();
    } catch (...) {
      return fail(result, what, rank, world, std::current_exception());
    }
    shm_->thread.post([what, value, result, op, rank, world] {
      try {
        op();
      } catch (...) {
        fail(result, what + " in shared memory", rank, world, std::current_exception());
        return;
      }
      result->markCompleted(c10::IValue(value));
    });
  });
  return result;
}

// On the shm thread, `data` contiguous. Local rank l owns row l of the tensor viewed as
// [local_size, m]: shared-memory reduce-scatter gives it its host's sum of row l, the group of the
// ranks with local rank l on every host allreduces that shard over Gloo, and a shared-memory
// allgather hands every shard to every local rank. In pieces, so piece k crosses the network
// while piece k + 1 is reduced here.
void ProcessGroup::hierarchical_allreduce(const at::Tensor& data, double scale) {
  shm::Domain& d = *shm_->domain;
  const int64_t L = d.local_size(), numel = data.numel(), m = (numel + L - 1) / L;
  const auto dtype = data.scalar_type();
  const int64_t elt = static_cast<int64_t>(data.element_size());
  at::Tensor rows = data.view({-1});
  const bool padded = m * L != numel;
  if (padded) {
    rows = take_workspace(dtype, m * L);
    rows.narrow(0, 0, numel).copy_(data.view({-1}));
    rows.narrow(0, numel, m * L - numel).zero_();
  }
  at::Tensor shard = take_workspace(dtype, std::max<int64_t>(m, 1));
  const int64_t piece = std::max<int64_t>(1, std::max<int64_t>(piece_bytes(), 1 << 20) / elt);
  auto* rows_ptr = static_cast<uint8_t*>(rows.data_ptr());
  std::vector<std::pair<int64_t, FuturePtr>> across;
  for (int64_t off = 0; off < m; off += piece) {
    const int64_t c = std::min(piece, m - off);
    d.reduce_scatter(rows_ptr + off * elt, static_cast<uint8_t*>(shard.data_ptr()) + off * elt, c, dtype, m);
    across.emplace_back(off, shm_->across->allreduce(shard.narrow(0, off, c)));
  }
  for (auto& [off, future] : across) {
    at::Tensor part = ProcessGroup::wait(future);
    if (scale != 1.0) part.mul_(scale);
    d.allgather(part.data_ptr(), rows_ptr + off * elt, part.numel() * elt, m * elt);
  }
  give_workspace(shard);
  if (padded) {
    data.view({-1}).copy_(rows.narrow(0, 0, numel));
    give_workspace(rows);
  }
}

}  // namespace ddpkit
