// The parameter server's shared-memory data path (src/ps/shared_region.h): the same averages as
// in messages, the fallback when slots are busy or the path is off, the server's checks on every
// place a request names, and what the server refuses to map.
#include "harness.h"
#include "ps_harness.h"

#include <ddpkit/ps/parameter_server.h>

#include "parameter_server.grpc.pb.h"
#include "shared_region.h"

#include <grpcpp/grpcpp.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace ddpkit {
namespace {

using namespace std::chrono_literals;
using ps::ClientOptions;
using ps::ParameterServer;
using ps::ParameterServerClient;
using ps::ServerOptions;
using ps::SharedRegion;
using testing::connect;
using testing::start_server;

// Sends every gradient pair through two clients of one server; returns trainer 0's averages.
std::vector<at::Tensor> averages(const std::vector<at::Tensor>& grads0, const std::vector<at::Tensor>& grads1,
                                 ClientOptions options, bool expect_shared, ps::ParameterServerClient::Traffic* traffic) {
  auto server = start_server({0, 1});
  auto a = connect(*server, 0, options), b = connect(*server, 1, options);
  EXPECT_EQ(a->uses_shared_memory(), expect_shared) << a->shared_memory_refused();
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < grads0.size(); ++i) {
    auto fa = a->average(0, static_cast<int64_t>(i), grads0[i]);
    auto fb = b->average(0, static_cast<int64_t>(i), grads1[i]);
    out.push_back(ProcessGroup::wait(fa));
    EXPECT_TRUE(at::equal(ProcessGroup::wait(fb), out.back())) << "bucket " << i;
  }
  *traffic = a->traffic();
  return out;
}

TEST(PsSharedMemory, SameAveragesAsInMessagesForEveryDtypeAndSize) {
  // Whole buckets (0 elements to exactly one chunk) and chunked ones with a short last chunk.
  std::vector<at::Tensor> g0, g1;
  int64_t bytes = 0;
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16})
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(1000), int64_t(4096), int64_t(100003)}) {
      g0.push_back(testing::seeded_randn({n}, 10 * n + 1).to(dtype));
      g1.push_back(testing::seeded_randn({n}, 10 * n + 2).to(dtype));
      bytes += g0.back().nbytes();
    }
  g0.push_back(testing::seeded_randn({7, 5, 3}, 3));  // a whole bucket keeps its shape
  g1.push_back(testing::seeded_randn({7, 5, 3}, 4));
  bytes += g0.back().nbytes();
  const auto options = ClientOptions().chunk_bytes(16384);
  ps::ParameterServerClient::Traffic shared, messages;
  const auto via_shm = averages(g0, g1, options, true, &shared);
  const auto via_messages = averages(g0, g1, ClientOptions(options).shared_memory(false), false, &messages);
  for (size_t i = 0; i < g0.size(); ++i) {
    EXPECT_EQ(via_shm[i].sizes(), g0[i].sizes());
    EXPECT_TRUE(at::equal(via_shm[i], via_messages[i])) << "bucket " << i;
    const auto sum_type = g0[i].scalar_type() == at::kDouble ? at::kDouble : at::kFloat;  // fp16/bf16 sum in fp32
    const at::Tensor mean = (g0[i].to(sum_type) + g1[i].to(sum_type)) / 2;
    EXPECT_TRUE(at::equal(via_shm[i], mean.to(g0[i].scalar_type()))) << "bucket " << i;
  }
  // All data through shared memory; the messages carry dtypes, shapes and places only.
  EXPECT_EQ(shared.shm_bytes_sent, bytes);
  EXPECT_EQ(shared.shm_bytes_received, bytes);
  EXPECT_LT(shared.bytes_sent, shared.calls * 100);
  EXPECT_EQ(messages.shm_bytes_sent + messages.shm_bytes_received, 0);
  EXPECT_GE(messages.bytes_sent, bytes);
}

