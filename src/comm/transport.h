// The transport interface (internal): how a process group's collectives move their bytes. One
// implementation per file, chosen once when the group is made (create_transport, transport.cpp):
//
//   gloo          c10d Gloo between any ranks (gloo_transport.cpp, point to point in gloo_exchange.cpp)
//   gloo pairs    Gloo over pairs connected when a collective first needs them, rings and trees
//                 (ProcessGroupOptions::lazy_connections; gloo_pairs_transport.cpp)
//   nccl          c10d NCCL, CUDA tensors (nccl_transport.cpp)
//   two-phase     allreduce as two alltoalls over an inner transport: fp16/bf16 on Gloo, and fp32
//                 from ProcessGroupOptions::two_phase_min_bytes up (two_phase_transport.cpp)
//   shared memory every rank on one host, through one segment (shm_transport.cpp)
//   hierarchical  several hosts with equal rank counts: allreduce through shared memory within each
//                 host and an inner group across them (hierarchical_transport.cpp)
//   checked       any of these, with every collective's arguments compared across ranks first
//                 (ProcessGroupOptions::check_collectives; checked_transport.cpp)
//   abortable     any of these, whose collectives in flight a caller can fail at once
//                 (ProcessGroupOptions::abortable; abortable_transport.cpp)
//
// The ProcessGroup checks arguments (the same errors whatever the transport), then calls its
// transport. A composite transport (two-phase, shared memory, hierarchical) takes what it is
// for and forwards the rest to the transport it wraps. Every transport runs
// tests/transport_conformance_test.cpp.
#pragma once

#include <ddpkit/comm/gradient_arena.h>
#include <ddpkit/comm/process_group.h>

#include "group_core.h"

#include <memory>
#include <string>
#include <vector>

namespace ddpkit {

class Transport {
 public:
  explicit Transport(GroupCore& core) : core_(core) {}
  virtual ~Transport() = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // What the group runs on, as ProcessGroup::transport_name() reports it.
  virtual std::string name() const = 0;

  // The collectives (see ProcessGroup for their contracts; the arguments are checked there).
  virtual FuturePtr allreduce(const at::Tensor& tensor, c10d::ReduceOp op) = 0;
  virtual FuturePtr broadcast(const at::Tensor& tensor, int root) = 0;
  virtual FuturePtr allgather_into_tensor(const at::Tensor& output, const at::Tensor& input) = 0;
  virtual FuturePtr alltoall(const at::Tensor& output, const at::Tensor& input) = 0;
  virtual FuturePtr barrier() = 0;
  virtual FuturePtr two_phase(const std::shared_ptr<TwoPhaseJob>& job, const at::Tensor& value,
                              const std::string& what) = 0;
  // Defaults built on the above: allgather into pooled scratch through allgather_into_tensor;
  // reduce_scatter as alltoall and a local sum; monitored_barrier refused.
  virtual FuturePtr allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input);
  virtual FuturePtr reduce_scatter(const at::Tensor& output, const at::Tensor& input);
  virtual FuturePtr monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks);

  // Memory the ranks of a host share. Defaults: private memory (zeros), nothing shared.
  virtual at::Tensor allreduce_buffer(int64_t numel, at::ScalarType dtype);
  virtual at::Tensor host_shared_tensor(int64_t numel, at::ScalarType dtype);
  virtual std::shared_ptr<GradientArena> gradient_arena(const std::vector<int64_t>& block_bytes);
  virtual bool sums_in_place(const at::Tensor& buffer) const;
  // Default: the parts copied into `buffer` (unless already there), allreduce, copied back.
  virtual FuturePtr allreduce_parts(const at::Tensor& buffer, const std::vector<at::Tensor>& parts, double scale);

  virtual bool uses_shared_memory() const { return false; }
  virtual bool hierarchical() const { return false; }
  // The piece size changed (GroupCore holds it): a transport with a group of its own passes it on.
  virtual void piece_bytes_changed(int64_t bytes) {}
  // The c10d backend under the transport, locked as ProcessGroup::with_backend describes.
  virtual detail::BackendCall backend_call() = 0;
  // Fails every collective in flight and every later one with a CommError naming `reason`;
  // false where the transport cannot (only the abortable one can).
  virtual bool abort(const std::string& reason) { return false; }

 protected:
  GroupCore& core_;
};

// A composite's base: forwards every collective, the shared-memory queries and buffers to `inner`.
// The defaults built on other calls (allgather, reduce_scatter, allreduce_parts) are not
// forwarded, so they run on the composite's own allgather_into_tensor, alltoall and allreduce.
class ForwardingTransport : public Transport {
 public:
  ForwardingTransport(GroupCore& core, std::unique_ptr<Transport> inner)
      : Transport(core), inner_(std::move(inner)) {}

