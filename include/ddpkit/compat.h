// Every difference between libtorch 1.13 (Debian) and pytorch.org 2.x that ddpkit touches lives here.
// See docs/compat.md for the facts behind each item.
#pragma once

#include <torch/version.h>  // 1.13 includes it only from torch/all.h: include it explicitly.

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/core/Allocator.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define DDPKIT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace ddpkit {
namespace compat {

// An optional as libtorch's own APIs take it: c10::optional in 1.13 (a type of its own there),
// std::optional from 2.x, where c10::optional is a deprecated alias of it.
#if DDPKIT_TORCH_AT_LEAST(2, 0)
template <class T>
using optional = std::optional<T>;
inline constexpr std::nullopt_t nullopt = std::nullopt;
#else
template <class T>
using optional = c10::optional<T>;
constexpr c10::nullopt_t nullopt = c10::nullopt;
#endif

// c10::Allocator::allocate is const in 1.13 and not in 2.x, where copy_data became pure virtual as
// well. An allocator derives from this and implements allocate_bytes; both spellings of allocate
// are declared (neither marked override), so whichever the base has is the one overridden.
struct CpuAllocatorBase : c10::Allocator {
  virtual c10::DataPtr allocate_bytes(size_t n) const = 0;
  c10::DataPtr allocate(size_t n) const { return allocate_bytes(n); }
  c10::DataPtr allocate(size_t n) { return allocate_bytes(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const { std::memcpy(dest, src, count); }
};

// The object collectives are called on: ProcessGroup in 1.13, Backend from 2.0 on. Both have the
// same collective signatures and return c10::intrusive_ptr<c10d::Work>.
#if DDPKIT_TORCH_AT_LEAST(2, 0)
using Backend = c10d::Backend;
#else
using Backend = c10d::ProcessGroup;
#endif

// Gloo gained _reduce_scatter_base/_allgather_base in 2.2 (1.13 throws "no support"). Where they
// exist, bench/collective_bench measures them beside ddpkit's own alltoall-based reduce-scatter and
// allgather; those were faster at 100 MB in both versions, so ProcessGroup uses its own (docs/compat.md).
#define DDPKIT_GLOO_HAS_BASE_COLLECTIVES DDPKIT_TORCH_AT_LEAST(2, 2)

// The single-tensor collectives took their torchcomms names in 2.13 (all_gather_single,
// reduce_scatter_single, all_to_all_single and their _coalesced forms); the old names stay as
// deprecated aliases that forward to them. ddpkit calls them by these, and a c10d backend
// (the Python package's) overrides the DDPKIT_C10D_* name, the canonical one of its libtorch.
#if DDPKIT_TORCH_AT_LEAST(2, 13)
#define DDPKIT_C10D_ALL_GATHER_SINGLE all_gather_single
#define DDPKIT_C10D_ALL_GATHER_SINGLE_COALESCED all_gather_single_coalesced
#define DDPKIT_C10D_REDUCE_SCATTER_SINGLE reduce_scatter_single
#define DDPKIT_C10D_REDUCE_SCATTER_SINGLE_COALESCED reduce_scatter_single_coalesced
#define DDPKIT_C10D_ALL_TO_ALL_SINGLE all_to_all_single
#else
#define DDPKIT_C10D_ALL_GATHER_SINGLE _allgather_base
#define DDPKIT_C10D_ALL_GATHER_SINGLE_COALESCED allgather_into_tensor_coalesced
#define DDPKIT_C10D_REDUCE_SCATTER_SINGLE _reduce_scatter_base
#define DDPKIT_C10D_REDUCE_SCATTER_SINGLE_COALESCED reduce_scatter_tensor_coalesced
#define DDPKIT_C10D_ALL_TO_ALL_SINGLE alltoall_base
#endif

// c10d::Backend::split (torch.distributed.split_group for a backend other than NCCL's): overridden
// from 2.15, the release whose header it was checked against (earlier ones had it in other shapes).
#define DDPKIT_C10D_BACKEND_HAS_SPLIT DDPKIT_TORCH_AT_LEAST(2, 15)

inline c10::intrusive_ptr<c10d::Work> all_gather_single(Backend& b, at::Tensor& out, at::Tensor& in,
                                                        const c10d::AllgatherOptions& o) {
  return b.DDPKIT_C10D_ALL_GATHER_SINGLE(out, in, o);
}
inline c10::intrusive_ptr<c10d::Work> reduce_scatter_single(Backend& b, at::Tensor& out, at::Tensor& in,
                                                            const c10d::ReduceScatterOptions& o) {
  return b.DDPKIT_C10D_REDUCE_SCATTER_SINGLE(out, in, o);
}
inline c10::intrusive_ptr<c10d::Work> all_to_all_single(Backend& b, at::Tensor& out, at::Tensor& in,
                                                        std::vector<int64_t>& out_splits,
                                                        std::vector<int64_t>& in_splits,
                                                        const c10d::AllToAllOptions& o) {
  return b.DDPKIT_C10D_ALL_TO_ALL_SINGLE(out, in, out_splits, in_splits, o);
}

// PREMUL_SUM's factor when it is a number (FSDP2's gradient divide factor, ReduceOp.PREMUL_SUM(x)),
// nullopt when it is a tensor or missing. The supplement holds `tensor_factors` in 1.13 and
// `tensor_factor` from 2.x (PreMulSumSupplement, with the old name an alias).
inline compat::optional<double> premul_sum_factor(const c10d::ReduceOp& op) {
  const auto* s = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  if (s == nullptr) return compat::nullopt;
#if DDPKIT_TORCH_AT_LEAST(2, 0)
  if (s->tensor_factor.defined()) return compat::nullopt;
#else
  if (!s->tensor_factors.empty()) return compat::nullopt;
#endif
  return s->double_factor;
}

// torch::optim::Optimizer::state() is keyed by the parameter's TensorImpl: as the pointer printed
// to a string in 1.13, as the pointer itself (void*) in 2.x. Pass the map to get its key type.
template <class StateMap>
typename StateMap::key_type optimizer_state_key(const StateMap&, const at::Tensor& param) {
  using Key = typename StateMap::key_type;
  if constexpr (std::is_same<Key, std::string>::value) {
    std::ostringstream os;  // what c10::guts::to_string(p.unsafeGetTensorImpl()) writes
    os << static_cast<const void*>(param.unsafeGetTensorImpl());
    return os.str();
  } else {
    return static_cast<Key>(param.unsafeGetTensorImpl());
  }
}

// TCPStore options for the classic (socket) store server. 2.4+ default useLibUV to true, and a
// libtorch built without libuv (Debian's 2.6) then refuses every TCPStore. Detected by the field
// rather than by version, since the field and the default arrived in different releases.
namespace detail {
template <class Options>
auto use_classic_store(Options& o, int) -> decltype(o.useLibUV = false, void()) {
  o.useLibUV = false;
}
template <class Options>
void use_classic_store(Options&, long) {}
}  // namespace detail

inline c10d::TCPStoreOptions tcp_store_options() {
  c10d::TCPStoreOptions o;
  detail::use_classic_store(o, 0);
  return o;
}

// A client connection of its own to the TCPStore at host:port, every call bounded by `timeout`.
inline c10::intrusive_ptr<c10d::TCPStore> tcp_store_client(const std::string& host, int port,
                                                           std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions o = tcp_store_options();
  o.port = static_cast<uint16_t>(port);
  o.isServer = false;
  o.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(host, o);
}

// A c10d::Store that hands every call to another. 2.x adds append/multiGet/multiSet to the base,
// with defaults built on the calls forwarded here; later releases add a pure virtual clone(),
// declared here without `override` so that it overrides only where the base has it. This store
// keeps no state of its own, so a clone is the same object.
class ForwardingStore : public c10d::Store {
 public:
  explicit ForwardingStore(c10::intrusive_ptr<c10d::Store> inner)
      : c10d::Store(inner->getTimeout()), inner_(std::move(inner)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override { inner_->set(key, value); }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    return inner_->compareSet(key, expected, desired);
  }
  std::vector<uint8_t> get(const std::string& key) override { return inner_->get(key); }
  int64_t add(const std::string& key, int64_t value) override { return inner_->add(key, value); }
  bool deleteKey(const std::string& key) override { return inner_->deleteKey(key); }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  int64_t getNumKeys() override { return inner_->getNumKeys(); }
  void wait(const std::vector<std::string>& keys) override { inner_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    inner_->wait(keys, timeout);
  }
  const std::chrono::milliseconds& getTimeout() const noexcept override { return inner_->getTimeout(); }
  void setTimeout(const std::chrono::milliseconds& timeout) override { inner_->setTimeout(timeout); }
  c10::intrusive_ptr<c10d::Store> clone() { return c10::intrusive_ptr<c10d::Store>::reclaim_copy(this); }
#if DDPKIT_TORCH_AT_LEAST(2, 1)
  // Forwarded, not the base's one get per key: a TCPStore answers them in one round trip.
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys) override {
    return inner_->multiGet(keys);
  }
#endif

 protected:
  c10::intrusive_ptr<c10d::Store> inner_;
};

// The values of `keys` (each waited for, up to the store's timeout): one round trip where the store
// batches them (2.1+'s multiGet; a TCPStore's get is a wait and a get, two), else a get each.
inline std::vector<std::vector<uint8_t>> multi_get(c10d::Store& store, const std::vector<std::string>& keys) {
#if DDPKIT_TORCH_AT_LEAST(2, 1)
  return store.multiGet(keys);
#else
  std::vector<std::vector<uint8_t>> values;
  for (const auto& key : keys) values.push_back(store.get(key));
  return values;
#endif
}

// A parameter's grad accumulator as autograd hands it out: std::shared_ptr<Node> up to 2.14,
// c10::intrusive_ptr<Node> in 2.15. Holders keep it by this type.
using GradAccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// A post hook on a grad accumulator. operator() is unchanged from 1.13 to 2.x; compiled_args
// (added ~2.1, later const) is deliberately not overridden.
class LambdaPostHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit LambdaPostHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace compat
}  // namespace ddpkit
