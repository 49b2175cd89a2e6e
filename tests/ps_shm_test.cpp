// The parameter server's shared-memory data path (src/ps/shared_region.h): the same averages as
// in messages, the fallback when slots are busy or the path is off, the server's checks on every
// place a request names, and what the server refuses to map; calls posted in mailboxes
// (src/ps/doorbell.h) under deadlines, cancellation and the server's end.
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
#include <thread>

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
    const at::Tensor other = ProcessGroup::wait(fb);
    EXPECT_TRUE(out.back().is_sparse() ? at::equal(other.to_dense(), out.back().to_dense()) : at::equal(other, out.back()))
        << "bucket " << i;
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
  EXPECT_EQ(shared.doorbell_calls, shared.calls) << "every call had a slot, so none needed gRPC";
  EXPECT_EQ(messages.shm_bytes_sent + messages.shm_bytes_received + messages.doorbell_calls, 0);
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
  EXPECT_GT(traffic.doorbell_calls, 0);
  EXPECT_LT(traffic.doorbell_calls, traffic.calls) << "a chunk without a slot goes by gRPC";
}

// `nnz` distinct random rows of a rows x cols sparse gradient, coalesced.
at::Tensor sparse_rows(int64_t rows, int64_t cols, int64_t nnz, uint64_t seed, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor picked = at::randperm(rows, gen, at::kLong).narrow(0, 0, nnz);
  return at::sparse_coo_tensor(picked.view({1, nnz}), at::randn({nnz, cols}, gen).to(dtype), {rows, cols}).coalesce();
}

TEST(PsSharedMemory, SparseGradientsGoByRowRangesThroughSlots) {
  // 1000 rows of 64 floats (256 bytes) with 16 KiB chunks: 16 ranges of 63 rows, each one piece.
  // The trainers' rows differ, so every average is a union; a range of rows 500..699 is empty on
  // both, another gradient has no entries at all, and one small enough goes whole.
  std::vector<at::Tensor> g0, g1;
  int64_t values_bytes = 0, index_bytes = 0;
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    at::Tensor a = sparse_rows(1000, 64, 300, 1, dtype), b = sparse_rows(1000, 64, 450, 2, dtype);
    auto without_rows_500_to_699 = [](const at::Tensor& t) {
      const at::Tensor keep = (t._indices()[0] < 500).logical_or(t._indices()[0] >= 700).nonzero().view({-1});
      return at::sparse_coo_tensor(t._indices().index_select(1, keep), t._values().index_select(0, keep), t.sizes())
          .coalesce();
    };
    g0.push_back(without_rows_500_to_699(a));
    g1.push_back(without_rows_500_to_699(b));
  }
  g0.push_back(at::sparse_coo_tensor(at::empty({1, 0}, at::kLong), at::empty({0, 64}), {1000, 64}).coalesce());
  g1.push_back(sparse_rows(1000, 64, 10, 3, at::kFloat));
  g0.push_back(sparse_rows(10, 4, 3, 4, at::kFloat));  // 160 bytes dense: sent whole
  g1.push_back(sparse_rows(10, 4, 5, 5, at::kFloat));
  for (const at::Tensor& g : g0) {
    values_bytes += g._values().nbytes();
    index_bytes += g._indices().nbytes();
  }
  const auto options = ClientOptions().chunk_bytes(16384);
  ps::ParameterServerClient::Traffic shared, messages;
  const auto via_shm = averages(g0, g1, options, true, &shared);
  const auto via_messages = averages(g0, g1, ClientOptions(options).shared_memory(false), false, &messages);
  int64_t average_values_bytes = 0;
  for (size_t i = 0; i < g0.size(); ++i) {
    ASSERT_TRUE(via_shm[i].is_sparse());
    EXPECT_TRUE(via_shm[i].is_coalesced()) << "bucket " << i;
    EXPECT_EQ(via_shm[i].sizes(), g0[i].sizes());
    EXPECT_EQ(via_shm[i].scalar_type(), g0[i].scalar_type());
    const auto sum_type = g0[i].scalar_type() == at::kDouble ? at::kDouble : at::kFloat;  // fp16/bf16 sum in fp32
    const at::Tensor mean = ((g0[i].to(sum_type) + g1[i].to(sum_type)).coalesce() / 2).to(g0[i].scalar_type());
    EXPECT_TRUE(at::equal(via_shm[i]._indices(), mean._indices())) << "bucket " << i << ": the union of rows";
    EXPECT_TRUE(at::equal(via_shm[i]._values(), mean._values())) << "bucket " << i;
    EXPECT_TRUE(at::equal(via_shm[i].to_dense(), via_messages[i].to_dense())) << "bucket " << i;
    average_values_bytes += via_shm[i]._values().nbytes();
  }
  // Values through shared memory both ways; the messages carry the indices and the headers.
  EXPECT_EQ(shared.shm_bytes_sent, values_bytes);
  EXPECT_EQ(shared.shm_bytes_received, average_values_bytes);
  EXPECT_EQ(shared.calls, 5 * 16 + 1);  // five gradients of 16 ranges, one whole
  EXPECT_LT(shared.bytes_sent, index_bytes + shared.calls * 100);
  EXPECT_EQ(shared.doorbell_calls, shared.calls);
  EXPECT_EQ(messages.shm_bytes_sent + messages.shm_bytes_received + messages.doorbell_calls, 0);
  EXPECT_GE(messages.bytes_sent, values_bytes + index_bytes);
}

