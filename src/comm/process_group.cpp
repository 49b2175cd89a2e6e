// ProcessGroup: rendezvous, the choice of transport, the argument checks every transport shares,
// and ordered jobs. The collectives themselves are the transports' (transport.h).
#include <ddpkit/comm/process_group.h>

#include "group_core.h"
#include "setup_keys.h"
#include "transport.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cstdlib>

namespace ddpkit {

using detail::describe_tensor;

struct ProcessGroup::Impl {
  Impl(c10::intrusive_ptr<c10d::Store> store, int rank, int world, ProcessGroupOptions options)
      : store(std::move(store)), core(rank, world, std::move(options)) {}
  ~Impl() {
    core.stop();  // drains: queued jobs may still hand work to the transport's threads
    transport.reset();
  }

  c10::intrusive_ptr<c10d::Store> store;
  std::atomic<int64_t> subgroups_made{0};  // numbers new_subgroup's names
  HostTopology topology;
  GroupCore core;
  std::unique_ptr<Transport> transport;
};

FuturePtr make_tensor_future(c10::Device device) {
  std::vector<c10::Device> devices;
  if (!device.is_cpu()) devices.push_back(device);
  return c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(), std::move(devices));
}

FuturePtr completed_future(const at::Tensor& value) {
  auto f = make_tensor_future(value.defined() ? value.device() : c10::Device(c10::kCPU));
  f->markCompleted(c10::IValue(value));
  return f;
}

FuturePtr when_all(const std::vector<FuturePtr>& all, const at::Tensor& value) {
  if (all.empty()) return completed_future(value);
  auto result = make_tensor_future(value.defined() ? value.device() : c10::Device(c10::kCPU));
  auto remaining = std::make_shared<std::atomic<size_t>>(all.size());
  auto failed = std::make_shared<std::atomic<bool>>(false);
  for (const auto& f : all) {
    f->addCallback([result, remaining, failed, value](c10::ivalue::Future& done) {
      if (done.hasError()) {
        if (!failed->exchange(true)) result->setError(done.exception_ptr());
      } else if (remaining->fetch_sub(1) == 1 && !failed->load()) {
        result->markCompleted(c10::IValue(value));
      }
    });
  }
  return result;
}

ProcessGroup::ProcessGroup(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                           ProcessGroupOptions options) {
  DDPKIT_CHECK(store, "ProcessGroup needs a store");
  DDPKIT_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  DDPKIT_CHECK(rank >= 0 && rank < world_size, "rank must be in [0, ", world_size, "), got ", rank);
  DDPKIT_CHECK(options.timeout().count() > 0, "timeout must be positive, got ", options.timeout().count(), " ms");
  DDPKIT_CHECK(options.piece_bytes() >= 1, "piece_bytes must be >= 1, got ", options.piece_bytes());
  DDPKIT_CHECK(options.backend() == "gloo" || options.backend() == "nccl", "unknown backend '", options.backend(),
               "' (expected gloo or nccl)");
  impl_ = std::make_unique<Impl>(std::move(store), rank, world_size, std::move(options));
  GroupCore& core = impl_->core;
  const ProcessGroupOptions& o = core.options();
  // Every key construction touches passes through `setup`, so the last rank done can delete them.
  c10::intrusive_ptr<c10d::Store> group_store = c10::make_intrusive<c10d::PrefixStore>(o.group_name() + "/", impl_->store);
  auto setup = c10::make_intrusive<detail::SetupKeysStore>(group_store);
  c10::intrusive_ptr<c10d::Store> prefixed = setup;
  const std::string what = "rendezvous of process group '" + o.group_name() + "' (" + o.backend() + ", timeout " +
                           std::to_string(o.timeout().count()) + " ms)";
  std::unique_ptr<Transport> network;
  try {
    network = create_network_transport(core, prefixed, group_store);
  } catch (const std::exception&) {
    throw CommError(describe_comm_failure(what, rank, world_size, std::current_exception()));
  }
  // Which ranks share a host: per group, from what each rank publishes (docs/design.md).
  impl_->topology = discover_host_topology(*prefixed, "ddpkit/topology", rank, world_size, o.timeout());
  impl_->transport = create_transport(*this, core, impl_->topology, prefixed, std::move(network));
  // Gloo's lazy connections (TORCH_GLOO_LAZY_INIT, libtorch 2.8+) read the rendezvous keys at the
  // first collective: they stay then.
  const char* lazy = std::getenv("TORCH_GLOO_LAZY_INIT");
  if (lazy && !std::string(lazy).empty() && std::string(lazy) != "0") return;
  try {
    setup->finish(world_size, o.timeout());
  } catch (const std::exception&) {
    throw CommError(describe_comm_failure(what, rank, world_size, std::current_exception()));
  }
}

ProcessGroup::~ProcessGroup() = default;