// One slot and four chunks in flight: chunks that find no free slot go in their messages.
TEST(PsSharedMemory, ChunksWithoutAFreeSlotGoInTheirMessages) {
  const at::Tensor g0 = testing::seeded_randn({100000}, 1), g1 = testing::seeded_randn({100000}, 2);
  ps::ParameterServerClient::Traffic traffic;
  const auto got = averages({g0}, {g1}, ClientOptions().chunk_bytes(4096).chunks_in_flight(4).shared_memory_slots(1),
                            true, &traffic);
  EXPECT_TRUE(at::equal(got[0], (g0 + g1) / 2));
  EXPECT_GT(traffic.shm_bytes_sent, 0);
  EXPECT_GT(traffic.bytes_sent, 4096);
  // Every chunk goes one way or the other (a message's own fields are under 100 bytes).
  const int64_t in_messages = 400000 - traffic.shm_bytes_sent;
  EXPECT_GE(traffic.bytes_sent, in_messages);
  EXPECT_LT(traffic.bytes_sent, in_messages + traffic.calls * 100);
}

TEST(PsSharedMemory, OptionAndEnvironmentTurnItOff) {
  auto server = start_server({0});
  EXPECT_FALSE(connect(*server, 0, ClientOptions().shared_memory(false))->uses_shared_memory());
  EXPECT_FALSE(connect(*server, 0, ClientOptions().chunk_bytes(0))->uses_shared_memory());
  EXPECT_FALSE(connect(*server, 0, ClientOptions().open_session(false))->uses_shared_memory());
  ::setenv("DDPKIT_SHM", "0", 1);
  const bool off = connect(*server, 0)->uses_shared_memory();
  ::unsetenv("DDPKIT_SHM");
  EXPECT_FALSE(off);
  EXPECT_TRUE(connect(*server, 0)->uses_shared_memory());
}

TEST(PsSharedMemory, ServerRefusesWhatItCannotTrust) {
  std::string why;
  SharedRegion mine(4096, 2);
  std::string cookie = mine.cookie();
  EXPECT_TRUE(SharedRegion::attach(::getpid(), mine.fd(), mine.bytes(), cookie, &why)) << why;
  cookie[0] ^= 1;
  EXPECT_FALSE(SharedRegion::attach(::getpid(), mine.fd(), mine.bytes(), cookie, &why));
  EXPECT_THAT(why, ::testing::HasSubstr("cookie differs"));
  EXPECT_FALSE(SharedRegion::attach(::getpid(), mine.fd(), mine.bytes() - 4096, mine.cookie(), &why));
  EXPECT_THAT(why, ::testing::HasSubstr("is not a sealed"));
  EXPECT_FALSE(SharedRegion::attach(::getpid(), 100000, mine.bytes(), mine.cookie(), &why));
  EXPECT_THAT(why, ::testing::HasSubstr("cannot open /proc/"));
  // A memfd whose size is not sealed could shrink under the server's mapping.
  const int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(::ftruncate(unsealed, 8192), 0);
  EXPECT_FALSE(SharedRegion::attach(::getpid(), unsealed, 8192, mine.cookie(), &why));
  EXPECT_THAT(why, ::testing::HasSubstr("is not a sealed 8192-byte memfd"));
  ::close(unsealed);
  EXPECT_FALSE(SharedRegion::attach(::getpid(), mine.fd(), 1 << 20, "short", &why));
  EXPECT_THAT(why, ::testing::HasSubstr("malformed offer"));
}

