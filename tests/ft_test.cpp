// The lighthouse's quorum rule and its checks, in one process: an in-process lighthouse and its
// clients on threads, each client standing for one replica group's rank 0. And the state service
// a heal copies from, on both of its routes, with its refusals.
#include <ddpkit/compat.h>
#include <ddpkit/error.h>
#include <ddpkit/ft/lighthouse.h>

#include "detached.h"
#include "group_beats.h"
#include "lighthouse.grpc.pb.h"
#include "state_transfer.h"
#include "wire.h"

#include <grpcpp/grpcpp.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <mutex>
#include <thread>

namespace ddpkit {
namespace ft {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

GroupInfo group(const std::string& id, int64_t step, int world = 1) {
  GroupInfo g;
  g.group_id = id;
  g.step = step;
  g.world_size = world;
  for (int r = 0; r < world; ++r) {
    g.state_addresses.push_back("127.0.0.1:1" + std::to_string(r));
    g.hosts.push_back("host");
  }
  g.incarnation = id + "-1";
  return g;
}

std::unique_ptr<LighthouseClient> client_of(const Lighthouse& lh, const std::string& token = "") {
  return std::make_unique<LighthouseClient>(LighthouseClientOptions().address(lh.address()).token(token));
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Three groups ask; the quorum lists all of them by id, the highest step, and a heal source for
// the one behind. The same participants keep the id; a lost group changes it.
TEST(Lighthouse, FormsAQuorumOfEveryLiveGroupAndNamesWhoHeals) {
  Lighthouse lh(LighthouseOptions().heartbeat_timeout(400ms).expected_groups(3));
  lh.start();
  auto ask = [&](GroupInfo g) {
    return std::async(std::launch::async, [&lh, g] { return client_of(lh)->quorum(g, 10s); });
  };
  auto a = ask(group("a", 5)), b = ask(group("b", 5)), c = ask(group("c", 3));
  const Quorum qa = a.get(), qb = b.get(), qc = c.get();
  ASSERT_EQ(qa.participants.size(), 3u);
  EXPECT_EQ(qa.participants[0].group_id, "a");
  EXPECT_EQ(qa.participants[2].group_id, "c");
  EXPECT_EQ(qa.max_step, 5);
  EXPECT_EQ(qa.heal_sources[0], -1);
  EXPECT_EQ(qa.heal_sources[1], -1);
  EXPECT_TRUE(qa.heal_sources[2] == 0 || qa.heal_sources[2] == 1);
  EXPECT_EQ(qa.quorum_id, qb.quorum_id);
  EXPECT_EQ(qa.quorum_id, qc.quorum_id);

  // Again, same groups (kept live by their requests and beats): same id.
  auto beats = [&](const std::string& id) { client_of(lh)->heartbeat(id, 0, id + "-1"); };
  beats("a"), beats("b"), beats("c");
  auto a2 = ask(group("a", 6)), b2 = ask(group("b", 6)), c2 = ask(group("c", 6));
  const Quorum same = a2.get();
  b2.get(), c2.get();
  EXPECT_EQ(same.quorum_id, qa.quorum_id);

  // c stops beating: after the heartbeat timeout a and b form a quorum without it, and a's
  // heartbeat reply names it lost.
  std::this_thread::sleep_for(500ms);
  beats("b");
  auto beat = client_of(lh)->heartbeat("a", 0, "a-1");
  EXPECT_THAT(beat.lost, ::testing::Contains("c"));
  auto a3 = ask(group("a", 7)), b3 = ask(group("b", 7));
  const Quorum without = a3.get();
  b3.get();
  EXPECT_EQ(without.participants.size(), 2u);
  EXPECT_NE(without.quorum_id, qa.quorum_id);
  EXPECT_THAT(without.dropped, ::testing::ElementsAre("c"));
}

// An operator sees each quorum change and each lost group as it happens (on_event): b stops
// beating, and within a tick of its heartbeat timeout it is reported lost, naming how long.
TEST(Lighthouse, TellsQuorumChangesAndLostGroupsAsTheyHappen) {
  std::mutex mu;
  std::vector<std::pair<std::chrono::steady_clock::time_point, std::string>> events;
  Lighthouse lh(LighthouseOptions().heartbeat_timeout(300ms).expected_groups(2).on_event([&](const std::string& e) {
    std::lock_guard<std::mutex> lock(mu);
    events.emplace_back(std::chrono::steady_clock::now(), e);
  }));
  lh.start();
  auto qa = std::async(std::launch::async, [&] { return client_of(lh)->quorum(group("a", 0), 10s); });
  auto qb = std::async(std::launch::async, [&] { return client_of(lh)->quorum(group("b", 0), 10s); });
  qa.get(), qb.get();
  auto beater = client_of(lh);
  std::atomic<bool> stop{false};
  std::thread keep_a_alive([&] {
    while (!stop) {
      beater->heartbeat("a", 0, "a-1");
      std::this_thread::sleep_for(50ms);
    }
  });
  auto b = client_of(lh);
  const auto b_silent = std::chrono::steady_clock::now();  // its last beat arrives after this
  b->heartbeat("b", 0, "b-1");
  std::this_thread::sleep_for(450ms);
  const Quorum alone = client_of(lh)->quorum(group("a", 1), 10s);
  std::this_thread::sleep_for(100ms);  // the ticker tells within ~20 ms
  stop = true;
  keep_a_alive.join();
  EXPECT_EQ(alone.participants.size(), 1u);
  std::lock_guard<std::mutex> lock(mu);
  std::vector<std::string> lines;
  for (const auto& e : events) lines.push_back(e.second);
  ASSERT_EQ(lines.size(), 3u) << ::testing::PrintToString(lines);
  EXPECT_EQ(lines[0], "quorum 0: groups [a, b]");
  const std::string told = "group b lost: rank 0 silent for ";
  ASSERT_EQ(lines[1].rfind(told, 0), 0u) << lines[1];
  EXPECT_GE(std::stoi(lines[1].substr(told.size())), 300) << lines[1];
  EXPECT_EQ(lines[2], "quorum 1: groups [a], dropped [b]");
  const auto told_after = std::chrono::duration_cast<std::chrono::milliseconds>(events[1].first - b_silent);
  EXPECT_GE(told_after.count(), 300);
  EXPECT_LT(told_after.count(), 600);  // a 20 ms tick, on a loaded machine
}

// A group that asks to heal (its first quorum under init_sync, or its state found to differ) copies
// from a participant at the quorum's step that did not ask; when every one asked (groups starting
// together), the first by id keeps its state and the others copy it.
TEST(Lighthouse, AGroupAskingToHealCopiesFromOneThatDidNot) {
  auto asking = [](GroupInfo g) {
    g.heal = true;
    return g;
  };
  {
    Lighthouse lh(LighthouseOptions().expected_groups(3));
    lh.start();
    auto a = std::async(std::launch::async, [&] { return client_of(lh)->quorum(asking(group("a", 5)), 10s); });
    auto b = std::async(std::launch::async, [&] { return client_of(lh)->quorum(group("b", 5), 10s); });
    auto c = std::async(std::launch::async, [&] { return client_of(lh)->quorum(asking(group("c", 5)), 10s); });
    const Quorum q = a.get();
    b.get(), c.get();
    EXPECT_THAT(q.heal_sources, ::testing::ElementsAre(1, -1, 1));  // a and c from b, the one that did not ask
  }
  {
    Lighthouse lh(LighthouseOptions().expected_groups(3));
    lh.start();
    auto a = std::async(std::launch::async, [&] { return client_of(lh)->quorum(asking(group("a", 0)), 10s); });
    auto b = std::async(std::launch::async, [&] { return client_of(lh)->quorum(asking(group("b", 0)), 10s); });
    auto c = std::async(std::launch::async, [&] { return client_of(lh)->quorum(asking(group("c", 0)), 10s); });
    const Quorum q = c.get();
    a.get(), b.get();
    EXPECT_THAT(q.heal_sources, ::testing::ElementsAre(-1, 0, 0));  // all asked: a, the first, is kept
  }
}

// A group copying a heal named at the quorum before (async quorum) asks "healing", claiming the
// step it will hold: it is no heal source and its claim is not the quorum's step; a claim the
// others did not reach (its source's step failed) makes it behind, with a source named. The flags
// reach a caller whose reply is a delta too.
TEST(Lighthouse, AHealingGroupIsNoSourceAndAClaimNobodyReachedIsBehind) {
  auto healing = [](GroupInfo g) {
    g.healing = true;
    return g;
  };
  {
    Lighthouse lh(LighthouseOptions().expected_groups(3));
    lh.start();
    auto ca = client_of(lh), cb = client_of(lh), cc = client_of(lh);  // each keeps the quorum it holds
    auto a = std::async(std::launch::async, [&] { return ca->quorum(healing(group("a", 6)), 10s); });
    auto b = std::async(std::launch::async, [&] { return cb->quorum(group("b", 6), 10s); });
    auto c = std::async(std::launch::async, [&] { return cc->quorum(group("c", 2), 10s); });
    const Quorum q = c.get();
    a.get(), b.get();
    EXPECT_EQ(q.max_step, 6);
    EXPECT_THAT(q.heal_sources, ::testing::ElementsAre(-1, -1, 1));  // c copies from b, never from a
    EXPECT_TRUE(q.participants[0].healing);
    // The next step as a delta against it: a still healing (step 7 now), b at 7, c healing too.
    auto a2 = std::async(std::launch::async, [&] { return ca->quorum(healing(group("a", 7)), 10s); });
    auto b2 = std::async(std::launch::async, [&] { return cb->quorum(group("b", 7), 10s); });
    auto c2 = std::async(std::launch::async, [&] { return cc->quorum(healing(group("c", 7)), 10s); });
    const Quorum d = b2.get();
    a2.get(), c2.get();
    EXPECT_TRUE(d.participants[0].healing && !d.participants[1].healing && d.participants[2].healing);
    EXPECT_THAT(d.heal_sources, ::testing::ElementsAre(-1, -1, -1));
  }
  {
    Lighthouse lh(LighthouseOptions().expected_groups(2));
    lh.start();
    auto a = std::async(std::launch::async, [&] { return client_of(lh)->quorum(healing(group("a", 9)), 10s); });
    auto b = std::async(std::launch::async, [&] { return client_of(lh)->quorum(group("b", 8), 10s); });
    const Quorum q = a.get();
    b.get();
    EXPECT_EQ(q.max_step, 8);  // a's claim is not a step anybody holds
    EXPECT_FALSE(q.participants[0].healing);
    EXPECT_LT(q.participants[0].step, 8);
    EXPECT_THAT(q.heal_sources, ::testing::ElementsAre(1, -1));
  }
}

// A second process given a running group's id is refused, named as a duplicate, and the running
// group is never displaced (its beats and quorums go on). A real restart (the old incarnation
// silent for the heartbeat timeout) still takes the group's place.
TEST(Lighthouse, ADuplicateGroupIdIsRefusedAndNeverDisplacesTheRunningGroup) {
  std::mutex mu;
  std::vector<std::string> events;
  Lighthouse lh(LighthouseOptions().heartbeat_timeout(300ms).on_event([&](const std::string& e) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(e);
  }));
  lh.start();
  ASSERT_EQ(client_of(lh)->quorum(group("g", 0), 10s).participants.size(), 1u);
  auto beater = client_of(lh);
  std::atomic<bool> beating{true};
  std::thread keep_alive([&] {
    while (beating) {
      EXPECT_TRUE(beater->heartbeat("g", 0, "g-1").lost.empty());
      std::this_thread::sleep_for(50ms);
    }
  });
  GroupInfo copy = group("g", 0);
  copy.incarnation = "g-2";
  copy.hosts = {"other-host"};
  const auto asked = std::chrono::steady_clock::now();
  const std::string error = error_of([&] { client_of(lh)->quorum(copy, 10s); });
  const auto waited = std::chrono::steady_clock::now() - asked;
  EXPECT_THAT(error, HasSubstr("duplicate group id 'g': incarnation g-1 on host host is running"));
  EXPECT_THAT(error, HasSubstr("this process (incarnation g-2 on host other-host)"));
  EXPECT_LT(waited, 2s);  // a heartbeat timeout and a little, not the 10 s asked for
  EXPECT_THAT(error_of([&] { client_of(lh)->heartbeat("g", 0, "g-2"); }), HasSubstr("is live as incarnation g-1"));
  const Quorum still = client_of(lh)->quorum(group("g", 1), 10s);  // the running group goes on
  ASSERT_EQ(still.participants.size(), 1u);
  EXPECT_EQ(still.participants[0].incarnation, "g-1");
  beating = false;
  keep_alive.join();
  // g-1 dies: a restart, asking at once, is taken once g-1 has been silent for the timeout.
  GroupInfo restart = group("g", 0);
  restart.incarnation = "g-3";
  const Quorum back = client_of(lh)->quorum(restart, 10s);
  ASSERT_EQ(back.participants.size(), 1u);
  EXPECT_EQ(back.participants[0].incarnation, "g-3");
  std::this_thread::sleep_for(100ms);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_THAT(events, ::testing::Contains(HasSubstr("group g: refused a second process (incarnation g-2) while "
                                                    "incarnation g-1 is running: a duplicate group id")));
}

// A group that ran its last step leaves: the next quorum goes on without it at once (no heartbeat
// timeout), and it is not reported lost. When the last group of the job leaves, the job is
// finished: a group lost before the end, back from an older step, is refused (JobFinished) rather
// than training alone; groups that left may start a new run from a checkpoint.
TEST(Lighthouse, AGroupThatLeftIsOutAtOnceAndALostOneBackAfterTheEndIsRefused) {
  std::mutex mu;
  std::vector<std::string> events;
  Lighthouse lh(LighthouseOptions().heartbeat_timeout(600ms).expected_groups(3).on_event([&](const std::string& e) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(e);
  }));
  lh.start();
  std::atomic<bool> beat_a{true}, beat_b{true}, stop{false};
  auto beater = client_of(lh);
  std::thread beats([&] {
    while (!stop) {
      if (beat_a) beater->heartbeat("a", 0, "a-1");
      if (beat_b) beater->heartbeat("b", 0, "b-1");
      std::this_thread::sleep_for(50ms);
    }
  });
  auto together = [&](std::vector<GroupInfo> groups) {
    std::vector<std::future<Quorum>> asks;
    for (const auto& g : groups) asks.push_back(std::async(std::launch::async, [&lh, g] { return client_of(lh)->quorum(g, 10s); }));
    Quorum q;
    for (auto& f : asks) q = f.get();
    return q;
  };
  struct Joiner {  // an assertion that returns early still stops the beats
    std::function<void()> fn;
    ~Joiner() { fn(); }
  } join_beats{[&] {
    stop = true;
    if (beats.joinable()) beats.join();
  }};
  ASSERT_EQ(together({group("a", 0), group("b", 0), group("c", 0)}).participants.size(), 3u);
  std::this_thread::sleep_for(700ms);  // c is killed: silent past the timeout
  EXPECT_THAT(together({group("a", 10), group("b", 10)}).dropped, ::testing::ElementsAre("c"));
  beat_a = false;
  client_of(lh)->leave("a", "a-1", 10);
  const auto alone = std::chrono::steady_clock::now();
  const Quorum b_alone = client_of(lh)->quorum(group("b", 10), 10s);
  EXPECT_LT(std::chrono::steady_clock::now() - alone, 400ms) << "waited for the group that left";
  ASSERT_EQ(b_alone.participants.size(), 1u);
  EXPECT_THAT(client_of(lh)->heartbeat("b", 0, "b-1").lost, ::testing::Not(::testing::Contains("a")));
  beat_b = false;
  client_of(lh)->leave("b", "b-1", 12);
  // c restarted after the end, from step 0: refused at once, naming the job's end.
  GroupInfo c2 = group("c", 0);
  c2.incarnation = "c-2";
  const auto asked = std::chrono::steady_clock::now();
  try {
    client_of(lh)->quorum(c2, 10s);
    ADD_FAILURE() << "c trained on alone after the job finished";
  } catch (const JobFinished& e) {
    EXPECT_THAT(e.what(), HasSubstr("the job has finished: groups [b] left after step 12"));
    EXPECT_THAT(e.what(), HasSubstr("group c (at step 0, lost before the end)"));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - asked, 1s);
  // a, which left, starts a new run from its step-8 checkpoint: not refused.
  GroupInfo a2 = group("a", 8);
  a2.incarnation = "a-2";
  EXPECT_EQ(client_of(lh)->quorum(a2, 10s).max_step, 8);
  join_beats.fn();
  std::this_thread::sleep_for(100ms);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_THAT(events, ::testing::Contains("group a left after step 10"));
  EXPECT_THAT(events, ::testing::Contains(HasSubstr("job finished at step 12")));
  EXPECT_THAT(events, ::testing::Contains(HasSubstr("group c refused: the job has finished")));
  EXPECT_THAT(events, ::testing::Not(::testing::Contains(HasSubstr("group a lost"))));
}

// A lighthouse that cannot be reached (a wrong address) is named at the first refusal, and asked
// again until the timeout.
TEST(Lighthouse, AnUnreachableLighthouseIsNamedAtTheFirstRefusal) {
  int port = 0;
  {
    Lighthouse gone{LighthouseOptions()};
    gone.start();
    port = gone.port();
  }  // nothing listens there now
  LighthouseClient client(LighthouseClientOptions().address("127.0.0.1:" + std::to_string(port)));
  ::testing::internal::CaptureStderr();
  const auto asked = std::chrono::steady_clock::now();
  const std::string error = error_of([&] { client.quorum(group("a", 0), 1500ms); });
  const auto waited = std::chrono::steady_clock::now() - asked;
  const std::string printed = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(printed, HasSubstr("group a: the lighthouse at 127.0.0.1:" + std::to_string(port) + " cannot be reached"));
  EXPECT_THAT(printed, HasSubstr("asking again every 100 ms"));
  EXPECT_EQ(std::count(printed.begin(), printed.end(), '\n'), 1) << printed;  // once, not at every try
  EXPECT_GE(waited, 1400ms);
  EXPECT_THAT(error, HasSubstr("quorum failed"));
}

TEST(Lighthouse, BelowMinReplicasTimesOutNamingTheGroups) {
  Lighthouse lh(LighthouseOptions().min_replicas(2));
  lh.start();
  const std::string error = error_of([&] { client_of(lh)->quorum(group("only", 0), 600ms); });
  EXPECT_THAT(error, HasSubstr("no quorum within"));
  EXPECT_THAT(error, HasSubstr("live groups [only]"));
  EXPECT_THAT(error, HasSubstr("min_replicas 2"));
}

TEST(Lighthouse, BadRequestsAreNamedErrors) {
  Lighthouse lh(LighthouseOptions().token("secret"));
  lh.start();
  EXPECT_THAT(error_of([&] { client_of(lh)->quorum(group("a", 0), 1s); }), HasSubstr("requires a token"));
  EXPECT_THAT(error_of([&] { client_of(lh, "guess")->quorum(group("a", 0), 1s); }), HasSubstr("wrong token"));
  auto c = client_of(lh, "secret");
  GroupInfo g = group("bad id!", 0);
  EXPECT_THAT(error_of([&] { c->quorum(g, 1s); }), HasSubstr("group_id must be 1-128 characters"));
  g = group("a", -1);
  EXPECT_THAT(error_of([&] { c->quorum(g, 1s); }), HasSubstr("step must be >= 0"));
  g = group("a", 0, 2);
  g.state_addresses.pop_back();
  EXPECT_THAT(error_of([&] { c->quorum(g, 1s); }), HasSubstr("needs one state address and one host per rank"));
  g = group("a", 0);
  g.state_addresses[0] = "no-port";
  EXPECT_THAT(error_of([&] { c->quorum(g, 1s); }), HasSubstr("is not host:port"));
  EXPECT_THAT(error_of([&] { c->heartbeat("a", -3, "a-1"); }), HasSubstr("rank must be in 0..65535"));
  EXPECT_THAT(error_of([&] { Lighthouse bad(LighthouseOptions().min_replicas(0)); }), HasSubstr("min_replicas must be >= 1"));
}

// What a client accepts from a lighthouse: a forged or corrupt quorum is refused, named.
TEST(Lighthouse, AForgedQuorumIsRefused) {
  Quorum q;
  q.quorum_id = 3;
  q.participants = {group("a", 5), group("b", 4)};
  q.max_step = 5;
  q.store_address = "127.0.0.1:29500";
  q.heal_sources = {-1, 0};
  wire::QuorumReply reply;
  wire::to_wire(q, &reply);
  EXPECT_EQ(wire::check_reply(reply), "");
  reply.set_heal_sources(1, 7);
  EXPECT_THAT(wire::check_reply(reply), HasSubstr("heal source 7 out of range"));
  reply.set_heal_sources(1, 0);
  reply.mutable_participants(1)->set_step(9);
  EXPECT_THAT(wire::check_reply(reply), HasSubstr("ahead of max_step"));
  reply.mutable_participants(1)->set_step(4);
  reply.mutable_participants(0)->set_world_size(0);
  EXPECT_THAT(wire::check_reply(reply), HasSubstr("world_size must be in 1..65536"));
  reply.clear_participants();
  EXPECT_THAT(wire::check_reply(reply), HasSubstr("no participants"));
  // A delta whose behind entry points past the participants is refused the same way.
  wire::QuorumReply delta;
  delta.set_delta(true);
  delta.set_quorum_id(3);
  delta.set_max_step(5);
  delta.set_store_address("127.0.0.1:29500");
  auto* b = delta.add_behind();
  b->set_index(7);
  b->set_step(4);
  b->set_heal_source(0);
  EXPECT_THAT(wire::check_reply(wire::apply_delta(delta, q)), HasSubstr("heal_sources does not match"));
}

// A group asks naming the quorum it holds; the reply is then a delta against it (a step's
// reply stays small at a thousand groups) and the client fills in the rest. A caller holding
// nothing, or a quorum of another lighthouse, gets the whole quorum.
TEST(Lighthouse, AStepsReplyCarriesOnlyWhatChanged) {
  Lighthouse lh(LighthouseOptions().expected_groups(2));
  lh.start();
  auto ca = client_of(lh), cb = client_of(lh);
  auto round = [&](int64_t step_a, int64_t step_b) {
    auto b = std::async(std::launch::async, [&] { return cb->quorum(group("b", step_b, 2), 10s); });
    Quorum a = ca->quorum(group("a", step_a, 2), 10s);
    b.get();
    return a;
  };
  const Quorum first = round(4, 4);
  const Quorum second = round(5, 5);
  EXPECT_EQ(second.quorum_id, first.quorum_id);
  ASSERT_EQ(second.participants.size(), 2u);
  EXPECT_EQ(second.participants[1].group_id, "b");
  EXPECT_EQ(second.participants[1].state_addresses, first.participants[1].state_addresses);
  EXPECT_EQ(second.participants[1].step, 5);
  EXPECT_EQ(second.max_step, 5);
  EXPECT_THAT(second.heal_sources, ::testing::ElementsAre(-1, -1));

  // On the wire: the ask, raw, naming the quorum it holds: no participants; naming nothing or
  // another lighthouse's quorum: all of them.
  auto stub = wire::Lighthouse::NewStub(grpc::CreateChannel(lh.address(), grpc::InsecureChannelCredentials()));
  auto raw = [&](const std::string* known_lighthouse, int64_t step) {
    wire::QuorumRequest req;
    wire::to_wire(group("a", step, 2), req.mutable_member());
    req.set_timeout_ms(10000);
    if (known_lighthouse) {
      req.set_known_quorum_id(first.quorum_id);
      req.set_known_lighthouse(*known_lighthouse);
    }
    auto b = std::async(std::launch::async, [&] { return cb->quorum(group("b", step, 2), 10s); });
    grpc::ClientContext ctx;
    wire::QuorumReply reply;
    EXPECT_TRUE(stub->Quorum(&ctx, req, &reply).ok());
    b.get();
    return reply;
  };
  const wire::QuorumReply whole = raw(nullptr, 6);
  EXPECT_FALSE(whole.delta());
  EXPECT_EQ(whole.participants_size(), 2);
  const std::string instance = whole.lighthouse();
  const wire::QuorumReply compact = raw(&instance, 7);
  EXPECT_TRUE(compact.delta());
  EXPECT_EQ(compact.participants_size(), 0);
  EXPECT_EQ(compact.max_step(), 7);
  const std::string elsewhere = "another-lighthouse";
  EXPECT_EQ(raw(&elsewhere, 8).participants_size(), 2);
  // b behind a: the delta names it, its step and its source.
  const Quorum healing = round(9, 6);
  EXPECT_EQ(healing.heal_sources[1], 0);
  EXPECT_EQ(healing.participants[1].step, 6);
  // c joins: a and b get c alone on the wire, c (holding nothing) the whole quorum.
  auto cc = client_of(lh);
  cc->heartbeat("c", 0, "c-1");  // known live before a and b ask: their quorum waits for it
  auto c = std::async(std::launch::async, [&] { return cc->quorum(group("c", 10, 2), 10s); });
  const Quorum joined = round(10, 10);
  const Quorum for_c = c.get();
  ASSERT_EQ(joined.participants.size(), 3u);
  EXPECT_EQ(joined.participants[2].group_id, "c");
  EXPECT_EQ(joined.participants[2].state_addresses, for_c.participants[2].state_addresses);
  EXPECT_NE(joined.quorum_id, first.quorum_id);
  EXPECT_EQ(joined.quorum_id, for_c.quorum_id);
}

// A group of three beats once for all its ranks (its rank 0 does, with how long ago it heard
// from each): the lighthouse counts every rank live from it, and a rank whose age passes the
// heartbeat timeout makes the group lost as a silent rank would.
TEST(Lighthouse, AGroupBeatsForItsRanksAndASilentRankLosesIt) {
  Lighthouse lh(LighthouseOptions().heartbeat_timeout(300ms).expected_groups(2));
  lh.start();
  auto ca = client_of(lh), cg = client_of(lh);
  auto qg = std::async(std::launch::async, [&] { return cg->quorum(group("g", 0, 3), 10s); });
  ca->quorum(group("a", 0), 10s);
  qg.get();
  const auto until = std::chrono::steady_clock::now() + 600ms;
  while (std::chrono::steady_clock::now() < until) {
    cg->heartbeat_for_group("g", "g-1", {0, 20, 40});
    EXPECT_THAT(ca->heartbeat("a", 0, "a-1").lost, ::testing::IsEmpty());
    std::this_thread::sleep_for(50ms);
  }
  // Rank 0 stops hearing from rank 2 (its age grows with the time since): once it passes the
  // heartbeat timeout, g is lost.
  const auto silent_since = std::chrono::steady_clock::now();
  for (const auto until = silent_since + 450ms; std::chrono::steady_clock::now() < until;) {
    const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - silent_since);
    cg->heartbeat_for_group("g", "g-1", {0, 20, age.count()});
    ca->heartbeat("a", 0, "a-1");
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_THAT(ca->heartbeat("a", 0, "a-1").lost, ::testing::ElementsAre("g"));
  EXPECT_THAT(error_of([&] { cg->heartbeat_for_group("g", "g-1", {0, 0, 0, 0}); }), HasSubstr("outside group g of 3 ranks"));
  auto stub = wire::Lighthouse::NewStub(grpc::CreateChannel(lh.address(), grpc::InsecureChannelCredentials()));
  wire::HeartbeatRequest req;
  req.set_group_id("g");
  req.set_rank(1);
  req.set_incarnation("g-1");
  req.add_rank_ages_ms(0);
  grpc::ClientContext ctx;
  wire::HeartbeatReply reply;
  EXPECT_THAT(stub->Heartbeat(&ctx, req, &reply).error_message(), HasSubstr("comes from its rank 0"));
}

// Each quorum's cross groups meet in a store of their own, and the store of the quorum before
// the last goes with its keys: after 30 changes of members (a group restarting each time) the
// lighthouse holds two stores and the keys written in them alone.
TEST(Lighthouse, StoresDoNotOutliveTheQuorumAfterNext) {
  // A restart is taken once the old incarnation has been silent for the heartbeat timeout: short here.
  Lighthouse lh{LighthouseOptions().heartbeat_timeout(100ms)};
  lh.start();
  auto client = client_of(lh);
  auto store_client = [](const std::string& address, std::chrono::milliseconds timeout) {
    return compat::tcp_store_client(address.substr(0, address.rfind(':')),
                                    std::stoi(address.substr(address.rfind(':') + 1)), timeout);
  };
  std::vector<std::string> addresses;
  for (int k = 0; k < 30; ++k) {
    GroupInfo g = group("a", k);
    g.incarnation = "a-" + std::to_string(k);  // restarted: a new quorum
    const Quorum q = client->quorum(g, 10s);
    EXPECT_EQ(q.quorum_id, k);
    addresses.push_back(q.store_address);
    auto store = store_client(q.store_address, 10s);
    for (int i = 0; i < 10; ++i) store->set("rendezvous/" + std::to_string(i), {1});
    store->get("rendezvous/9");  // answered after the sets before it on this connection: all are in
  }
  EXPECT_NE(addresses[28], addresses[29]);
  const auto use = lh.store_use();
  EXPECT_EQ(use.stores, 2);
  EXPECT_EQ(use.keys, 20);
  EXPECT_THAT(error_of([&] { store_client(addresses[0], 300ms)->set("late", {1}); }), ::testing::Not(::testing::IsEmpty()));
}

// The lighthouse times its own part of each round: the asks coming in (a group 200 ms late shows
// there) and its replies handed to gRPC; rounds that sent a whole quorum are counted apart.
TEST(Lighthouse, TimesItsOwnPartOfEachRound) {
  Lighthouse lh(LighthouseOptions().expected_groups(2));
  lh.start();
  auto ca = client_of(lh), cb = client_of(lh);
  for (int k = 0; k < 5; ++k) {
    auto qa = std::async(std::launch::async, [&] { return ca->quorum(group("a", k), 10s); });
    if (k == 3) std::this_thread::sleep_for(200ms);
    cb->quorum(group("b", k), 10s);
    qa.get();
  }
  const auto t = lh.round_times();
  EXPECT_EQ(t.whole_rounds, 1);  // the first: neither group held a quorum
  EXPECT_EQ(t.rounds, 4);
  EXPECT_EQ(t.sampled, 4);
  EXPECT_GE(t.intake_p99_ms, 100.0);
  EXPECT_LT(t.intake_p50_ms, 100.0);
  EXPECT_GE(t.replies_p50_ms, 0.0);
  EXPECT_LE(t.replies_p50_ms, t.replies_p99_ms);
  EXPECT_LE(t.replies_p99_ms, t.replies_max_ms);
  EXPECT_GE(t.whole_replies_max_ms, 0.0);
}

// Ranks beat through their group: rank 0 alone calls the lighthouse and the others read its
// reply in the group's store; when one of them stops beating, the group is lost.
TEST(GroupBeats, RanksBeatThroughRankZeroAndASilentRankLosesTheGroup) {
  Lighthouse lh(LighthouseOptions().heartbeat_timeout(300ms).expected_groups(2));
  lh.start();
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::unique_ptr<GroupBeats>> ranks;
  for (int r = 0; r < 3; ++r) ranks.push_back(std::make_unique<GroupBeats>(store, "g", r, 3));
  ranks[0]->prepare();
  auto ca = client_of(lh), cg = client_of(lh);
  auto qg = std::async(std::launch::async, [&] { return cg->quorum(group("g", 0, 3), 10s); });
  ca->quorum(group("a", 0), 10s);
  qg.get();
  auto beat_for = [&](std::chrono::milliseconds how_long, int ranks_beating) {
    int fresh = 0;
    bool lost = false;
    for (const auto until = std::chrono::steady_clock::now() + how_long; std::chrono::steady_clock::now() < until;) {
      for (int r = 0; r < ranks_beating; ++r) {
        const auto b = ranks[static_cast<size_t>(r)]->beat(*cg, "g-1");
        if (r == 1 && b) ++fresh;
      }
      const auto lost_now = ca->heartbeat("a", 0, "a-1").lost;
      lost = lost || std::find(lost_now.begin(), lost_now.end(), "g") != lost_now.end();
      std::this_thread::sleep_for(50ms);
    }
    return std::make_pair(fresh, lost);
  };
  const auto all = beat_for(600ms, 3);
  EXPECT_GE(all.first, 5);  // rank 1 read a new reply of rank 0's nearly every beat
  EXPECT_FALSE(all.second);
  EXPECT_FALSE(ranks[1]->beat(*cg, "g-1").has_value());  // nothing new since its last read
  const auto without_2 = beat_for(600ms, 2);
  EXPECT_TRUE(without_2.second);
}

// ---- rendezvous given up ----------------------------------------------------------------------

// A rendezvous whose peer never comes is given up as soon as the caller learns why (the peer is
// lost), not at the rendezvous's timeout; the abandoned attempt ends alone.
TEST(RunUnless, ARendezvousIsGivenUpWithItsReason) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  DetachedThreads detached;
  const auto start = std::chrono::steady_clock::now();
  auto stop = [start]() -> std::string {
    return std::chrono::steady_clock::now() - start > 100ms ? "replica group g1 is lost" : "";
  };
  auto make = [store] {
    return std::make_shared<ProcessGroup>(store, 0, 2, ProcessGroupOptions().gloo_hostname("127.0.0.1").timeout(3s));
  };
  EXPECT_THAT(error_of([&] { run_unless<std::shared_ptr<ProcessGroup>>(make, stop, detached); }),
              HasSubstr("replica group g1 is lost"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);  // not the rendezvous's 3 s
  // What make() returns or throws comes back when nothing stops it.
  EXPECT_EQ(run_unless<int>([] { return 7; }, nullptr, detached), 7);
  EXPECT_THAT(error_of([&] { run_unless<int>([]() -> int { throw std::runtime_error("no store"); }, nullptr, detached); }),
              HasSubstr("no store"));
  detached.join_all();
}

// ---- the state service -------------------------------------------------------------------------

TensorDict some_state() {
  TensorDict d;
  d["model/w"] = at::randn({1500, 1000});  // 6 MB: two chunks over the network, a mapping of its own
  d["model/b"] = at::randn({10}).to(at::kDouble);
  d["optimizer/0/adam_step"] = at::tensor({int64_t{42}}, at::kLong);
  d["rng/cpu"] = at::randint(0, 255, {5056}, at::kByte);
  d["empty"] = at::empty({0, 3});
  return d;
}

void expect_equal(const TensorDict& got, const TensorDict& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& kv : want) {
    ASSERT_TRUE(got.count(kv.first)) << kv.first;
    EXPECT_TRUE(got.at(kv.first).equal(kv.second)) << kv.first;
  }
}

