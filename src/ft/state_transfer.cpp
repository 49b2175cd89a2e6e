// StateServer and fetch_state (state_transfer.h).
#include "state_transfer.h"

#include <ddpkit/error.h>

#include "../ps/grpc_common.h"
#include "lighthouse.grpc.pb.h"

#include <grpcpp/grpcpp.h>

#include <sys/uio.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace ddpkit {
namespace ft {

namespace {

constexpr int64_t kChunkBytes = 4 << 20;
constexpr int kMaxMessage = 64 << 20;
constexpr int kMaxEntries = 1 << 20;
constexpr int64_t kMaxTotal = int64_t{1} << 48;
constexpr size_t kMaxIov = 1024;  // IOV_MAX

// A dtype code from the wire that names a dtype checkpoints store.
bool transferable(int code) {
  return code >= 0 && code < static_cast<int>(at::ScalarType::NumOptions) &&
         storable_dtype(static_cast<at::ScalarType>(code));
}

// Four independent lanes of 64-bit FNV-1a over 8-byte words (one dependency chain would make the
// checksum slower than the copy it guards); catches truncated, torn or flipped bytes.
uint64_t chunk_checksum(const char* p, size_t n) {
  constexpr uint64_t kPrime = 0x100000001b3ULL;
  uint64_t h[4] = {0xcbf29ce484222325ULL ^ n, 0x84222325cbf29ce4ULL, 0x9e3779b97f4a7c15ULL, 0xc2b2ae3d27d4eb4fULL};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, 32);
    for (int l = 0; l < 4; ++l) h[l] = (h[l] ^ w[l]) * kPrime;
  }
  for (; i < n; ++i) h[0] = (h[0] ^ static_cast<unsigned char>(p[i])) * kPrime;
  for (int l = 1; l < 4; ++l) h[0] = (h[0] ^ h[l]) * kPrime;
  return h[0];
}

}  // namespace

// A state as one run of bytes: its tensors in order, each beginning at offsets[i].
// (Named: StateServer::Impl holds it; see quantization_hooks.cpp on -Wsubobject-linkage.)
struct StateLayout {
  std::vector<std::string> keys;
  std::vector<at::Tensor> tensors;  // CPU, contiguous
  std::vector<int64_t> offsets{0};  // tensors.size() + 1

  void add(std::string key, at::Tensor t) {
    offsets.push_back(offsets.back() + static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size()));
    keys.push_back(std::move(key));
    tensors.push_back(std::move(t));
  }
  int64_t total() const { return offsets.back(); }
  char* bytes(size_t i) const { return static_cast<char*>(tensors[i].data_ptr()); }
  // fn(tensor index, offset in that tensor, offset from `begin`, length) for each piece of [begin, end).
  template <typename F>
  void pieces(int64_t begin, int64_t end, F&& fn) const {
    size_t i = static_cast<size_t>(std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin()) - 1;
    for (int64_t at = begin; at < end && i < tensors.size(); ++i) {
      const int64_t len = std::min(end, offsets[i + 1]) - at;
      if (len <= 0) continue;
      fn(i, at - offsets[i], at - begin, len);
      at += len;
    }
  }
};

struct ServedState {
  int64_t step = -1;
  StateLayout layout;
  std::set<std::string> waiting;  // healers that have not released it
  size_t released = 0;
};

struct StateServer::Impl {
  std::string token;
  std::mutex mu;
  std::condition_variable released;
  std::shared_ptr<ServedState> served;
  std::array<char, 32> proof{};  // what a reader on this host checks it reads this process with
  std::string host;
  int port = 0;
  std::unique_ptr<grpc::Service> service;
  std::unique_ptr<grpc::Server> server;

