// Manager::register_state's registry (state_registry.h).
#include "state_registry.h"

#include <ddpkit/error.h>
#include <ddpkit/training/checkpoint.h>

namespace ddpkit {
namespace ft {
namespace {

// Heal entries live under this prefix of the snapshot's extras, markers under kMarker.
const std::string kPrefix = "registered/";
const std::string kMarker = "registered_key/";

void put_under(TensorDict* out, const std::string& prefix, const TensorDict& entries) {
  for (const auto& [name, value] : entries) (*out)[prefix + name] = value;
}

bool heals_copy(StateScope scope) { return scope != StateScope::kLocal; }

}  // namespace

void StateRegistry::add(const std::string& key, SaveState save, LoadState load, StateScope scope) {
  DDPKIT_CHECK(!key.empty() && key.find('/') == std::string::npos,
               "ft::Manager::register_state: the key must be non-empty and hold no '/', got '", key, "'");
  DDPKIT_CHECK(save && load, "ft::Manager::register_state('", key, "'): give both a save and a load function");
  for (const Entry& e : entries_)
    DDPKIT_CHECK(e.key != key, "ft::Manager::register_state: '", key,
                 "' is registered already (unregister_state it first, or choose another key)");
  entries_.push_back(Entry{key, std::move(save), std::move(load), scope});
}

void StateRegistry::remove(const std::string& key) {
  for (auto it = entries_.begin(); it != entries_.end(); ++it)
    if (it->key == key) {
      entries_.erase(it);
      return;
    }
}

TensorDict StateRegistry::heal_entries() const {
  TensorDict out;
  for (const Entry& e : entries_) {
    if (!heals_copy(e.scope)) continue;
    put_under(&out, kPrefix + e.key + "/", e.save());
    out[kMarker + e.key] = at::empty({0}, at::kByte);
  }
  return out;
}

void StateRegistry::load_heal_entries(const TensorDict& entries, const std::string& what) const {
  for (const Entry& e : entries_) {
    if (!heals_copy(e.scope)) continue;
    DDPKIT_CHECK(entries.count(kMarker + e.key), "ft::Manager: ", what, " holds no state '", e.key,
                 "': register_state it on every replica group (the source's loop registered other keys)");
    e.load(entries_under(entries, kPrefix + e.key + "/"));
  }
}

TensorDict StateRegistry::without_registered(const TensorDict& entries) {
  TensorDict out;
  for (const auto& [name, value] : entries)
    if (name.compare(0, kPrefix.size(), kPrefix) != 0 && name.compare(0, kMarker.size(), kMarker) != 0)
      out[name] = value;
  return out;
}

void StateRegistry::checkpoint_entries(TensorDict* common, TensorDict* local) const {
  for (const Entry& e : entries_) {
    const bool shared = e.scope == StateScope::kShared;
    TensorDict* into = shared ? common : local;
    put_under(into, kPrefix + e.key + "/", e.save());
    (*into)[kMarker + e.key] = at::empty({0}, at::kByte);
  }
}

void StateRegistry::load_checkpoint_entries(const TensorDict& common, const TensorDict& local,
                                            const std::string& what) const {
  // Every entry is checked before any is loaded: a checkpoint that cannot be resumed changes nothing.
  auto source = [&](const Entry& e) -> const TensorDict& { return e.scope == StateScope::kShared ? common : local; };
  for (const Entry& e : entries_) {
    if (source(e).count(kMarker + e.key) || e.scope == StateScope::kLocal) continue;
    DDPKIT_CHECK(e.scope == StateScope::kShared || !local.empty(), what, " holds no per-rank state '", e.key,
                 "': it was written by a group of another size, and this state is each rank's part (resume "
                 "with as many ranks per group)");
    DDPKIT_CHECK(false, what, " holds no state '", e.key, "': the loop that wrote it did not register_state it");
  }
  for (const Entry& e : entries_) {
    // This rank's own state starts afresh when the checkpoint keeps none (another world size).
    e.load(source(e).count(kMarker + e.key) ? entries_under(source(e), kPrefix + e.key + "/") : TensorDict{});
  }
}

}  // namespace ft
}  // namespace ddpkit
