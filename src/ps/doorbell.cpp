#include "doorbell.h"

#include "../comm/futex.h"

#include <cstring>
#include <vector>

namespace ddpkit {
namespace ps {
namespace {

using Clock = std::chrono::steady_clock;

// The longest a waiter sleeps between looks at what a ring cannot tell it: the session's end,
// a passed deadline, a stop.
constexpr auto kLook = std::chrono::milliseconds(20);

grpc::ByteBuffer to_buffer(const char* data, size_t n) {
  grpc::Slice slice(data, n);
  return grpc::ByteBuffer(&slice, 1);
}

// Copies all of `bytes` to `to`, which has room for bytes.Length().
void copy_out(const grpc::ByteBuffer& bytes, char* to) {
  std::vector<grpc::Slice> slices;
  (void)bytes.Dump(&slices);
  for (const grpc::Slice& s : slices) {
    std::memcpy(to, s.begin(), s.size());
    to += s.size();
  }
}

}  // namespace

DoorbellHeader* doorbells(const SharedRegion& region) { return reinterpret_cast<DoorbellHeader*>(region.at(0)); }

Mailbox* mailbox(const SharedRegion& region, int index) { return reinterpret_cast<Mailbox*>(region.mailbox(index)); }

void ring(DoorbellWord& word) {
  word.value.fetch_add(1, std::memory_order_seq_cst);
  if (word.sleepers.load(std::memory_order_seq_cst) > 0) detail::futex_wake_all(word.value);
}

void wait_for_ring(DoorbellWord& word, uint32_t seen, std::chrono::nanoseconds timeout) {
  if (timeout <= std::chrono::nanoseconds(0)) return;
  word.sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (word.value.load(std::memory_order_seq_cst) == seen) {
    const timespec ts{static_cast<time_t>(timeout.count() / 1000000000), static_cast<long>(timeout.count() % 1000000000)};
    detail::futex_wait(word.value, seen, ts);
  }
  word.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

// ---- trainer ----

DoorbellClient::DoorbellClient(SharedRegion* region, std::chrono::milliseconds timeout,
                               std::function<bool()> session_alive)
    : region_(region), timeout_(timeout), session_alive_(std::move(session_alive)) {
  thread_ = std::thread([this] { loop(); });
}

DoorbellClient::~DoorbellClient() { close(); }

void DoorbellClient::post(int index, const grpc::ByteBuffer& request, Done done) {
  Mailbox* box = mailbox(*region_, index);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!closing_) {
      copy_out(request, box->payload);
      box->request_bytes = static_cast<uint32_t>(request.Length());
      box->cancel.store(0, std::memory_order_relaxed);
      pending_[index] = Pending{std::move(done), Clock::now() + timeout_};
      box->state.store(Mailbox::kRequest, std::memory_order_release);
      done = nullptr;
    }
  }
  if (done) {
    grpc::ByteBuffer none;
    done(grpc::Status(grpc::StatusCode::CANCELLED, "the client is closing"), none);
    return;
  }
  ring(doorbells(*region_)->to_server);
}

void DoorbellClient::close() {
  std::map<int, Pending> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
  }
  ring(doorbells(*region_)->to_trainer);  // our own thread sleeps on it
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(pending_);
  }
  for (auto& [index, p] : left) {
    grpc::ByteBuffer none;
    p.done(grpc::Status(grpc::StatusCode::CANCELLED, "the client is closing"), none);
  }
}