  std::shared_ptr<ServedState> holding(int64_t step, grpc::Status* refused) {
    std::lock_guard<std::mutex> lock(mu);
    if (served && served->step == step) return served;
    *refused = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            "holds the state of step " + std::to_string(served ? served->step : -1) + ", not " +
                                std::to_string(step));
    return nullptr;
  }

  grpc::Status fetch(const grpc::ServerContext* ctx, const wire::StateRequest& req, wire::StateReply* reply) {
    const std::string refusal = ps::token_refusal(ctx->client_metadata(), token, "state service");
    if (!refusal.empty()) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, refusal);
    grpc::Status refused;
    const std::shared_ptr<ServedState> s = holding(req.step(), &refused);
    if (!s) return refused;
    const StateLayout& layout = s->layout;
    const int64_t total = layout.total();
    const int64_t chunks = std::max<int64_t>(1, (total + kChunkBytes - 1) / kChunkBytes);
    reply->set_step(req.step());
    reply->set_total_bytes(total);
    reply->set_chunk_bytes(kChunkBytes);
    reply->set_chunks(chunks);
    if (req.chunk() < 0) {
      for (size_t i = 0; i < layout.tensors.size(); ++i) {
        const at::Tensor& t = layout.tensors[i];
        wire::StateEntry* e = reply->add_entries();
        e->set_key(layout.keys[i]);
        e->set_dtype(static_cast<int32_t>(t.scalar_type()));
        for (int64_t d : t.sizes()) e->add_sizes(d);
        e->set_nbytes(layout.offsets[i + 1] - layout.offsets[i]);
        e->set_address(reinterpret_cast<uint64_t>(layout.bytes(i)));
      }
      reply->set_pid(getpid());
      reply->set_proof_address(reinterpret_cast<uint64_t>(proof.data()));
      reply->set_proof(proof.data(), proof.size());
      return grpc::Status::OK;
    }
    if (req.chunk() >= chunks)
      return grpc::Status(grpc::StatusCode::OUT_OF_RANGE, "chunk " + std::to_string(req.chunk()) + " of " +
                                                              std::to_string(chunks));
    const int64_t begin = req.chunk() * kChunkBytes, end = std::min(total, begin + kChunkBytes);
    std::string* data = reply->mutable_data();
    data->resize(static_cast<size_t>(end - begin));
    layout.pieces(begin, end, [&](size_t i, int64_t in, int64_t out, int64_t len) {
      std::memcpy(&(*data)[static_cast<size_t>(out)], layout.bytes(i) + in, static_cast<size_t>(len));
    });
    reply->set_checksum(chunk_checksum(data->data(), data->size()));
    return grpc::Status::OK;
  }

  grpc::Status release(const grpc::ServerContext* ctx, const wire::StateRequest& req, wire::StateReply* reply) {
    const std::string refusal = ps::token_refusal(ctx->client_metadata(), token, "state service");
    if (!refusal.empty()) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, refusal);
    std::lock_guard<std::mutex> lock(mu);
    if (!served || served->step != req.step() || !served->waiting.erase(req.healer()))
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "no longer serves step " + std::to_string(req.step()) +
                                                                     " to " + req.healer() + " (it moved on)");
    ++served->released;
    reply->set_step(req.step());
    released.notify_all();
    return grpc::Status::OK;
  }
};

namespace {

class StateService final : public wire::StateTransfer::Service {
 public:
  explicit StateService(StateServer::Impl* impl) : impl_(impl) {}
  grpc::Status Fetch(grpc::ServerContext* ctx, const wire::StateRequest* req, wire::StateReply* reply) override {
    return impl_->fetch(ctx, *req, reply);
  }
  grpc::Status Release(grpc::ServerContext* ctx, const wire::StateRequest* req, wire::StateReply* reply) override {
    return impl_->release(ctx, *req, reply);
  }

 private:
  StateServer::Impl* impl_;
};

}  // namespace

StateServer::StateServer(const std::string& host, const std::string& token) : impl_(std::make_unique<Impl>()) {
  ps::hold_grpc_runtime();
  impl_->token = token;
  impl_->host = host;
  std::random_device rd;
  for (char& c : impl_->proof) c = static_cast<char>(rd());
  auto service = std::make_unique<StateService>(impl_.get());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(host + ":0", grpc::InsecureServerCredentials(), &impl_->port);
  builder.RegisterService(service.get());
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  ps::apply_bulk_transport_args([&](const char* name, int value) { builder.AddChannelArgument(name, value); });
  builder.SetMaxSendMessageSize(kMaxMessage);
  impl_->server = builder.BuildAndStart();
  DDPKIT_CHECK(impl_->server && impl_->port > 0, "fault tolerance: cannot listen on '", host,
               ":0' for the state service (not an address of this host?)");
  impl_->service = std::move(service);
}

