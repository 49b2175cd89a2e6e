// Every difference between libtorch 1.13 (Debian) and pytorch.org 2.x that ddpkit touches lives here.
// See docs/compat.md for the facts behind each item.
#pragma once

#include <torch/version.h>  // 1.13 includes it only from torch/all.h: include it explicitly.

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/core/Allocator.h>

#include <chrono>
#include <cstring>
#include <functional>
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

 protected:
  c10::intrusive_ptr<c10d::Store> inner_;
};

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
