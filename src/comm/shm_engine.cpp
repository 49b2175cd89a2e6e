// The shared-memory engine: choosing it at creation, its thread, its allocations (shm_engine.h).
#include "shm_engine.h"

#include "shm_switch.h"

#include <ddpkit/compat.h>

#include <iostream>

namespace ddpkit {

std::shared_ptr<ShmEngine> ShmEngine::create(GroupCore& core, const HostTopology& topology,
                                             const c10::intrusive_ptr<c10d::Store>& group_store) {
  const ProcessGroupOptions& options = core.options();
  const int rank = core.rank(), world = core.size();
  if (world == 1) return nullptr;
  const bool want = options.shared_memory() && options.backend() == "gloo" && shared_memory_allowed_by_environment();
  DDPKIT_CHECK(options.shm_slot_bytes() >= 4096 && options.shm_slot_bytes() % 64 == 0,
               "shm_slot_bytes must be a multiple of 64 and at least 4096, got ", options.shm_slot_bytes());
  // Shared memory needs every host to hold the same number (>= 2) of ranks: the topology, equal
  // on every rank, decides that alone, so a group across hosts asks nothing more of the store.
  const auto& hosts = topology.ranks_of_host;
  const size_t local = topology.local_ranks().size();
  bool uniform = true;
  for (const auto& h : hosts) uniform = uniform && h.size() == local;
  if (local < 2 || !uniform) return nullptr;
  c10d::Store& store = *group_store;
  const std::string prefix = "ddpkit/shm/";
  store.set(prefix + "want/" + std::to_string(rank), std::vector<uint8_t>{static_cast<uint8_t>(want ? '1' : '0')});
  std::vector<std::string> all_keys, others;
  for (int r = 0; r < world; ++r) {
    all_keys.push_back(prefix + "want/" + std::to_string(r));
    if (r != rank) others.push_back(all_keys.back());
  }
  store.wait(all_keys, options.timeout());
  bool all = want;
  for (const auto& v : compat::multi_get(store, others)) all = all && v == std::vector<uint8_t>{'1'};
  if (!all) return nullptr;
  shm::DomainOptions o;
  o.local_rank = topology.local_rank();
  o.local_size = static_cast<int>(local);
  o.group_ranks = topology.local_ranks();
  o.timeout = options.timeout();
  o.slot_bytes = options.shm_slot_bytes();
  std::shared_ptr<ShmEngine> engine(new ShmEngine(core));
  engine->store_ = group_store;
  engine->key_ = prefix + "host" + std::to_string(topology.host());
  try {
    engine->domain_ = shm::Domain::create(store, engine->key_, o);
  } catch (const std::exception&) {
    throw CommError(describe_comm_failure("shared-memory setup of process group '" + options.group_name() + "'",
                                          rank, world, std::current_exception()));
  }
  return engine;
}

std::shared_ptr<shm::SharedBuffer> ShmEngine::allocate(size_t bytes, const std::string& what,
                                                       const std::string& instead, bool one_region, bool reserve) {
  std::lock_guard<std::mutex> lock(allocate_mutex_);
  const int64_t id = allocations_++;
  std::string why;
  std::shared_ptr<shm::SharedBuffer> buffer;
  try {
    buffer = domain_->allocate(*store_, key_ + "/buffer", id, bytes, &why, one_region, reserve);
  } catch (const std::exception&) {
    throw CommError(describe_comm_failure(what + " in shared memory", core_.rank(), core_.size(),
                                          std::current_exception()));
  }
  if (!buffer && !warned_) {
    std::cerr << "ddpkit: rank " << core_.rank() << ": " << instead << " (" << why << ")\n";
    warned_ = true;
  }
  return buffer;
}

FuturePtr ShmEngine::issue(const std::string& what, uint64_t bus_bytes, const at::Tensor& value,
                           std::function<void()> op) {
  GroupCore* core = &core_;
  return issue(what, value, [core, bus_bytes] { core->count(bus_bytes, bus_bytes, /*shared_memory=*/true); },
               std::move(op));
}

FuturePtr ShmEngine::issue(const std::string& what, const at::Tensor& value, std::function<void()> account,
                           std::function<void()> op) {
  auto result = make_tensor_future(value.device());
  core_.post([this, what, value, result, account = std::move(account), op = std::move(op)] {
    try {
      account();
    } catch (...) {
      return core_.fail(result, what, std::current_exception());
    }
    GroupCore* core = &core_;
    thread_.post([what, value, result, op, core] {
      try {
        op();
      } catch (...) {
        core->fail(result, what + " in shared memory", std::current_exception());
        return;
      }
      result->markCompleted(c10::IValue(value));
    });
  });
  return result;
}

}  // namespace ddpkit
