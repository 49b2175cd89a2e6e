// StateServer and fetch_state (state_transfer.h).
#include "state_transfer.h"

#include <ddpkit/error.h>

#include "../ps/grpc_common.h"
#include "lighthouse.grpc.pb.h"

#include <grpcpp/grpcpp.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

namespace ddpkit {
namespace ft {

namespace {

constexpr int64_t kChunkBytes = 4 << 20;
constexpr int kMaxMessage = 64 << 20;

}  // namespace

// `size` bytes to encode a snapshot into: a memory file's shared mapping, or (no memfd) the heap.
// (Named: StateServer::Impl holds it; see quantization_hooks.cpp on -Wsubobject-linkage.)
struct Held {
  char* data = nullptr;
  size_t size = 0;
  int fd = -1;  // the memory file, or -1
  std::string heap;
  Held() = default;
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
  ~Held() {
    if (fd < 0) return;
    munmap(data, size);
    close(fd);
  }
};

namespace {

std::shared_ptr<Held> hold(size_t size) {
  auto h = std::make_shared<Held>();
  h->size = size;
  const int fd = static_cast<int>(memfd_create("ddpkit-ft-state", MFD_CLOEXEC));
  if (fd >= 0 && ftruncate(fd, static_cast<off_t>(size)) == 0) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (p != MAP_FAILED) {
      h->fd = fd;
      h->data = static_cast<char*>(p);
      return h;
    }
  }
  if (fd >= 0) close(fd);
  h->heap.assign(size, '\0');
  h->data = h->heap.data();
  return h;
}

}  // namespace

struct StateServer::Impl {
  std::string token;
  std::mutex mu;
  int64_t step = -1;
  std::shared_ptr<Held> held;
  std::string host;
  int port = 0;
  std::unique_ptr<grpc::Service> service;
  std::unique_ptr<grpc::Server> server;

  grpc::Status fetch(const grpc::ServerContext* ctx, const wire::StateRequest& req, wire::StateReply* reply) {
    const std::string refusal = ps::token_refusal(ctx->client_metadata(), token, "state service");
    if (!refusal.empty()) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, refusal);
    std::shared_ptr<Held> bytes;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (step != req.step() || !held)
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            "holds the state of step " + std::to_string(step) + ", not " + std::to_string(req.step()));
      bytes = held;
    }
    const int64_t total = static_cast<int64_t>(bytes->size);
    const int64_t chunks = std::max<int64_t>(1, (total + kChunkBytes - 1) / kChunkBytes);
    reply->set_step(req.step());
    reply->set_total_bytes(total);
    reply->set_chunk_bytes(kChunkBytes);
    reply->set_chunks(chunks);
    if (req.chunk() < 0) {
      if (bytes->fd >= 0) reply->set_memory_file("/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(bytes->fd));
      return grpc::Status::OK;
    }
    if (req.chunk() >= chunks)
      return grpc::Status(grpc::StatusCode::OUT_OF_RANGE, "chunk " + std::to_string(req.chunk()) + " of " +
                                                              std::to_string(chunks));
    const int64_t begin = req.chunk() * kChunkBytes;
    reply->set_data(bytes->data + begin, static_cast<size_t>(std::min(kChunkBytes, total - begin)));
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

 private:
  StateServer::Impl* impl_;
};

}  // namespace

StateServer::StateServer(const std::string& host, const std::string& token) : impl_(std::make_unique<Impl>()) {
  ps::hold_grpc_runtime();
  impl_->token = token;
  impl_->host = host;
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

void StateServer::publish(int64_t step, const TensorDict& snapshot) {
  std::shared_ptr<Held> h = hold(encoded_size(snapshot));
  encode_tensors_into(snapshot, h->data, h->size);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->step = step;
  impl_->held = std::move(h);  // a fetch still reading the previous one keeps it
}

void StateServer::clear() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->step = -1;
  impl_->held.reset();
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

grpc::Status call(wire::StateTransfer::Stub& stub, const std::string& token, int64_t step, int64_t chunk,
                  std::chrono::steady_clock::time_point deadline, wire::StateReply* reply) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline - std::chrono::steady_clock::now()));
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  wire::StateRequest req;
  req.set_step(step);
  req.set_chunk(chunk);
  return stub.Fetch(&ctx, req, reply);
}

