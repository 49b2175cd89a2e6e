// The parameter server's view of its trainers: sessions (one per trainer, open while it lives),
// the shared-memory regions they offer, and the reaper that fails a batch whose trainer is gone
// or late.
#include "server_state.h"

#include "../comm/shm_switch.h"

#include <algorithm>

namespace ddpkit {
namespace ps {

wire::SessionEvent ParameterServer::Impl::on_session_opened(const wire::SessionRequest& request, SessionCall* call) {
  wire::SessionEvent event;
  if (request.has_shared_memory()) {
    const wire::SharedMemoryOffer& offer = request.shared_memory();
    std::string why;
    std::shared_ptr<SharedRegion> memory;
    if (!shared_memory_allowed_by_environment())
      why = "DDPKIT_SHM=0 on the server";
    else
      memory = SharedRegion::attach(offer.pid(), offer.fd(), offer.bytes(), offer.cookie(), offer.mailboxes(), &why);
    if (memory) {
      std::lock_guard<std::mutex> lock(regions_mu);
      Region entry{request.trainer_id(), memory, nullptr};
      if (offer.region() == 0 || regions.count(offer.region())) {
        why = "region id " + std::to_string(offer.region()) + " is taken";
        memory.reset();
      } else {
        if (memory->mailboxes() > 0) {
          auto calls = std::make_shared<DoorbellCalls>();
          entry.listener = std::make_shared<DoorbellListener>(
              memory,
              [this, memory, calls](int box, const grpc::ByteBuffer& bytes) { serve_posted(memory, calls, box, bytes); },
              [this, calls](int box) { cancel_posted(calls, box); });
          event.set_doorbell(true);
        }
        regions.emplace(offer.region(), std::move(entry));
      }
    }
    event.set_shared_memory(memory != nullptr);
    event.set_shared_memory_refused(why);
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    disconnected.erase(request.trainer_id());
  }
  std::lock_guard<std::recursive_mutex> lock(sessions_mu);
  sessions.insert(call);
  return event;
}

void ParameterServer::Impl::on_session_done(SessionCall* call, uint64_t region) {
  std::shared_ptr<DoorbellListener> listener;
  if (region != 0) {
    std::lock_guard<std::mutex> lock(regions_mu);
    auto it = regions.find(region);
    if (it != regions.end()) {
      listener = std::move(it->second.listener);
      regions.erase(it);
    }
  }
  listener.reset();  // joins its thread, which may be taking regions_mu to check a call's place
  std::lock_guard<std::recursive_mutex> lock(sessions_mu);
  sessions.erase(call);
}

void ParameterServer::Impl::stop_listeners() {
  std::vector<std::shared_ptr<DoorbellListener>> stop;
  {
    std::lock_guard<std::mutex> lock(regions_mu);
    for (auto& [id, r] : regions) stop.push_back(std::move(r.listener));
  }
  stop.clear();
}

void SessionCall::OnCancel() {
  impl_->on_session_lost(trainer_);
  finish_once(grpc::Status(grpc::StatusCode::CANCELLED, "session ended"));
}

void SessionCall::OnDone() {
  impl_->on_session_done(this, region_);
  delete this;
}

void ParameterServer::Impl::on_session_lost(int trainer) {
  // Buckets waiting for it fail once the reconnect grace has passed without a new session (reaper).
  std::lock_guard<std::mutex> lock(mu);
  disconnected.emplace(trainer, Clock::now());
}

void ParameterServer::Impl::reaper_loop() {
  const auto period = std::max(std::chrono::milliseconds(10), std::min(std::chrono::milliseconds(200), options.bucket_timeout() / 10));
  std::unique_lock<std::mutex> stop_lock(stop_mu);
  while (!stopping) {
    stop_cv.wait_for(stop_lock, period);
    if (stopping) break;
    std::vector<std::pair<AverageCall*, grpc::Status>> finish;
    {
      std::lock_guard<std::mutex> lock(mu);
      const auto now = Clock::now();
      for (auto& [index, bucket] : buckets) {
        if (bucket.waiting.empty()) continue;
        std::vector<int> missing, waiting, lost;
        for (int t : serving)
          if (!bucket.sent.count(t)) {
            missing.push_back(t);
            if (gone(t, now)) lost.push_back(t);
          }
        for (auto& [t, c] : bucket.waiting) waiting.push_back(t);
        if (!lost.empty()) {
          fail_batch_locked(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                         "trainer " + join_ids(lost) + " disconnected before sending " +
                                             name(index, bucket.chunk_count) + " of batch " + std::to_string(batch) +
                                             " (trainers " + join_ids(waiting) + " were waiting for it)"),
                            &finish);
          break;
        }
        if (now - bucket.first < options.bucket_timeout()) continue;
        fail_batch_locked(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                       name(index, bucket.chunk_count) + " of batch " + std::to_string(batch) +
                                           ": trainer(s) " + join_ids(missing) + " did not send within " +
                                           std::to_string(options.bucket_timeout().count()) + " ms (trainers " +
                                           join_ids(waiting) + " were waiting)"),
                          &finish);
        break;
      }
    }
    stop_lock.unlock();
    for (auto& [c, s] : finish) c->finish(s);
    stop_lock.lock();
  }
}

}  // namespace ps
}  // namespace ddpkit
