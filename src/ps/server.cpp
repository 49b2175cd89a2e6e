// The parameter server: gRPC callback service (no thread per waiting call), per-(batch, bucket)
// state under one mutex, replies finished outside it.
#include <ddpkit/codecs/sparse.h>
#include <ddpkit/ps/parameter_server.h>

#include "grpc_common.h"
#include "server_state.h"
#include "shared_region.h"
#include "wire_tensor.h"

#include <grpcpp/security/server_credentials.h>

#include <algorithm>
#include <sstream>

namespace ddpkit {
namespace ps {

ServerKind server_kind_from_name(const std::string& name) {
  if (name == "average" || name == "AverageParameterServer") return ServerKind::kAverage;
  if (name == "average_batch" || name == "AverageBatchParameterServer") return ServerKind::kAverageBatch;
  DDPKIT_CHECK(false, "unknown parameter server class '", name, "' (known: average, average_batch)");
  return ServerKind::kAverage;
}

const char* server_kind_name(ServerKind kind) {
  return kind == ServerKind::kAverage ? "average" : "average_batch";
}

int server_for_trainer(int trainer, int ntrainer, int nserver) {
  DDPKIT_CHECK(nserver > 0 && ntrainer > 0 && ntrainer % nserver == 0, "trainer count ", ntrainer,
               " must be a positive multiple of the server count ", nserver);
  DDPKIT_CHECK(trainer >= 0 && trainer < ntrainer, "trainer ", trainer, " is outside 0..", ntrainer - 1);
  return trainer / (ntrainer / nserver);
}

std::vector<int> trainers_of_server(int server, int ntrainer, int nserver) {
  DDPKIT_CHECK(nserver > 0 && ntrainer > 0 && ntrainer % nserver == 0, "trainer count ", ntrainer,
               " must be a positive multiple of the server count ", nserver);
  DDPKIT_CHECK(server >= 0 && server < nserver, "server ", server, " is outside 0..", nserver - 1);
  const int per = ntrainer / nserver;
  std::vector<int> out;
  for (int t = server * per; t < (server + 1) * per; ++t) out.push_back(t);
  return out;
}

std::string join_ids(const std::vector<int>& ids) {
  std::ostringstream os;
  for (size_t i = 0; i < ids.size(); ++i) os << (i ? ", " : "") << ids[i];
  return os.str();
}

namespace {
class Service final
    : public wire::ParameterServer::WithRawCallbackMethod_AverageGradient<wire::ParameterServer::CallbackService> {
 public:
  explicit Service(ParameterServer::Impl* impl, ParameterServer* owner) : impl_(impl), owner_(owner) {}

  grpc::ServerUnaryReactor* AverageGradient(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override {
    return impl_->average_gradient(ctx, request, response);
  }

  grpc::ServerUnaryReactor* ResetState(grpc::CallbackServerContext* ctx, const wire::ResetRequest*,
                                       wire::ResetReply*) override {
    auto* reactor = ctx->DefaultReactor();
    grpc::Status s = impl_->check_token(ctx);
    if (s.ok()) impl_->reset();
    reactor->Finish(s);
    return reactor;
  }

  grpc::ServerUnaryReactor* GetMetrics(grpc::CallbackServerContext* ctx, const wire::MetricsRequest*,
                                       wire::MetricsReply* reply) override {
    auto* reactor = ctx->DefaultReactor();
    grpc::Status s = impl_->check_token(ctx);
    if (s.ok()) {
      reply->set_server_rank(impl_->options.rank());
      for (const auto& [name, values] : owner_->metrics()) {
        auto* m = reply->add_metrics();
        m->set_name(name);
        for (double v : values) m->add_elapsed_ms(v);
      }
      for (const auto& e : owner_->events()) {
        auto* t = reply->add_events();
        t->set_type(e.type);
        t->set_key(e.key);
        t->set_name(e.name);
        t->set_start_us(e.start_us);
        t->set_duration_us(e.duration_us);
      }
      const auto c = owner_->counters();
      reply->set_buckets_averaged(c.buckets_averaged);
      reply->set_gradients_received(c.gradients_received);
      reply->set_bytes_received(c.bytes_received);
      reply->set_bytes_sent(c.bytes_sent);
      reply->set_seconds_since_reset(c.seconds_since_reset);
      reply->set_peak_bytes_held(c.peak_bytes_held);
      reply->set_shm_bytes_received(c.shm_bytes_received);
      reply->set_shm_bytes_sent(c.shm_bytes_sent);
    }
    reactor->Finish(s);
    return reactor;
  }

  grpc::ServerWriteReactor<wire::SessionEvent>* Session(grpc::CallbackServerContext* ctx,
                                                        const wire::SessionRequest* req) override {
    grpc::Status s = impl_->check_token(ctx);
    if (s.ok() && !impl_->serving.count(req->trainer_id()))
      s = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "trainer " + std::to_string(req->trainer_id()) +
                                                               " is not served here (this server serves trainers " +
                                                               join_ids(impl_->options.trainer_ids()) + ")");
    auto* call = new SessionCall(impl_, req->trainer_id());
    if (!s.ok()) {
      call->finish_once(s);
    } else {
      wire::SessionEvent event = impl_->on_session_opened(*req, call);
      const uint64_t region = event.shared_memory() ? req->shared_memory().region() : 0;
      call->announce(std::move(event), region);
    }
    return call;
  }

 private:
  ParameterServer::Impl* impl_;
  ParameterServer* owner_;
};
}  // namespace

grpc::Status ParameterServer::Impl::check_token(grpc::CallbackServerContext* ctx) const {
  const std::string refusal = token_refusal(ctx->client_metadata(), options.token(), "parameter server");
  return refusal.empty() ? grpc::Status::OK : grpc::Status(grpc::StatusCode::UNAUTHENTICATED, refusal);
}

grpc::ServerUnaryReactor* ParameterServer::Impl::average_gradient(grpc::CallbackServerContext* ctx,
                                                                  const grpc::ByteBuffer* raw,
                                                                  grpc::ByteBuffer* response) {
  auto* call = new GrpcAverageCall(this, response);
  const grpc::Status auth = check_token(ctx);
  if (!auth.ok()) {
    call->waiting = false;
    call->finish(auth);
  } else {
    serve(call, *raw);
  }
  return call;
}

void ParameterServer::Impl::serve_posted(const std::shared_ptr<SharedRegion>& region,
                                         const std::shared_ptr<DoorbellCalls>& calls, int mailbox,
                                         const grpc::ByteBuffer& request) {
  auto* call = new DoorbellCall(this, region, calls, mailbox);
  {
    std::lock_guard<std::mutex> lock(calls->mu);
    calls->pending[mailbox] = call;
  }
  serve(call, request);
}

void ParameterServer::Impl::cancel_posted(const std::shared_ptr<DoorbellCalls>& calls, int mailbox) {
  DoorbellCall* call = nullptr;
  {
    std::lock_guard<std::mutex> lock(calls->mu);
    auto it = calls->pending.find(mailbox);
    if (it == calls->pending.end()) return;  // already answered
    call = it->second;
    call->ref();
  }
  on_cancel(call);
  call->unref();
}

void ParameterServer::Impl::serve(AverageCall* call, const grpc::ByteBuffer& raw) {
  auto reject = [&](grpc::StatusCode code, const std::string& msg) {
    call->waiting = false;
    call->finish(grpc::Status(code, msg));
  };
  if (shutting_down) return reject(grpc::StatusCode::UNAVAILABLE, "the parameter server is shutting down");
  grpc::ByteBuffer shared(raw);  // shares the slices; Deserialize consumes its argument
  if (!grpc::SerializationTraits<wire::GradientRequest>::Deserialize(&shared, &call->request).ok())
    return reject(grpc::StatusCode::INVALID_ARGUMENT, "malformed GradientRequest");
  const wire::GradientRequest* req = &call->request;
  const int trainer = req->trainer_id();
  const int64_t b = req->batch_number(), index = req->bucket_index();
  const int64_t chunk = req->chunk_index(), chunk_count = req->chunk_count();
  const BucketKey bkey(index, chunk);
  call->trainer = trainer;
  call->batch = b;
  call->bucket = index;
  call->chunk = chunk;
  call->chunk_count = chunk_count;
  const std::string where = name(bkey, chunk_count) + " of batch " + std::to_string(b);
  if (!serving.count(trainer))
    return reject(grpc::StatusCode::INVALID_ARGUMENT, "trainer " + std::to_string(trainer) +
                                                          " is not served here (this server serves trainers " +
                                                          join_ids(options.trainer_ids()) + ")");
  if (b < 0 || index < 0) return reject(grpc::StatusCode::INVALID_ARGUMENT, "negative batch number or bucket index (" + where + ")");
  if (chunk_count < 0 || chunk < 0 || (chunk_count <= 1 && chunk != 0) || (chunk_count > 1 && chunk >= chunk_count))
    return reject(grpc::StatusCode::INVALID_ARGUMENT, "chunk index " + std::to_string(chunk) + " is outside a bucket of " +
                                                          std::to_string(chunk_count) + " chunks (" + where + ")");
  const wire::Tensor& g = req->gradient();
  if (chunk_count > 1 && !g.sparse() &&
      (g.shape_size() != 1 || req->bucket_numel() < chunk_count || g.shape(0) > req->bucket_numel()))
    return reject(grpc::StatusCode::INVALID_ARGUMENT,
                  "a dense chunk must be a 1-D part of a bucket of at least as many elements as chunks (" + where +
                      ": " + describe(g) + ", bucket of " + std::to_string(req->bucket_numel()) + " elements)");
  if (chunk_count > 1 && g.sparse() &&
      (g.sparse_dim() != 1 || g.shape_size() < 1 || req->bucket_numel() != g.shape(0) || g.shape(0) < chunk_count))
    return reject(grpc::StatusCode::INVALID_ARGUMENT,
                  "a sparse chunk must have sparse_dim 1 and cut its " + std::to_string(req->bucket_numel()) +
                      " rows (bucket_numel, dimension 0 of its shape) into at most as many chunks (" + where + ": " +
                      describe(g) + ")");

  // Decode outside the lock: it is the expensive part.
  std::string error;
  at::Tensor grad;
  if (req->has_shared_memory()) {
    grpc::Status place = borrow_shared_memory(call, "trainer " + std::to_string(trainer) + ", " + where);
    if (!place.ok()) return reject(place.error_code(), place.error_message());
    if (!g.sparse()) {
      grad = view_dense(g, call->shared_data, call->shared_bytes, &error);
    } else {
      grad = decode_sparse_at(g, call->shared_data, call->shared_bytes, &error);
      if (grad.defined() && grad._values().nbytes() != static_cast<size_t>(call->shared_bytes)) {
        error = describe(g) + " has " + std::to_string(grad._values().nbytes()) + " bytes of values, its place " +
                std::to_string(call->shared_bytes);
        grad = at::Tensor();
      }
    }
  } else {
    // Dense: a view of the request's bytes, alive until this call is finished, which is after the
    // sum has read it (the first gradient of a bucket and average_batch parts are copied below).
    grad = decode_tensor(req->gradient(), &error, /*borrow_dense=*/true);
  }
  if (!grad.defined()) return reject(grpc::StatusCode::INVALID_ARGUMENT, "trainer " + std::to_string(trainer) + ", " + where + ": " + error);
  if (chunk_count > 1 && grad.is_sparse() && grad._nnz() > 0) {
    // Its rows must lie in its range: the average then fits the room every trainer's range has.
    const int64_t per = (req->bucket_numel() + chunk_count - 1) / chunk_count;
    const int64_t lo = chunk * per, hi = std::min(req->bucket_numel(), lo + per);
    const int64_t* rows = grad._indices().data_ptr<int64_t>();  // coalesced: sorted
    if (rows[0] < lo || rows[grad._nnz() - 1] >= hi)
      return reject(grpc::StatusCode::INVALID_ARGUMENT,
                    "trainer " + std::to_string(trainer) + ", " + where + ": rows " + std::to_string(rows[0]) + ".." +
                        std::to_string(rows[grad._nnz() - 1]) + " lie outside the chunk's rows " + std::to_string(lo) +
                        ".." + std::to_string(hi - 1));
  }
  const int64_t in_bytes = payload_bytes(req->gradient());
  // Sums of low-precision gradients are kept in float32.
  if (grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16) {
    try {
      grad = grad.to(at::kFloat);
    } catch (const c10::Error& e) {  // an exception must not escape: gRPC would drop the call unanswered
      return reject(grpc::StatusCode::INVALID_ARGUMENT, "trainer " + std::to_string(trainer) + ", " + where + ": " +
                                                            e.what_without_backtrace());
    }
  }

  std::vector<std::pair<AverageCall*, grpc::Status>> finish;
  std::vector<AverageCall*> answer;
  at::Tensor average;
  wire::Tensor signature;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (chunk == 0) counters.gradients_received++;  // a gradient is a whole bucket from one trainer
    counters.bytes_received += in_bytes;
    counters.shm_bytes_received += call->shared_bytes;
    if (b < batch) {
      call->waiting = false;
      finish.emplace_back(call, grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                             "trainer " + std::to_string(trainer) + " sent " + where +
                                                 ", but the server has moved on to batch " + std::to_string(batch)));
    } else if (b > batch) {
      // A newer batch: whoever still waits on the old one will never be answered.
      if (!buckets.empty())
        fail_batch_locked(grpc::Status(grpc::StatusCode::ABORTED, "batch " + std::to_string(batch) +
                                                                      " was superseded by batch " + std::to_string(b) +
                                                                      " before every trainer had sent"),
                          &finish);
      batch = b;
      buckets.clear();
      chunks_averaged.clear();
      batch_failure = grpc::Status::OK;
    }
    if (!call->waiting) {
      // rejected above
    } else if (!batch_failure.ok()) {
      call->waiting = false;
      finish.emplace_back(call, batch_failure);
    } else {
      Bucket& bucket = buckets[bkey];
      wire::Tensor sig = req->gradient();
      sig.clear_data();
      sig.clear_indices();
      sig.clear_nnz();
      if (bucket.sent.count(trainer)) {
        call->waiting = false;
        finish.emplace_back(call, grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                                               "trainer " + std::to_string(trainer) + " already sent " + where));
      } else if (!bucket.sent.empty() &&
                 (chunk_count != bucket.chunk_count || req->bucket_numel() != bucket.bucket_numel)) {
        // Before the shape check: a chunk of a bucket cut otherwise has another shape too, and
        // the cut is the cause to name.
        call->waiting = false;
        finish.emplace_back(call, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                               "trainer " + std::to_string(trainer) + " cut bucket " + std::to_string(index) +
                                                   " of batch " + std::to_string(b) + " into " + std::to_string(chunk_count) +
                                                   " chunks of a " + std::to_string(req->bucket_numel()) +
                                                   "-element bucket, the other trainers into " +
                                                   std::to_string(bucket.chunk_count) + " of " +
                                                   std::to_string(bucket.bucket_numel)));
      } else if (!bucket.sent.empty() && sig.SerializeAsString() != bucket.signature.SerializeAsString()) {
        call->waiting = false;
        finish.emplace_back(call, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                               "trainer " + std::to_string(trainer) + " sent " + describe(sig) + " for " +
                                                   where + ", but the other trainers sent " + describe(bucket.signature)));
      } else {
        std::vector<int> gone;
        const auto now = Clock::now();
        for (int t : serving)
          if (!bucket.sent.count(t) && t != trainer && this->gone(t, now)) gone.push_back(t);
        if (bucket.sent.empty()) {
          bucket.signature = sig;
          bucket.chunk_count = chunk_count;
          bucket.bucket_numel = req->bucket_numel();
          bucket.first = Clock::now();
          log.record_start("parameter_server_straggler_metric", key(b, bkey, chunk_count), "param_index_straggler");
          log.record_start("parameter_server_batch_metric", key(b, bkey, chunk_count), "param_index_batch");
        }
        bucket.sent.insert(trainer);
        bucket.waiting[trainer] = call;
        const bool borrowed = !grad.is_sparse() && (grad.data_ptr() == req->gradient().data().data() ||
                                                    grad.data_ptr() == call->shared_data);
        const int64_t grad_bytes = grad.is_sparse() ? in_bytes : grad.numel() * static_cast<int64_t>(grad.element_size());
        hold(bucket, in_bytes + call->shared_bytes);  // the request stays until answered
        if (options.kind() == ServerKind::kAverage) {
          // The first gradient is kept as it came (a view of its request, which waits too); the
          // second makes the sum, in one pass, and later ones add into it.
          if (!bucket.sum.defined() && !bucket.first_gradient.defined()) {
            bucket.first_gradient = grad;
            if (!borrowed) hold(bucket, grad_bytes);
          } else if (bucket.first_gradient.defined()) {
            bucket.sum = bucket.first_gradient + grad;  // sparse: concatenates; coalesced once at the end
            bucket.first_gradient = at::Tensor();
            hold(bucket, grad_bytes);
          } else if (grad.is_sparse()) {
            bucket.sum = bucket.sum + grad;
          } else {
            bucket.sum.add_(grad);
          }
        } else {
          bucket.parts[trainer] = borrowed ? grad.clone() : grad;
          hold(bucket, grad_bytes);
        }
        if (!gone.empty()) {
          fail_batch_locked(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                         "trainer(s) " + join_ids(gone) + " disconnected before sending " + where),
                            &finish);
        } else if (bucket.sent.size() == serving.size()) {
          log.record_end("parameter_server_straggler_metric", key(b, bkey, chunk_count));
          const std::string method_key = "avg," + key(b, bkey, chunk_count);
          log.record_start("method_metric", method_key, "average computation");
          if (options.kind() == ServerKind::kAverage) {
            // One trainer: its gradient may still be a view of a request about to be released.
            average = bucket.sum.defined() ? bucket.sum : bucket.first_gradient.clone();
          } else {
            average = bucket.parts.begin()->second;
            for (auto it = std::next(bucket.parts.begin()); it != bucket.parts.end(); ++it)
              average = average.is_sparse() ? average + it->second : average.add_(it->second);
          }
          if (average.is_sparse()) average = codecs::coalesce(average);
          average.div_(static_cast<double>(serving.size()));
          log.record_end("method_metric", method_key);
          signature = bucket.signature;
          for (auto& [t, c] : bucket.waiting) {
            c->waiting = false;
            answer.push_back(c);
          }
          bucket.waiting.clear();
          bucket.sum = bucket.first_gradient = at::Tensor();
          bucket.parts.clear();
          release(bucket);
          if (chunk_count <= 1 || ++chunks_averaged[index] == chunk_count) counters.buckets_averaged++;
        }
      }
    }
  }
  if (!answer.empty()) {
    const at::ScalarType wire_type = scalar_type_of(signature);
    if (average.scalar_type() != wire_type) average = average.to(wire_type);
    // Serialized once; every waiting trainer's response shares its slices (the data slice is the
    // average's own memory). A trainer that sent through shared memory gets the average there.
    if (!average.is_sparse()) average = average.contiguous();
    const at::Tensor data = average.is_sparse() ? average._values().contiguous() : average;
    const int64_t data_bytes = static_cast<int64_t>(data.nbytes());
    const int64_t out_bytes = data_bytes + (average.is_sparse() ? static_cast<int64_t>(average._indices().nbytes()) : 0);
    grpc::ByteBuffer reply, shared_reply;
    bool have_reply = false, have_shared_reply = false;
    int64_t sent = 0, shm_sent = 0;
    for (AverageCall* c : answer) {
      // The average's data goes into the place when the room the trainer gave holds it: always
      // for dense (the same bytes as its gradient's); sparse values, the union of every
      // trainer's rows, may not fit, and then go in the message.
      if (c->shared_data && data_bytes <= c->shared_capacity) {
        if (!have_shared_reply) {
          shared_reply = serialize_shared_memory_reply(average);
          have_shared_reply = true;
        }
        if (data_bytes) std::memcpy(c->shared_data, data.data_ptr(), data_bytes);
        *c->response = shared_reply;
        sent += out_bytes - data_bytes;
        shm_sent += data_bytes;
      } else {
        if (!have_reply) reply = serialize_reply(average);
        have_reply = true;
        *c->response = reply;
        sent += out_bytes;
      }
    }
    {
      // Counted before anyone is answered: a trainer that reads the metrics after its reply
      // must find this bucket in them.
      std::lock_guard<std::mutex> lock(mu);
      counters.bytes_sent += sent;
      counters.shm_bytes_sent += shm_sent;
      log.record_end("parameter_server_batch_metric", key(b, bkey, chunk_count));
    }
    for (AverageCall* c : answer) c->finish(grpc::Status::OK);
  }
  for (auto& [c, s] : finish) c->finish(s);
}