// The source's memory file, mapped read-only; null when it cannot be (another host's, gone).
std::shared_ptr<const char> map_memory_file(const std::string& path, int64_t total) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nullptr;
  struct stat st;
  void* p = MAP_FAILED;
  if (fstat(fd, &st) == 0 && st.st_size == total && total > 0)
    p = mmap(nullptr, static_cast<size_t>(total), PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);  // the mapping keeps the file
  if (p == MAP_FAILED) return nullptr;
  const size_t n = static_cast<size_t>(total);
  return std::shared_ptr<const char>(static_cast<const char*>(p), [n](const char* q) { munmap(const_cast<char*>(q), n); });
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
  for (;;) {
    const grpc::Status s = call(*first, options.token, step, -1, deadline, &head);
    if (s.ok()) break;
    // The source publishes when it learns of the quorum, which may be a moment after we did.
    if (s.error_code() != grpc::StatusCode::FAILED_PRECONDITION || std::chrono::steady_clock::now() >= deadline)
      throw fail(s.error_message());
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const int64_t total = head.total_bytes(), chunks = head.chunks(), chunk_bytes = head.chunk_bytes();
  if (total < 0 || chunks < 1 || chunk_bytes < 1 || (total + chunk_bytes - 1) / chunk_bytes > chunks)
    throw fail("malformed description (" + std::to_string(total) + " bytes in " + std::to_string(chunks) + " chunks)");
  Fetched out;
  out.size = static_cast<size_t>(total);
  if (options.try_memory_file && !head.memory_file().empty()) {
    if (auto mapped = map_memory_file(head.memory_file(), total)) {
      // Still the same step's file once ours is open (a re-publish of the step holds the same
      // bytes; another step's would be refused here), so the descriptor was not reused under us.
      wire::StateReply again;
      if (call(*first, options.token, step, -1, deadline, &again).ok() && again.memory_file() == head.memory_file()) {
        out.data = std::move(mapped);
        out.through_memory_file = true;
        return out;
      }
    }
  }
  auto heap = std::make_shared<std::string>(static_cast<size_t>(total), '\0');
  out.data = std::shared_ptr<const char>(heap, heap->data());
  char* into = heap->data();
  const int streams = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(options.connections, chunks)));
  std::atomic<int64_t> next{0};
  std::mutex error_mu;
  std::string error;
  auto worker = [&](int index) {
    auto stub = index == 0 ? std::move(first) : stub_for(address, index);
    for (int64_t c = next++; c < chunks; c = next++) {
      wire::StateReply part;
      const grpc::Status s = call(*stub, options.token, step, c, deadline, &part);
      const int64_t begin = c * chunk_bytes;
      const int64_t want = std::min(chunk_bytes, total - begin);
      std::string why = !s.ok() ? s.error_message()
                        : static_cast<int64_t>(part.data().size()) != want
                            ? "chunk " + std::to_string(c) + " has " + std::to_string(part.data().size()) + " bytes, not " + std::to_string(want)
                            : "";
      if (!why.empty()) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (error.empty()) error = why;
        next = chunks;
        return;
      }
      std::memcpy(into + begin, part.data().data(), static_cast<size_t>(want));
    }
  };
  std::vector<std::thread> threads;
  for (int i = 1; i < streams; ++i) threads.emplace_back(worker, i);
  worker(0);
  for (auto& t : threads) t.join();
  if (!error.empty()) throw fail(error);
  return out;
}

}  // namespace ft
}  // namespace ddpkit
