// AverageGradient from the trainer's side: a gradient cut into chunks (dense) or row ranges
// (sparse), each sent as one call with at most a window in flight, its data through a
// shared-memory slot where one is free. A call with a slot is posted in the slot's mailbox
// (doorbell.h) and completes on the client's doorbell thread; any other goes through gRPC's
// callback API and completes on a gRPC thread.
#include "client_impl.h"

#include <ddpkit/codecs/sparse.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace ddpkit {
namespace ps {
namespace {


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
  auto answered = [shared, slot, room, what, address = options.address(), counters = counters,
                   read = std::move(read), done = std::move(done)](const grpc::Status& status, grpc::ByteBuffer& reply) {
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
  };
  // The largest reply: a dense average's is dtype and shape; a sparse one's also carries the
  // indices of up to every row of its range (sparse_dim 1; others always go by gRPC).
  int64_t reply_bound = 1024;
  if (piece.is_sparse()) {
    const int64_t row_bytes = piece.dim() >= 1 && piece.size(0) > 0
                                  ? piece.numel() / piece.size(0) * static_cast<int64_t>(piece.element_size())
                                  : 0;
    reply_bound = piece.sparse_dim() == 1 && row_bytes > 0 ? reply_bound + room / row_bytes * 8
                                                           : std::numeric_limits<int64_t>::max();
  }
  if (slot >= 0 && doorbell && static_cast<int64_t>(request.Length()) <= kMailboxPayloadBytes &&
      reply_bound <= kMailboxPayloadBytes) {
    counters->sent += static_cast<int64_t>(request.Length());
    doorbell->post(shared->mailbox_of(slot), request,
                   [counters = counters, answered = std::move(answered)](const grpc::Status& status, grpc::ByteBuffer& reply) {
                     if (status.ok()) {
                       counters->received += static_cast<int64_t>(reply.Length());
                       counters->calls++;
                       counters->doorbell_calls++;
                     }
                     answered(status, reply);
                   });
    return;
  }
  send(std::move(request), std::move(answered));
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
    const at::Tensor sparse = codecs::coalesce(gradient.cpu());
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

}  // namespace ps
}  // namespace ddpkit
