// PreemptionWatch: the handler only records the signal; the decision is an allreduce (MAX) at
// a step boundary, so every rank checkpoints the same step even when the signal reached one.
#include <ddpkit/training/preemption.h>

#include <ddpkit/error.h>

#include <atomic>
#include <csignal>

namespace ddpkit {

namespace {
volatile std::sig_atomic_t g_received = 0;
std::atomic<bool> g_watching{false};

void on_preemption_signal(int sig) { g_received = sig; }
}  // namespace

PreemptionWatch::PreemptionWatch(std::vector<int> signals)
    : signals_(signals.empty() ? std::vector<int>{SIGTERM, SIGUSR1} : std::move(signals)) {
  DDPKIT_CHECK(!g_watching.exchange(true), "PreemptionWatch: one watch at a time per process");
  g_received = 0;
  for (int sig : signals_) {
    struct sigaction action {};
    action.sa_handler = on_preemption_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;  // blocking calls in progress carry on; the step boundary decides
    struct sigaction old {};
    sigaction(sig, &action, &old);
    previous_.push_back(old);
  }
}

PreemptionWatch::~PreemptionWatch() {
  for (size_t i = 0; i < signals_.size(); ++i) {
    sigaction(signals_[i], &previous_[i], nullptr);
  }
  g_watching = false;
}

int PreemptionWatch::received() const { return static_cast<int>(g_received); }

bool PreemptionWatch::stop_now(ProcessGroup* pg) {
  const int local = g_received != 0 ? 1 : 0;
  if (!pg || pg->size() == 1) return local != 0;
  at::Tensor flag = at::full({1}, static_cast<float>(local), at::kFloat);
  ProcessGroup::wait(pg->allreduce(flag, c10d::ReduceOp::MAX));
  return flag.item<float>() != 0;
}

}  // namespace ddpkit
