// A seam for tests that run ranks as threads (internal; tests/transport_conformance_test.cpp):
// while a ScopedHostKey lives on a thread, groups made on that thread publish this host's key
// with `label` appended, so ranks of one process can model several hosts (hierarchical groups)
// while still sharing memory within each modelled host.
#pragma once

#include <string>

namespace ddpkit {

class ScopedHostKey {
 public:
  explicit ScopedHostKey(std::string label);
  ~ScopedHostKey();
  ScopedHostKey(const ScopedHostKey&) = delete;
  ScopedHostKey& operator=(const ScopedHostKey&) = delete;
  static const std::string& current();  // "" when none

 private:
  std::string previous_;
};

}  // namespace ddpkit
