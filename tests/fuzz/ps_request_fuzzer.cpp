// libFuzzer target: the parameter server's request handling, end to end over loopback gRPC.
//
// One real ParameterServer (trainers 0 and 1, a token) serves the whole run. Each input is
//   byte 0: how the call authenticates (0: right token, 1: wrong token, 2: none),
//   the rest: the bytes of an AverageGradient request, sent unparsed,
// so the fuzzer reaches gRPC's deserialization, the token check, the chunk and shape checks, wire
// tensor decoding (dense and sparse, every dtype and size field) and the averaging itself. When the
// bytes parse as a GradientRequest, the same request is also sent as the other trainer, so a valid
// one completes its batch and both answers come back instead of waiting for a peer. Trainers 0 and 1
// have shared-memory regions attached (as a client on this host has): a request that names a
// shared-memory place is pointed at its trainer's region, so the fuzzer reaches the place and size
// checks and the reads and writes of the region too.
//
//   scripts/sanitize.sh fuzz 600        (builds build-asan/ with clang 14, ASan + UBSan)
#include <ddpkit/ps/parameter_server.h>

#include "parameter_server.grpc.pb.h"
#include "shared_region.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/byte_buffer.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <string>

namespace {

const char* kToken = "fuzz-secret";
const char* kMethod = "/ddpkit.ps.wire.ParameterServer/AverageGradient";

// A trainer's session, holding its region attached for the whole run.
struct Attached {
  ddpkit::ps::SharedRegion region{4096, 4};
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<ddpkit::ps::wire::SessionEvent>> session;
};

struct Fixture {
  std::unique_ptr<ddpkit::ps::ParameterServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> stub;
  std::unique_ptr<ddpkit::ps::wire::ParameterServer::Stub> typed;
  Attached trainers[2];
};

Fixture& fixture() {
  static Fixture* f = [] {
    auto* fx = new Fixture;
    fx->server = std::make_unique<ddpkit::ps::ParameterServer>(
        ddpkit::ps::ServerOptions()
            .trainer_ids({0, 1})
            .token(kToken)
            .max_message_bytes(1 << 20)
            .bucket_timeout(std::chrono::milliseconds(200)));
    fx->server->start();
    fx->channel = grpc::CreateChannel(fx->server->address(), grpc::InsecureChannelCredentials());
    fx->stub = std::make_unique<grpc::GenericStub>(fx->channel);
    fx->typed = ddpkit::ps::wire::ParameterServer::NewStub(fx->channel);
    for (int t = 0; t < 2; ++t) {
      Attached& a = fx->trainers[t];
      ddpkit::ps::wire::SessionRequest request;
      request.set_trainer_id(t);
      a.region.offer(request.mutable_shared_memory());
      a.ctx.AddMetadata("authorization", std::string("Bearer ") + kToken);
      a.session = fx->typed->Session(&a.ctx, request);
      ddpkit::ps::wire::SessionEvent event;
      if (!a.session->Read(&event) || !event.shared_memory()) std::abort();  // the fixture itself is broken
    }
    return fx;
  }();
  return *f;
}

// One unary call with raw request bytes; returns when answered or after the deadline.
std::future<grpc::Status> call(const std::string& bytes, uint8_t auth) {
  auto promise = std::make_shared<std::promise<grpc::Status>>();
  auto ctx = std::make_shared<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  if (auth == 0) ctx->AddMetadata("authorization", std::string("Bearer ") + kToken);
  if (auth == 1) ctx->AddMetadata("authorization", "Bearer wrong");
  grpc::Slice slice(bytes.data(), bytes.size());
  auto request = std::make_shared<grpc::ByteBuffer>(&slice, 1);
  auto response = std::make_shared<grpc::ByteBuffer>();
  fixture().stub->UnaryCall(ctx.get(), kMethod, grpc::StubOptions(), request.get(), response.get(),
                            [promise, ctx, request, response](grpc::Status s) { promise->set_value(s); });
  return promise->get_future();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t auth = data[0] % 3;
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  ddpkit::ps::wire::GradientRequest request;
  const bool parsed = request.ParseFromString(bytes);
  // A shared-memory place names its trainer's attached region (ids are random: a fuzzer would
  // never guess one).
  auto point = [&] {
    const int t = request.trainer_id();
    if (request.has_shared_memory() && (t == 0 || t == 1))
      request.mutable_shared_memory()->set_region(fixture().trainers[t].region.id());
  };
  std::string first_bytes = bytes;
  if (parsed && request.has_shared_memory()) {
    point();
    request.SerializeToString(&first_bytes);
  }
  auto first = call(first_bytes, auth);
  if (parsed) {
    request.set_trainer_id(request.trainer_id() == 0 ? 1 : 0);
    point();
    std::string twin;
    request.SerializeToString(&twin);
    call(twin, auth).wait();
  }
  first.wait();
  return 0;
}