StateServer::~StateServer() {
  impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

std::string StateServer::address() const { return impl_->host + ":" + std::to_string(impl_->port); }

void StateServer::publish(int64_t step, const TensorDict& snapshot, const std::set<std::string>& healers) {
  auto s = std::make_shared<ServedState>();
  s->step = step;
  s->waiting = healers;
  for (const auto& kv : snapshot) {
    DDPKIT_CHECK(kv.second.defined(), "fault tolerance: state entry '", kv.first, "' is an undefined tensor");
    DDPKIT_CHECK(transferable(static_cast<int>(kv.second.scalar_type())), "fault tolerance: state entry '", kv.first,
                 "' has dtype ", kv.second.scalar_type(), ", which a heal does not copy");
    s->layout.add(kv.first, kv.second.detach().cpu().contiguous());
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->served = std::move(s);
}

size_t StateServer::wait_released(std::chrono::steady_clock::time_point deadline,
                                  const std::function<bool(const std::string&)>& gone) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  if (!impl_->served) return 0;
  while (!impl_->served->waiting.empty() && std::chrono::steady_clock::now() < deadline) {
    const std::set<std::string> left = impl_->served->waiting;
    lock.unlock();
    std::set<std::string> lost;
    for (const auto& h : left)
      if (gone && gone(h)) lost.insert(h);
    lock.lock();
    // A healer given up on is refused its Release from now on: what it read may be torn.
    for (const auto& h : lost) impl_->served->waiting.erase(h);
    impl_->released.wait_for(lock, std::chrono::milliseconds(20));
  }
  const size_t done = impl_->served->released;
  impl_->served.reset();
  return done;
}

void StateServer::clear() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->served.reset();
}

// ---- fetching ----------------------------------------------------------------------------------

namespace {

std::unique_ptr<wire::StateTransfer::Stub> stub_for(const std::string& address, int index) {
  grpc::ChannelArguments args;
  ps::apply_bulk_transport_args([&](const char* name, int value) { args.SetInt(name, value); });
  args.SetMaxReceiveMessageSize(kMaxMessage);
  // A channel of its own per stream (else gRPC shares one connection among them).
  args.SetInt("ddpkit.state_stream", index);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return wire::StateTransfer::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

std::unique_ptr<grpc::ClientContext> context(const std::string& token, std::chrono::steady_clock::time_point deadline) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline - std::chrono::steady_clock::now()));
  ps::add_token(*ctx, token);
  return ctx;
}

grpc::Status call(wire::StateTransfer::Stub& stub, const std::string& token, int64_t step, int64_t chunk,
                  std::chrono::steady_clock::time_point deadline, wire::StateReply* reply) {
  auto ctx = context(token, deadline);
  wire::StateRequest req;
  req.set_step(step);
  req.set_chunk(chunk);
  return stub.Fetch(ctx.get(), req, reply);
}

// A tensor in memory of its own: large ones in a mapping of their own, unmapped with the tensor.
// (The allocator's large blocks come from wherever its heap has room; a fresh mapping is written
// at the kernel's page-fault rate every time, and is returned whole when the tensor goes.)
at::Tensor fresh_tensor(const std::vector<int64_t>& sizes, at::ScalarType type, int64_t nbytes) {
  constexpr int64_t kOwnMapping = 1 << 20;
  if (nbytes >= kOwnMapping) {
    const size_t len = static_cast<size_t>(nbytes);
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED)
      return at::from_blob(p, sizes, [len](void* q) { munmap(q, len); }, at::TensorOptions().dtype(type));
  }
  return at::empty(sizes, at::TensorOptions().dtype(type));
}

