// Memory that processes on one host share without naming it anywhere (internal). The owner
// creates an unnamed memfd; a peer opens it through /proc/<pid>/fd/<fd> while the owner still
// holds it. Nothing exists in /dev/shm at any moment, so nothing can be left there: the memory
// goes with the last mapping, even when every process is SIGKILLed at once.
//
// A peer must see the owner's /proc (same PID namespace) with ptrace read access (same user);
// otherwise opening fails with a message saying so. An address names the file as well as the
// fd (device and inode), so a reused fd or pid is refused instead of mapping the wrong memory.
#pragma once

#include <cstddef>
#include <string>

namespace ddpkit {
namespace detail {

struct PeerMemoryAddress {
  long pid = -1;
  int fd = -1;
  unsigned long long dev = 0, ino = 0;  // ino 0: not known (the caller checks the contents)
  unsigned long long bytes = 0;
};

// A memfd of `bytes` (CLOEXEC), reserved now (no room is an error here, not a SIGBUS mid-copy),
// sealed against growing or shrinking (so a peer's mapping never faults), and mapped at *base.
// Returns the fd, or -1 with *error set and nothing left open. Unreserved (`reserve` false), its
// pages come at first touch and are charged to the process (and cgroup) that touches them.
// The region is recorded as this process's shared memory (runtime/memory_sampler.h) until
// unmap_peer_memory.
int create_peer_memory(const char* label, size_t bytes, void** base, std::string* error, bool reserve = true);
// Unmaps a mapping of peer memory (this process's own or a peer's), forgetting it as owned.
void unmap_peer_memory(void* base, size_t bytes);

// Where peers find the memfd `fd` of this process; "pid fd dev ino bytes" as text.
std::string peer_memory_address(int fd);
bool parse_peer_memory_address(const std::string& text, PeerMemoryAddress* out);

// Opens a peer's memfd (O_RDWR, CLOEXEC), checking that it is the file the address names (unless
// its inode is 0), sealed, and exactly address.bytes long. Returns the fd, or -1 with *error
// naming the path and the reason.
int open_peer_memory(const PeerMemoryAddress& address, std::string* error);

// open_peer_memory, then maps all address.bytes of it (read/write, shared). The fd is closed (the
// mapping keeps the memory) unless `keep_fd` is given, which then receives it. Returns the
// mapping, or null with *error set and nothing left open.
void* map_peer_memory(const PeerMemoryAddress& address, std::string* error, int* keep_fd = nullptr);

}  // namespace detail
}  // namespace ddpkit