int ProcessGroup::rank() const { return impl_->core.rank(); }
int ProcessGroup::size() const { return impl_->core.size(); }
const std::string& ProcessGroup::backend_name() const { return impl_->core.options().backend(); }
std::chrono::milliseconds ProcessGroup::timeout() const { return impl_->core.timeout(); }
const c10::intrusive_ptr<c10d::Store>& ProcessGroup::store() const { return impl_->store; }
const ProcessGroupOptions& ProcessGroup::options() const { return impl_->core.options(); }
int64_t ProcessGroup::piece_bytes() const { return impl_->core.piece_bytes(); }
const HostTopology& ProcessGroup::topology() const { return impl_->topology; }
std::string ProcessGroup::transport_name() const { return impl_->transport->name(); }
bool ProcessGroup::uses_shared_memory() const { return impl_->transport->uses_shared_memory(); }
bool ProcessGroup::hierarchical() const { return impl_->transport->hierarchical(); }
detail::BackendCall ProcessGroup::backend_call() { return impl_->transport->backend_call(); }

void ProcessGroup::abort(const std::string& reason) {
  DDPKIT_CHECK(impl_->transport->abort(reason), "abort(): process group '", options().group_name(),
               "' was made without ProcessGroupOptions::abortable");
}

void ProcessGroup::set_piece_bytes(int64_t bytes) {
  impl_->core.set_piece_bytes(bytes);
  impl_->transport->piece_bytes_changed(bytes);
}

int64_t ProcessGroup::pieces_for(uint64_t bytes_per_rank) const { return impl_->core.pieces_for(bytes_per_rank); }

CommStats ProcessGroup::stats() const { return impl_->core.stats(); }
CommStats ProcessGroup::traffic(int64_t key) const { return impl_->core.traffic(key); }
void ProcessGroup::reset_stats() { impl_->core.reset_stats(); }

std::shared_ptr<ProcessGroup> ProcessGroup::new_subgroup(int rank, int world_size, ProcessGroupOptions options) const {
  DDPKIT_CHECK(world_size >= 1 && world_size <= size(), "new_subgroup: a subgroup of ", world_size,
               " ranks from a group of ", size());
  DDPKIT_CHECK(!options.group_name().empty(), "new_subgroup: the subgroup's label (options.group_name()) is empty");
  const int64_t n = impl_->subgroups_made.fetch_add(1);
  options.group_name(this->options().group_name() + "/" + options.group_name() + "." + std::to_string(n));
  return std::make_shared<ProcessGroup>(impl_->store, rank, world_size, std::move(options));
}

// ---- Collectives: the checks every transport shares, then the transport.

FuturePtr ProcessGroup::allreduce(const at::Tensor& tensor, c10d::ReduceOp op) {
  return impl_->transport->allreduce(tensor, op);
}

FuturePtr ProcessGroup::broadcast(const at::Tensor& tensor, int root) {
  DDPKIT_CHECK(root >= 0 && root < size(), "broadcast root must be in [0, ", size(), "), got ", root);
  return impl_->transport->broadcast(tensor, root);
}

FuturePtr ProcessGroup::allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  DDPKIT_CHECK(static_cast<int>(outputs.size()) == size(), "allgather needs ", size(), " outputs, got ",
               outputs.size());
  for (size_t k = 0; k < outputs.size(); ++k)
    DDPKIT_CHECK(outputs[k].numel() == input.numel() && outputs[k].scalar_type() == input.scalar_type(),
                 "allgather: output ", k, " is ", describe_tensor(outputs[k]), ", the input ", describe_tensor(input));
  return impl_->transport->allgather(outputs, input);
}

FuturePtr ProcessGroup::allgather_into_tensor(const at::Tensor& output, const at::Tensor& input) {
  DDPKIT_CHECK(output.numel() == input.numel() * size() && output.scalar_type() == input.scalar_type() &&
                   output.device() == input.device(),
               "allgather_into_tensor: output is ", describe_tensor(output), ", expected ", size(),
               " x the input (", describe_tensor(input), ")");
  DDPKIT_CHECK(output.is_contiguous(), "allgather_into_tensor: the output must be contiguous");
  return impl_->transport->allgather_into_tensor(output, input);
}

FuturePtr ProcessGroup::alltoall(const at::Tensor& output, const at::Tensor& input) {
  DDPKIT_CHECK(input.dim() >= 1 && input.size(0) % size() == 0, "alltoall: dim 0 (",
               input.dim() >= 1 ? input.size(0) : 0, ") must divide evenly among ", size(), " ranks");
  DDPKIT_CHECK(detail::bytes_of(output) == detail::bytes_of(input), "alltoall: output is ", describe_tensor(output),
               ", the input ", describe_tensor(input));
  return impl_->transport->alltoall(output, input);
}