// Trainers that cut a sparse gradient differently are told so, by name.
TEST(PsSharedMemory, SparseChunksMustBeCutAlike) {
  auto server = start_server({0, 1});
  auto a = connect(*server, 0, ClientOptions().chunk_bytes(16384)), b = connect(*server, 1, ClientOptions().chunk_bytes(8192));
  const at::Tensor g = sparse_rows(1000, 64, 100, 1, at::kFloat);
  auto fa = a->average(0, 0, g), fb = b->average(0, 0, g);
  // Whichever cut reached a place second is rejected there; a trainer whose pieces were all first
  // waits until the server moves on.
  for (int i = 0; i < 5000 && !fa->completed() && !fb->completed(); ++i) std::this_thread::sleep_for(1ms);
  auto next = b->average(1, 0, at::ones({4}));
  std::string errors;
  for (auto f : {fa, fb}) {
    f->wait();
    if (f->hasError()) errors += f->tryRetrieveErrorMessage();
  }
  EXPECT_THAT(errors, ::testing::HasSubstr("chunks of a 1000-element bucket, the other trainers into"));
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
  EXPECT_TRUE(SharedRegion::attach(::getpid(), mine.fd(), mine.bytes(), cookie, mine.mailboxes(), &why)) << why;
  cookie[0] ^= 1;
  EXPECT_FALSE(SharedRegion::attach(::getpid(), mine.fd(), mine.bytes(), cookie, mine.mailboxes(), &why));
  EXPECT_THAT(why, ::testing::HasSubstr("cookie differs"));
  EXPECT_FALSE(SharedRegion::attach(::getpid(), mine.fd(), mine.bytes() - 4096, mine.cookie(), mine.mailboxes(), &why));
  EXPECT_THAT(why, ::testing::HasSubstr("is not a sealed"));
  EXPECT_FALSE(SharedRegion::attach(::getpid(), 100000, mine.bytes(), mine.cookie(), mine.mailboxes(), &why));
  EXPECT_THAT(why, ::testing::HasSubstr("cannot open /proc/"));
  // A memfd whose size is not sealed could shrink under the server's mapping.
  const int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(::ftruncate(unsealed, 8192), 0);
  EXPECT_FALSE(SharedRegion::attach(::getpid(), unsealed, 8192, mine.cookie(), 0, &why));
  EXPECT_THAT(why, ::testing::HasSubstr("is not a sealed 8192-byte memfd"));
  ::close(unsealed);
  EXPECT_FALSE(SharedRegion::attach(::getpid(), mine.fd(), 1 << 20, "short", 0, &why));
  EXPECT_THAT(why, ::testing::HasSubstr("malformed offer"));
  // Mailboxes that would run past the region, or more than there can be.
  EXPECT_FALSE(SharedRegion::attach(::getpid(), mine.fd(), mine.bytes(), mine.cookie(), 100, &why));
  EXPECT_THAT(why, ::testing::HasSubstr("100 mailboxes"));
  EXPECT_FALSE(SharedRegion::attach(::getpid(), mine.fd(), mine.bytes(), mine.cookie(), -1, &why));
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
    if (offset >= region.first_slot() && offset + 16 <= region.bytes()) {
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
  const int64_t slot = raw.region.first_slot();
  auto status = [](const grpc::Status& s) { return s.error_message(); };
  using ::testing::HasSubstr;
  EXPECT_THAT(status(raw.send(slot, 16, [](auto& r) { r.mutable_shared_memory()->set_region(12345); })),
              HasSubstr("its shared-memory region is not attached"));
  EXPECT_THAT(status(raw.send(slot, 16, [](auto& r) { r.set_trainer_id(1); })),  // another trainer's region
              HasSubstr("its shared-memory region is not attached"));
  EXPECT_THAT(status(raw.send(0, 16)), HasSubstr("lie outside its"));  // the header holds the cookie
  EXPECT_THAT(status(raw.send(SharedRegion::kHeaderBytes, 16)), HasSubstr("lie outside its"));  // the mailboxes
  EXPECT_THAT(status(raw.send(raw.region.bytes() - 8, 16)), HasSubstr("lie outside its"));
  EXPECT_THAT(status(raw.send(slot, -16)), HasSubstr("lie outside its"));
  EXPECT_THAT(status(raw.send(slot, int64_t(1) << 62)), HasSubstr("lie outside its"));
  EXPECT_THAT(status(raw.send(slot, 12)), HasSubstr("float32[4] in shared memory of 12 bytes (16 needed)"));
  EXPECT_THAT(status(raw.send(slot, 16, [](auto& r) { r.mutable_gradient()->set_data("0123456789abcdef"); })),
              HasSubstr("carries data"));
  EXPECT_THAT(status(raw.send(slot, 16, [](auto& r) { r.mutable_gradient()->set_sparse(true); })),
              HasSubstr("bad sparse layout"));
  EXPECT_THAT(status(raw.send(slot, 16, [](auto& r) { r.mutable_shared_memory()->set_capacity(8); })),
              HasSubstr("of room 8) lie outside its"));
  EXPECT_THAT(status(raw.send(slot, 16, [&](auto& r) { r.mutable_shared_memory()->set_capacity(raw.region.bytes()); })),
              HasSubstr("lie outside its"));
  // Sparse: rows 2 and 3 of a 4 x 1 gradient cut into 2 ranges of 2 rows, its values in the slot.
  auto sparse = [](int64_t chunk, std::vector<int64_t> rows, int64_t bytes) {
    return [=](ps::wire::GradientRequest& r) {
      r.mutable_gradient()->add_shape(1);
      r.mutable_gradient()->set_sparse(true);
      r.mutable_gradient()->set_sparse_dim(1);
      r.mutable_gradient()->set_nnz(static_cast<int64_t>(rows.size()));
      r.mutable_gradient()->set_indices(std::string(reinterpret_cast<const char*>(rows.data()), rows.size() * 8));
      r.set_chunk_index(chunk);
      r.set_chunk_count(2);
      r.set_bucket_numel(4);
      r.mutable_shared_memory()->set_bytes(bytes);
    };
  };
  EXPECT_THAT(status(raw.send(slot, 8, sparse(0, {2, 3}, 8))),
              HasSubstr("rows 2..3 lie outside the chunk's rows 0..1"));
  EXPECT_THAT(status(raw.send(slot, 8, sparse(1, {2, 3}, 4))), HasSubstr("needs 16 bytes of indices and 8 of values"));
  EXPECT_THAT(status(raw.send(slot, 8, sparse(1, {2, 3}, 12))), HasSubstr("has 8 bytes of values, its place 12"));
  EXPECT_THAT(status(raw.send(slot, 8, [&](auto& r) {
                sparse(1, {2, 3}, 8)(r);
                r.mutable_gradient()->set_sparse_dim(2);
              })),
              HasSubstr("a sparse chunk must have sparse_dim 1"));
  // Rows outside the shape (the client refuses to send them; a raw trainer can).
  EXPECT_THAT(status(raw.send(slot, 8, [&](auto& r) {
                sparse(0, {0, 9}, 8)(r);
                r.set_chunk_count(0);
                r.set_bucket_numel(0);
              })),
              HasSubstr("found index 9"));
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

// ---- calls posted in mailboxes ------------------------------------------------------------------

std::string failure(const FuturePtr& f) {
  return testing::error_of([&] { ProcessGroup::wait(f); });
}

// A trainer whose deadline passes gives up there, and its raised cancel flag fails the batch for
// the trainers waiting with it at once, as a cancelled gRPC call does; nobody waits for the
// server's bucket timeout.
TEST(PsDoorbell, AGivenUpCallFailsTheBatchForTheOthers) {
  auto server = start_server({0, 1, 2}, ps::ServerKind::kAverage, ServerOptions().bucket_timeout(60s));
  auto a = connect(*server, 0, ClientOptions().timeout(300ms)), b = connect(*server, 1);
  ASSERT_TRUE(a->uses_shared_memory() && b->uses_shared_memory());
  const auto start = std::chrono::steady_clock::now();
  auto fb = b->average(0, 0, at::ones({4}));
  EXPECT_THAT(failure(a->average(0, 0, at::ones({4}))), ::testing::HasSubstr("DEADLINE_EXCEEDED"));
  EXPECT_THAT(failure(fb), ::testing::HasSubstr("ABORTED: trainer 0 gave up on bucket 0 of batch 0"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s) << "not the 60 s bucket timeout";
  EXPECT_EQ(a->traffic().doorbell_calls + b->traffic().doorbell_calls, 0) << "no call completed";
  EXPECT_EQ(server->counters().gradients_received, 2) << "both went by doorbell and reached the server";
}

// Calls waiting in mailboxes when the server shuts down are answered there, and a client whose
// session is gone fails what it had posted instead of waiting for its deadline.
TEST(PsDoorbell, TheServersEndFailsPostedCalls) {
  auto server = start_server({0, 1});
  auto a = connect(*server, 0, ClientOptions().timeout(60s));
  auto waiting = a->average(0, 0, at::ones({4}));
  for (int i = 0; i < 5000 && server->counters().gradients_received < 1; ++i) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(server->counters().gradients_received, 1);
  const auto start = std::chrono::steady_clock::now();
  server->shutdown();
  EXPECT_THAT(failure(waiting), ::testing::HasSubstr("UNAVAILABLE: the parameter server is shutting down"));
  // The session has ended: a call posted now has nobody to answer it.
  EXPECT_THAT(failure(a->average(0, 1, at::ones({4}))), ::testing::HasSubstr("UNAVAILABLE"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s) << "not the 60 s deadline";
}

// Gradients from mailboxes and from gRPC meet in the same buckets.
TEST(PsDoorbell, MailboxAndGrpcTrainersAverageTogether) {
  auto server = start_server({0, 1});
  auto a = connect(*server, 0), b = connect(*server, 1, ClientOptions().shared_memory(false));
  for (int64_t batch = 0; batch < 3; ++batch) {
    const at::Tensor ga = testing::seeded_randn({50000}, 2 * batch + 1), gb = testing::seeded_randn({50000}, 2 * batch + 2);
    auto fa = a->average(batch, 0, ga), fb = b->average(batch, 0, gb);
    const at::Tensor mean = (ga + gb) / 2;
    EXPECT_TRUE(at::equal(ProcessGroup::wait(fa), mean));
    EXPECT_TRUE(at::equal(ProcessGroup::wait(fb), mean));
  }
  EXPECT_EQ(a->traffic().doorbell_calls, a->traffic().calls);
  EXPECT_EQ(b->traffic().doorbell_calls, 0);
}

}  // namespace
}  // namespace ddpkit
