// The trainer's side: one channel per server; AverageGradient through gRPC's callback API, so a
// hook returns at once and its future completes on a gRPC thread.
#include <ddpkit/ps/parameter_server.h>

#include "grpc_common.h"
#include "parameter_server.grpc.pb.h"
#include "wire_tensor.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <set>
#include <sstream>

namespace ddpkit {
namespace ps {
namespace {

const char* code_name(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN_CODE";
  }
}

std::string failure_message(const std::string& address, const std::string& what, const grpc::Status& s) {
  return "ddpkit ps: " + what + " on " + address + " failed: " + code_name(s.error_code()) + ": " + s.error_message();
}

}  // namespace

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
    if (!options.token().empty()) ctx.AddMetadata("authorization", "Bearer " + options.token());
  }
  // A blocking call (`rpc(ctx)` returns its status), bounded by connect_timeout.
  template <typename Rpc>
  void call(const char* what, Rpc&& rpc) const {
    grpc::ClientContext ctx;
    prepare(ctx, options.connect_timeout());
    const grpc::Status s = rpc(ctx);
    if (!s.ok()) throw CommError(failure(what, s));
  }

  // The session: a server stream that never carries a message; its end is the signal.
  class Session final : public grpc::ClientReadReactor<wire::SessionEvent> {
   public:
    void start(wire::ParameterServer::Stub* stub, int trainer) {
      request.set_trainer_id(trainer);
      stub->async()->Session(&ctx, &request, this);
      StartRead(&event);
      StartCall();
    }
    void OnReadDone(bool ok) override {
      if (ok) StartRead(&event);
    }
    void OnDone(const grpc::Status&) override {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      cv.notify_all();
    }
    void stop() {
      ctx.TryCancel();
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return done; });
    }
    grpc::ClientContext ctx;

   private:
    wire::SessionRequest request;
    wire::SessionEvent event;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  std::unique_ptr<Session> session;

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
    std::atomic<int64_t> sent{0}, received{0}, calls{0};
  };
  std::shared_ptr<Counters> counters = std::make_shared<Counters>();

  // Sends one serialized AverageGradient; `done` runs once, on a gRPC thread (or here, with
  // CANCELLED, when the client is closing), after the call is released.
  void send(grpc::ByteBuffer request,
            std::function<void(const grpc::Status&, grpc::ByteBuffer&)> done);
};