grpc::Status ParameterServer::Impl::borrow_shared_memory(AverageCall* call, const std::string& who) {
  const wire::SharedMemoryRef& ref = call->request.shared_memory();
  {
    std::lock_guard<std::mutex> lock(regions_mu);
    auto it = regions.find(ref.region());
    if (it != regions.end() && it->second.trainer == call->request.trainer_id()) call->region = it->second.memory;
  }
  if (!call->region)
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        who + ": its shared-memory region is not attached (no open session offered it)");
  const int64_t capacity = ref.capacity() == 0 ? ref.bytes() : ref.capacity();
  if (ref.bytes() < 0 || capacity < ref.bytes() || !call->region->holds(ref.offset(), capacity))
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        who + ": bytes [" + std::to_string(ref.offset()) + ", +" + std::to_string(ref.bytes()) +
                            (capacity != ref.bytes() ? " of room " + std::to_string(capacity) : std::string()) +
                            ") lie outside its " + std::to_string(call->region->bytes()) + "-byte shared-memory region");
  if (ref.bytes() > options.max_message_bytes())  // the limit a message of these bytes would hit
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        who + ": " + std::to_string(ref.bytes()) + " bytes in shared memory, more than max_message_bytes " +
                            std::to_string(options.max_message_bytes()));
  call->shared_data = call->region->at(ref.offset());
  call->shared_bytes = ref.bytes();
  call->shared_capacity = capacity;
  return grpc::Status::OK;
}

