// The trainer's client state (internal): its channel and stubs, its session with the server,
// its shared-memory region, and the calls in flight. client.cpp sets it up and runs the blocking
// calls; client_average.cpp sends gradients through it.
#pragma once

#include <ddpkit/ps/parameter_server.h>

#include "doorbell.h"
#include "grpc_common.h"
#include "parameter_server.grpc.pb.h"
#include "shared_region.h"
#include "wire_tensor.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <set>
#include <string>

namespace ddpkit {
namespace ps {

// "ddpkit ps: <what> on <address> failed: <CODE>: <message>".
std::string failure_message(const std::string& address, const std::string& what, const grpc::Status& s);


struct ParameterServerClient::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<wire::ParameterServer::Stub> stub;
  // AverageGradient goes through the generic stub: its request is serialized straight from the
  // tensor and its reply parsed straight into the bucket (wire_tensor.h).
  std::unique_ptr<grpc::GenericStub> generic;

  std::string failure(const std::string& what, const grpc::Status& s) const {
    return failure_message(options.address(), what, s);
  }
  void prepare(grpc::ClientContext& ctx, std::chrono::milliseconds timeout) const {
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    add_token(ctx, options.token());
  }
  // A blocking call (`rpc(ctx)` returns its status), bounded by connect_timeout.
  template <typename Rpc>
  void call(const char* what, Rpc&& rpc) const {
    grpc::ClientContext ctx;
    prepare(ctx, options.connect_timeout());
    const grpc::Status s = rpc(ctx);
    if (!s.ok()) throw CommError(failure(what, s));
  }

  // The session: a server stream whose one event answers the shared-memory offer; its end is
  // the signal that this trainer is gone.
  class Session final : public grpc::ClientReadReactor<wire::SessionEvent> {
   public:
    void start(wire::ParameterServer::Stub* stub, wire::SessionRequest r) {
      request = std::move(r);
      stub->async()->Session(&ctx, &request, this);
      StartRead(&event);
      StartCall();
    }
    void OnReadDone(bool ok) override {
      if (!ok) return;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!answered) first = event;
        answered = true;
        cv.notify_all();
      }
      StartRead(&event);
    }
    void OnDone(const grpc::Status&) override {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      cv.notify_all();
    }
    // The server's first event, or false when the session ended or `timeout` passed first.
    bool answer(std::chrono::milliseconds timeout, wire::SessionEvent* out) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, timeout, [&] { return answered || done; });
      if (answered) *out = first;
      return answered;
    }
    bool ended() {
      std::lock_guard<std::mutex> lock(mu);
      return done;
    }
    void stop() {
      ctx.TryCancel();
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return done; });
    }
    grpc::ClientContext ctx;

   private:
    wire::SessionRequest request;
    wire::SessionEvent event, first;
    std::mutex mu;
    std::condition_variable cv;
    bool answered = false, done = false;
  };
  std::unique_ptr<Session> session;
  // Set while the server has mapped it (ClientOptions::shared_memory).
  std::unique_ptr<SharedRegion> region;
  std::string shared_memory_refused;
  // Set while the server answers calls posted in the region's mailboxes (doorbell.h).
  std::unique_ptr<DoorbellClient> doorbell;

  struct Call {
    grpc::ClientContext ctx;
    grpc::ByteBuffer request, reply;
  };
  // Calls in flight: the destructor cancels them and waits until their callbacks are done, so
  // the channel outlives every callback.
  struct InFlight {
    std::mutex mu;
    std::condition_variable cv;
    std::set<Call*> calls;
    int callbacks = 0;
    bool closing = false;
    // False once the client is closing: a chunk's callback must not start another call then.
    bool begin(Call* c) {
      std::lock_guard<std::mutex> lock(mu);
      if (closing) return false;
      calls.insert(c);
      ++callbacks;
      return true;
    }
    void end(Call* c) {
      std::lock_guard<std::mutex> lock(mu);
      calls.erase(c);
    }
    void done() {
      std::lock_guard<std::mutex> lock(mu);
      --callbacks;
      cv.notify_all();
    }
    void cancel_and_wait() {
      std::unique_lock<std::mutex> lock(mu);
      closing = true;
      for (Call* c : calls) c->ctx.TryCancel();
      cv.wait(lock, [&] { return callbacks == 0; });
    }
  };
  std::shared_ptr<InFlight> flight = std::make_shared<InFlight>();
  struct Counters {
    std::atomic<int64_t> sent{0}, received{0}, shm_sent{0}, shm_received{0}, calls{0}, doorbell_calls{0};
  };
  std::shared_ptr<Counters> counters = std::make_shared<Counters>();

  // Sends one serialized AverageGradient; `done` runs once, on a gRPC thread (or here, with
  // CANCELLED, when the client is closing), after the call is released.
  void send(grpc::ByteBuffer request,
            std::function<void(const grpc::Status&, grpc::ByteBuffer&)> done);
  // One call for one piece of a gradient (dense, or sparse coalesced CPU). Its data (`data`: the
  // dense piece or the sparse values) goes through a free shared-memory slot when the reply's
  // data can need at most `room` bytes and a slot holds that; otherwise in the message, with a
  // sparse piece's indices. A call with a slot is posted in the slot's mailbox instead of sent by
  // gRPC when the request and the largest reply it can get fit one. `read(reply, slot or nullptr, room, &error)` takes the answer and
  // returns the bytes it read from the slot, or -1 with *error. `done` runs once, with "" or the
  // error.
  using ReadReply = std::function<int64_t(grpc::ByteBuffer&, uint8_t*, int64_t, std::string*)>;
  void send_piece(int64_t batch, int64_t bucket, const at::Tensor& piece, const at::Tensor& data, int64_t room,
                  ChunkOf chunk, const std::string& what, ReadReply read, std::function<void(const std::string&)> done);
  // A dense piece, its average written into `out` (same numel and dtype).
  void average_dense(int64_t batch, int64_t bucket, const at::Tensor& part, at::Tensor out, ChunkOf chunk,
                     const std::string& what, std::function<void(const std::string&)> done);
  // A sparse piece (coalesced, CPU); `dense_bytes`, its size were it dense, bounds the average's
  // values. `done` runs once, with "" and the average, or the error.
  void average_sparse(int64_t batch, int64_t bucket, const at::Tensor& piece, ChunkOf chunk, int64_t dense_bytes,
                      const std::string& what, std::function<void(const std::string&, at::Tensor)> done);
  // Offers a shared-memory region when the session opens; keeps it if the server maps it.
  void offer_shared_memory(wire::SessionRequest* request);
  void settle_shared_memory();
};

}  // namespace ps
}  // namespace ddpkit