// A trainer speaking the wire protocol directly, with its own region attached through a session.
struct RawTrainer {
  RawTrainer(const ParameterServer& server, int trainer) : trainer(trainer), region(4096, 4) {
    auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
    stub = ps::wire::ParameterServer::NewStub(channel);
    ps::wire::SessionRequest request;
    request.set_trainer_id(trainer);
    region.offer(request.mutable_shared_memory());
    session = stub->Session(&session_ctx, request);
    ps::wire::SessionEvent event;
    attached = session->Read(&event) && event.shared_memory();
  }
  ~RawTrainer() {
    session_ctx.TryCancel();
    session->Finish();
  }
  // A 4-float gradient of ones at `offset`, described by `edit`ed fields.
  grpc::Status send(int64_t offset, int64_t bytes, const std::function<void(ps::wire::GradientRequest&)>& edit = {},
                    ps::wire::GradientReply* reply = nullptr) {
    ps::wire::GradientRequest r;
    r.set_trainer_id(trainer);
    r.mutable_gradient()->set_dtype(ps::wire::FLOAT32);
    r.mutable_gradient()->add_shape(4);
    r.mutable_shared_memory()->set_region(region.id());
    r.mutable_shared_memory()->set_offset(offset);
    r.mutable_shared_memory()->set_bytes(bytes);
    if (offset >= SharedRegion::kHeaderBytes && offset + 16 <= region.bytes()) {
      const float ones[4] = {1, 1, 1, 1};
      std::memcpy(region.at(offset), ones, sizeof(ones));
    }
    if (edit) edit(r);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 5s);
    ps::wire::GradientReply ignored;
    return stub->AverageGradient(&ctx, r, reply ? reply : &ignored);
  }

  int trainer;
  SharedRegion region;
  std::unique_ptr<ps::wire::ParameterServer::Stub> stub;
  grpc::ClientContext session_ctx;
  std::unique_ptr<grpc::ClientReader<ps::wire::SessionEvent>> session;
  bool attached = false;
};

TEST(PsSharedMemory, EveryPlaceARequestNamesIsChecked) {
  auto server = start_server({0, 1}, ps::ServerKind::kAverage, ServerOptions().max_message_bytes(2048));
  RawTrainer raw(*server, 0);
  ASSERT_TRUE(raw.attached);
  const int64_t slot = SharedRegion::kHeaderBytes;
  auto status = [](const grpc::Status& s) { return s.error_message(); };
  using ::testing::HasSubstr;
  EXPECT_THAT(status(raw.send(slot, 16, [](auto& r) { r.mutable_shared_memory()->set_region(12345); })),
              HasSubstr("its shared-memory region is not attached"));
  EXPECT_THAT(status(raw.send(slot, 16, [](auto& r) { r.set_trainer_id(1); })),  // another trainer's region
              HasSubstr("its shared-memory region is not attached"));
  EXPECT_THAT(status(raw.send(0, 16)), HasSubstr("lie outside its"));  // the header holds the cookie
  EXPECT_THAT(status(raw.send(raw.region.bytes() - 8, 16)), HasSubstr("lie outside its"));
  EXPECT_THAT(status(raw.send(slot, -16)), HasSubstr("lie outside its"));
  EXPECT_THAT(status(raw.send(slot, int64_t(1) << 62)), HasSubstr("lie outside its"));
  EXPECT_THAT(status(raw.send(slot, 12)), HasSubstr("float32[4] in shared memory of 12 bytes (16 needed)"));
  EXPECT_THAT(status(raw.send(slot, 16, [](auto& r) { r.mutable_gradient()->set_data("0123456789abcdef"); })),
              HasSubstr("carries data"));
  EXPECT_THAT(status(raw.send(slot, 16, [](auto& r) { r.mutable_gradient()->set_sparse(true); })),
              HasSubstr("is sparse"));
  EXPECT_THAT(status(raw.send(slot, 4096, [](auto& r) { r.mutable_gradient()->set_shape(0, 1024); })),
              HasSubstr("4096 bytes in shared memory, more than max_message_bytes 2048"));
  EXPECT_EQ(server->counters().gradients_received, 0) << "rejected before they touch any sum";

  // A valid one completes with trainer 1's (sent in a message): the average comes back in the slot.
  auto b = connect(*server, 1, ClientOptions().shared_memory(false));
  auto fb = b->average(0, 0, at::full({4}, 3.0f));
  ps::wire::GradientReply reply;
  ASSERT_TRUE(raw.send(slot, 16, {}, &reply).ok());
  EXPECT_TRUE(reply.in_shared_memory());
  EXPECT_TRUE(reply.average().data().empty());
  EXPECT_TRUE(at::equal(at::from_blob(raw.region.at(slot), {4}), at::full({4}, 2.0f)));
  EXPECT_TRUE(at::equal(ProcessGroup::wait(fb), at::full({4}, 2.0f)));
}

}  // namespace
}  // namespace ddpkit