void ParameterServer::Impl::fail_batch_locked(const grpc::Status& status,
                                              std::vector<std::pair<AverageCall*, grpc::Status>>* finish) {
  batch_failure = status;
  for (auto& [index, bucket] : buckets) {
    for (auto& [t, c] : bucket.waiting) {
      c->waiting = false;
      finish->emplace_back(c, status);
    }
    bucket.waiting.clear();
    bucket.sum = bucket.first_gradient = at::Tensor();
    bucket.parts.clear();
    release(bucket);
  }
}

void ParameterServer::Impl::on_cancel(AverageCall* call) {
  std::vector<std::pair<AverageCall*, grpc::Status>> finish;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!call->waiting) return;
    fail_batch_locked(grpc::Status(grpc::StatusCode::ABORTED,
                                   "trainer " + std::to_string(call->trainer) + " gave up on " +
                                       name({call->bucket, call->chunk}, call->chunk_count) + " of batch " +
                                       std::to_string(call->batch) + " (its deadline passed or it was cancelled)"),
                      &finish);
  }
  for (auto& [c, s] : finish) c->finish(s);
}

void ParameterServer::Impl::reset() {
  std::vector<std::pair<AverageCall*, grpc::Status>> finish;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!buckets.empty())
      fail_batch_locked(grpc::Status(grpc::StatusCode::ABORTED, "the server's state was reset"), &finish);
    buckets.clear();
    chunks_averaged.clear();
    batch = 0;
    batch_failure = grpc::Status::OK;
    log.clear();
    counters = Counters();
    held_bytes = 0;
    reset_at = Clock::now();
  }
  for (auto& [c, s] : finish) c->finish(s);
}

