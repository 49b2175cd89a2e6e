// The trainer's side: one channel per server; AverageGradient through gRPC's callback API, so a
// hook returns at once and its future completes on a gRPC thread.
#include <ddpkit/ps/parameter_server.h>

#include "grpc_common.h"
#include "parameter_server.grpc.pb.h"
#include "shared_region.h"
#include "wire_tensor.h"
#include "../comm/shm_switch.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <iostream>
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

// dst <- src, same numel and dtype: a plain memcpy where both are contiguous CPU memory (every
// chunk), ATen's copy otherwise. These copies into and out of slots are most of a trainer's work
// on the shared-memory path.
void copy_elements(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.is_contiguous() && src.is_contiguous() && dst.device().is_cpu() && src.device().is_cpu()) {
    if (dst.numel()) std::memcpy(dst.data_ptr(), src.data_ptr(), dst.nbytes());
  } else {
    dst.copy_(src.view(dst.sizes()));
  }
}

// Writes a dense reply's average into `into`: from the message, or from `shared` (the request's
// shared-memory place) when the server put it there. Returns the bytes read from `shared`, or -1
// with *error when the reply does not fit.
int64_t read_dense_reply(grpc::ByteBuffer& raw, at::Tensor into, uint8_t* shared, std::string* error) {
  if (!shared) return parse_dense_reply_into(raw, into, error) ? 0 : -1;
  wire::GradientReply reply;  // small: its data, if any, is one chunk
  if (!grpc::SerializationTraits<wire::GradientReply>::Deserialize(&raw, &reply).ok()) {
    *error = "unparsable GradientReply";
    return -1;
  }
  const int64_t bytes = into.numel() * static_cast<int64_t>(into.element_size());
  const at::Tensor avg = reply.in_shared_memory() ? view_dense(reply.average(), shared, bytes, error)
                                                  : decode_tensor(reply.average(), error, /*borrow_dense=*/true);
  if (!avg.defined()) return -1;
  if (avg.is_sparse() || avg.scalar_type() != into.scalar_type() || avg.numel() != into.numel()) {
    *error = "reply " + describe(reply.average()) + " does not fit the gradient";
    return -1;
  }
  copy_elements(into, avg);
  return reply.in_shared_memory() ? bytes : 0;
}

bool loopback(const std::string& address) {
  const std::string host = address.substr(0, address.rfind(':'));
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "[::1]";
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
    std::atomic<int64_t> sent{0}, received{0}, shm_sent{0}, shm_received{0}, calls{0};
  };
  std::shared_ptr<Counters> counters = std::make_shared<Counters>();

  // Sends one serialized AverageGradient; `done` runs once, on a gRPC thread (or here, with
  // CANCELLED, when the client is closing), after the call is released.
  void send(grpc::ByteBuffer request,
            std::function<void(const grpc::Status&, grpc::ByteBuffer&)> done);
  // One call for one piece of a gradient (dense, or sparse coalesced CPU). Its data (`data`: the
  // dense piece or the sparse values) goes through a free shared-memory slot when the reply's
  // data can need at most `room` bytes and a slot holds that; otherwise in the message, with a
  // sparse piece's indices. `read(reply, slot or nullptr, room, &error)` takes the answer and
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

void ParameterServerClient::Impl::offer_shared_memory(wire::SessionRequest* request) {
  if (!options.shared_memory() || options.chunk_bytes() <= 0 || !shared_memory_allowed_by_environment()) return;
  try {
    region = std::make_unique<SharedRegion>((options.chunk_bytes() + 63) / 64 * 64, options.shared_memory_slots());
  } catch (const CommError& e) {
    shared_memory_refused = e.what();
    return;
  }
  region->offer(request->mutable_shared_memory());
}

