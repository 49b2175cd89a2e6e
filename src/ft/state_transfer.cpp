// StateServer and fetch_state (state_transfer.h).
#include "state_transfer.h"

#include <ddpkit/error.h>

#include "../ps/grpc_common.h"
#include "detached.h"
#include "lighthouse.grpc.pb.h"
#include "wire.h"

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
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace ddpkit {
namespace ft {

namespace {

constexpr int64_t kPieceBytes = 4 << 20;  // one broadcast of the pair group
constexpr int kMaxMessage = 64 << 20;
constexpr int kMaxEntries = 1 << 20;
constexpr int64_t kMaxTotal = int64_t{1} << 48;
constexpr size_t kMaxIov = 1024;  // IOV_MAX
constexpr int kCopyThreads = 4;    // of the single copy, one 8 MiB range each at least

// A dtype code from the wire that names a dtype checkpoints store.
bool transferable(int code) {
  return code >= 0 && code < static_cast<int>(at::ScalarType::NumOptions) &&
         storable_dtype(static_cast<at::ScalarType>(code));
}

std::string random_name() {
  std::random_device rd;
  char buf[32];
  std::snprintf(buf, sizeof(buf), "h%08x%08x%08x", rd(), rd(), rd());
  return buf;
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
  // Broadcasts of every tensor's bytes from rank 0 of the pair group, in order, kPieceBytes each
  // (successive ones go over the group's successive connections). Both ends issue the same list.
  std::vector<FuturePtr> broadcast(ProcessGroup& pair) const {
    std::vector<FuturePtr> sent;
    for (size_t i = 0; i < tensors.size(); ++i)
      for (int64_t at = 0, n = offsets[i + 1] - offsets[i]; at < n; at += kPieceBytes)
        sent.push_back(pair.broadcast(at::from_blob(bytes(i) + at, {std::min(kPieceBytes, n - at)}, at::kByte), 0));
    return sent;
  }
};

namespace {

// Waits for every future of `pair`; "" or the first error. `stop` is polled meanwhile: a reason
// aborts the group (its collectives in flight fail at once) and is returned.
std::string wait_all(ProcessGroup& pair, const std::vector<FuturePtr>& futures,
                     const std::function<std::string()>& stop) {
  const FuturePtr all = when_all(futures, at::Tensor());
  auto done = std::make_shared<std::pair<std::mutex, std::condition_variable>>();
  all->addCallback([done](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(done->first);
    done->second.notify_all();
  });
  std::unique_lock<std::mutex> lock(done->first);
  while (!all->completed()) {
    const std::string why = stop ? stop() : "";
    if (!why.empty()) {
      lock.unlock();
      pair.abort(why);
      return why;
    }
    done->second.wait_for(lock, std::chrono::milliseconds(10));
  }
  return all->hasError() ? all->tryRetrieveErrorMessage() : "";
}

}  // namespace

struct ServedState {
  int64_t step = -1;
  StateLayout layout;
  std::set<std::string> waiting;  // healers that have not released it
  size_t released = 0;
};

struct StateServer::Impl {
  std::string token;
  PairGroupFactory pair_group;
  std::mutex mu;
  std::condition_variable released;
  std::shared_ptr<ServedState> served;
  std::vector<std::pair<std::string, std::string>> stream_requests;  // (healer, pair group name)
  std::array<char, 32> proof{};  // what a reader on this host checks it reads this process with
  std::string host;
  int port = 0;
  std::unique_ptr<grpc::Service> service;
  std::unique_ptr<grpc::Server> server;
  // Streams, each on a thread of its own with its flags. A thread may outlive the wait that
  // started it (a group still meeting its healer, or waiting for its transport's work to end after
  // an abort), holding the state it streams until it ends.
  static constexpr int kOver = 1, kGone = 2;  // set by the wait
  DetachedThreads streams;

  std::shared_ptr<ServedState> holding(int64_t step, grpc::Status* refused) {
    std::lock_guard<std::mutex> lock(mu);
    if (served && served->step == step) return served;
    *refused = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            "holds the state of step " + std::to_string(served ? served->step : -1) + ", not " +
                                std::to_string(step));
    return nullptr;
  }

  grpc::Status describe(const grpc::ServerContext* ctx, const wire::StateRequest& req, wire::StateReply* reply) {
    const std::string refusal = ps::token_refusal(ctx->client_metadata(), token, "state service");
    if (!refusal.empty()) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, refusal);
    grpc::Status refused;
    const std::shared_ptr<ServedState> s = holding(req.step(), &refused);
    if (!s) return refused;
    const StateLayout& layout = s->layout;
    reply->set_step(req.step());
    reply->set_total_bytes(layout.total());
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

  grpc::Status stream(const grpc::ServerContext* ctx, const wire::StateRequest& req, wire::StateReply* reply) {
    const std::string refusal = ps::token_refusal(ctx->client_metadata(), token, "state service");
    if (!refusal.empty()) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, refusal);
    if (!wire::valid_name(req.pair_group()))
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "pair group name must be 1-128 characters of "
                                                              "[A-Za-z0-9_.-]");
    std::lock_guard<std::mutex> lock(mu);
    if (!served || served->step != req.step() || !served->waiting.count(req.healer()))
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "does not serve step " + std::to_string(req.step()) +
                                                                     " to " + req.healer());
    stream_requests.emplace_back(req.healer(), req.pair_group());
    reply->set_step(req.step());
    released.notify_all();
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

  // Streams `s` to `healer` over the pair group `name` (rank 0). Ends when the healer has
  // received it all, or aborts when the wait marks the healer lost or is over. A failure ends
  // here: the healer's copy fails with it, and a Release it might still send is refused.
  void stream_to(const std::shared_ptr<ServedState>& s, const std::string& healer, const std::string& name,
                 const std::shared_ptr<std::atomic<int>>& flags) {
    try {
      std::shared_ptr<ProcessGroup> pair = pair_group(name, 0, healer);
      wait_all(*pair, s->layout.broadcast(*pair), [&]() -> std::string {
        if (flags->load() & kGone) return "healer " + healer + " is lost";
        if (flags->load() & kOver) return "the server no longer serves this state";
        return "";
      });
    } catch (const std::exception&) {
      // The healer's side fails too and says why.
    }
  }
};