FuturePtr ProcessGroup::reduce_scatter(const at::Tensor& output, const at::Tensor& input) {
  DDPKIT_CHECK(input.numel() == output.numel() * size(), "reduce_scatter: input has ", input.numel(),
               " elements, expected ", size(), " x output (", output.numel(), ")");
  DDPKIT_CHECK(input.scalar_type() == output.scalar_type() && input.device() == output.device(),
               "reduce_scatter: input ", describe_tensor(input), " and output ", describe_tensor(output),
               " must share dtype and device");
  DDPKIT_CHECK(input.is_contiguous() && output.is_contiguous(), "reduce_scatter: tensors must be contiguous");
  return impl_->transport->reduce_scatter(output, input);
}

FuturePtr ProcessGroup::barrier() { return impl_->transport->barrier(); }

FuturePtr ProcessGroup::monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) {
  DDPKIT_CHECK(timeout.count() >= 0, "monitored_barrier: the timeout must not be negative, got ", timeout.count(), " ms");
  return impl_->transport->monitored_barrier(timeout, wait_all_ranks);
}

FuturePtr ProcessGroup::two_phase(std::shared_ptr<TwoPhaseJob> job, const at::Tensor& value, const std::string& what) {
  DDPKIT_CHECK(job && job->pieces >= 1, what, ": two_phase needs a job with at least one piece");
  DDPKIT_CHECK(job->reduce, what, ": two_phase needs a reduce step");
  return impl_->transport->two_phase(job, value, what);
}

// ---- Memory the host's ranks share.

at::Tensor ProcessGroup::allreduce_buffer(int64_t numel, at::ScalarType dtype) {
  DDPKIT_CHECK(numel >= 0, "allreduce_buffer: numel must be >= 0, got ", numel);
  return impl_->transport->allreduce_buffer(numel, dtype);
}

at::Tensor ProcessGroup::host_shared_tensor(int64_t numel, at::ScalarType dtype) {
  DDPKIT_CHECK(numel >= 0, "host_shared_tensor: numel must be >= 0, got ", numel);
  return impl_->transport->host_shared_tensor(numel, dtype);
}

std::shared_ptr<GradientArena> ProcessGroup::gradient_arena(const std::vector<int64_t>& block_bytes) {
  return impl_->transport->gradient_arena(block_bytes);
}

bool ProcessGroup::sums_in_place(const at::Tensor& buffer) const { return impl_->transport->sums_in_place(buffer); }

FuturePtr ProcessGroup::allreduce_parts(const at::Tensor& buffer, const std::vector<at::Tensor>& parts, double scale) {
  DDPKIT_CHECK(buffer.defined() && !buffer.is_sparse() && buffer.is_contiguous(),
               "allreduce_parts: the buffer must be a dense contiguous tensor");
  int64_t total = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& p = parts[i];
    DDPKIT_CHECK(p.defined() && !p.is_sparse() && p.is_contiguous() && p.scalar_type() == buffer.scalar_type() &&
                     p.device() == buffer.device(),
                 "allreduce_parts: part ", i, " is ", (p.defined() ? describe_tensor(p) : "undefined"),
                 "; every part must be dense, contiguous, and of the buffer's dtype and device (",
                 describe_tensor(buffer), ")");
    total += p.numel();
  }
  DDPKIT_CHECK(total == buffer.numel(), "allreduce_parts: the parts hold ", total, " elements, the buffer ",
               buffer.numel());
  return impl_->transport->allreduce_parts(buffer, parts, scale);
}

// ---- Ordered jobs.

FuturePtr ProcessGroup::run_ordered_async(std::function<FuturePtr()> fn, c10::Device device) {
  auto result = make_tensor_future(device);
  GroupCore* core = &impl_->core;
  core->post([core, result, fn = std::move(fn)] {
    try {
      FuturePtr inner = fn();
      DDPKIT_CHECK(inner, "run_ordered_async: the job returned no future");
      inner->addCallback([core, result](c10::ivalue::Future& f) {
        if (f.hasError()) {
          core->fail(result, "ordered job", f.exception_ptr());
        } else {
          result->markCompleted(f.value());
        }
      });
    } catch (...) {
      core->fail(result, "ordered job", std::current_exception());
    }
  });
  return result;
}

FuturePtr ProcessGroup::run_ordered(std::function<at::Tensor()> fn, c10::Device device) {
  return run_ordered_async([fn = std::move(fn)] { return completed_future(fn()); }, device);
}

at::Tensor ProcessGroup::wait(const FuturePtr& future) {
  future->wait();
  if (future->hasError()) {
    try {
      std::rethrow_exception(future->exception_ptr());
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      throw CommError(std::string("ddpkit: ") + e.what());
    }
  }
  return future->value().toTensor();
}

}  // namespace ddpkit