// ---- ParameterServer ----------------------------------------------------------------------------

ParameterServer::ParameterServer(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  hold_grpc_runtime();
  const auto& ids = impl_->options.trainer_ids();
  DDPKIT_CHECK(!ids.empty(), "parameter server: trainer_ids is empty (which trainers does it serve?)");
  DDPKIT_CHECK(impl_->serving.size() == ids.size(), "parameter server: trainer_ids has duplicates (", join_ids(ids), ")");
  DDPKIT_CHECK(impl_->options.max_message_bytes() > 0 && impl_->options.max_message_bytes() <= (int64_t(1) << 31) - 1,
               "parameter server: max_message_bytes must be in 1..2^31-1, got ", impl_->options.max_message_bytes());
  DDPKIT_CHECK(impl_->options.bucket_timeout().count() > 0, "parameter server: bucket_timeout must be positive");
  DDPKIT_CHECK(impl_->options.reconnect_grace().count() >= 0, "parameter server: reconnect_grace must be >= 0");
  const auto& tls = impl_->options.tls();
  DDPKIT_CHECK(tls.certificate().empty() == tls.private_key().empty(),
               "parameter server: TLS needs both a certificate and a private key");
}

void ParameterServer::start() {
  DDPKIT_CHECK(!impl_->server, "parameter server: start() called twice");
  auto service = std::make_unique<Service>(impl_.get(), this);
  const auto& tls = impl_->options.tls();
  const auto creds = server_credentials(tls.certificate(), tls.private_key());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(impl_->options.address(), creds, &impl_->bound_port);
  builder.RegisterService(service.get());
  // gRPC sets SO_REUSEPORT by default: a second server on a taken port would then share it.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  apply_bulk_transport_args([&](const char* name, int value) { builder.AddChannelArgument(name, value); });
  builder.SetMaxReceiveMessageSize(static_cast<int>(impl_->options.max_message_bytes()));
  builder.SetMaxSendMessageSize(static_cast<int>(impl_->options.max_message_bytes()));
  impl_->server = builder.BuildAndStart();
  DDPKIT_CHECK(impl_->server && impl_->bound_port > 0, "parameter server: cannot listen on '", impl_->options.address(),
               "' (address in use, or not an address of this host)");
  const std::string& a = impl_->options.address();
  impl_->host = a.substr(0, a.rfind(':'));
  impl_->service = std::move(service);
  impl_->reaper = std::thread([impl = impl_.get()] { impl->reaper_loop(); });
}

