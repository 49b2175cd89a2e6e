// The lighthouse's messages <-> the public structs, and the checks every message passes before it
// is used (internal). A check returns what is wrong, or "" when nothing is.
#pragma once

#include <ddpkit/ft/lighthouse.h>

#include "lighthouse.pb.h"

#include <cctype>
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
}

inline GroupInfo from_wire(const Member& m) {
  GroupInfo g;
  g.group_id = m.group_id();
  g.step = m.step();
  g.world_size = m.world_size();
  g.state_addresses.assign(m.state_addresses().begin(), m.state_addresses().end());
  g.hosts.assign(m.hosts().begin(), m.hosts().end());
  g.incarnation = m.incarnation();
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

}  // namespace wire
}  // namespace ft
}  // namespace ddpkit