ParameterServerClient::ParameterServerClient(ClientOptions options) : impl_(std::make_unique<Impl>()) {
  hold_grpc_runtime();
  impl_->options = std::move(options);
  const auto& o = impl_->options;
  DDPKIT_CHECK(o.address().find(':') != std::string::npos, "parameter server address '", o.address(), "' is not host:port");
  DDPKIT_CHECK(o.timeout().count() > 0, "parameter server client: timeout must be positive");
  DDPKIT_CHECK(o.max_message_bytes() > 0 && o.max_message_bytes() <= (int64_t(1) << 31) - 1,
               "parameter server client: max_message_bytes must be in 1..2^31-1");
  DDPKIT_CHECK(o.chunk_bytes() >= 0, "parameter server client: chunk_bytes must be >= 0, got ", o.chunk_bytes());
  DDPKIT_CHECK(o.chunks_in_flight() >= 1, "parameter server client: chunks_in_flight must be >= 1, got ",
               o.chunks_in_flight());
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (!o.tls().root_certificate().empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = read_pem_file(o.tls().root_certificate(), "root certificate");
    creds = grpc::SslCredentials(ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(o.max_message_bytes()));
  args.SetMaxSendMessageSize(static_cast<int>(o.max_message_bytes()));
  // One channel per client: trainers sharing a process must not share a TCP connection.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  apply_bulk_transport_args([&](const char* name, int value) { args.SetInt(name, value); });
  impl_->channel = grpc::CreateCustomChannel(o.address(), creds, args);
  if (!impl_->channel->WaitForConnected(std::chrono::system_clock::now() + o.connect_timeout()))
    throw CommError("ddpkit ps: could not connect to the parameter server at " + o.address() + " within " +
                    std::to_string(o.connect_timeout().count()) + " ms");
  impl_->stub = wire::ParameterServer::NewStub(impl_->channel);
  impl_->generic = std::make_unique<grpc::GenericStub>(impl_->channel);
  if (o.open_session()) {
    impl_->session = std::make_unique<Impl::Session>();
    if (!o.token().empty()) impl_->session->ctx.AddMetadata("authorization", "Bearer " + o.token());
    impl_->session->start(impl_->stub.get(), o.trainer_id());
  }
}

ParameterServerClient::~ParameterServerClient() {
  impl_->flight->cancel_and_wait();
  if (impl_->session) impl_->session->stop();
}

ParameterServerClient::Traffic ParameterServerClient::traffic() const {
  Traffic t;
  t.bytes_sent = impl_->counters->sent;
  t.bytes_received = impl_->counters->received;
  t.calls = impl_->counters->calls;
  return t;
}

int ParameterServerClient::trainer_id() const { return impl_->options.trainer_id(); }
const std::string& ParameterServerClient::address() const { return impl_->options.address(); }

namespace {

// One AverageGradient of a dense bucket cut into chunks: chunk i is elements [i*per, ...) of the
// flat gradient, its average lands in the same elements of `out`. Up to `window` calls in flight;
// each completion starts the next chunk. The first failure fails the whole and starts no more.
struct ChunkedAverage {
  at::Tensor flat, out, value;
  int64_t per = 0, count = 0;
  std::mutex mu;
  int64_t next = 0, remaining = 0;
  bool failed = false;
  FuturePtr result;
};

}  // namespace

void ParameterServerClient::Impl::send(grpc::ByteBuffer request,
                                       std::function<void(const grpc::Status&, grpc::ByteBuffer&)> done) {
  auto* call = new Call;
  prepare(call->ctx, options.timeout());
  call->request = std::move(request);
  counters->sent += static_cast<int64_t>(call->request.Length());
  if (!flight->begin(call)) {
    delete call;
    grpc::ByteBuffer none;
    done(grpc::Status(grpc::StatusCode::CANCELLED, "the client is closing"), none);
    return;
  }
  generic->UnaryCall(&call->ctx, "/ddpkit.ps.wire.ParameterServer/AverageGradient", grpc::StubOptions(),
                     &call->request, &call->reply,
                     [call, flight = flight, counters = counters, done = std::move(done)](grpc::Status status) {
                       if (status.ok()) {
                         counters->received += static_cast<int64_t>(call->reply.Length());
                         counters->calls++;
                       }
                       grpc::ByteBuffer reply = std::move(call->reply);
                       // Release the call (its ClientContext holds a channel reference) before
                       // anyone waiting on a future can destroy the client: the last channel
                       // reference must not drop on this gRPC callback thread (grpc/grpc#32584).
                       flight->end(call);
                       delete call;
                       done(status, reply);
                       flight->done();
                     });
}

FuturePtr ParameterServerClient::average(int64_t batch_number, int64_t bucket_index, const at::Tensor& gradient,
                                         at::Tensor into) {
  DDPKIT_CHECK(gradient.defined(), "parameter server client: gradient is undefined");
  DDPKIT_CHECK(!into.defined() || (!gradient.is_sparse() && into.numel() == gradient.numel() &&
                                   into.scalar_type() == gradient.scalar_type()),
               "parameter server client: `into` must be dense with the gradient's numel and dtype");
  const c10::Device device = gradient.device();
  FuturePtr result = make_tensor_future(device);
  const std::string what = "AverageGradient(batch " + std::to_string(batch_number) + ", bucket " +
                           std::to_string(bucket_index) + ")";
  const std::string address = impl_->options.address();
  const int trainer = impl_->options.trainer_id();
  const int64_t bytes = gradient.is_sparse() ? 0 : gradient.numel() * static_cast<int64_t>(gradient.element_size());
  const int64_t chunk_bytes = impl_->options.chunk_bytes();

  if (chunk_bytes > 0 && bytes > chunk_bytes) {
    auto st = std::make_shared<ChunkedAverage>();
    st->flat = gradient.contiguous().view({-1});
    if (into.defined() && into.is_contiguous() && into.device().is_cpu()) {
      st->out = into.view({-1});
      st->value = into;
    } else {
      st->out = at::empty({gradient.numel()}, gradient.options().device(c10::kCPU));
      st->value = into.defined() ? into : gradient;  // replaced below by a copy of out
    }
    st->per = std::max<int64_t>(1, chunk_bytes / static_cast<int64_t>(gradient.element_size()));
    st->count = (gradient.numel() + st->per - 1) / st->per;
    st->remaining = st->count;
    st->result = result;
    const bool copy_out = st->out.data_ptr() != (into.defined() ? into.data_ptr() : nullptr);
    const std::vector<int64_t> shape = gradient.sizes().vec();
    Impl* impl = impl_.get();
    // Starts chunks while fewer than the window are in flight. Called with st->mu not held.
    auto pump = std::make_shared<std::function<void()>>();
    *pump = [st, impl, trainer, batch_number, bucket_index, what, address, copy_out, into, shape, device,
             weak = std::weak_ptr<std::function<void()>>(pump)]() {
      for (;;) {
        int64_t i;
        {
          std::lock_guard<std::mutex> lock(st->mu);
          if (st->failed || st->next >= st->count) return;
          i = st->next++;
        }
        const int64_t off = i * st->per, len = std::min(st->per, st->flat.numel() - off);
        const std::string chunk_what = what + " chunk " + std::to_string(i) + " of " + std::to_string(st->count);
        auto self = weak.lock();
        impl->send(serialize_gradient_request(trainer, batch_number, bucket_index, st->flat.narrow(0, off, len),
                                              ChunkOf{i, st->count, st->flat.numel()}),
                   [st, off, len, chunk_what, address, copy_out, into, shape, device, self](const grpc::Status& status,
                                                                                           grpc::ByteBuffer& reply) {
                     std::string error = status.ok() ? "" : failure_message(address, chunk_what, status);
                     at::Tensor part = st->out.narrow(0, off, len);
                     if (status.ok() && !parse_dense_reply_into(reply, part, &error))
                       error = "ddpkit ps: " + chunk_what + " on " + address + ": malformed reply: " + error;
                     bool last = false;
                     {
                       std::lock_guard<std::mutex> lock(st->mu);
                       if (st->failed) return;
                       if (!error.empty()) {
                         st->failed = true;
                       } else {
                         last = --st->remaining == 0;
                       }
                     }
                     if (!error.empty()) {
                       st->result->setError(std::make_exception_ptr(CommError(error)));
                       return;
                     }
                     if (last) {
                       at::Tensor value = st->value;
                       if (copy_out) {
                         at::Tensor avg = st->out.view(shape);
                         if (into.defined()) {
                           into.copy_(avg);
                         } else {
                           value = device.is_cpu() ? avg : avg.to(device);
                         }
                       }
                       st->result->markCompleted(c10::IValue(value));
                       return;
                     }
                     (*self)();
                   });
        {
          std::lock_guard<std::mutex> lock(st->mu);
          if (st->next - (st->count - st->remaining) >= impl->options.chunks_in_flight()) return;
        }
      }
    };
    // The pump lives while a chunk is pending: each chunk's callback holds it (and it holds
    // only a weak reference to itself, so nothing cycles).
    (*pump)();
    return result;
  }

  const bool sparse = gradient.is_sparse();
  const std::vector<int64_t> shape = gradient.sizes().vec();
  impl_->send(serialize_gradient_request(trainer, batch_number, bucket_index, gradient),
              [result, into, device, what, sparse, shape, address](const grpc::Status& status, grpc::ByteBuffer& raw) {
                std::string error = status.ok() ? "" : failure_message(address, what, status);
                at::Tensor out;
                if (status.ok() && !sparse && into.defined()) {
                  at::Tensor target = into;
                  if (parse_dense_reply_into(raw, target, &error)) out = into;
                } else if (status.ok()) {
                  wire::GradientReply reply;
                  if (!grpc::SerializationTraits<wire::GradientReply>::Deserialize(&raw, &reply).ok()) {
                    error = "unparsable GradientReply";
                  } else {
                    out = decode_tensor(reply.average(), &error);
                    if (out.defined() && out.sizes().vec() != shape) {
                      error = "reply " + describe(reply.average()) + " has another shape than the gradient";
                      out = at::Tensor();
                    }
                  }
                  if (out.defined() && out.device() != device) out = out.to(device);
                }
                if (status.ok() && !out.defined())
                  error = "ddpkit ps: " + what + " on " + address + ": malformed reply: " + error;
                if (out.defined())
                  result->markCompleted(c10::IValue(out));
                else
                  result->setError(std::make_exception_ptr(CommError(error)));
              });
  return result;
}

void ParameterServerClient::reset_state() {
  wire::ResetReply reply;
  impl_->call("ResetState", [&](grpc::ClientContext& ctx) { return impl_->stub->ResetState(&ctx, {}, &reply); });
}

ParameterServerClient::ServerMetrics ParameterServerClient::get_metrics() {
  wire::MetricsReply reply;
  impl_->call("GetMetrics", [&](grpc::ClientContext& ctx) { return impl_->stub->GetMetrics(&ctx, {}, &reply); });
  ServerMetrics out;
  out.server_rank = reply.server_rank();
  for (const auto& m : reply.metrics()) out.series[m.name()] = std::vector<double>(m.elapsed_ms().begin(), m.elapsed_ms().end());
  for (const auto& e : reply.events()) out.events.push_back({e.type(), e.key(), e.name(), e.start_us(), e.duration_us()});
  out.counters.buckets_averaged = reply.buckets_averaged();
  out.counters.gradients_received = reply.gradients_received();
  out.counters.bytes_received = reply.bytes_received();
  out.counters.bytes_sent = reply.bytes_sent();
  out.counters.seconds_since_reset = reply.seconds_since_reset();
  out.counters.peak_bytes_held = reply.peak_bytes_held();
  return out;
}

}  // namespace ps
}  // namespace ddpkit
