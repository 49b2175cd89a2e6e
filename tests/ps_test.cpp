// The parameter server: averages against a local computation, every rejected input, a killed
// trainer, tokens and TLS, and the rpc / sparse_rpc / hybrid hooks against allreduce.
// A killed trainer needs a real process: the binary re-executes itself with
// DDPKIT_PS_TEST_TRAINER=<address> as that trainer.
#include "harness.h"
#include "ps_harness.h"

#include <ddpkit/ps/parameter_server.h>
#include <ddpkit/ps/trainer_hooks.h>

#include <torch/nn/modules/embedding.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <sys/wait.h>
#include <unistd.h>

namespace ddpkit {
namespace {

using namespace std::chrono_literals;
using ps::ClientOptions;
using ps::ParameterServer;
using ps::ParameterServerClient;
using ps::ServerKind;
using ps::ServerOptions;
using testing::connect;
using testing::error_of;
using testing::seeded_randn;
using testing::start_server;

// Calls from one client may be served in any order: tests whose point is an order wait for the
// server to have taken the earlier ones.
// A chunked gradient counts as received at its first chunk: `bytes` (in messages or shared
// memory) waits for the rest too.
void wait_received(const ParameterServer& server, int64_t count, int64_t bytes = 0) {
  auto received = [&] {
    const auto c = server.counters();
    return c.bytes_received + c.shm_bytes_received;
  };
  auto done = [&] { return server.counters().gradients_received >= count && received() >= bytes; };
  for (int i = 0; i < 5000 && !done(); ++i) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(done()) << "the server took " << server.counters().gradients_received << " gradient(s), "
                      << received() << " bytes; expected " << count << ", " << bytes;
}

at::Tensor sparse_gradient(int64_t rows, int64_t cols, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor idx = at::randint(rows, {1, rows / 3}, gen);  // repeats: coalescing must add them
  at::Tensor values = at::randn({rows / 3, cols}, gen);
  return at::sparse_coo_tensor(idx, values, {rows, cols});
}

// Every trainer sends its own gradient for `buckets` buckets of `batches` batches; every reply
// must be the mean over the trainers of its server.
void check_averages(int ntrainer, int nserver, ServerKind kind, bool sparse) {
  std::vector<std::unique_ptr<ParameterServer>> servers;
  for (int s = 0; s < nserver; ++s) servers.push_back(start_server(ps::trainers_of_server(s, ntrainer, nserver), kind));
  std::vector<std::shared_ptr<ParameterServerClient>> clients;
  for (int t = 0; t < ntrainer; ++t)
    clients.push_back(connect(*servers[ps::server_for_trainer(t, ntrainer, nserver)], t));
  auto gradient = [&](int t, int64_t batch, int64_t bucket) {
    const uint64_t seed = 1000 * t + 10 * batch + bucket;
    return sparse ? sparse_gradient(30, 4, seed) : seeded_randn({257}, seed);
  };
  for (int64_t batch = 0; batch < 3; ++batch) {
    std::vector<std::vector<FuturePtr>> futures(ntrainer);
    for (int64_t bucket = 0; bucket < 2; ++bucket)
      for (int t = ntrainer - 1; t >= 0; --t)  // arrival order differs from trainer order
        futures[t].push_back(clients[t]->average(batch, bucket, gradient(t, batch, bucket)));
    for (int t = 0; t < ntrainer; ++t)
      for (int64_t bucket = 0; bucket < 2; ++bucket) {
        at::Tensor expected;
        auto peers = ps::trainers_of_server(ps::server_for_trainer(t, ntrainer, nserver), ntrainer, nserver);
        for (int p : peers) {
          at::Tensor g = gradient(p, batch, bucket);
          expected = expected.defined() ? expected + g : g;
        }
        expected = expected / static_cast<double>(peers.size());
        at::Tensor got = ProcessGroup::wait(futures[t][bucket]);
        ASSERT_EQ(got.is_sparse(), sparse);
        if (sparse) {
          got = got.to_dense();
          expected = expected.to_dense();
        }
        EXPECT_TRUE(at::allclose(got, expected, 1e-6, 1e-6))
            << "trainer " << t << " batch " << batch << " bucket " << bucket << " max diff "
            << (got - expected).abs().max().item<double>();
      }
  }
  int64_t averaged = 0;
  for (auto& s : servers) averaged += s->counters().buckets_averaged;
  EXPECT_EQ(averaged, 3 * 2 * nserver);
}

struct Shape {
  int trainers, servers;
};
class Averaging : public ::testing::TestWithParam<std::tuple<Shape, ServerKind, bool>> {};

TEST_P(Averaging, RepliesAreTheMeanOfTheServersTrainers) {
  auto [shape, kind, sparse] = GetParam();
  check_averages(shape.trainers, shape.servers, kind, sparse);
}

INSTANTIATE_TEST_SUITE_P(TrainersServersKinds, Averaging,
                         ::testing::Combine(::testing::Values(Shape{1, 1}, Shape{2, 1}, Shape{3, 1}, Shape{4, 1},
                                                              Shape{2, 2}, Shape{4, 2}),
                                            ::testing::Values(ServerKind::kAverage, ServerKind::kAverageBatch),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           const Shape s = std::get<0>(info.param);
                           return std::to_string(s.trainers) + "x" + std::to_string(s.servers) + "_" +
                                  ps::server_kind_name(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_sparse" : "_dense");
                         });

TEST(ParameterServer, HundredMegabyteBucket) {
  auto server = start_server({0, 1});
  auto a = connect(*server, 0), b = connect(*server, 1);
  at::Tensor ga = at::full({25 * 1000 * 1000}, 1.0f), gb = at::full({25 * 1000 * 1000}, 3.0f);
  auto fa = a->average(0, 0, ga, ga), fb = b->average(0, 0, gb);
  EXPECT_TRUE(at::equal(ProcessGroup::wait(fa), at::full_like(ga, 2.0f)));
  EXPECT_TRUE(at::equal(ProcessGroup::wait(fb), at::full_like(gb, 2.0f)));
  EXPECT_EQ(ga.data_ptr<float>()[12345], 2.0f);  // `into` received the average
}

// A bucket larger than chunk_bytes goes as chunks on parallel calls: same average as a bucket
// sent whole (both server kinds, into or not), and the server holds a few chunks, not the bucket.
TEST(ParameterServer, ChunkedBucketsAverageLikeWholeOnesInBoundedMemory) {
  for (ServerKind kind : {ServerKind::kAverage, ServerKind::kAverageBatch}) {
    auto server = start_server({0, 1}, kind);
    const int64_t chunk = 1 << 20;
    auto a = connect(*server, 0, ClientOptions().chunk_bytes(chunk).chunks_in_flight(2));
    auto b = connect(*server, 1, ClientOptions().chunk_bytes(chunk).chunks_in_flight(2));
    const int64_t n = 1000 * 10007;  // 40 MB: 39 chunks, the last one short
    at::Tensor ga = seeded_randn({n}, 1), gb = seeded_randn({n}, 2).view({1000, -1}).t();  // strided, 2-D
    at::Tensor want = (ga + gb.reshape({-1})) / 2;  // elementwise in row-major order
    at::Tensor into = at::empty({n});
    auto fa = a->average(0, 0, ga, into), fb = b->average(0, 0, gb);
    EXPECT_TRUE(at::equal(ProcessGroup::wait(fa), want));
    EXPECT_TRUE(at::equal(into, want));
    at::Tensor rb = ProcessGroup::wait(fb);
    EXPECT_EQ(rb.sizes(), gb.sizes());
    EXPECT_TRUE(at::equal(rb, want.view(gb.sizes())));
    const auto c = server->counters();
    EXPECT_EQ(c.buckets_averaged, 1);
    EXPECT_EQ(c.gradients_received, 2);
    EXPECT_GT(c.peak_bytes_held, 0);
    // Each trainer has at most two chunks in flight: requests and sums of ~6 chunks at worst.
    EXPECT_LE(c.peak_bytes_held, 8 * chunk) << ps::server_kind_name(kind);
    EXPECT_EQ(a->traffic().calls, (n * 4 + chunk - 1) / chunk);
  }
}

TEST(ParameterServer, ChunkedLowPrecisionSumsInFloat32) {
  auto server = start_server({0, 1});
  auto a = connect(*server, 0, ClientOptions().chunk_bytes(256)), b = connect(*server, 1, ClientOptions().chunk_bytes(256));
  at::Tensor g = at::full({1000}, 65504.0f).to(at::kHalf);
  auto fa = a->average(0, 0, g), fb = b->average(0, 0, g);
  EXPECT_TRUE(at::equal(ProcessGroup::wait(fa), g));
  EXPECT_TRUE(at::equal(ProcessGroup::wait(fb), g));
  EXPECT_EQ(server->counters().buckets_averaged, 1);
}

TEST(ParameterServer, LowPrecisionGradientsAreSummedInFloat32) {
  auto server = start_server({0, 1});
  auto a = connect(*server, 0), b = connect(*server, 1);
  // 65504 is float16's largest value: a float16 sum of two would be inf.
  auto fa = a->average(0, 0, at::full({8}, 65504.0f).to(at::kHalf));
  auto fb = b->average(0, 0, at::full({8}, 65504.0f).to(at::kHalf));
  at::Tensor r = ProcessGroup::wait(fa);
  EXPECT_EQ(r.scalar_type(), at::kHalf);
  EXPECT_TRUE(at::equal(r, at::full({8}, 65504.0f).to(at::kHalf)));
  EXPECT_TRUE(at::equal(r, ProcessGroup::wait(fb)));
}

// ---- rejected inputs ---------------------------------------------------------------------------

std::string failure(const FuturePtr& f) {
  return error_of([&] { ProcessGroup::wait(f); });
}

TEST(ParameterServerRejects, UnknownTrainer) {
  auto server = start_server({0, 1});
  auto stranger = connect(*server, 7, ClientOptions().open_session(false));
  EXPECT_THAT(failure(stranger->average(0, 0, at::ones({4}))),
              ::testing::HasSubstr("INVALID_ARGUMENT: trainer 7 is not served here (this server serves trainers 0, 1)"));
}

TEST(ParameterServerRejects, DuplicateShapeDtypeAndLayoutMismatchWithoutCorruptingTheAverage) {
  auto server = start_server({0, 1});
  auto a = connect(*server, 0), b = connect(*server, 1);
  auto first = a->average(0, 0, at::full({4}, 1.0f));
  wait_received(*server, 1);
  EXPECT_THAT(failure(a->average(0, 0, at::full({4}, 100.0f))),
              ::testing::HasSubstr("ALREADY_EXISTS: trainer 0 already sent bucket 0 of batch 0"));
  EXPECT_THAT(failure(b->average(0, 0, at::full({5}, 100.0f))),
              ::testing::HasSubstr("INVALID_ARGUMENT: trainer 1 sent float32[5] for bucket 0 of batch 0, but the "
                                   "other trainers sent float32[4]"));
  EXPECT_THAT(failure(b->average(0, 0, at::full({4}, 100.0, at::kDouble))),
              ::testing::HasSubstr("trainer 1 sent float64[4] for bucket 0 of batch 0"));
  EXPECT_THAT(failure(b->average(0, 0, at::full({4}, 100.0f).to_sparse())),
              ::testing::HasSubstr("trainer 1 sent sparse float32[4]"));
  auto second = b->average(0, 0, at::full({4}, 3.0f));
  EXPECT_TRUE(at::equal(ProcessGroup::wait(first), at::full({4}, 2.0f)));
  EXPECT_TRUE(at::equal(ProcessGroup::wait(second), at::full({4}, 2.0f)));
}

TEST(ParameterServerRejects, TrainersThatCutABucketDifferently) {
  auto server = start_server({0, 1});
  auto a = connect(*server, 0, ClientOptions().chunk_bytes(4000)), b = connect(*server, 1, ClientOptions().chunk_bytes(4000));
  auto first = a->average(0, 2, at::ones({3000}));  // 3 chunks of 1000
  wait_received(*server, 1, 3000 * 4);  // all of them: else b's last chunk may be first at its place
  EXPECT_THAT(failure(b->average(0, 2, at::ones({2500}))),  // 3 chunks of 1000, 1000, 500
              ::testing::HasSubstr("INVALID_ARGUMENT: trainer 1 cut bucket 2 of batch 0 into 3 chunks of a 2500-element "
                                   "bucket, the other trainers into 3 of 3000"));
  auto next = b->average(1, 0, at::ones({4}));  // moves the server on: `first` fails
  EXPECT_THAT(failure(first), ::testing::HasSubstr("superseded by batch 1"));
}

TEST(ParameterServerRejects, StaleBatchAndSupersededWaiters) {
  auto server = start_server({0, 1});
  auto a = connect(*server, 0), b = connect(*server, 1);
  auto waiting = a->average(3, 0, at::ones({4}));
  wait_received(*server, 1);
  auto newer = b->average(5, 0, at::ones({4}));  // the server moves to batch 5
  EXPECT_THAT(failure(waiting), ::testing::HasSubstr("ABORTED: batch 3 was superseded by batch 5"));
  EXPECT_THAT(failure(a->average(4, 1, at::ones({4}))),
              ::testing::HasSubstr("FAILED_PRECONDITION: trainer 0 sent bucket 1 of batch 4, but the server has moved on to batch 5"));
  auto fine = a->average(5, 0, at::full({4}, 3.0f));
  EXPECT_TRUE(at::equal(ProcessGroup::wait(fine), at::full({4}, 2.0f)));
  EXPECT_TRUE(at::equal(ProcessGroup::wait(newer), at::full({4}, 2.0f)));
}

// The limit bounds a chunk's data whichever way it travels (in the message or shared memory).
TEST(ParameterServerRejects, OversizedMessage) {
  for (bool shared : {true, false}) {
    auto server = start_server({0}, ServerKind::kAverage, ServerOptions().max_message_bytes(1 << 19));
    auto a = connect(*server, 0, ClientOptions().max_message_bytes(64 << 20).shared_memory(shared));
    ASSERT_EQ(a->uses_shared_memory(), shared);
    EXPECT_THAT(failure(a->average(0, 0, at::ones({1 << 19}))), ::testing::HasSubstr("RESOURCE_EXHAUSTED"));
    // The server is still serving; a message under the limit works.
    EXPECT_TRUE(at::equal(ProcessGroup::wait(a->average(0, 0, at::ones({1000}))), at::ones({1000})));
  }
}

TEST(ParameterServerRejects, SparseIndicesOutsideTheShape) {
  auto server = start_server({0});
  auto a = connect(*server, 0);
  at::Tensor bad = at::_sparse_coo_tensor_unsafe(at::tensor(std::vector<int64_t>{0, 9}).view({1, 2}), at::ones({2, 3}), {4, 3});
  // The client names the row before anything is sent; the server's own check, against a trainer
  // that sends such rows anyway, is in PsSharedMemory.EveryPlaceARequestNamesIsChecked.
  EXPECT_THAT(testing::error_of([&] { a->average(0, 0, bad); }), ::testing::HasSubstr("entry 1 has row 9, outside [0, 4)"));
  EXPECT_EQ(server->counters().gradients_received, 0);
}

TEST(ParameterServerRejects, IncompleteBucketTimesOutForTheWaiters) {
  auto server = start_server({0, 1}, ServerKind::kAverage, ServerOptions().bucket_timeout(300ms));
  auto a = connect(*server, 0);
  EXPECT_THAT(failure(a->average(0, 0, at::ones({4}))),
              ::testing::HasSubstr("DEADLINE_EXCEEDED: bucket 0 of batch 0: trainer(s) 1 did not send within 300 ms"));
}

TEST(ParameterServerRejects, ClientDeadline) {
  auto server = start_server({0, 1});
  auto a = connect(*server, 0, ClientOptions().timeout(300ms));
  EXPECT_THAT(failure(a->average(0, 0, at::ones({4}))), ::testing::HasSubstr("DEADLINE_EXCEEDED"));
}

TEST(ParameterServerSecurity, TokenIsRequired) {
  auto server = start_server({0}, ServerKind::kAverage, ServerOptions().token("s3cret"));
  auto none = connect(*server, 0, ClientOptions().open_session(false));
  EXPECT_THAT(failure(none->average(0, 0, at::ones({4}))), ::testing::HasSubstr("UNAUTHENTICATED: this parameter server requires a token"));
  auto wrong = connect(*server, 0, ClientOptions().token("s3creT").open_session(false));
  EXPECT_THAT(failure(wrong->average(0, 0, at::ones({4}))), ::testing::HasSubstr("UNAUTHENTICATED: wrong token"));
  EXPECT_THAT(error_of([&] { wrong->get_metrics(); }), ::testing::HasSubstr("UNAUTHENTICATED"));
  EXPECT_THAT(error_of([&] { wrong->reset_state(); }), ::testing::HasSubstr("UNAUTHENTICATED"));
  auto right = connect(*server, 0, ClientOptions().token("s3cret"));
  EXPECT_TRUE(at::equal(ProcessGroup::wait(right->average(0, 0, at::ones({4}))), at::ones({4})));
  EXPECT_EQ(right->get_metrics().counters.buckets_averaged, 1);
}

TEST(ParameterServerSecurity, Tls) {
  char dir[] = "/tmp/ddpkit_tls_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string d = dir;
  const std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -addext "
                          "subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " + d + "/key.pem -out " + d +
                          "/cert.pem >/dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "openssl could not make a test certificate";
  auto tls = ps::TlsFiles().certificate(d + "/cert.pem").private_key(d + "/key.pem");
  auto server = start_server({0}, ServerKind::kAverage, ServerOptions().tls(tls));
  auto secure = connect(*server, 0, ClientOptions().tls(ps::TlsFiles().root_certificate(d + "/cert.pem")));
  EXPECT_TRUE(at::equal(ProcessGroup::wait(secure->average(0, 0, at::ones({4}))), at::ones({4})));
  EXPECT_THAT(error_of([&] { connect(*server, 0, ClientOptions().connect_timeout(500ms)); }),
              ::testing::HasSubstr("could not connect to the parameter server"));
  std::system(("rm -rf " + d).c_str());
}

TEST(ParameterServer, ResetStateAndMetrics) {
  auto server = start_server({0, 1}, ServerKind::kAverageBatch);
  auto a = connect(*server, 0), b = connect(*server, 1);
  for (int64_t batch = 0; batch < 2; ++batch) {
    auto fa = a->average(batch, 0, at::ones({16})), fb = b->average(batch, 0, at::ones({16}));
    ProcessGroup::wait(fa);
    ProcessGroup::wait(fb);
  }
  auto m = a->get_metrics();
  EXPECT_EQ(m.counters.buckets_averaged, 2);
  EXPECT_EQ(m.counters.gradients_received, 4);
  // Trainers on the server's host: the data goes through shared memory, not in the messages.
  EXPECT_EQ(m.counters.shm_bytes_received, 4 * 16 * 4);
  EXPECT_EQ(m.counters.shm_bytes_sent, 4 * 16 * 4);
  EXPECT_EQ(m.counters.bytes_received + m.counters.bytes_sent, 0);
  for (const char* name : {"param_index_straggler", "param_index_batch", "average computation"})
    EXPECT_EQ(m.series[name].size(), 2u) << name;
  a->reset_state();
  m = b->get_metrics();
  EXPECT_EQ(m.counters.buckets_averaged, 0);
  EXPECT_TRUE(m.series.empty());
  // After a reset the server starts again from batch 0.
  auto fa = a->average(0, 0, at::ones({16})), fb = b->average(0, 0, at::ones({16}));
  EXPECT_TRUE(at::equal(ProcessGroup::wait(fa), at::ones({16})));
  ProcessGroup::wait(fb);
}

TEST(ParameterServer, BadOptionsAreNamed) {
  EXPECT_THAT(error_of([] { ParameterServer s{ServerOptions()}; }), ::testing::HasSubstr("trainer_ids is empty"));
  EXPECT_THAT(error_of([] { ParameterServer s(ServerOptions().trainer_ids({1, 1})); }), ::testing::HasSubstr("duplicates"));
  EXPECT_THAT(error_of([] { ps::server_for_trainer(0, 3, 2); }), ::testing::HasSubstr("must be a positive multiple of the server count 2"));
  EXPECT_THAT(error_of([] { ps::server_kind_from_name("median"); }), ::testing::HasSubstr("unknown parameter server class 'median'"));
  EXPECT_THAT(error_of([] {
                auto s = start_server({0});
                auto busy = std::make_unique<ParameterServer>(ServerOptions().trainer_ids({0}).address(s->address()));
                busy->start();
              }),
              ::testing::HasSubstr("cannot listen on"));
}

// ---- a trainer that dies -----------------------------------------------------------------------

int run_doomed_trainer(const std::string& address) {
  // Sends bucket 0 of batch 0 with the test's trainer 0, says so (and whether the server mapped
  // this process's shared-memory region), then waits to be killed.
  ParameterServerClient client(ClientOptions().address(address).trainer_id(1));
  ProcessGroup::wait(client.average(0, 0, at::ones({4})));
  std::printf("ready%s\n", client.uses_shared_memory() ? " shm" : "");
  std::fflush(stdout);
  pause();
  return 0;
}

// A trainer that reconnects (a restarted process, a new client) within the reconnect grace is not
// taken for dead, even when its peer's next request arrives before its new session opens.
TEST(ParameterServer, TrainerReconnectingWithinTheGraceIsNotTakenForDead) {
  auto server = start_server({0, 1});
  auto a = connect(*server, 0);
  {
    auto b = connect(*server, 1);
    auto fa = a->average(0, 0, at::ones({4}));
    ProcessGroup::wait(b->average(0, 0, at::ones({4})));
    ProcessGroup::wait(fa);
  }  // trainer 1's client, and its session, are gone
  auto fa = a->average(1, 0, at::full({4}, 3.0));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto b = connect(*server, 1);
  ProcessGroup::wait(b->average(1, 0, at::ones({4})));
  EXPECT_TRUE(at::equal(ProcessGroup::wait(fa), at::full({4}, 2.0)));
}

TEST(ParameterServer, KilledTrainerFailsTheBatchForTheOthers) {
  auto server = start_server({0, 1});
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    setenv("DDPKIT_PS_TEST_TRAINER", server->address().c_str(), 1);
    execl("/proc/self/exe", "ddpkit_ps_tests", nullptr);
    _exit(127);
  }
  close(out[1]);
  auto a = connect(*server, 0);
  ProcessGroup::wait(a->average(0, 0, at::ones({4})));
  char buf[16] = {};
  ASSERT_GT(read(out[0], buf, sizeof(buf) - 1), 0);
  ASSERT_STREQ(buf, "ready shm\n") << "a trainer process on the server's host passes data through shared memory";
  auto waiting = a->average(0, 1, at::ones({4}));  // trainer 1 will never send bucket 1
  wait_received(*server, 3);
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  close(out[0]);
  EXPECT_THAT(failure(waiting), ::testing::HasSubstr("UNAVAILABLE: trainer 1 disconnected before sending bucket 1 of batch 0"));
  // And later buckets of the batch fail at once rather than waiting for the dead trainer.
  EXPECT_THAT(failure(a->average(0, 2, at::ones({4}))), ::testing::HasSubstr("UNAVAILABLE"));
}

// ---- the hooks against allreduce ---------------------------------------------------------------

// DummyModelSparse in small: a sparse EmbeddingBag, then Linear layers.
struct TinySparseModel : torch::nn::Module {
  TinySparseModel(bool sparse) {
    bag = register_module("bag", torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(50, 16)
                                                             .mode(torch::kMean)
                                                             .sparse(sparse)));
    fc1 = register_module("fc1", torch::nn::Linear(16, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::relu(fc1(bag(x)))); }
  torch::nn::EmbeddingBag bag{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// Gradients (dense form) after two steps of SGD-free backward with `hook`.
std::vector<at::Tensor> hook_gradients(const std::string& hook, int world, int nserver, bool sparse) {
  std::vector<std::unique_ptr<ParameterServer>> servers;
  if (hook == "rpc" || hook == "sparse_rpc")
    for (int s = 0; s < nserver; ++s) servers.push_back(start_server(ps::trainers_of_server(s, world, nserver)));
  std::vector<std::vector<at::Tensor>> grads(world);
  testing::spawn_ranks(world, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    std::shared_ptr<TinySparseModel> model;
    {
      std::lock_guard<std::mutex> lock(testing::seed_mutex());
      torch::manual_seed(7);
      model = std::make_shared<TinySparseModel>(sparse);
    }
    DistributedDataParallel<std::shared_ptr<TinySparseModel>> ddp(model, pg, DistributedDataParallelOptions().bucket_cap_mb(0.001).first_bucket_cap_mb(0.001));
    std::shared_ptr<ProcessGroup> second;
    if (hook == "rpc") {
      ddp.register_comm_hook(ps::rpc_hook(connect(*servers[ps::server_for_trainer(rank, world, nserver)], rank)), hook);
    } else if (hook == "sparse_rpc") {
      ddp.register_comm_hook(
          ps::sparse_rpc_hook(connect(*servers[ps::server_for_trainer(rank, world, nserver)], rank), pg), hook);
    } else if (hook == "hybrid") {
      second = std::make_shared<ProcessGroup>(pg->store(), rank, world, ProcessGroupOptions().gloo_hostname("127.0.0.1").group_name("sparse"));
      ddp.register_comm_hook(ps::hybrid_hook(second, pg), hook);
    }
    for (int step = 0; step < 2; ++step) {
      for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * rank + step);
      at::Tensor x = at::randint(50, {8, 5}, gen);
      ddp.forward(x).pow(2).mean().backward();
    }
    for (auto& p : model->parameters()) grads[rank].push_back(p.grad().is_sparse() ? p.grad().to_dense() : p.grad().clone());
  });
  // The ranks a server serves end with the same gradients. (With several servers each group of
  // trainers averages on its own, as in the seed benchmark: groups differ.)
  for (int r = 1; r < world; ++r) {
    const int first = ps::trainers_of_server(ps::server_for_trainer(r, world, nserver), world, nserver)[0];
    for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_TRUE(at::allclose(grads[r][i], grads[first][i], 1e-6, 1e-6));
  }
  return grads[0];
}

class HookParity : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(HookParity, SameGradientsAsAllreduce) {
  auto [hook, world] = GetParam();
  for (bool sparse : {true, false}) {
    auto expected = hook_gradients("", world, 1, sparse);
    {
      const int nserver = 1;
      auto got = hook_gradients(hook, world, nserver, sparse);
      ASSERT_EQ(got.size(), expected.size());
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_TRUE(at::allclose(got[i], expected[i], 1e-6, 1e-6))
            << hook << " parameter " << i << " sparse " << sparse << " servers " << nserver << ": max diff "
            << (got[i] - expected[i]).abs().max().item<double>();
    }
  }
}

TEST(TrainerHooks, TwoServersAverageTheirOwnTrainerGroups) { hook_gradients("rpc", 4, 2, true); }

INSTANTIATE_TEST_SUITE_P(Hooks, HookParity,
                         ::testing::Combine(::testing::Values("rpc", "sparse_rpc", "hybrid"), ::testing::Values(2, 4)),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)); });

TEST(TrainerHooks, RecordHookMetrics) {
  auto server = start_server({0});
  auto log = std::make_shared<metrics::MetricsLogger>(0);
  testing::spawn_ranks(1, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto model = std::make_shared<TinySparseModel>(true);
    DistributedDataParallel<std::shared_ptr<TinySparseModel>> ddp(model, pg);
    ddp.register_comm_hook(ps::rpc_hook(connect(*server, 0), log), "rpc");
    for (int step = 0; step < 3; ++step) ddp.forward(at::randint(50, {4, 3})).sum().backward();
  });
  auto series = log->processed();
  EXPECT_EQ(series["rpc_sparse"].size(), 3u);
  EXPECT_EQ(series["rpc_dense"].size(), 3u);  // the three Linear tensors fit one bucket
  EXPECT_TRUE(log->open_events().empty());
}

}  // namespace
}  // namespace ddpkit

int main(int argc, char** argv) {
  if (const char* address = std::getenv("DDPKIT_PS_TEST_TRAINER")) return ddpkit::run_doomed_trainer(address);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
