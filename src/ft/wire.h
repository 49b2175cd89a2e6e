// The lighthouse's messages <-> the public structs, and the checks every message passes before it
// is used (internal). A check returns what is wrong, or "" when nothing is.
#pragma once

#include <ddpkit/ft/lighthouse.h>

#include "lighthouse.pb.h"

#include <cctype>
#include <map>
#include <string>

namespace ddpkit {
namespace ft {
namespace wire {

// 1-128 characters of [A-Za-z0-9_.-].
inline bool valid_name(const std::string& s) {
  if (s.empty() || s.size() > 128) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-')) return false;
  return true;
}

inline std::string check_member(const Member& m) {
  if (!valid_name(m.group_id()))
    return "group_id must be 1-128 characters of [A-Za-z0-9_.-], got '" + m.group_id().substr(0, 160) + "'";
  const std::string who = "group " + m.group_id() + ": ";
  if (m.step() < 0) return who + "step must be >= 0, got " + std::to_string(m.step());
  if (m.world_size() < 1 || m.world_size() > 65536)
    return who + "world_size must be in 1..65536, got " + std::to_string(m.world_size());
  if (m.state_addresses_size() != m.world_size() || m.hosts_size() != m.world_size())
    return who + "needs one state address and one host per rank (" + std::to_string(m.world_size()) + "), got " +
           std::to_string(m.state_addresses_size()) + " and " + std::to_string(m.hosts_size());
  for (const auto& a : m.state_addresses())
    if (a.empty() || a.size() > 300 || a.rfind(':') == std::string::npos)
      return who + "state address '" + a.substr(0, 300) + "' is not host:port";
  if (!valid_name(m.incarnation()))
    return who + "incarnation must be 1-128 characters of [A-Za-z0-9_.-], got '" + m.incarnation().substr(0, 160) + "'";
  return "";
}

inline std::string check_heartbeat(const HeartbeatRequest& r) {
  if (!valid_name(r.group_id()))
    return "group_id must be 1-128 characters of [A-Za-z0-9_.-], got '" + r.group_id().substr(0, 160) + "'";
  if (r.rank() < 0 || r.rank() >= 65536) return "rank must be in 0..65535, got " + std::to_string(r.rank());
  if (r.rank_ages_ms_size() > 0 && r.rank() != 0)
    return "a beat for the whole group (rank_ages_ms) comes from its rank 0, got rank " + std::to_string(r.rank());
  if (r.rank_ages_ms_size() > 65536) return "rank_ages_ms has more than 65536 ranks";
  for (int64_t age : r.rank_ages_ms())
    if (age < 0 || age > 24LL * 3600 * 1000) return "rank_ages_ms must be in 0..86400000, got " + std::to_string(age);
  if (!valid_name(r.incarnation())) return "incarnation must be 1-128 characters of [A-Za-z0-9_.-]";
  return "";
}

inline std::string check_reply(const QuorumReply& q) {
  if (q.participants_size() < 1) return "no participants";
  if (q.heal_sources_size() != q.participants_size()) return "heal_sources does not match the participants";
  for (int i = 0; i < q.participants_size(); ++i) {
    const std::string bad = check_member(q.participants(i));
    if (!bad.empty()) return bad;
    const int s = q.heal_sources(i);
    if (s < -1 || s >= q.participants_size() || s == i) return "heal source " + std::to_string(s) + " out of range";
    if (s >= 0 && q.participants(s).step() != q.max_step()) return "a heal source is behind max_step";
    if (s >= 0 && q.participants(s).healing()) return "a heal source is itself healing";
    if (q.participants(i).step() > q.max_step()) return "a participant is ahead of max_step";
  }
  if (q.store_address().rfind(':') == std::string::npos) return "store address '" + q.store_address() + "' is not host:port";
  return "";
}

inline void to_wire(const GroupInfo& g, Member* m) {
  m->set_group_id(g.group_id);
  m->set_step(g.step);
  m->set_world_size(g.world_size);
  for (const auto& a : g.state_addresses) m->add_state_addresses(a);
  for (const auto& h : g.hosts) m->add_hosts(h);
  m->set_incarnation(g.incarnation);
  m->set_heal(g.heal);
  m->set_healing(g.healing);
}

inline GroupInfo from_wire(const Member& m) {
  GroupInfo g;
  g.group_id = m.group_id();
  g.step = m.step();
  g.world_size = m.world_size();
  g.state_addresses.assign(m.state_addresses().begin(), m.state_addresses().end());
  g.hosts.assign(m.hosts().begin(), m.hosts().end());
  g.incarnation = m.incarnation();
  g.heal = m.heal();
  g.healing = m.healing();
  return g;
}

inline void to_wire(const Quorum& q, QuorumReply* r) {
  r->set_quorum_id(q.quorum_id);
  for (const auto& p : q.participants) to_wire(p, r->add_participants());
  r->set_max_step(q.max_step);
  r->set_store_address(q.store_address);
  for (int s : q.heal_sources) r->add_heal_sources(s);
  for (const auto& d : q.dropped) r->add_dropped(d);
}

inline Quorum from_wire(const QuorumReply& r) {
  Quorum q;
  q.quorum_id = r.quorum_id();
  for (const auto& p : r.participants()) q.participants.push_back(from_wire(p));
  q.max_step = r.max_step();
  q.store_address = r.store_address();
  q.heal_sources.assign(r.heal_sources().begin(), r.heal_sources().end());
  q.dropped.assign(r.dropped().begin(), r.dropped().end());
  return q;
}

// A quorum's reply as a delta against `known` (QuorumReply::delta): the members of `q`
// that `known` lacks (or holds as another incarnation), the groups of `known` gone, the
// participants below max_step.
inline QuorumReply delta_reply(const Quorum& q, const Quorum& known) {
  QuorumReply r;
  r.set_quorum_id(q.quorum_id);
  r.set_max_step(q.max_step);
  r.set_store_address(q.store_address);
  r.set_delta(true);
  std::map<std::string, const std::string*> had;  // group_id -> incarnation
  for (const auto& p : known.participants) had[p.group_id] = &p.incarnation;
  for (const auto& p : q.participants) {
    auto it = had.find(p.group_id);
    if (it == had.end() || *it->second != p.incarnation) to_wire(p, r.add_participants());
    if (it != had.end()) had.erase(it);
  }
  for (const auto& kv : had) r.add_dropped(kv.first);
  for (size_t i = 0; i < q.participants.size(); ++i) {
    const GroupInfo& p = q.participants[i];
    if (p.step == q.max_step && q.heal_sources[i] < 0 && !p.heal && !p.healing) continue;
    auto* b = r.add_behind();
    b->set_index(static_cast<int>(i));
    b->set_step(p.step);
    b->set_heal_source(q.heal_sources[i]);
    b->set_heal(p.heal);
    b->set_healing(p.healing);
  }
  return r;
}

// The whole reply a delta (QuorumReply::delta) stands for, against `known`, the quorum the caller
// holds. What it cannot place (a behind index out of range) is left for check_reply to name.
inline QuorumReply apply_delta(const QuorumReply& delta, const Quorum& known) {
  std::map<std::string, Member> members;
  for (const auto& p : known.participants) to_wire(p, &members[p.group_id]);
  for (const auto& d : delta.dropped()) members.erase(d);
  for (const auto& m : delta.participants()) members[m.group_id()] = m;
  QuorumReply whole;
  whole.set_quorum_id(delta.quorum_id());
  whole.set_max_step(delta.max_step());
  whole.set_store_address(delta.store_address());
  whole.set_lighthouse(delta.lighthouse());
  for (auto& kv : members) {
    kv.second.set_step(delta.max_step());
    kv.second.set_heal(false);
    kv.second.set_healing(false);
    *whole.add_participants() = std::move(kv.second);
    whole.add_heal_sources(-1);
  }
  for (const auto& d : delta.dropped()) whole.add_dropped(d);
  for (const auto& b : delta.behind()) {
    if (b.index() < 0 || b.index() >= whole.participants_size()) {
      whole.clear_heal_sources();  // check_reply: "heal_sources does not match the participants"
      break;
    }
    whole.mutable_participants(b.index())->set_step(b.step());
    whole.set_heal_sources(b.index(), b.heal_source());
    whole.mutable_participants(b.index())->set_heal(b.heal());
    whole.mutable_participants(b.index())->set_healing(b.healing());
  }
  return whole;
}

}  // namespace wire
}  // namespace ft
}  // namespace ddpkit