// The pair groups of heals in this process: two ranks meet under a name on one in-memory store,
// over Gloo on loopback (as between hosts), or through shared memory.
PairGroupFactory pair_groups(bool shared_memory, std::chrono::milliseconds timeout = 20s) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  return [store, shared_memory, timeout](const std::string& name, int rank, const std::string&) {
    return std::make_shared<ProcessGroup>(c10::make_intrusive<c10d::PrefixStore>(name, store), rank, 2,
                                          ProcessGroupOptions()
                                              .gloo_hostname("127.0.0.1")
                                              .gloo_connections(2)
                                              .shared_memory(shared_memory)
                                              .timeout(timeout)
                                              .abortable(true));
  };
}

size_t wait_released(StateServer& server, std::function<bool(const std::string&)> gone = nullptr) {
  return server.wait_released(std::chrono::steady_clock::now() + 20s, gone ? gone : [](const std::string&) { return false; });
}

// On this host the healer reads the server's memory; the server waits for its release.
TEST(StateTransfer, OnOneHostTheHealerCopiesOnceFromTheServersMemory) {
  StateServer server("127.0.0.1", "", pair_groups(false));
  const TensorDict state = some_state();
  server.publish(7, state, {"joiner"});
  FetchOptions o;
  o.healer = "joiner";
  o.same_host = true;
  auto released = std::async(std::launch::async, [&] { return wait_released(server); });
  const Fetched got = fetch_state(server.address(), 7, o);
  EXPECT_TRUE(got.single_copy) << got.single_copy_refused;
  EXPECT_EQ(got.bytes, 6000000 + 80 + 8 + 5056);
  expect_equal(got.state, state);
  EXPECT_EQ(released.get(), 1u);
}

