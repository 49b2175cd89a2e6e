// The transports' shared defaults, and the choice of a group's transport at creation.
#include "transport.h"

#include <ddpkit/codecs/cast.h>

#include "shm_engine.h"

#include <cstdlib>

namespace ddpkit {

using detail::bytes_of;
using detail::describe_tensor;

std::unique_ptr<Transport> create_network_transport(GroupCore& core, const c10::intrusive_ptr<c10d::Store>& setup_store,
                                                    const c10::intrusive_ptr<c10d::Store>& group_store) {
  if (core.options().backend() == "nccl") {
    DDPKIT_CHECK(!core.options().lazy_connections(), "lazy_connections is for the gloo backend (nccl connects lazily "
                 "by itself)");
    return make_nccl_transport(core, group_store);
  }
  if (core.options().lazy_connections() && core.size() > 1) return make_gloo_pairs_transport(core, group_store);
  return make_gloo_transport(core, setup_store);
}

namespace {

// DDPKIT_CHECK_COLLECTIVES=1, or PyTorch's switch for its own check of collectives
// (ProcessGroupWrapper), TORCH_DISTRIBUTED_DEBUG=DETAIL.
bool checks_asked_by_environment() {
  const char* ours = std::getenv("DDPKIT_CHECK_COLLECTIVES");
  const char* torch = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  return (ours && std::string(ours) == "1") || (torch && std::string(torch) == "DETAIL");
}

std::unique_ptr<Transport> choose_transport(ProcessGroup& group, GroupCore& core, const HostTopology& topology,
                                            const c10::intrusive_ptr<c10d::Store>& store,
                                            std::unique_ptr<Transport> network) {
  const bool gloo = core.options().backend() == "gloo";
  // Gloo has no bf16 and sums fp16 element by element in software: on several ranks a Gloo
  // group reduces them (and large fp32, by the option) as two alltoalls.
  if (gloo && core.size() > 1) network = make_two_phase_transport(core, std::move(network));
  std::shared_ptr<ShmEngine> engine = ShmEngine::create(core, topology, store);
  if (!engine) return network;
  if (topology.single_host()) return make_shm_transport(core, std::move(engine), std::move(network));
  // Rank h of the across-hosts group is the rank with this local rank on host h.
  ProcessGroupOptions across = core.options();
  across.shared_memory(false).group_name("across-hosts-" + std::to_string(topology.local_rank()));
  auto across_group = group.new_subgroup(topology.host(), topology.hosts(), across);
  return make_hierarchical_transport(core, std::move(engine), std::move(across_group), std::move(network));
}

}  // namespace

std::unique_ptr<Transport> create_transport(ProcessGroup& group, GroupCore& core, const HostTopology& topology,
                                            const c10::intrusive_ptr<c10d::Store>& store,
                                            std::unique_ptr<Transport> network) {
  std::unique_ptr<Transport> transport = choose_transport(group, core, topology, store, std::move(network));
  if (core.options().check_collectives() || checks_asked_by_environment())
    transport = make_checked_transport(core, std::move(transport));
  if (core.options().abortable()) transport = make_abortable_transport(core, std::move(transport));
  return transport;
}

FuturePtr Transport::allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  // Gathered into pooled scratch, then copied out as local work once it lands.
  const int64_t m = input.numel();
  at::Tensor all = core_.take_workspace(input.scalar_type(), m * core_.size());
  GroupCore* core = &core_;
  return allgather_into_tensor(all, input)->then(
      [core, outputs, input, all, m](c10::ivalue::Future& f) -> c10::IValue {
        f.value();  // rethrows the collective's error
        for (size_t k = 0; k < outputs.size(); ++k)
          outputs[k].copy_(all.narrow(0, static_cast<int64_t>(k) * m, m).view(outputs[k].sizes()));
        core->give_workspace(all);
        return c10::IValue(input);
      },
      c10::TensorType::get());
}

FuturePtr Transport::reduce_scatter(const at::Tensor& output, const at::Tensor& input) {
  const int64_t n = core_.size();
  // Pooled: a fresh buffer of the input's size costs more in page faults than the local sum.
  at::Tensor received = core_.take_workspace(input.scalar_type(), input.numel()).view({n, output.numel()});
  auto result = make_tensor_future(output.device());
  GroupCore* core = &core_;
  alltoall(received, input.reshape({n, -1}))->addCallback([=](c10::ivalue::Future& f) {
    if (f.hasError()) return core->fail(result, "reduce_scatter", f.exception_ptr());
    try {
      at::Tensor out = output.view({-1});
      if (received.scalar_type() == at::kHalf || received.scalar_type() == at::kBFloat16) {
        out.copy_(received.to(at::kFloat).sum(0));
      } else {
        at::sum_out(out, received, {0});
      }
      core->give_workspace(received.view({-1}));
      result->markCompleted(c10::IValue(output));
    } catch (...) {
      core->fail(result, "reduce_scatter", std::current_exception());
    }
  });
  return result;
}

FuturePtr Transport::monitored_barrier(std::chrono::milliseconds, bool) {
  DDPKIT_CHECK(false, "monitored_barrier needs a gloo group; '", core_.options().group_name(), "' runs on ", name());
  return FuturePtr();
}

at::Tensor Transport::allreduce_buffer(int64_t numel, at::ScalarType dtype) {
  return at::zeros({numel}, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

at::Tensor Transport::host_shared_tensor(int64_t, at::ScalarType) { return at::Tensor(); }

std::shared_ptr<GradientArena> Transport::gradient_arena(const std::vector<int64_t>&) { return nullptr; }

bool Transport::sums_in_place(const at::Tensor&) const { return false; }

FuturePtr Transport::allreduce_parts(const at::Tensor& buffer, const std::vector<at::Tensor>& parts, double scale) {
  const std::string what = "allreduce (" + describe_tensor(buffer) + " in " + std::to_string(parts.size()) + " parts)";
  // A part that already is its place in the buffer is not copied.
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
  GroupCore* core = &core_;
  allreduce(buffer, c10d::ReduceOp::SUM)->addCallback([=](c10::ivalue::Future& f) {
    if (f.hasError()) return result->setError(f.exception_ptr());
    try {
      if (scale != 1.0) flat.mul_(scale);
      for (auto& [part, place] : *places) part.view({-1}).copy_(place);
      result->markCompleted(c10::IValue(buffer));
    } catch (...) {
      core->fail(result, what, std::current_exception());
    }
  });
  return result;
}

void check_two_phase(const GroupCore& core, const TwoPhaseJob& job, const std::string& what) {
  for (const at::Tensor* t : {&job.send1, &job.recv1, &job.send2, &job.recv2})
    DDPKIT_CHECK(t->defined() && t->is_contiguous() && t->numel() % (job.pieces * core.size()) == 0, what,
                 ": two_phase buffers must be contiguous and split into ", job.pieces, " x ", core.size(),
                 " equal chunks");
}

}  // namespace ddpkit
