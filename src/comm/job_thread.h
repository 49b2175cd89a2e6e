// One thread that runs jobs one at a time, in the order they were posted (internal): a process
// group's sequencer, and its shared-memory thread. The destructor runs what is still queued,
// then joins.
#pragma once

#include <ddpkit/error.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace ddpkit {

class JobThread {
 public:
  using Job = std::function<void()>;

  JobThread() : thread_([this] { loop(); }) {}
  ~JobThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  JobThread(const JobThread&) = delete;
  JobThread& operator=(const JobThread&) = delete;

  bool is_current() const { return std::this_thread::get_id() == thread_.get_id(); }

  // Jobs put their own errors where they belong (their futures): one that throws ends the process.
  void post(Job job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      DDPKIT_CHECK(!stopping_, "process group is shutting down");
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping and drained
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
  std::thread thread_;  // last: it starts running loop() as soon as it is made
};

}  // namespace ddpkit