// Elsewhere the server streams its tensors over a group of the pair (4 MiB broadcasts over the
// group's connections), Gloo between hosts, shared memory on one; the same bytes.
TEST(StateTransfer, ElsewhereTheServerStreamsOverAPairGroup) {
  for (bool shm : {false, true}) {
    const auto pairs = pair_groups(shm);
    StateServer server("127.0.0.1", "secret", pairs);
    const TensorDict state = some_state();
    server.publish(7, state, {"joiner"});
    FetchOptions o;
    o.token = "secret";
    o.healer = "joiner";
    o.pair_group = pairs;
    auto released = std::async(std::launch::async, [&] { return wait_released(server); });
    const Fetched got = fetch_state(server.address(), 7, o);
    EXPECT_FALSE(got.single_copy);
    ASSERT_TRUE(got.pair);
    EXPECT_THAT(got.pair->transport_name(), HasSubstr(shm ? "shared memory" : "gloo"));
    expect_equal(got.state, state);
    EXPECT_EQ(released.get(), 1u);
  }
}

// A healer that asks for a stream and never joins it, then is found lost: the wait ends at once
// (not at the deadline), and the release it might still send is refused.
TEST(StateTransfer, AStreamToALostHealerIsAbandoned) {
  StateServer server("127.0.0.1", "", pair_groups(false, 2s));
  server.publish(7, some_state(), {"joiner"});
  auto stub = wire::StateTransfer::NewStub(grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  wire::StateRequest req;
  req.set_step(7);
  req.set_healer("joiner");
  req.set_pair_group("never-joined");
  wire::StateReply reply;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Stream(&ctx, req, &reply).ok());
  }
  std::atomic<bool> lost{false};
  auto released = std::async(std::launch::async, [&] {
    return wait_released(server, [&](const std::string&) { return lost.load(); });
  });
  std::this_thread::sleep_for(100ms);
  lost = true;
  EXPECT_EQ(released.get(), 0u);
  grpc::ClientContext ctx;
  const grpc::Status s = stub->Release(&ctx, req, &reply);
  EXPECT_THAT(s.error_message(), HasSubstr("no longer serves step 7 to joiner"));
}

