// What `ddpkit train` scores and prints besides its progress: the test-set evaluation, the bucket
// and online-tuning tables, the advice when training diverges, and the last line's JSON object.
#include "training.h"

#include <ddpkit/ddpkit.h>
#include <ddpkit/training/divergence_guard.h>

#include <cmath>

namespace ddpkit {
namespace cli {

TestScore evaluate(const Model& model, const Dataset& test, FullyShardedDataParallelBase* sharded, ProcessGroup* pg) {
  // Each rank scores a shard of the test set (FSDP: through it, every rank the same number of
  // chunks, since each forward gathers); correct predictions, loss and counts are summed.
  const int rank = pg ? pg->rank() : 0, world = pg ? pg->size() : 1;
  torch::NoGradGuard no_grad;
  model.module->eval();
  const int64_t n_test = test.inputs.size(0), chunk = model.language_model ? 128 : 1000;
  at::Tensor counts = at::zeros({3}, at::kDouble);
  const int64_t rounds = (n_test + world * chunk - 1) / (world * chunk);
  for (int64_t k = 0; k < rounds; ++k) {
    int64_t s = (k * world + rank) * chunk, e = std::min(n_test, s + chunk);
    if (s >= n_test && !sharded) break;
    const bool counted = s < n_test;
    if (!counted) s = 0, e = 1;
    at::Tensor xs = test.inputs.slice(0, s, e), ys = test.labels.slice(0, s, e);
    if (model.language_model) xs = xs.to(at::kLong), ys = ys.to(at::kLong);
    at::Tensor out =
        sharded ? sharded->forward_with([&] { return model.forward(sharded->cast_input(xs)); }) : model.forward(xs);
    if (!counted) continue;
    counts[0] += out.argmax(-1).eq(ys).sum().item<double>();
    counts[1] += static_cast<double>(ys.numel());
    counts[2] += model_loss(model, out, ys).item<double>() * static_cast<double>(ys.numel());
  }
  if (pg) ProcessGroup::wait(pg->allreduce(counts));
  model.module->train();
  return {counts[0].item<double>() / counts[1].item<double>(), counts[2].item<double>() / counts[1].item<double>()};
}

std::string bucket_traffic_table(const DistributedDataParallelBase& ddp, int64_t steps_run, double* compression_ratio) {
  uint64_t allreduce_bytes = 0, sent = 0;
  std::ostringstream table;
  table << "bucket  elements   sent/step B  received/step B  vs allreduce\n";
  for (const auto& b : ddp.bucket_traffic()) {
    allreduce_bytes += b.allreduce_bytes;
    // Over the network or through shared memory (ranks on one host): what the hook moved.
    const uint64_t moved = b.traffic.bytes_sent + b.traffic.shm_bytes_sent;
    sent += moved;
    table << std::setw(6) << b.index << std::setw(10) << b.numel << std::setw(14) << (steps_run ? moved / steps_run : 0)
          << std::setw(17) << (steps_run ? (b.traffic.bytes_received + b.traffic.shm_bytes_received) / steps_run : 0)
          << std::setw(13) << std::fixed << std::setprecision(2) << b.compression_ratio() << "x\n";
  }
  *compression_ratio = sent ? static_cast<double>(allreduce_bytes) / static_cast<double>(sent) : 0.0;
  return table.str();
}

std::string tuning_table(const OnlineTuningResult& r) {
  std::ostringstream os;
  os << "online tuning (" << r.steps << " steps)\n   cap MiB  piece KiB  buckets  median step ms\n";
  size_t kept = r.trials.size();  // the last trial run with the final choice
  for (size_t i = 0; i < r.trials.size(); ++i)
    if (r.trials[i].bucket_cap_mb == r.bucket_cap_mb && r.trials[i].piece_bytes == r.piece_bytes) kept = i;
  for (size_t i = 0; i < r.trials.size(); ++i) {
    const TuningTrial& t = r.trials[i];
    os << std::fixed << std::setprecision(1) << std::setw(10) << t.bucket_cap_mb << std::setw(11)
       << t.piece_bytes / 1024 << std::setw(9) << t.buckets << std::setw(16) << std::setprecision(2)
       << t.median_step_ms << (i == kept ? "  <- kept" : "") << "\n";
  }
  return os.str();
}

std::string divergence_message(const Flags& f, const Divergence& d, int64_t powersgd_rank, double lr) {
  const std::string hook = f.str("hook");
  std::ostringstream os;
  os << "training diverged with --hook " << hook << ": " << d.what << ". ";
  if (hook == "powersgd" || hook == "batched_powersgd") {
    os << "Raise --powersgd-rank (now " << powersgd_rank << ") or --powersgd-start-iter (now "
       << f.integer("powersgd-start-iter") << ")" << (f.on("no-error-feedback") ? ", drop --no-error-feedback" : "")
       << ", or lower --lr (now " << lr << ")";
  } else if (hook == "int8") {
    os << (f.on("int8-error-feedback") ? "" : "Add --int8-error-feedback, ") << "lower --int8-block (now "
       << f.integer("int8-block") << "), or lower --lr (now " << lr << ")";
  } else if (hook == "fp16" || hook == "fp16_wrapper") {
    os << "fp16 overflows above 65504: try --hook bf16, or lower --lr (now " << lr << ")";
  } else if (hook == "post_local_sgd") {
    os << "Lower --local-sgd-period (now " << f.integer("local-sgd-period") << "), raise --local-sgd-start-iter (now "
       << f.integer("local-sgd-start-iter") << "), or lower --lr (now " << lr << ")";
  } else {
    os << "Lower --lr (now " << lr << ")";
  }
  os << "; --no-divergence-guard trains on regardless.";
  return os.str();
}

std::string report_json(const TrainReport& r) {
  std::ostringstream js;
  const int64_t n = r.steps_run;
  js << std::fixed << "{\"hook\": \"" << r.hook << "\", \"world_size\": " << r.world << ", \"steps\": " << r.steps
     << ", \"median_step_ms\": " << std::setprecision(3) << median(r.step_ms) << ", \"samples_per_s\": "
     << std::setprecision(1)
     << (r.train_seconds > 0 ? static_cast<double>(n) * r.batch * r.world / r.train_seconds : 0.0)
     << ", \"bytes_sent_per_step\": " << (n ? r.traffic.bytes_sent / n : 0)
     << ", \"bytes_received_per_step\": " << (n ? r.traffic.bytes_received / n : 0)
     << ", \"shm_bytes_sent_per_step\": " << (n ? r.traffic.shm_bytes_sent / n : 0) << ", \"shared_memory\": "
     << (r.shared_memory.empty() ? std::string("false") : "\"" + r.shared_memory + "\"")
     << ", \"compression_ratio\": " << std::setprecision(3) << r.compression_ratio << ", \"bucket_cap_mb\": ";
  if (r.bucket_cap_mb >= 0) js << r.bucket_cap_mb; else js << "null";
  js << ", \"piece_kb\": " << r.piece_kb << ", \"tuning_steps\": " << (r.tuning ? r.tuning->steps : 0)
     << ", \"tuned_median_step_ms\": ";
  if (r.tuned_from >= 0) js << median(std::vector<double>(r.step_ms.begin() + r.tuned_from, r.step_ms.end()));
  else js << "null";
  js << ", \"tuning_trials\": [";
  if (r.tuning)
    for (const auto& t : r.tuning->trials)
      js << (&t == &r.tuning->trials.front() ? "" : ", ") << "{\"bucket_cap_mb\": " << t.bucket_cap_mb
         << ", \"piece_kb\": " << t.piece_bytes / 1024 << ", \"buckets\": " << t.buckets
         << ", \"median_step_ms\": " << t.median_step_ms << "}";
  js << "], \"test_accuracy\": ";
  if (r.accuracy >= 0) js << std::setprecision(4) << r.accuracy; else js << "null";
  js << ", \"test_perplexity\": ";
  if (r.test_perplexity >= 0) js << std::setprecision(4) << r.test_perplexity; else js << "null";
  js << ", \"final_loss\": " << std::setprecision(4) << r.final_loss << ", \"median_forward_ms\": "
     << std::setprecision(3) << median(r.forward_ms) << ", \"median_backward_ms\": " << median(r.backward_ms)
     << ", \"median_optimizer_ms\": " << median(r.optimizer_ms) << ", \"median_minor_faults_per_step\": "
     << std::setprecision(0) << median(r.minor_faults) << std::setprecision(3) << ", \"reducer_ms_per_step\": ";
  if (!r.reducer.empty()) {
    // Medians over steps, like the phases above: the first steps' one-time costs (buckets' first
    // touch, the rebuild) do not stand for every step.
    auto med = [&](double ReducerTimes::*field) {
      std::vector<double> v;
      for (const auto& t : r.reducer) v.push_back(t.*field);
      return median(v);
    };
    js << "{\"copy_in\": " << med(&ReducerTimes::copy_in_ms) << ", \"launch\": " << med(&ReducerTimes::launch_ms)
       << ", \"wait\": " << med(&ReducerTimes::wait_ms) << ", \"copy_out\": " << med(&ReducerTimes::copy_out_ms)
       << "}";
  } else {
    js << "null";
  }
  js << ", \"optimizer\": \"" << r.optimizer
     << "\", \"zero\": \"" << r.zero << "\", \"optimizer_state_bytes\": " << r.optimizer_state_bytes
     << ", \"model\": \"" << r.model << "\", \"fsdp\": \"" << r.fsdp << "\", \"peak_rss_bytes\": " << r.peak_rss_bytes
     << ", \"peak_pss_bytes\": " << r.peak_pss_bytes << ", \"mean_peak_pss_bytes\": " << r.mean_peak_pss_bytes
     << ", \"resumed_from_step\": ";
  if (r.resumed_from >= 0) js << r.resumed_from; else js << "null";
  js << ", \"checkpoints_written\": " << r.checkpoints_written << "}";
  return js.str();
}

}  // namespace cli
}  // namespace ddpkit