namespace {

class StateService final : public wire::StateTransfer::Service {
 public:
  explicit StateService(StateServer::Impl* impl) : impl_(impl) {}
  grpc::Status Describe(grpc::ServerContext* ctx, const wire::StateRequest* req, wire::StateReply* reply) override {
    return impl_->describe(ctx, *req, reply);
  }
  grpc::Status Stream(grpc::ServerContext* ctx, const wire::StateRequest* req, wire::StateReply* reply) override {
    return impl_->stream(ctx, *req, reply);
  }
  grpc::Status Release(grpc::ServerContext* ctx, const wire::StateRequest* req, wire::StateReply* reply) override {
    return impl_->release(ctx, *req, reply);
  }

 private:
  StateServer::Impl* impl_;
};

}  // namespace

StateServer::StateServer(const std::string& host, const std::string& token, PairGroupFactory pair_group)
    : impl_(std::make_unique<Impl>()) {
  DDPKIT_CHECK(pair_group, "fault tolerance: the state service needs a way to make its pair groups");
  ps::hold_grpc_runtime();
  impl_->token = token;
  impl_->pair_group = std::move(pair_group);
  impl_->host = host;
  std::random_device rd;
  for (char& c : impl_->proof) c = static_cast<char>(rd());
  auto service = std::make_unique<StateService>(impl_.get());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(host + ":0", grpc::InsecureServerCredentials(), &impl_->port);
  builder.RegisterService(service.get());
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxSendMessageSize(kMaxMessage);
  impl_->server = builder.BuildAndStart();
  DDPKIT_CHECK(impl_->server && impl_->port > 0, "fault tolerance: cannot listen on '", host,
               ":0' for the state service (not an address of this host?)");
  impl_->service = std::move(service);
}

StateServer::~StateServer() {
  impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  impl_->streams.join_all();  // each was told its wait is over
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
  impl_->stream_requests.clear();
}

size_t StateServer::wait_released(std::chrono::steady_clock::time_point deadline,
                                  const std::function<bool(const std::string&)>& gone) {
  Impl& im = *impl_;
  std::unique_lock<std::mutex> lock(im.mu);
  if (!im.served) return 0;
  const std::shared_ptr<ServedState> s = im.served;
  std::map<std::string, std::vector<std::shared_ptr<std::atomic<int>>>> streaming;  // by healer
  while (!s->waiting.empty() && std::chrono::steady_clock::now() < deadline) {
    for (auto& request : im.stream_requests) {
      auto flags = std::make_shared<std::atomic<int>>(0);
      streaming[request.first].push_back(flags);
      im.streams.start([&im, s, healer = request.first, name = request.second, flags] {
        im.stream_to(s, healer, name, flags);
      });
    }
    im.stream_requests.clear();
    const std::set<std::string> left = s->waiting;
    lock.unlock();
    std::set<std::string> lost;
    for (const auto& h : left)
      if (gone && gone(h)) lost.insert(h);
    lock.lock();
    // A healer given up on is refused its Release from now on: what it read may be torn.
    for (const auto& h : lost) {
      s->waiting.erase(h);
      for (auto& f : streaming[h]) f->fetch_or(Impl::kGone);
    }
    im.released.wait_for(lock, std::chrono::milliseconds(20));
  }
  const size_t done = s->released;
  im.served.reset();
  im.stream_requests.clear();
  for (auto& kv : streaming)
    for (auto& f : kv.second) f->fetch_or(Impl::kOver);
  return done;
}

void StateServer::clear() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->served.reset();
  impl_->stream_requests.clear();
}

// ---- fetching ----------------------------------------------------------------------------------

