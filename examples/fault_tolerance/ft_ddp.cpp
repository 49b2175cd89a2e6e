// Fault-tolerant DDP over a model of your own: R replica groups (each one `ddpkit launch --nproc W`)
// train one model; a group that dies is left out of the next step, and one that starts late or
// comes back copies the live state from another group (no restart of the others, no checkpoint).
//
//   ddpkit launch --nproc 2 ./ft_ddp --lighthouse HOST:PORT --group G --groups R [--steps N]
//
// Rank 0 of each group prints "step N loss L" lines, then a JSON line with its figures.
#include "example_common.h"

#include <ddpkit/ddpkit.h>
#include <ddpkit/ft/cross_group_gradients.h>
#include <ddpkit/ft/manager.h>
#include <ddpkit/training/replica_group_sampler.h>

#include <chrono>
#include <thread>

static int train(int argc, char** argv) {
  const ExampleFlags flags(argc, argv, {{"lighthouse", ""}, {"group", "0"}, {"groups", "1"}, {"steps", "200"},
                                        {"step-ms", "0"}, {"checkpoint-dir", ""}});
  ddpkit::set_compute_threads(1);
  auto pg = ddpkit::init_process_group();  // this group's ranks: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  const auto [inputs, labels] = example_data();

  Net net;
  ddpkit::DistributedDataParallel<Net> ddp(net, pg);  // inside the group, as usual
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  // What a heal copies from a live group: the model, the optimizer, DDP's buckets (and the CPU
  // generator). Your own state (a data loader's position) goes in with manager.register_state.
  ddpkit::TrainingState state;
  state.module(net.ptr()).optimizer(&optimizer).ddp(&ddp);
  ddpkit::ft::Manager manager(pg, state,
                              ddpkit::ft::ManagerOptions()
                                  .lighthouse(flags.str("lighthouse"))
                                  .group_id("group-" + flags.str("group"))
                                  .quorum_timeout(std::chrono::seconds(60)));
  // DDP's buckets cross the groups inside backward (ZeRO-2, FSDP: after it; the class chooses).
  ddpkit::ft::CrossGroupGradients crossing(manager, net->parameters(), &ddp);
  // The groups read disjoint shares of every epoch; a batch depends only on the step.
  ddpkit::ReplicaGroupSampler sampler(inputs.size(0), ddpkit::ReplicaGroupSamplerOptions()
                                                          .batch_size(32)
                                                          .replica_groups(static_cast<int>(flags.integer("groups")))
                                                          .replica_group(static_cast<int>(flags.integer("group")))
                                                          .group_size(pg->size())
                                                          .group_rank(pg->rank()));
  const std::string dir = flags.str("checkpoint-dir");
  if (!dir.empty()) manager.restore_checkpoint(dir);  // a whole job stopped and started again

  int64_t steps_run = 0;
  double loss_value = 0;
  for (;;) {
    manager.start_step();  // asks for the quorum; forward and backward go on meanwhile
    if (manager.step() >= flags.integer("steps")) break;
    const at::Tensor idx = sampler.batch(manager.step());
    optimizer.zero_grad();
    at::Tensor loss = torch::cross_entropy_loss(ddp.forward(inputs.index_select(0, idx)), labels.index_select(0, idx));
    loss.backward();
    crossing.after_backward();
    if (manager.should_commit()) {  // every rank of every group in the quorum succeeded
      optimizer.step();
      loss_value = loss.item<double>();
      if (!dir.empty() && manager.replica_rank() == 0 && manager.step() % 50 == 0) manager.save_checkpoint(dir);
    }
    ++steps_run;
    std::this_thread::sleep_for(std::chrono::milliseconds(flags.integer("step-ms")));
    if (pg->rank() == 0) std::printf("group %s step %lld loss %.4f\n", flags.str("group").c_str(),
                                     static_cast<long long>(manager.step()), loss_value), std::fflush(stdout);
  }
  manager.close();  // the group leaves the job at once; heartbeats, state service and cross groups freed
  const auto& s = manager.stats();
  if (pg->rank() == 0)
    std::printf("{\"group\": %ld, \"steps\": %lld, \"steps_run\": %lld, \"heals\": %lld, \"steps_not_committed\": "
                "%lld, \"loss\": %.5f, \"checksum\": \"%s\"}\n",
                flags.integer("group"), static_cast<long long>(manager.step()), static_cast<long long>(steps_run),
                static_cast<long long>(s.heals), static_cast<long long>(s.steps_not_committed), loss_value,
                checksum(net->parameters()).c_str());
  return 0;
}

int main(int argc, char** argv) {
  return ddpkit::run_main("ft_ddp", [&] { return train(argc, argv); });
}