void ParameterServerClient::Impl::settle_shared_memory() {
  if (!region) return;
  wire::SessionEvent event;
  if (!session->answer(options.connect_timeout(), &event))
    shared_memory_refused = "the session did not answer the offer";
  else if (!event.shared_memory())
    shared_memory_refused = event.shared_memory_refused();
  else
    return;
  region.reset();
  // On one host the offer should be taken: say why not, once, rather than run slower unnoticed.
  if (loopback(options.address()))
    std::cerr << "ddpkit ps: trainer " << options.trainer_id() << ": the server at " << options.address()
              << " did not take shared memory (" << shared_memory_refused << "); gradients go in gRPC messages\n";
}

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
  DDPKIT_CHECK(o.shared_memory_slots() >= 1, "parameter server client: shared_memory_slots must be >= 1, got ",
               o.shared_memory_slots());
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
    wire::SessionRequest request;
    request.set_trainer_id(o.trainer_id());
    impl_->offer_shared_memory(&request);
    impl_->session->start(impl_->stub.get(), std::move(request));
    impl_->settle_shared_memory();
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
  t.shm_bytes_sent = impl_->counters->shm_sent;
  t.shm_bytes_received = impl_->counters->shm_received;
  t.calls = impl_->counters->calls;
  return t;
}

int ParameterServerClient::trainer_id() const { return impl_->options.trainer_id(); }
bool ParameterServerClient::uses_shared_memory() const { return impl_->region != nullptr; }
const std::string& ParameterServerClient::shared_memory_refused() const { return impl_->shared_memory_refused; }
const std::string& ParameterServerClient::address() const { return impl_->options.address(); }

