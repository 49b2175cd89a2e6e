// Futex calls on 32-bit words in memory that processes share (internal): the shared-memory
// collectives' counters and the parameter server's doorbells. Not FUTEX_PRIVATE: the waiter and
// the waker are in different processes.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <ctime>

namespace ddpkit {
namespace detail {

static_assert(sizeof(std::atomic<uint32_t>) == 4, "futex words are 32-bit");

// Wakes every process and thread asleep on `word`.
inline void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, &word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Sleeps while `word` still holds `seen`, until a wake or `timeout` (spurious returns allowed).
inline void futex_wait(std::atomic<uint32_t>& word, uint32_t seen, const timespec& timeout) {
  syscall(SYS_futex, &word, FUTEX_WAIT, seen, &timeout, nullptr, 0);
}

}  // namespace detail
}  // namespace ddpkit
