// The Gloo transport (internal): c10d's ProcessGroupGloo between any ranks. Collectives in
// gloo_transport.cpp; allgather and alltoall as point-to-point messages, and monitored_barrier,
// in gloo_exchange.cpp.
#pragma once

#include "job_thread.h"
#include "local_address.h"
#include "transport.h"

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ddpkit {

// The Gloo device a group's connections use, from the options and the environment (an address or
// interface to listen on).
std::shared_ptr<::gloo::transport::Device> make_gloo_device(const ProcessGroupOptions& o);
// Gloo's writes to a peer that has gone raise SIGPIPE: once per process, a handler that does
// nothing, unless the program set its own, so that the collective fails instead of the process.
void survive_writes_to_dead_peers();
// Held around every call into a c10d Gloo backend, of any group (GlooTransport::backend_call).
std::unique_lock<std::mutex> lock_gloo_calls();

// A point-to-point message in flight: its Gloo work and the peer it goes to or comes from.
struct PeerMessage {
  c10::intrusive_ptr<c10d::Work> work;
  int peer;
  bool receive;
};
// Waits for each message until `deadline`; one that fails or is late throws, naming the peer and
// which way ("rank 2 sent nothing within 30000 ms (gloo: ...)"), `timeout` being the group's.
void wait_for_messages(const std::vector<PeerMessage>& messages, std::chrono::steady_clock::time_point deadline,
                       std::chrono::milliseconds timeout);
// The tag of a group's n-th point-to-point exchange: a range of their own (ProcessGroup::
// kFirstInternalTag up), apart from the small tags programs use for their own send/recv. Every rank
// numbers its exchanges in issue order, so a tag names the same exchange on both ends.
int exchange_tag(uint32_t n);

class GlooTransport final : public Transport {
 public:
  GlooTransport(GroupCore& core, const c10::intrusive_ptr<c10d::Store>& store);
  ~GlooTransport() override;

  std::string name() const override { return "gloo"; }
  FuturePtr allreduce(const at::Tensor& tensor, c10d::ReduceOp op) override;
  FuturePtr broadcast(const at::Tensor& tensor, int root) override;
  FuturePtr allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input) override;
  FuturePtr allgather_into_tensor(const at::Tensor& output, const at::Tensor& input) override;
  FuturePtr alltoall(const at::Tensor& output, const at::Tensor& input) override;
  FuturePtr barrier() override;
  FuturePtr two_phase(const std::shared_ptr<TwoPhaseJob>& job, const at::Tensor& value,
                      const std::string& what) override;
  FuturePtr monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) override;
  // Every call into a Gloo backend, of any group, one at a time (ProcessGroup::with_backend).
  detail::BackendCall backend_call() override;

 private:
  template <typename F>
  auto with_backend(F&& f) {
    detail::BackendCall call = backend_call();
    return f(*call.backend);
  }
  // CPU dense tensors go point to point (gloo_exchange.cpp); others through c10d's collectives.
  bool point_to_point(const at::Tensor& t) const;
  // One allreduce per connection, issued back to back, which Gloo runs concurrently.
  FuturePtr sliced_allreduce(const at::Tensor& tensor, c10d::ReduceOp op, uint64_t bus_bytes);

  // On the sequencer: posts, for every peer r, a send of sends[r] and a receive into recvs[r]
  // (bytes) under a tag of this exchange's own. On the exchange thread: runs `during` (local work
  // while the messages travel), waits for every message within the group's timeout, runs `after`,
  // completes `result` with `value`.
  void exchange(const std::vector<at::Tensor>& sends, const std::vector<at::Tensor>& recvs, const std::string& what,
                const at::Tensor& value, const FuturePtr& result, std::function<void()> during,
                std::function<void()> after);
  // outputs[r] receives rank r's input; completes `result` with `value`.
  void exchange_allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input, const at::Tensor& value,
                          const FuturePtr& result);
  void exchange_alltoall(const at::Tensor& output, const at::Tensor& input, const FuturePtr& result);
  void run_monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks);  // on the sequencer

  c10::intrusive_ptr<compat::Backend> backend_;
  std::unique_ptr<JobThread> exchange_waiter_;  // waits for point-to-point exchanges
  uint32_t exchange_count_ = 0;                  // exchanges issued, on the sequencer
};

}  // namespace ddpkit