// A healer the server gives up on while it streams (its heartbeats stopped, say): the stream is
// aborted, and the healer's copy fails, whether its bytes arrived or not.
TEST(StateTransfer, AHealerGivenUpOnMidStreamHasNoCopy) {
  const auto pairs = pair_groups(false);
  StateServer server("127.0.0.1", "", pairs);
  server.publish(7, some_state(), {"joiner"});
  std::atomic<bool> joining{false}, given_up{false};
  FetchOptions o;
  o.healer = "joiner";
  o.pair_group = [&](const std::string& name, int rank, const std::string& peer) {
    joining = true;  // the server streams (its thread is meeting this healer): now it gives up
    for (int i = 0; i < 500 && !given_up; ++i) std::this_thread::sleep_for(10ms);
    return pairs(name, rank, peer);
  };
  auto released = std::async(std::launch::async, [&] {
    return wait_released(server, [&](const std::string&) { return given_up = joining.load(); });
  });
  EXPECT_THAT(error_of([&] { fetch_state(server.address(), 7, o); }),
              HasSubstr("fetching the state of step 7 from " + server.address() + " failed"));
  EXPECT_EQ(released.get(), 0u);
}

TEST(StateTransfer, RefusalsAreNamed) {
  const auto pairs = pair_groups(false);
  StateServer server("127.0.0.1", "secret", pairs);
  server.publish(7, some_state(), {"joiner"});
  FetchOptions o;
  o.healer = "joiner";
  o.pair_group = pairs;
  o.timeout = 300ms;
  EXPECT_THAT(error_of([&] { fetch_state(server.address(), 7, o); }), HasSubstr("requires a token"));
  o.token = "secret";
  EXPECT_THAT(error_of([&] { fetch_state(server.address(), 6, o); }), HasSubstr("holds the state of step 7, not 6"));
  // A healer the server does not serve: refused its stream, and its release.
  o.healer = "stranger";
  EXPECT_THAT(error_of([&] { fetch_state(server.address(), 7, o); }),
              HasSubstr("the source refused to stream: does not serve step 7 to stranger"));
  o.same_host = true;
  EXPECT_THAT(error_of([&] { fetch_state(server.address(), 7, o); }),
              HasSubstr("did not accept the release: no longer serves step 7 to stranger"));
  o.same_host = false;
  // Given up on (lost): a copy it may have read meanwhile is refused, and nothing is served.
  auto stub = wire::StateTransfer::NewStub(grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  EXPECT_EQ(wait_released(server, [](const std::string&) { return true; }), 0u);
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer secret");
  wire::StateRequest req;
  req.set_step(7);
  req.set_healer("joiner");
  wire::StateReply reply;
  const grpc::Status s = stub->Release(&ctx, req, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("no longer serves step 7 to joiner"));
  o.healer = "joiner";
  EXPECT_THAT(error_of([&] { fetch_state(server.address(), 7, o); }), HasSubstr("holds the state of step -1, not 7"));
  EXPECT_THAT(error_of([&] { server.publish(1, {{"c", at::zeros({2}, at::kComplexFloat)}}, {"x"}); }),
              HasSubstr("state entry 'c' has dtype ComplexFloat"));
  // A pair group name the server would put into its store keys is checked.
  server.publish(8, some_state(), {"joiner"});
  grpc::ClientContext ctx2;
  ctx2.AddMetadata("authorization", "Bearer secret");
  req.set_step(8);
  req.set_pair_group("../x");
  EXPECT_THAT(stub->Stream(&ctx2, req, &reply).error_message(), HasSubstr("pair group name must be 1-128 characters"));
}

// A server that describes what it does not hold: each lie is a named error, nothing is read.
class ForgedStateService final : public wire::StateTransfer::Service {
 public:
  std::function<void(wire::StateReply*)> forge;
  grpc::Status Describe(grpc::ServerContext*, const wire::StateRequest* req, wire::StateReply* reply) override {
    reply->set_step(req->step());
    wire::StateEntry* e = reply->add_entries();
    e->set_key("w");
    e->set_dtype(static_cast<int>(at::kFloat));
    e->add_sizes(4);
    e->set_nbytes(16);
    reply->set_total_bytes(16);
    forge(reply);
    return grpc::Status::OK;
  }
  grpc::Status Stream(grpc::ServerContext*, const wire::StateRequest*, wire::StateReply*) override {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "forged: streams nothing");
  }
  grpc::Status Release(grpc::ServerContext*, const wire::StateRequest*, wire::StateReply*) override {
    return grpc::Status::OK;
  }
};

