// An optimizer's per-parameter state as named plain tensors (internal), for heals: libtorch's
// archive encodes and decodes several times slower than the bytes take to copy. SGD, Adam and
// AdamW (libtorch's state types, which ddpkit's optimizers use too); any other state is left to
// the archive.
#pragma once

#include <ddpkit/hooks/hook_state.h>

#include <torch/optim/optimizer.h>

#include <string>

namespace ddpkit {
namespace detail {

// Adds `prefix`/... entries for every parameter's state and every group's learning rate. The
// tensors share storage with the optimizer's (encode them before it steps again). False, adding
// nothing, when some state is of a kind not handled here.
bool put_optimizer_tensors(TensorDict& d, torch::optim::Optimizer& o, const std::string& prefix);
// Replaces the optimizer's state with what put_optimizer_tensors wrote under `prefix` (the
// tensors are taken, not copied). False when there is none; an error naming `what` when it does
// not fit this optimizer (another parameter count, shape or kind of state).
bool load_optimizer_tensors(const TensorDict& d, torch::optim::Optimizer& o, const std::string& prefix,
                            const std::string& what);

}  // namespace detail
}  // namespace ddpkit
