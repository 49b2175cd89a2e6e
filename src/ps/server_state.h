// What the parameter server's translation units share (server.cpp: the service and averaging;
// server_sessions.cpp: trainer sessions, shared-memory regions and the reaper): the server's
// state and its two kinds of call. Not installed.
#pragma once

#include <ddpkit/ps/parameter_server.h>

#include "doorbell.h"
#include "parameter_server.grpc.pb.h"
#include "shared_region.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace ddpkit {
namespace ps {

using Clock = std::chrono::steady_clock;

// "1, 2, 5": trainer ids in messages.
std::string join_ids(const std::vector<int>& ids);

class AverageCall;
class DoorbellCall;
class SessionCall;

// The calls waiting in one trainer's mailboxes, by mailbox: a raised cancel flag finds its call here.
struct DoorbellCalls {
  std::mutex mu;
  std::map<int, DoorbellCall*> pending;
};

struct ParameterServer::Impl {
  explicit Impl(ServerOptions o) : options(std::move(o)), log(options.rank()) {
    log.keep_events(options.trace_events());
    serving = std::set<int>(options.trainer_ids().begin(), options.trainer_ids().end());
  }

  // (bucket index, chunk index): a chunked bucket's chunks are averaged independently, so the
  // server holds chunks in flight, never a whole large bucket.
  using BucketKey = std::pair<int64_t, int64_t>;
  struct Bucket {
    int64_t chunk_count = 0, bucket_numel = 0;  // 0: sent whole
    std::map<int, AverageCall*> waiting;  // trainer -> call not yet answered
    std::set<int> sent;
    wire::Tensor signature;  // dtype, shape, layout of the first gradient (no data)
    at::Tensor first_gradient, sum;  // kAverage: the first gradient, then the sum of all so far
    std::map<int, at::Tensor> parts;  // kAverageBatch
    Clock::time_point first;
    int64_t held_bytes = 0;  // gradient data kept for it: waiting requests, sum or parts
  };

  grpc::Status check_token(grpc::CallbackServerContext* ctx) const;
  grpc::ServerUnaryReactor* average_gradient(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw,
                                             grpc::ByteBuffer* response);
  // Everything an AverageGradient does once its caller is known to be allowed (a gRPC call
  // with the token, or a call in the mailbox of a session that had it): parse, check, sum, and
  // finish `call` now or when its bucket is complete.
  void serve(AverageCall* call, const grpc::ByteBuffer& raw);
  // A request posted in mailbox `mailbox` of the region `region` (doorbell.h).
  void serve_posted(const std::shared_ptr<SharedRegion>& region, const std::shared_ptr<DoorbellCalls>& calls,
                    int mailbox, const grpc::ByteBuffer& request);
  void cancel_posted(const std::shared_ptr<DoorbellCalls>& calls, int mailbox);
  // Points the call at the shared-memory place its request names, after checking it lies in
  // that trainer's attached region and within max_message_bytes; `who` starts the messages.
  grpc::Status borrow_shared_memory(AverageCall* call, const std::string& who);
  void on_cancel(AverageCall* call);
  void on_session_lost(int trainer);
  // Maps the session's shared-memory offer (if any) and registers the session; returns the event
  // that tells the trainer whether its offer was taken.
  wire::SessionEvent on_session_opened(const wire::SessionRequest& request, SessionCall* call);
  void on_session_done(SessionCall* call, uint64_t region);
  // Fails every waiting call of the current batch; later gradients of this batch get the same
  // status. Caller holds mu; the calls to finish are appended to *finish.
  void fail_batch_locked(const grpc::Status& status, std::vector<std::pair<AverageCall*, grpc::Status>>* finish);
  void reaper_loop();
  void reset();
  std::string key(int64_t batch, const BucketKey& k, int64_t chunk_count) const {
    return std::to_string(batch) + "," + std::to_string(k.first) +
           (chunk_count > 1 ? "," + std::to_string(k.second) : std::string());
  }
  static std::string name(const BucketKey& k, int64_t chunk_count) {
    return "bucket " + std::to_string(k.first) +
           (chunk_count > 1 ? " (chunk " + std::to_string(k.second) + " of " + std::to_string(chunk_count) + ")" : "");
  }

  ServerOptions options;
  std::set<int> serving;
  std::unique_ptr<grpc::Service> service;
  std::unique_ptr<grpc::Server> server;
  int bound_port = 0;
  std::string host;