  FuturePtr allreduce(const at::Tensor& t, c10d::ReduceOp op) override { return inner_->allreduce(t, op); }
  FuturePtr broadcast(const at::Tensor& t, int root) override { return inner_->broadcast(t, root); }
  FuturePtr allgather_into_tensor(const at::Tensor& output, const at::Tensor& input) override {
    return inner_->allgather_into_tensor(output, input);
  }
  FuturePtr alltoall(const at::Tensor& output, const at::Tensor& input) override {
    return inner_->alltoall(output, input);
  }
  FuturePtr barrier() override { return inner_->barrier(); }
  FuturePtr two_phase(const std::shared_ptr<TwoPhaseJob>& job, const at::Tensor& value,
                      const std::string& what) override {
    return inner_->two_phase(job, value, what);
  }
  FuturePtr monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) override {
    return inner_->monitored_barrier(timeout, wait_all_ranks);
  }
  at::Tensor allreduce_buffer(int64_t numel, at::ScalarType dtype) override {
    return inner_->allreduce_buffer(numel, dtype);
  }
  at::Tensor host_shared_tensor(int64_t numel, at::ScalarType dtype) override {
    return inner_->host_shared_tensor(numel, dtype);
  }
  std::shared_ptr<GradientArena> gradient_arena(const std::vector<int64_t>& block_bytes) override {
    return inner_->gradient_arena(block_bytes);
  }
  bool sums_in_place(const at::Tensor& buffer) const override { return inner_->sums_in_place(buffer); }
  bool uses_shared_memory() const override { return inner_->uses_shared_memory(); }
  bool hierarchical() const override { return inner_->hierarchical(); }
  void piece_bytes_changed(int64_t bytes) override { inner_->piece_bytes_changed(bytes); }
  detail::BackendCall backend_call() override { return inner_->backend_call(); }
  bool abort(const std::string& reason) override { return inner_->abort(reason); }

 protected:
  std::unique_ptr<Transport> inner_;
};

// The transports (one file each) and the choice between them.
std::unique_ptr<Transport> make_gloo_transport(GroupCore& core, const c10::intrusive_ptr<c10d::Store>& store);
// `store` must live as long as the group: pairs meet through it when first needed.
std::unique_ptr<Transport> make_gloo_pairs_transport(GroupCore& core, const c10::intrusive_ptr<c10d::Store>& store);
std::unique_ptr<Transport> make_nccl_transport(GroupCore& core, const c10::intrusive_ptr<c10d::Store>& store);
std::unique_ptr<Transport> make_two_phase_transport(GroupCore& core, std::unique_ptr<Transport> inner);
std::unique_ptr<Transport> make_checked_transport(GroupCore& core, std::unique_ptr<Transport> inner);
std::unique_ptr<Transport> make_abortable_transport(GroupCore& core, std::unique_ptr<Transport> inner);

class ShmEngine;  // shm_engine.h
std::unique_ptr<Transport> make_shm_transport(GroupCore& core, std::shared_ptr<ShmEngine> engine,
                                              std::unique_ptr<Transport> inner);
std::unique_ptr<Transport> make_hierarchical_transport(GroupCore& core, std::shared_ptr<ShmEngine> engine,
                                                       std::shared_ptr<ProcessGroup> across,
                                                       std::unique_ptr<Transport> inner);

// The network transport for options().backend(): gloo, which meets its peers through
// `setup_store` (its keys are deleted once every rank is connected), or nccl, whose rendezvous is
// lazy (at its first collective) and so reads `group_store` for as long as the group lives, as
// gloo with lazy_connections does.
std::unique_ptr<Transport> create_network_transport(GroupCore& core, const c10::intrusive_ptr<c10d::Store>& setup_store,
                                                    const c10::intrusive_ptr<c10d::Store>& group_store);
// The group's transport: `network` as it is, or wrapped by two-phase, shared memory or
// hierarchical as the topology and options allow (collective over the group: every rank agrees),
// by checked when asked for, and by abortable (outermost) when asked for.
std::unique_ptr<Transport> create_transport(ProcessGroup& group, GroupCore& core, const HostTopology& topology,
                                            const c10::intrusive_ptr<c10d::Store>& store,
                                            std::unique_ptr<Transport> network);

// A two-phase job run over a c10d backend's alltoall (Gloo's and NCCL's two_phase), on the
// sequencer; completes `result` with `value`.
void run_two_phase_over_backend(GroupCore& core, Transport& transport, const std::shared_ptr<TwoPhaseJob>& job,
                                const at::Tensor& value, const std::string& what, const FuturePtr& result);
// Piece p of a two-phase buffer (of `pieces` equal consecutive blocks).
at::Tensor two_phase_block(const at::Tensor& t, int64_t pieces, int64_t p);
// The checks every two_phase makes of its job's buffers.
void check_two_phase(const GroupCore& core, const TwoPhaseJob& job, const std::string& what);

}  // namespace ddpkit