// Fresh tensors for the described entries, once all of them are checked; "" or why the
// description is malformed.
std::string allocate(const wire::StateReply& head, StateLayout* out) {
  if (head.entries_size() > kMaxEntries) return std::to_string(head.entries_size()) + " entries";
  std::set<std::string> seen;
  int64_t total = 0;
  for (const auto& e : head.entries()) {
    if (!seen.insert(e.key()).second) return "entry '" + e.key() + "' appears twice";
    if (!transferable(e.dtype())) return "entry '" + e.key() + "' has dtype code " + std::to_string(e.dtype());
    int64_t numel = 1;
    for (int64_t s : e.sizes()) {
      if (s < 0 || (s > 0 && numel > kMaxTotal / s)) return "entry '" + e.key() + "' has size " + std::to_string(s);
      numel *= s;
    }
    const auto type = static_cast<at::ScalarType>(e.dtype());
    if (e.nbytes() != numel * static_cast<int64_t>(c10::elementSize(type)) || total > kMaxTotal - e.nbytes())
      return "entry '" + e.key() + "' claims " + std::to_string(e.nbytes()) + " bytes for " + std::to_string(numel) +
             " elements of " + c10::toString(type);
    total += e.nbytes();
  }
  if (total != head.total_bytes())
    return "entries of " + std::to_string(total) + " bytes, total " + std::to_string(head.total_bytes());
  for (const auto& e : head.entries())
    out->add(e.key(), fresh_tensor(std::vector<int64_t>(e.sizes().begin(), e.sizes().end()),
                                   static_cast<at::ScalarType>(e.dtype()), e.nbytes()));
  return "";
}

// worker(0 .. n-1), each on a thread of its own (0 on the caller's).
void on_threads(int n, const std::function<void(int)>& worker) {
  std::vector<std::thread> threads;
  for (int i = 1; i < n; ++i) threads.emplace_back(worker, i);
  worker(0);
  for (auto& t : threads) t.join();
}

// Reads [remote, remote + n) pieces of process `pid` into local memory; "" or why not.
std::string read_process(pid_t pid, std::vector<iovec>& local, std::vector<iovec>& remote) {
  for (size_t i = 0; i < local.size(); i += kMaxIov) {
    const size_t n = std::min(kMaxIov, local.size() - i);
    size_t want = 0;
    for (size_t k = i; k < i + n; ++k) want += local[k].iov_len;
    const ssize_t got = process_vm_readv(pid, &local[i], n, &remote[i], n, 0);
    if (got < 0) return std::string("process_vm_readv: ") + std::strerror(errno);
    if (static_cast<size_t>(got) != want)
      return "process_vm_readv read " + std::to_string(got) + " of " + std::to_string(want) + " bytes";
  }
  return "";
}

// Copies the state straight from the server's memory (it is on this host): "" or why not, and
// then the caller fetches over the network instead.
std::string copy_from_process(const wire::StateReply& head, const StateLayout& into, int streams) {
  const pid_t pid = static_cast<pid_t>(head.pid());
  if (pid <= 0 || head.proof().empty()) return "no process to read";
  std::string proof(head.proof().size(), '\0');
  std::vector<iovec> l{{&proof[0], proof.size()}};
  std::vector<iovec> r{{reinterpret_cast<void*>(head.proof_address()), proof.size()}};
  std::string why = read_process(pid, l, r);
  if (!why.empty()) return why;
  if (proof != head.proof()) return "process " + std::to_string(pid) + " here is not the server";
  std::vector<int64_t> addresses;
  for (const auto& e : head.entries()) addresses.push_back(static_cast<int64_t>(e.address()));
  // Threads take equal byte ranges of the state.
  const int64_t total = into.total();
  streams = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(streams, total / (8 << 20))));
  std::vector<std::string> errors(streams);
  auto worker = [&](int s) {
    const int64_t begin = total * s / streams, end = total * (s + 1) / streams;
    std::vector<iovec> local, remote;
    into.pieces(begin, end, [&](size_t i, int64_t in, int64_t, int64_t len) {
      local.push_back({into.bytes(i) + in, static_cast<size_t>(len)});
      remote.push_back({reinterpret_cast<void*>(addresses[i] + in), static_cast<size_t>(len)});
    });
    errors[s] = read_process(pid, local, remote);
  };
  on_threads(streams, worker);
  for (const auto& e : errors)
    if (!e.empty()) return e;
  return "";
}

