// The Manager's registry of the loop's own state (Manager::register_state): what a heal carries
// besides TrainingState, and what a checkpoint keeps of it, each entry under its key.
#pragma once

#include <ddpkit/ft/manager.h>

#include <string>
#include <vector>

namespace ddpkit {
namespace ft {

class StateRegistry {
 public:
  void add(const std::string& key, SaveState save, LoadState load, StateScope scope);
  void remove(const std::string& key);
  void clear() { entries_.clear(); }  // the callbacks go (Manager::close)

  // What a heal source sends: every entry a heal copies, under "<key>/", with a marker per key so
  // a healer can tell a key its source never registered from one that saved nothing.
  TensorDict heal_entries() const;
  // Loads a source's heal entries, in the order of registration; `what` names the source in errors.
  void load_heal_entries(const TensorDict& entries, const std::string& what) const;
  // A heal's extras that are not the registry's (the Manager's legacy extra callback).
  static TensorDict without_registered(const TensorDict& entries);

  // A checkpoint's parts: kShared into `common`, kSharedPerRank and kLocal into `local`.
  void checkpoint_entries(TensorDict* common, TensorDict* local) const;
  // `local` is empty when the checkpoint was written under another world size: kLocal entries then
  // start afresh (load with an empty dict), kSharedPerRank ones are an error naming the key.
  void load_checkpoint_entries(const TensorDict& common, const TensorDict& local, const std::string& what) const;

 private:
  struct Entry {
    std::string key;
    SaveState save;
    LoadState load;
    StateScope scope;
  };
  std::vector<Entry> entries_;
};

}  // namespace ft
}  // namespace ddpkit