namespace {

std::unique_ptr<wire::StateTransfer::Stub> stub_for(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessage);
  return wire::StateTransfer::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

std::unique_ptr<grpc::ClientContext> context(const std::string& token, std::chrono::steady_clock::time_point deadline) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline - std::chrono::steady_clock::now()));
  ps::add_token(*ctx, token);
  return ctx;
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
// then the caller has it streamed instead.
std::string copy_from_process(const wire::StateReply& head, const StateLayout& into) {
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
  const int streams = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kCopyThreads, total / (8 << 20))));
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

grpc::Status call(grpc::Status (wire::StateTransfer::Stub::*rpc)(grpc::ClientContext*, const wire::StateRequest&,
                                                                   wire::StateReply*),
                  wire::StateTransfer::Stub& stub, const FetchOptions& options, int64_t step,
                  const std::string& pair_group, std::chrono::steady_clock::time_point deadline) {
  auto ctx = context(options.token, deadline);
  wire::StateRequest req;
  req.set_step(step);
  req.set_healer(options.healer);
  req.set_pair_group(pair_group);
  wire::StateReply reply;
  return (stub.*rpc)(ctx.get(), req, &reply);
}

// Has the server stream `into` over a new pair group (rank 1 here); "" or why it failed. After a
// failure the group is already destroyed (its transport wrote into the tensors until then);
// after success it is left in *pair for the caller to destroy.
std::string receive_stream(wire::StateTransfer::Stub& stub, const StateLayout& into, int64_t step,
                           const FetchOptions& options, std::chrono::steady_clock::time_point deadline,
                           std::shared_ptr<ProcessGroup>* pair) {
  if (!options.pair_group) return "no pair group to stream over (FetchOptions::pair_group)";
  const std::string name = random_name();
  const grpc::Status asked = call(&wire::StateTransfer::Stub::Stream, stub, options, step, name, deadline);
  if (!asked.ok()) return "the source refused to stream: " + asked.error_message();
  std::string why;
  try {
    *pair = options.pair_group(name, 1, options.source);
    why = wait_all(**pair, into.broadcast(**pair), [&]() -> std::string {
      if (std::chrono::steady_clock::now() >= deadline) return "the fetch timed out";
      return options.stop ? options.stop() : "";
    });
  } catch (const std::exception& e) {
    why = std::string("the pair group: ") + e.what();
  }
  if (!why.empty()) pair->reset();
  return why;
}

}  // namespace

Fetched fetch_state(const std::string& address, int64_t step, const FetchOptions& options) {
  ps::hold_grpc_runtime();
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  auto fail = [&](const std::string& why) -> CommError {
    return CommError("ddpkit: fetching the state of step " + std::to_string(step) + " from " + address + " failed: " + why);
  };
  auto stub = stub_for(address);
  const auto asked = std::chrono::steady_clock::now();
  wire::StateReply head;
  std::string refused;  // the source's last "not yet": what a timeout reports
  for (;;) {
    auto ctx = context(options.token, deadline);
    wire::StateRequest req;
    req.set_step(step);
    const grpc::Status s = stub->Describe(ctx.get(), req, &head);
    if (s.ok()) break;
    // The source publishes when it learns of the quorum, which may be a moment after we did.
    if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION) refused = s.error_message();
    const bool waiting = s.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
                         (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && !refused.empty());
    if (!waiting || std::chrono::steady_clock::now() >= deadline)
      throw fail(refused.empty() ? s.error_message() : "it still " + refused + " after " +
                 std::to_string(options.timeout.count()) + " ms");
    if (options.stop) {  // a source lost before it published (it serves from its next step boundary)
      const std::string why = options.stop();
      if (!why.empty()) throw fail(why);
    }
    // Asked again soon, then every 20 ms: under the async quorum a healer waits here for its
    // source's next step boundary, and the source's step should not pay for many answers.
    std::this_thread::sleep_for(std::chrono::milliseconds(refused.empty() ? 5 : 20));
  }
  const int64_t total = head.total_bytes();
  if (total < 0 || total > kMaxTotal) throw fail("malformed description (" + std::to_string(total) + " bytes)");
  StateLayout into;
  std::string why = allocate(head, &into);
  if (!why.empty()) throw fail("malformed description: " + why);
  Fetched out;
  out.bytes = total;
  out.waited_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count();
  if (options.same_host) {
    out.single_copy_refused = copy_from_process(head, into);
    out.single_copy = out.single_copy_refused.empty();
  }
  if (!out.single_copy) why = receive_stream(*stub, into, step, options, deadline, &out.pair);
  // Released even after a failure, so the source need not wait for this healer any longer.
  const grpc::Status released = call(&wire::StateTransfer::Stub::Release, *stub, options, step, "", deadline);
  if (!why.empty()) throw fail(why);
  if (!released.ok()) throw fail("the source did not accept the release: " + released.error_message());
  for (size_t i = 0; i < into.keys.size(); ++i) out.state.emplace(into.keys[i], std::move(into.tensors[i]));
  return out;
}

}  // namespace ft
}  // namespace ddpkit