int ParameterServer::port() const { return impl_->bound_port; }
std::string ParameterServer::address() const { return impl_->host + ":" + std::to_string(impl_->bound_port); }

void ParameterServer::shutdown(std::chrono::milliseconds grace) {
  {
    std::lock_guard<std::mutex> lock(impl_->stop_mu);
    if (impl_->stopping) return;
    impl_->stopping = true;
  }
  impl_->stop_cv.notify_all();
  if (impl_->reaper.joinable()) impl_->reaper.join();
  if (!impl_->server) return;
  impl_->shutting_down = true;
  auto fail_waiting = [&] {
    std::vector<std::pair<AverageCall*, grpc::Status>> finish;
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      impl_->fail_batch_locked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the parameter server is shutting down"),
                               &finish);
    }
    for (auto& [c, s] : finish) c->finish(s);
  };
  fail_waiting();
  {
    // Open sessions would otherwise hold Shutdown for the whole grace period.
    std::lock_guard<std::recursive_mutex> lock(impl_->sessions_mu);
    const std::set<SessionCall*> open = impl_->sessions;
    for (SessionCall* session : open)
      session->finish_once(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the parameter server is shutting down"));
  }
  impl_->server->Shutdown(std::chrono::system_clock::now() + grace);
  impl_->server->Wait();
  // A call posted in a mailbox just before may have slipped past the refusal above.
  impl_->stop_listeners();
  fail_waiting();
  std::lock_guard<std::mutex> lock(impl_->stop_mu);
  impl_->stopped = true;
  impl_->stop_cv.notify_all();
}

void ParameterServer::wait() {
  std::unique_lock<std::mutex> lock(impl_->stop_mu);
  impl_->stop_cv.wait(lock, [&] { return impl_->stopped; });
}

ParameterServer::~ParameterServer() {
  try {
    shutdown();
  } catch (...) {
  }
}

ParameterServer::Counters ParameterServer::counters() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Counters c = impl_->counters;
  c.seconds_since_reset = std::chrono::duration<double>(Clock::now() - impl_->reset_at).count();
  return c;
}

metrics::Series ParameterServer::metrics() const { return impl_->log.processed(); }

std::vector<metrics::Event> ParameterServer::events() const { return impl_->log.events(); }

void ParameterServer::reset_state() { impl_->reset(); }

}  // namespace ps
}  // namespace ddpkit
