// What a stateful comm hook carries from one step to the next (PowerSGD's error feedback and Q,
// int8's error feedback, iteration counters), as named tensors: the part of a training checkpoint
// that belongs to the hook. The state is rank-local; save and load it per rank.
#pragma once

#include <ddpkit/error.h>

#include <ATen/ATen.h>

#include <cstring>
#include <map>
#include <string>

namespace ddpkit {

using TensorDict = std::map<std::string, at::Tensor>;

// Scalars and byte strings as dict entries.
inline at::Tensor int_entry(int64_t value) { return at::tensor({value}, at::kLong); }
inline at::Tensor bytes_entry(const std::string& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}
// The entry `key` of `dict`, which `what` needs: a clear error when it is missing or malformed.
inline const at::Tensor& entry_of(const TensorDict& dict, const std::string& key, const std::string& what) {
  auto it = dict.find(key);
  DDPKIT_CHECK(it != dict.end() && it->second.defined(), what, ": state has no entry '", key, "'");
  return it->second;
}
inline int64_t int_of(const TensorDict& dict, const std::string& key, const std::string& what) {
  const at::Tensor& t = entry_of(dict, key, what);
  DDPKIT_CHECK(t.scalar_type() == at::kLong && t.numel() == 1, what, ": entry '", key,
               "' should hold one int64, holds ", t.numel(), " ", t.scalar_type());
  return t.item<int64_t>();
}
inline std::string bytes_of(const TensorDict& dict, const std::string& key, const std::string& what) {
  const at::Tensor t = entry_of(dict, key, what).contiguous();
  DDPKIT_CHECK(t.scalar_type() == at::kByte && t.dim() == 1, what, ": entry '", key, "' should hold bytes, holds ",
               t.scalar_type());
  return std::string(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()));
}

namespace hooks {

class HookState {
 public:
  virtual ~HookState() = default;
  // Copies, taken between steps (never while a backward pass runs).
  virtual TensorDict state_dict() const = 0;
  // Replaces the state with one state_dict() returned, before the next step. Entries the hook does
  // not know, or of a shape it cannot use, are an error naming them.
  virtual void load_state_dict(const TensorDict& state) = 0;
};

}  // namespace hooks
}  // namespace ddpkit
