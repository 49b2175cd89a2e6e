// Heartbeats through the replica group (group_beats.h).
#include "group_beats.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <sstream>

namespace ddpkit {
namespace ft {

namespace {

// "<number>\n<quorum_id>\n<lost group>\n..." (group ids have no newline: wire::valid_name).
std::string encode(int64_t number, const LighthouseClient::Beat& b) {
  std::ostringstream os;
  os << number << "\n" << b.quorum_id << "\n";
  for (const auto& g : b.lost) os << g << "\n";
  return os.str();
}

int64_t decode(const std::vector<uint8_t>& bytes, LighthouseClient::Beat* b) {
  std::istringstream is(std::string(bytes.begin(), bytes.end()));
  int64_t number = 0;
  is >> number >> b->quorum_id;
  is.ignore();
  for (std::string g; std::getline(is, g);)
    if (!g.empty()) b->lost.push_back(g);
  return number;
}

}  // namespace

GroupBeats::GroupBeats(const c10::intrusive_ptr<c10d::Store>& store, const std::string& group_id, int rank, int size)
    : store_(c10::make_intrusive<c10d::PrefixStore>("ddpkit-ft/beat/" + group_id, store)),
      group_id_(group_id),
      rank_(rank),
      size_(size),
      counts_(static_cast<size_t>(size), -1),
      seen_(static_cast<size_t>(size), Clock::now()) {}

void GroupBeats::prepare() {
  // Numbered after any reply a previous incarnation of this group left in the store.
  if (rank_ == 0) post(LighthouseClient::Beat());
}

void GroupBeats::post(const LighthouseClient::Beat& b) {
  const std::string s = encode(store_->add("replies", 1), b);
  store_->set("reply", std::vector<uint8_t>(s.begin(), s.end()));
}

std::optional<LighthouseClient::Beat> GroupBeats::beat(LighthouseClient& client, const std::string& incarnation) {
  if (rank_ != 0) {
    store_->add("r" + std::to_string(rank_), 1);
    LighthouseClient::Beat b;
    const int64_t number = decode(store_->get("reply"), &b);
    if (number == read_) return std::nullopt;  // rank 0 has not beaten since
    read_ = number;
    return b;
  }
  const auto now = Clock::now();
  std::vector<int64_t> ages(static_cast<size_t>(size_), 0);
  for (int r = 1; r < size_; ++r) {
    const int64_t count = store_->add("r" + std::to_string(r), 0);
    if (count != counts_[static_cast<size_t>(r)]) {
      counts_[static_cast<size_t>(r)] = count;
      seen_[static_cast<size_t>(r)] = now;
    }
    ages[static_cast<size_t>(r)] =
        std::chrono::duration_cast<std::chrono::milliseconds>(now - seen_[static_cast<size_t>(r)]).count();
  }
  const LighthouseClient::Beat b = client.heartbeat_for_group(group_id_, incarnation, ages);
  post(b);
  return b;
}

}  // namespace ft
}  // namespace ddpkit
