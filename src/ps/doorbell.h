// Same-host calls without a gRPC call: when a chunk's data already lies in a shared-memory slot,
// its AverageGradient request (a few hundred bytes: dtype, shape, where the data is) goes into
// the slot's mailbox, and a futex word in the region's first page rings the server; the reply
// comes back the same way. The bytes are the same GradientRequest and GradientReply the gRPC
// call carries, and the server handles them with the same code, so every rule (rejections,
// batches, limits, the reaper) holds. gRPC still opens the session (its end is how either side
// learns the other is gone), carries everything that does not fit a mailbox, and carries all
// traffic between hosts.
//
// Why: on one host a gRPC unary call costs several thread hand-offs and an epoll wake-up, more
// than a 1 MB round's memory traffic; a futex wake is one hand-off.
//
// A mailbox goes Empty -> Request (trainer) -> Taken -> Reply (server) -> Empty (trainer). The
// trainer's deadline is its own: when it passes, the call fails there with DEADLINE_EXCEEDED,
// the trainer raises the mailbox's cancel flag (the server then fails the batch, as a cancelled
// gRPC call does), and the slot and mailbox stay out of use, since the server may still answer.
// Everything the server reads from a mailbox is copied out first and checked like a message.
#pragma once

#include "shared_region.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace ddpkit {
namespace ps {

// Lives in the region's first page, after the cookie; each word on its own cache line.
struct alignas(64) DoorbellWord {
  std::atomic<uint32_t> value{0};
  std::atomic<uint32_t> sleepers{0};  // waiters on `value`: a ring wakes them only when there are any
};
struct DoorbellHeader {
  alignas(64) char cookie[SharedRegion::kCookieBytes];
  DoorbellWord to_server, to_trainer;
};
static_assert(sizeof(DoorbellHeader) <= SharedRegion::kHeaderBytes, "doorbells fit the first page");

struct alignas(64) Mailbox {
  enum State : uint32_t { kEmpty = 0, kRequest = 1, kTaken = 2, kReply = 3 };
  std::atomic<uint32_t> state{kEmpty};
  std::atomic<uint32_t> cancel{0};
  uint32_t request_bytes = 0;
  uint32_t reply_bytes = 0;
  int32_t status_code = 0;  // grpc::StatusCode; not OK: the payload is the message
  char payload[SharedRegion::kMailboxBytes - 64];
};
static_assert(sizeof(Mailbox) == SharedRegion::kMailboxBytes, "a mailbox fills its place");
constexpr int64_t kMailboxPayloadBytes = sizeof(Mailbox::payload);

DoorbellHeader* doorbells(const SharedRegion& region);
Mailbox* mailbox(const SharedRegion& region, int index);
// Bumps the word and wakes its waiters, if any.
void ring(DoorbellWord& word);
// Sleeps until the word moves from `seen`, a ring, or `timeout`.
void wait_for_ring(DoorbellWord& word, uint32_t seen, std::chrono::nanoseconds timeout);

// The trainer's side: posts requests and runs each reply's callback on its own thread.
class DoorbellClient {
 public:
  using Done = std::function<void(const grpc::Status&, grpc::ByteBuffer&)>;
  // `session_alive` false: the server is gone, and every call in flight fails with UNAVAILABLE.
  DoorbellClient(SharedRegion* region, std::chrono::milliseconds timeout, std::function<bool()> session_alive);
  ~DoorbellClient();  // close()

  // Posts `request` (at most kMailboxPayloadBytes) in mailbox `index`, which must be free (its
  // slot is the caller's). `done` runs once: on the doorbell thread with the reply or the failure,
  // or here with CANCELLED when the client is closing.
  void post(int index, const grpc::ByteBuffer& request, Done done);
  // Fails every call in flight with CANCELLED (their callbacks run here) and stops the thread.
  void close();

 private:
  void loop();
  struct Pending {
    Done done;
    std::chrono::steady_clock::time_point deadline;
  };
  SharedRegion* region_;
  std::chrono::milliseconds timeout_;
  std::function<bool()> session_alive_;
  std::mutex mu_;
  std::map<int, Pending> pending_;
  bool closing_ = false;
  std::thread thread_;
};

// The server's side, one per trainer session with mailboxes: a thread that takes posted requests
// and passes a copy of their bytes to `serve(mailbox, bytes)`, and a raised cancel flag to
// `cancel(mailbox)`.
class DoorbellListener {
 public:
  using Serve = std::function<void(int, const grpc::ByteBuffer&)>;
  using Cancel = std::function<void(int)>;
  DoorbellListener(std::shared_ptr<SharedRegion> region, Serve serve, Cancel cancel);
  ~DoorbellListener();  // stops and joins the thread
  // Writes the answer to the call in mailbox `index` (`reply` when OK) and rings the trainer.
  static void answer(SharedRegion& region, int index, const grpc::Status& status, grpc::ByteBuffer* reply);

 private:
  void loop();
  std::shared_ptr<SharedRegion> region_;
  Serve serve_;
  Cancel cancel_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace ps
}  // namespace ddpkit