namespace {

using PieceDone = std::function<void(const std::string&)>;

// Runs pieces 0..count-1 of one gradient, at most `window` at once: start(i, done) sends piece i
// and calls done("" or the error) once; each completion starts the next piece. When all are done,
// finish(""); at the first failure, finish(error) and no more pieces start.
void run_pieces(int64_t count, int window, std::function<void(int64_t, PieceDone)> start, PieceDone finish) {
  struct State {
    std::mutex mu;
    int64_t next = 0, remaining = 0;
    bool failed = false;
  };
  auto st = std::make_shared<State>();
  st->remaining = count;
  // The pump lives while a piece is pending: each piece's callback holds it (and it holds only a
  // weak reference to itself, so nothing cycles).
  auto pump = std::make_shared<std::function<void()>>();
  *pump = [st, count, window, start = std::move(start), finish = std::move(finish),
           weak = std::weak_ptr<std::function<void()>>(pump)]() {
    for (;;) {
      int64_t i;
      {
        std::lock_guard<std::mutex> lock(st->mu);
        if (st->failed || st->next >= count) return;
        i = st->next++;
      }
      start(i, [st, finish, self = weak.lock()](const std::string& error) {
        bool last = false;
        {
          std::lock_guard<std::mutex> lock(st->mu);
          if (st->failed) return;
          st->failed = !error.empty();
          last = !st->failed && --st->remaining == 0;
        }
        if (!error.empty() || last)
          finish(error);
        else
          (*self)();
      });
      std::lock_guard<std::mutex> lock(st->mu);
      if (st->next - (count - st->remaining) >= window) return;
    }
  };
  (*pump)();
}

// A sparse reply's average into *out, its values from `shared` (at most `room` bytes) when the
// server put them there; checked to have the gradient's shape and dtype. Returns the bytes read
// from `shared`, or -1 with *error.
int64_t read_sparse_reply(grpc::ByteBuffer& raw, const at::Tensor& gradient, const uint8_t* shared, int64_t room,
                          at::Tensor* out, std::string* error) {
  wire::GradientReply reply;
  if (!grpc::SerializationTraits<wire::GradientReply>::Deserialize(&raw, &reply).ok()) {
    *error = "unparsable GradientReply";
    return -1;
  }
  const bool in_shared = shared && reply.in_shared_memory();
  *out = in_shared ? decode_sparse_at(reply.average(), shared, room, error) : decode_tensor(reply.average(), error);
  if (!out->defined()) return -1;
  if (!out->is_sparse() || out->sizes() != gradient.sizes() || out->scalar_type() != gradient.scalar_type()) {
    *error = "reply " + describe(reply.average()) + " does not fit the gradient";
    return -1;
  }
  return in_shared ? static_cast<int64_t>((*out)._values().nbytes()) : 0;
}

// Entries of `sparse` (coalesced, sparse_dim 1) whose row lies in [lo, hi): a coalesced view.
at::Tensor rows_between(const at::Tensor& sparse, int64_t lo, int64_t hi) {
  const at::Tensor rows = sparse._indices()[0];
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t a = std::lower_bound(r, r + rows.numel(), lo) - r, b = std::lower_bound(r, r + rows.numel(), hi) - r;
  return at::_sparse_coo_tensor_unsafe(sparse._indices().narrow(1, a, b - a), sparse._values().narrow(0, a, b - a),
                                       sparse.sizes())
      ._coalesced_(true);
}

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

void ParameterServerClient::Impl::send_piece(int64_t batch, int64_t bucket, const at::Tensor& piece,
                                             const at::Tensor& data, int64_t room, ChunkOf chunk, const std::string& what,
                                             ReadReply read, std::function<void(const std::string&)> done) {
  const int64_t bytes = data.numel() * static_cast<int64_t>(data.element_size());
  SharedRegion* shared = region.get();
  const int64_t slot = shared && room <= shared->slot_bytes() ? shared->acquire() : -1;
  grpc::ByteBuffer request;
  if (slot >= 0) {
    copy_elements(at::from_blob(shared->at(slot), data.sizes(), at::TensorOptions().dtype(data.scalar_type())), data);
    wire::SharedMemoryRef ref;
    ref.set_region(shared->id());
    ref.set_offset(slot);
    ref.set_bytes(bytes);
    if (room > bytes) ref.set_capacity(room);
    request = serialize_gradient_request(options.trainer_id(), batch, bucket, piece, chunk, &ref);
    counters->shm_sent += bytes;
  } else {
    request = serialize_gradient_request(options.trainer_id(), batch, bucket, piece, chunk);
  }
  send(std::move(request), [shared, slot, room, what, address = options.address(), counters = counters,
                            read = std::move(read), done = std::move(done)](const grpc::Status& status,
                                                                            grpc::ByteBuffer& reply) {
    std::string error = status.ok() ? "" : failure_message(address, what, status);
    if (status.ok()) {
      const int64_t from_slot = read(reply, slot >= 0 ? shared->at(slot) : nullptr, room, &error);
      if (from_slot < 0)
        error = "ddpkit ps: " + what + " on " + address + ": malformed reply: " + error;
      else
        counters->shm_received += from_slot;
    }
    // A slot is reused only after a complete answer: after a failure (a deadline, say) the
    // server may still write into it, so it stays out of use.
    if (slot >= 0 && error.empty()) shared->release(slot);
    done(error);
  });
}

void ParameterServerClient::Impl::average_dense(int64_t batch, int64_t bucket, const at::Tensor& part, at::Tensor out,
                                                ChunkOf chunk, const std::string& what,
                                                std::function<void(const std::string&)> done) {
  const int64_t bytes = part.numel() * static_cast<int64_t>(part.element_size());
  send_piece(batch, bucket, part, part, bytes, chunk, what,
             [out](grpc::ByteBuffer& reply, uint8_t* slot, int64_t, std::string* error) {
               return read_dense_reply(reply, out, slot, error);
             },
             std::move(done));
}

void ParameterServerClient::Impl::average_sparse(int64_t batch, int64_t bucket, const at::Tensor& piece, ChunkOf chunk,
                                                 int64_t dense_bytes, const std::string& what,
                                                 std::function<void(const std::string&, at::Tensor)> done) {
  // The average's values (every trainer's entries, summed) are never more than the piece dense.
  auto average = std::make_shared<at::Tensor>();
  send_piece(batch, bucket, piece, piece._values().contiguous(), dense_bytes, chunk, what,
             [piece, average](grpc::ByteBuffer& reply, uint8_t* slot, int64_t room, std::string* error) {
               return read_sparse_reply(reply, piece, slot, room, average.get(), error);
             },
             [average, done = std::move(done)](const std::string& error) { done(error, *average); });
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
  const int64_t chunk_bytes = impl_->options.chunk_bytes();
  auto fail = [result](const std::string& error) { result->setError(std::make_exception_ptr(CommError(error))); };

  if (gradient.is_sparse()) {
    const at::Tensor sparse = gradient.cpu().coalesce();
    // A sparse_dim-1 gradient (an embedding's) larger than chunk_bytes when dense is cut by rows
    // into ranges whose values fit chunk_bytes; every trainer cuts the same shape alike, whatever
    // rows it has. Each range goes as a piece like a dense chunk, through a slot where one is free.
    const int64_t elem = static_cast<int64_t>(sparse.element_size());
    const int64_t rows = sparse.dim() >= 1 ? sparse.size(0) : 0;
    const int64_t row_bytes = rows > 0 ? sparse.numel() / rows * elem : 0;
    int64_t count = 1;
    if (chunk_bytes > 0 && sparse.sparse_dim() == 1 && row_bytes > 0 && row_bytes <= chunk_bytes &&
        rows * row_bytes > chunk_bytes) {
      const int64_t rows_per_chunk = chunk_bytes / row_bytes;
      count = (rows + rows_per_chunk - 1) / rows_per_chunk;
    }
    auto complete = [result, device](at::Tensor out) {
      result->markCompleted(c10::IValue(out.device() == device ? out : out.to(device)));
    };
    if (count <= 1) {
      impl_->average_sparse(batch_number, bucket_index, sparse, {}, sparse.numel() * elem, what,
                            [complete, fail](const std::string& error, at::Tensor out) {
                              if (error.empty())
                                complete(out);
                              else
                                fail(error);
                            });
      return result;
    }
    const int64_t per = (rows + count - 1) / count;  // <= rows_per_chunk: the server cuts alike
    auto pieces = std::make_shared<std::vector<at::Tensor>>(count);
    Impl* impl = impl_.get();
    run_pieces(
        count, impl_->options.chunks_in_flight(),
        [impl, sparse, pieces, batch_number, bucket_index, what, rows, row_bytes, per, count](int64_t i, PieceDone done) {
          const int64_t lo = i * per, hi = std::min(rows, lo + per);
          impl->average_sparse(batch_number, bucket_index, rows_between(sparse, lo, hi), ChunkOf{i, count, rows},
                               (hi - lo) * row_bytes, what + " chunk " + std::to_string(i) + " of " + std::to_string(count),
                               [pieces, i, done](const std::string& error, at::Tensor out) {
                                 if (error.empty()) (*pieces)[i] = out;
                                 done(error);
                               });
        },
        [pieces, sparse, complete, fail](const std::string& error) {
          if (!error.empty()) return fail(error);
          // Ranges in order: the concatenation is coalesced.
          std::vector<at::Tensor> indices, values;
          for (const at::Tensor& p : *pieces) {
            indices.push_back(p._indices());
            values.push_back(p._values());
          }
          complete(at::_sparse_coo_tensor_unsafe(at::cat(indices, 1), at::cat(values, 0), sparse.sizes())._coalesced_(true));
        });
    return result;
  }

  // Dense: the average lands in `out` (`into` itself where it can), then in the future's value.
  const bool direct = into.defined() && into.is_contiguous() && into.device().is_cpu();
  const at::Tensor out = direct ? into : at::empty(gradient.sizes(), gradient.options().device(c10::kCPU));
  auto complete = [result, out, into, device, direct]() {
    at::Tensor value = out;
    if (!direct && into.defined()) {
      into.copy_(out);
      value = into;
    } else if (!direct && !device.is_cpu()) {
      value = out.to(device);
    }
    result->markCompleted(c10::IValue(value));
  };

  const int64_t bytes = gradient.numel() * static_cast<int64_t>(gradient.element_size());
  if (chunk_bytes <= 0 || bytes <= chunk_bytes) {
    impl_->average_dense(batch_number, bucket_index, gradient, out, {}, what, [complete, fail](const std::string& error) {
      if (error.empty())
        complete();
      else
        fail(error);
    });
    return result;
  }

  const at::Tensor flat = gradient.contiguous().view({-1}), flat_out = out.view({-1});
  const int64_t per = std::max<int64_t>(1, chunk_bytes / static_cast<int64_t>(gradient.element_size()));
  const int64_t count = (gradient.numel() + per - 1) / per;
  Impl* impl = impl_.get();
  // Chunk i is elements [i*per, ...) of the flat gradient; its average lands in the same elements.
  run_pieces(
      count, impl_->options.chunks_in_flight(),
      [impl, flat, flat_out, per, count, batch_number, bucket_index, what](int64_t i, PieceDone done) {
        const int64_t off = i * per, len = std::min(per, flat.numel() - off);
        impl->average_dense(batch_number, bucket_index, flat.narrow(0, off, len), flat_out.narrow(0, off, len),
                            ChunkOf{i, count, flat.numel()},
                            what + " chunk " + std::to_string(i) + " of " + std::to_string(count), std::move(done));
      },
      [complete, fail](const std::string& error) {
        if (error.empty())
          complete();
        else
          fail(error);
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
  out.counters.shm_bytes_received = reply.shm_bytes_received();
  out.counters.shm_bytes_sent = reply.shm_bytes_sent();
  return out;
}

}  // namespace ps
}  // namespace ddpkit