  mutable std::mutex mu;
  int64_t batch = 0;
  std::map<BucketKey, Bucket> buckets;
  std::map<int64_t, int64_t> chunks_averaged;  // of `batch`, per chunked bucket
  grpc::Status batch_failure = grpc::Status::OK;  // of `batch`
  std::map<int, Clock::time_point> disconnected;  // trainer -> when its last session ended
  bool gone(int trainer, Clock::time_point now) const {
    auto it = disconnected.find(trainer);
    return it != disconnected.end() && now - it->second >= options.reconnect_grace();
  }
  // Open sessions, finished by shutdown. Recursive: Finish may run OnDone on the calling thread.
  std::recursive_mutex sessions_mu;
  std::set<SessionCall*> sessions;
  // Trainers' shared-memory regions by id, each mapped while its session is open (a call in
  // flight holds its own reference).
  struct Region {
    int trainer;
    std::shared_ptr<SharedRegion> memory;
    std::shared_ptr<DoorbellListener> listener;  // while the session is open, if it has mailboxes
  };
  // Stops every session's listener (shutdown, once gRPC has stopped).
  void stop_listeners();
  std::mutex regions_mu;
  std::map<uint64_t, Region> regions;
  metrics::MetricsLogger log;
  Counters counters;
  int64_t held_bytes = 0;  // over all buckets; counters.peak_bytes_held is its maximum
  void hold(Bucket& bucket, int64_t bytes) {
    bucket.held_bytes += bytes;
    held_bytes += bytes;
    counters.peak_bytes_held = std::max(counters.peak_bytes_held, held_bytes);
  }
  void release(Bucket& bucket) {
    held_bytes -= bucket.held_bytes;
    bucket.held_bytes = 0;
  }
  Clock::time_point reset_at = Clock::now();

  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopping = false;
  std::atomic<bool> shutting_down{false};  // new calls are refused
  bool stopped = false;
  std::thread reaper;
};

// One AverageGradient, from gRPC or from a mailbox. The request is parsed here, and the one
// reply is serialized once into a slice that every waiting trainer's response shares.
class AverageCall {
 public:
  explicit AverageCall(ParameterServer::Impl* impl) : impl_(impl) {}
  virtual ~AverageCall() = default;
  // Answers the trainer (with *response when OK). The call may be gone when this returns.
  virtual void finish(const grpc::Status& status) = 0;

  ParameterServer::Impl* impl_;
  grpc::ByteBuffer* response = nullptr;
  wire::GradientRequest request;  // the gradient's bytes stay here until the call is finished
  // The request's shared-memory place: the gradient is read from it and the average written to it.
  std::shared_ptr<SharedRegion> region;
  uint8_t* shared_data = nullptr;
  int64_t shared_bytes = 0;     // the gradient's data there
  int64_t shared_capacity = 0;  // room there for the average's data (>= shared_bytes)
  int trainer = -1;
  int64_t batch = 0, bucket = 0, chunk = 0, chunk_count = 0;
  bool waiting = true;  // guarded by impl_->mu
};

// AverageGradient is a raw (ByteBuffer) method of the callback API.
class GrpcAverageCall final : public AverageCall, public grpc::ServerUnaryReactor {
 public:
  GrpcAverageCall(ParameterServer::Impl* impl, grpc::ByteBuffer* reply) : AverageCall(impl) { response = reply; }
  void finish(const grpc::Status& status) override { Finish(status); }
  void OnCancel() override { impl_->on_cancel(this); }
  void OnDone() override { delete this; }
};

// A call posted in a trainer's mailbox; answered there. Counted: a raised cancel flag may hold it
// while it is finished on another thread.
class DoorbellCall final : public AverageCall {
 public:
  DoorbellCall(ParameterServer::Impl* impl, std::shared_ptr<SharedRegion> mailboxes, std::shared_ptr<DoorbellCalls> calls,
               int mailbox)
      : AverageCall(impl), mailboxes_(std::move(mailboxes)), calls_(std::move(calls)), mailbox_(mailbox) {
    response = &reply_;
  }
  void finish(const grpc::Status& status) override {
    {
      std::lock_guard<std::mutex> lock(calls_->mu);
      calls_->pending.erase(mailbox_);
    }
    DoorbellListener::answer(*mailboxes_, mailbox_, status, &reply_);
    unref();
  }
  void ref() { refs_.fetch_add(1); }
  void unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

 private:
  std::shared_ptr<SharedRegion> mailboxes_;
  std::shared_ptr<DoorbellCalls> calls_;
  int mailbox_;
  grpc::ByteBuffer reply_;
  std::atomic<int> refs_{1};
};

// The session: writes one event (the shared-memory answer), then nothing; ends when the trainer
// goes away or the server stops.
class SessionCall final : public grpc::ServerWriteReactor<wire::SessionEvent> {
 public:
  SessionCall(ParameterServer::Impl* impl, int trainer) : impl_(impl), trainer_(trainer) {}
  void OnCancel() override;
  void OnDone() override;
  void finish_once(const grpc::Status& status) {
    if (!finished_.exchange(true)) Finish(status);
  }
  void announce(wire::SessionEvent event, uint64_t region) {
    event_ = std::move(event);
    region_ = region;
    StartWrite(&event_);
  }

 private:
  ParameterServer::Impl* impl_;
  int trainer_;
  std::atomic<bool> finished_{false};
  wire::SessionEvent event_;
  uint64_t region_ = 0;  // registered in impl_->regions while this session lives; 0: none
};

}  // namespace ps
}  // namespace ddpkit
