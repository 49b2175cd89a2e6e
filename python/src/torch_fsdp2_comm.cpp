#include "torch_fsdp2_comm.h"

#include "backend.h"

#include <ddpkit/compat.h>
#include <ddpkit/error.h>
#include <ddpkit/hooks/fsdp_hooks.h>

#include <string>

namespace ddpkit {
namespace python {
namespace {

namespace py = pybind11;
using c10d::ReduceOp;

// "none": the plain hook in the tensors' dtype; "fp16"/"bf16": a copy in that precision crosses.
void check_codec(const std::string& codec) {
  DDPKIT_CHECK(codec == "none" || codec == "fp16" || codec == "bf16",
               "ddpkit FSDP2 comm: codec must be 'none', 'fp16' or 'bf16', got '", codec, "'");
}

void check_flat(const at::Tensor& t, const char* name, const char* op) {
  DDPKIT_CHECK(t.defined() && t.device().is_cpu() && t.layout() == c10::kStrided && t.is_contiguous(),
               "ddpkit FSDP2 ", op, ": the ", name, " must be a contiguous CPU tensor (ddpkit's backend serves CPU)");
  DDPKIT_CHECK(at::isFloatingType(t.scalar_type()), "ddpkit FSDP2 ", op, ": the ", name,
               " holds gradients, so floating point, got ", t.scalar_type());
}

// Runs the hook of `codec` with the given divisors (the SUM is divided by pre before and by post
// after it: ddpkit's fsdp::DefaultState split of the average, or 1 and 1 for a plain sum).
FuturePtr run_hook(const std::shared_ptr<ProcessGroup>& pg, const std::string& codec, const at::Tensor& grad,
                   const at::Tensor& output, bool mean) {
  const at::Tensor& result = output.defined() ? output : grad;
  if (codec == "none") {
    fsdp::DefaultState state(pg);
    if (!mean) state.gradient_predivide_factor = state.gradient_postdivide_factor = 1;
    return output.defined() ? fsdp::reduce_scatter_hook(state, grad, output) : fsdp::allreduce_hook(state, grad);
  }
  fsdp::LowPrecisionState state(pg, result.scalar_type());
  if (!mean) state.gradient_predivide_factor = state.gradient_postdivide_factor = 1;
  return codec == "fp16" ? fsdp::fp16_compress_hook(state, grad, output) : fsdp::bf16_compress_hook(state, grad, output);
}

c10::intrusive_ptr<c10d::Work> reduce_scatter(const py::handle& backend, const at::Tensor& output,
                                              const at::Tensor& input, const ReduceOp& op, const std::string& codec) {
  check_codec(codec);
  check_flat(output, "output", "reduce_scatter");
  check_flat(input, "input", "reduce_scatter");
  DDPKIT_CHECK(input.scalar_type() == output.scalar_type(), "ddpkit FSDP2 reduce_scatter: input is ",
               input.scalar_type(), " but output is ", output.scalar_type());
  // FSDP2's choices (_get_gradient_divide_factors): AVG for fp32/bf16, SUM when it divides itself,
  // PREMUL_SUM(1/factor) for a gradient divide factor of its own.
  bool mean = false;
  if (op == ReduceOp::AVG) {
    mean = true;
  } else if (op == ReduceOp::PREMUL_SUM) {
    const compat::optional<double> factor = compat::premul_sum_factor(op);
    DDPKIT_CHECK(factor.has_value(), "ddpkit FSDP2 reduce_scatter: PREMUL_SUM needs a number as its factor");
    input.mul_(*factor);  // FSDP2's own scratch input, as its predivide is
  } else {
    DDPKIT_CHECK(op == ReduceOp::SUM, "ddpkit FSDP2 reduce_scatter: gradients reduce by SUM, AVG or PREMUL_SUM, got "
                 "op ", static_cast<int>(op.op_));
  }
  return issue_on_backend(backend, c10d::OpType::REDUCE_SCATTER, {output},
                          [codec, input, output, mean](const std::shared_ptr<ProcessGroup>& pg) {
                            DDPKIT_CHECK(input.numel() == output.numel() * pg->size(),
                                         "ddpkit FSDP2 reduce_scatter: input has ", input.numel(),
                                         " elements, expected the group's size (", pg->size(), ") x output's ",
                                         output.numel());
                            return run_hook(pg, codec, input, output, mean);
                          });
}

// The average of `tensor` across the group, in place.
c10::intrusive_ptr<c10d::Work> all_reduce(const py::handle& backend, const at::Tensor& tensor,
                                          const std::string& codec) {
  check_codec(codec);
  check_flat(tensor, "tensor", "all_reduce");
  return issue_on_backend(backend, c10d::OpType::ALLREDUCE, {tensor},
                          [codec, tensor](const std::shared_ptr<ProcessGroup>& pg) {
                            return run_hook(pg, codec, tensor, at::Tensor(), true);
                          });
}

}  // namespace

void bind_fsdp2_comm(py::module& m) {
  m.def("_fsdp_reduce_scatter", &reduce_scatter, py::arg("backend"), py::arg("output"), py::arg("input"),
        py::arg("op"), py::arg("codec"),
        "output = this rank's chunk of the reduction of every rank's input, by ddpkit's FSDP hook of `codec`");
  m.def("_fsdp_all_reduce", &all_reduce, py::arg("backend"), py::arg("tensor"), py::arg("codec"),
        "tensor = the group's average of tensor, by ddpkit's FSDP hook of `codec`");
}

}  // namespace python
}  // namespace ddpkit