TEST(StateTransfer, AForgedDescriptionIsRefused) {
  ForgedStateService service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  ASSERT_GT(port, 0);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  FetchOptions o;
  o.healer = "joiner";
  o.pair_group = pair_groups(false);
  auto refusal = [&](std::function<void(wire::StateReply*)> forge) {
    service.forge = std::move(forge);
    return error_of([&] { fetch_state(address, 3, o); });
  };
  EXPECT_THAT(refusal([](wire::StateReply* r) { r->mutable_entries(0)->set_nbytes(1 << 30); }),
              HasSubstr("entry 'w' claims 1073741824 bytes for 4 elements of Float"));
  EXPECT_THAT(refusal([](wire::StateReply* r) { r->mutable_entries(0)->set_dtype(99); }),
              HasSubstr("entry 'w' has dtype code 99"));
  EXPECT_THAT(refusal([](wire::StateReply* r) { r->mutable_entries(0)->set_sizes(0, -4); }),
              HasSubstr("entry 'w' has size -4"));
  EXPECT_THAT(refusal([](wire::StateReply* r) { *r->add_entries() = r->entries(0); }), HasSubstr("'w' appears twice"));
  EXPECT_THAT(refusal([](wire::StateReply* r) { r->set_total_bytes(32); }), HasSubstr("entries of 16 bytes, total 32"));
  EXPECT_THAT(refusal([](wire::StateReply* r) { r->set_total_bytes(-1); }), HasSubstr("malformed description (-1 bytes)"));
  // On this host, a pid and proof that are not the server's: not read; it is asked to stream instead.
  o.same_host = true;
  EXPECT_THAT(refusal([](wire::StateReply* r) {
                r->set_pid(getpid());
                r->set_proof("not the proof");
                r->set_proof_address(reinterpret_cast<uint64_t>(r));
              }),
              HasSubstr("the source refused to stream: forged: streams nothing"));
  server->Shutdown();
}

}  // namespace
}  // namespace ft
}  // namespace ddpkit