void DoorbellClient::loop() {
  DoorbellWord& bell = doorbells(*region_)->to_trainer;
  for (;;) {
    const uint32_t seen = bell.value.load(std::memory_order_seq_cst);
    struct Ready {
      Done done;
      grpc::Status status;
      grpc::ByteBuffer reply;
    };
    std::vector<Ready> ready;
    auto next_deadline = Clock::now() + kLook;
    bool ring_server = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closing_) return;  // close() fails what is left
      const bool alive = session_alive_();
      const auto now = Clock::now();
      for (auto it = pending_.begin(); it != pending_.end();) {
        Mailbox* box = mailbox(*region_, it->first);
        if (box->state.load(std::memory_order_acquire) == Mailbox::kReply) {
          const uint32_t n = std::min<uint32_t>(box->reply_bytes, kMailboxPayloadBytes);
          const auto code = static_cast<grpc::StatusCode>(box->status_code);
          Ready r{std::move(it->second.done), grpc::Status::OK, {}};
          if (code == grpc::StatusCode::OK)
            r.reply = to_buffer(box->payload, n);
          else
            r.status = grpc::Status(code, std::string(box->payload, n));
          box->state.store(Mailbox::kEmpty, std::memory_order_relaxed);
          ready.push_back(std::move(r));
          it = pending_.erase(it);
        } else if (!alive || now >= it->second.deadline) {
          // The server may still answer: the caller keeps the slot (and so this mailbox) out of use.
          ready.push_back(Ready{std::move(it->second.done),
                                alive ? grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "Deadline Exceeded")
                                      : grpc::Status(grpc::StatusCode::UNAVAILABLE, "the session with the server ended"),
                                {}});
          if (alive) {
            box->cancel.store(1, std::memory_order_release);
            ring_server = true;
          }
          it = pending_.erase(it);
        } else {
          next_deadline = std::min(next_deadline, it->second.deadline);
          ++it;
        }
      }
    }
    if (ring_server) ring(doorbells(*region_)->to_server);
    for (Ready& r : ready) r.done(r.status, r.reply);
    if (ready.empty()) wait_for_ring(bell, seen, next_deadline - Clock::now());
  }
}

// ---- server ----

DoorbellListener::DoorbellListener(std::shared_ptr<SharedRegion> region, Serve serve, Cancel cancel)
    : region_(std::move(region)), serve_(std::move(serve)), cancel_(std::move(cancel)) {
  thread_ = std::thread([this] { loop(); });
}

DoorbellListener::~DoorbellListener() {
  stopping_ = true;
  ring(doorbells(*region_)->to_server);
  thread_.join();
}

void DoorbellListener::answer(SharedRegion& region, int index, const grpc::Status& status, grpc::ByteBuffer* reply) {
  Mailbox* box = mailbox(region, index);
  grpc::StatusCode code = status.error_code();
  std::string message = status.error_message();
  size_t n = 0;
  if (status.ok()) {
    n = reply->Length();
    if (n > static_cast<size_t>(kMailboxPayloadBytes)) {
      code = grpc::StatusCode::RESOURCE_EXHAUSTED;
      message = "the reply's " + std::to_string(n) + " bytes do not fit a mailbox (" +
                std::to_string(kMailboxPayloadBytes) + "); the trainer should have sent this by gRPC";
    } else {
      copy_out(*reply, box->payload);
    }
  }
  if (code != grpc::StatusCode::OK) {
    n = std::min(message.size(), static_cast<size_t>(kMailboxPayloadBytes));
    std::memcpy(box->payload, message.data(), n);
  }
  box->status_code = static_cast<int32_t>(code);
  box->reply_bytes = static_cast<uint32_t>(n);
  box->state.store(Mailbox::kReply, std::memory_order_release);
  ring(doorbells(region)->to_trainer);
}

void DoorbellListener::loop() {
  DoorbellWord& bell = doorbells(*region_)->to_server;
  const int count = region_->mailboxes();
  while (!stopping_) {
    const uint32_t seen = bell.value.load(std::memory_order_seq_cst);
    bool found = false;
    for (int i = 0; i < count && !stopping_; ++i) {
      Mailbox* box = mailbox(*region_, i);
      uint32_t expected = Mailbox::kRequest;
      if (box->state.compare_exchange_strong(expected, Mailbox::kTaken, std::memory_order_acquire)) {
        found = true;
        // Copied out before anything reads it: the trainer's process can write it at any time.
        const uint32_t n = box->request_bytes;
        if (n > static_cast<uint32_t>(kMailboxPayloadBytes)) {
          answer(*region_, i,
                 grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              "a request of " + std::to_string(n) + " bytes in mailbox " + std::to_string(i) +
                                  ", more than a mailbox holds (" + std::to_string(kMailboxPayloadBytes) + ")"),
                 nullptr);
          continue;
        }
        serve_(i, to_buffer(box->payload, n));
      }
      if (box->cancel.load(std::memory_order_acquire) && box->cancel.exchange(0, std::memory_order_acq_rel)) {
        found = true;
        cancel_(i);
      }
    }
    if (!found) wait_for_ring(bell, seen, kLook * 10);
  }
}

}  // namespace ps
}  // namespace ddpkit
