// The ddpkit backend's collectives on one ddpkit::ProcessGroup: every op and dtype
// torch.distributed names, mapped onto ddpkit's calls (SUM/AVG its own, the rest Gloo's). Free
// functions of the group they run on, so a collective issued before a reconfigure runs on the
// group it was issued to, never on the next. Included by backend.cpp only.
#pragma once

#include <ddpkit/comm/process_group.h>

#include <torch/csrc/distributed/c10d/Types.hpp>

#include <functional>
#include <vector>

namespace ddpkit {
namespace python {

// `f`, then `after` (on the thread that completes f); errors in either reach the result.
FuturePtr then(const FuturePtr& f, std::function<void()> after);

const char* op_name(const c10d::ReduceOp& op);

// A contiguous tensor's bytes, flat (Gloo moves no bfloat16 or bool).
at::Tensor as_bytes(const at::Tensor& contiguous);

// `t` broadcast from `root` as bytes, through a contiguous copy where it is not contiguous.
FuturePtr broadcast_any(ProcessGroup& pg, const at::Tensor& t, int root);

// t reduced into itself on every rank.
FuturePtr reduce_in_place(ProcessGroup& pg, const at::Tensor& t, const c10d::ReduceOp& op, const char* what);

// outputs[r] = rank r's input (outputs checked: one per rank, the input's size and dtype).
FuturePtr gather_list(ProcessGroup& pg, const std::vector<at::Tensor>& outputs, const at::Tensor& input);
// output = every rank's input, in rank order.
FuturePtr gather_flat(ProcessGroup& pg, const at::Tensor& output, const at::Tensor& input);
// output = chunk rank() of the reduction of every rank's input.
FuturePtr scatter_flat(ProcessGroup& pg, const at::Tensor& output, const at::Tensor& input, const c10d::ReduceOp& op,
                       const char* what);
// All-to-all of dim-0 rows; empty splits: even.
FuturePtr alltoall_flat(ProcessGroup& pg, const at::Tensor& output, const at::Tensor& input,
                        const std::vector<int64_t>& output_splits, const std::vector<int64_t>& input_splits);

}  // namespace python
}  // namespace ddpkit