// Fetches every chunk over `connections` streams into `into`; "" or the first failure.
std::string fetch_chunks(wire::StateTransfer::Stub& first, const std::string& address, int64_t step,
                         const wire::StateReply& head, const StateLayout& into, const FetchOptions& options,
                         std::chrono::steady_clock::time_point deadline) {
  const int64_t total = head.total_bytes(), chunks = head.chunks(), chunk_bytes = head.chunk_bytes();
  const int streams = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(options.connections, chunks)));
  std::atomic<int64_t> next{0};
  std::mutex error_mu;
  std::string error;
  auto worker = [&](int index) {
    auto own = index == 0 ? nullptr : stub_for(address, index);
    wire::StateTransfer::Stub& stub = own ? *own : first;
    for (int64_t c = next++; c < chunks; c = next++) {
      wire::StateReply part;
      const grpc::Status s = call(stub, options.token, step, c, deadline, &part);
      const int64_t begin = c * chunk_bytes, end = std::min(total, begin + chunk_bytes);
      const std::string& data = part.data();
      std::string why = !s.ok() ? s.error_message()
                        : static_cast<int64_t>(data.size()) != end - begin
                            ? "chunk " + std::to_string(c) + " has " + std::to_string(data.size()) + " bytes, not " +
                                  std::to_string(end - begin)
                        : chunk_checksum(data.data(), data.size()) != part.checksum()
                            ? "chunk " + std::to_string(c) + " is corrupt (checksum mismatch)"
                            : "";
      if (!why.empty()) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (error.empty()) error = why;
        next = chunks;
        return;
      }
      into.pieces(begin, end, [&](size_t i, int64_t in, int64_t out, int64_t len) {
        std::memcpy(into.bytes(i) + in, data.data() + out, static_cast<size_t>(len));
      });
    }
  };
  on_threads(streams, worker);
  return error;
}

grpc::Status release(wire::StateTransfer::Stub& stub, const FetchOptions& options, int64_t step,
                     std::chrono::steady_clock::time_point deadline) {
  auto ctx = context(options.token, deadline);
  wire::StateRequest req;
  req.set_step(step);
  req.set_healer(options.healer);
  wire::StateReply reply;
  return stub.Release(ctx.get(), req, &reply);
}

}  // namespace

Fetched fetch_state(const std::string& address, int64_t step, const FetchOptions& options) {
  ps::hold_grpc_runtime();
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  auto fail = [&](const std::string& why) -> CommError {
    return CommError("ddpkit: fetching the state of step " + std::to_string(step) + " from " + address + " failed: " + why);
  };
  auto first = stub_for(address, 0);
  wire::StateReply head;
  std::string refused;  // the source's last "not yet": what a timeout reports
  for (;;) {
    const grpc::Status s = call(*first, options.token, step, -1, deadline, &head);
    if (s.ok()) break;
    // The source publishes when it learns of the quorum, which may be a moment after we did.
    if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION) refused = s.error_message();
    const bool waiting = s.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
                         (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && !refused.empty());
    if (!waiting || std::chrono::steady_clock::now() >= deadline)
      throw fail(refused.empty() ? s.error_message() : "it still " + refused + " after " +
                 std::to_string(options.timeout.count()) + " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const int64_t total = head.total_bytes(), chunks = head.chunks(), chunk_bytes = head.chunk_bytes();
  if (total < 0 || total > kMaxTotal || chunks < 1 || chunk_bytes < 1 || (total + chunk_bytes - 1) / chunk_bytes > chunks)
    throw fail("malformed description (" + std::to_string(total) + " bytes in " + std::to_string(chunks) + " chunks)");
  StateLayout into;
  std::string why = allocate(head, &into);
  if (!why.empty()) throw fail("malformed description: " + why);
  Fetched out;
  out.bytes = total;
  if (options.same_host) {
    out.single_copy_refused = copy_from_process(head, into, options.connections);
    out.single_copy = out.single_copy_refused.empty();
  }
  if (!out.single_copy) why = fetch_chunks(*first, address, step, head, into, options, deadline);
  // Released even after a failure, so the source need not wait for this healer any longer.
  const grpc::Status released = release(*first, options, step, deadline);
  if (!why.empty()) throw fail(why);
  if (!released.ok()) throw fail("the source did not accept the release: " + released.error_message());
  for (size_t i = 0; i < into.keys.size(); ++i) out.state.emplace(into.keys[i], std::move(into.tensors[i]));
  return out;
}

}  // namespace ft
}  // namespace ddpkit
