// Stand-in for a header Debian's libtorch 1.13 does not ship (libtorch-dev lacks
// torch/csrc/distributed/autograd). c10d/reducer.hpp includes it only to name the distributed
// autograd context type in members ddpkit never touches; ddpkit only calls
// Reducer::register_comm_hook. Used only when the real header is missing (python/CMakeLists.txt).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>

namespace torch {
namespace distributed {
namespace autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;  // as the real one: reducer.hpp asserts it
};
using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace autograd
}  // namespace distributed
}  // namespace torch
