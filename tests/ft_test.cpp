// The lighthouse's quorum rule and its checks, in one process: an in-process lighthouse and its
// clients on threads, each client standing for one replica group's rank 0.
#include <ddpkit/error.h>
#include <ddpkit/ft/lighthouse.h>

#include "wire.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <future>
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
}

}  // namespace
}  // namespace ft
}  // namespace ddpkit
