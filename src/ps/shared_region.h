// Bulk gradient data between a trainer and its parameter server on one host, beside gRPC (which
// then carries only the small request and reply). The trainer creates a memfd of fixed-size slots
// and seals its size (it cannot shrink, so the server's mapping never faults); the server opens it
// through /proc/<pid>/fd/<fd> and checks a random cookie written at its start. A server on another
// host, in another PID namespace or without permission fails that check, and the pair stays on
// gRPC bytes. Nothing is named in /dev/shm: the memory goes when both sides have dropped it, even
// when either is SIGKILLed.
//
// Layout: one page (the cookie, then the doorbell words of doorbell.h), `mailboxes` mailboxes of
// kMailboxBytes (one per slot: a call's request and reply when it goes by doorbell), then the slots.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ddpkit {
namespace ps {
namespace wire {
class SharedMemoryOffer;
}

class SharedRegion {
 public:
  static constexpr int64_t kHeaderBytes = 4096;  // the cookie and the doorbell words
  static constexpr int kCookieBytes = 16;
  static constexpr int64_t kMailboxBytes = 16384;
  static constexpr int kMaxMailboxes = 1024;

  // Trainer: `slots` slots of `slot_bytes` each, and as many mailboxes. Throws CommError naming
  // the failing call.
  SharedRegion(int64_t slot_bytes, int slots);
  // Server: maps a trainer's region of `mailboxes` mailboxes; nullptr and *error (why) when it
  // cannot be used.
  static std::shared_ptr<SharedRegion> attach(int64_t pid, int fd, int64_t bytes, const std::string& cookie,
                                              int mailboxes, std::string* error);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  uint8_t* at(int64_t offset) const { return base_ + offset; }
  int64_t bytes() const { return bytes_; }
  int mailboxes() const { return mailboxes_; }
  uint8_t* mailbox(int i) const { return base_ + kHeaderBytes + i * kMailboxBytes; }
  // Where data may lie: after the header and the mailboxes.
  int64_t first_slot() const { return kHeaderBytes + mailboxes_ * kMailboxBytes; }
  // Does [offset, offset + n) lie among the slots, inside the region?
  bool holds(int64_t offset, int64_t n) const {
    return offset >= first_slot() && n >= 0 && offset <= bytes_ && n <= bytes_ - offset;
  }

  // Trainer side.
  // What the session offers the server: this process's pid, the fd, the size, the id, the cookie.
  void offer(wire::SharedMemoryOffer* out) const;
  int fd() const { return fd_; }
  const std::string& cookie() const { return cookie_; }
  uint64_t id() const { return id_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  // The mailbox that goes with the slot at `offset`.
  int mailbox_of(int64_t offset) const { return static_cast<int>((offset - first_slot()) / slot_bytes_); }
  // A free slot's offset, or -1 when every slot is in use (the caller sends in the message then).
  int64_t acquire();
  void release(int64_t offset);

 private:
  SharedRegion() = default;

  uint8_t* base_ = nullptr;
  int64_t bytes_ = 0;
  int mailboxes_ = 0;
  int fd_ = -1;
  std::string cookie_;
  uint64_t id_ = 0;
  int64_t slot_bytes_ = 0;
  std::mutex mu_;
  std::vector<int64_t> free_;  // offsets of free slots
};

}  // namespace ps
}  // namespace ddpkit
