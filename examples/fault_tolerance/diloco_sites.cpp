// Streaming DiLoCo over a model of your own: each site (one `ddpkit launch --nproc W`) trains
// alone and every H / P inner steps syncs one fragment of layers with the other sites, int8 or
// lower on the wire. A site lost mid-round costs the others no inner steps; one that comes back
// heals from a live site at the next sync.
//
//   ddpkit launch --nproc 2 ./diloco_sites --lighthouse HOST:PORT --site S --sites N
//       [--steps 400] [--sync-every 20] [--fragments 3] [--codec int4]
//
// Start the lighthouse with --join-timeout-ms as long as the sites' quorum timeout (60 s here):
// a site asks for a quorum only at its syncs (ft::LighthouseOptions::for_diloco).
#include "example_common.h"

#include <ddpkit/ddpkit.h>
#include <ddpkit/diloco/diloco.h>
#include <ddpkit/ft/manager.h>
#include <ddpkit/training/replica_group_sampler.h>

#include <chrono>
#include <thread>

static int train(int argc, char** argv) {
  const ExampleFlags flags(argc, argv, {{"lighthouse", ""}, {"site", "0"}, {"sites", "1"}, {"steps", "400"},
                                        {"sync-every", "20"}, {"fragments", "3"}, {"codec", "int4"}, {"step-ms", "0"}});
  ddpkit::set_compute_threads(1);
  auto pg = ddpkit::init_process_group();  // this site's ranks
  const auto [inputs, labels] = example_data();

  Net net;
  ddpkit::DistributedDataParallel<Net> ddp(net, pg);  // the site's ranks, over its fast network
  torch::optim::AdamW inner(net->parameters(), torch::optim::AdamWOptions(1e-3));
  ddpkit::TrainingState state;  // what a heal copies besides DiLoCo's own state
  state.module(net.ptr()).optimizer(&inner).ddp(&ddp);
  ddpkit::ft::Manager manager(pg, state,
                              ddpkit::ft::ManagerOptions()
                                  .lighthouse(flags.str("lighthouse"))
                                  .group_id("site-" + flags.str("site"))
                                  .quorum_timeout(std::chrono::seconds(60))
                                  .cross_gloo_threads(4));
  // The data position, which a healed site takes from its source so it reads on from there.
  int64_t inner_step = 0;
  manager.register_state(
      "data", [&] { return ddpkit::TensorDict{{"inner_step", ddpkit::int_entry(inner_step)}}; },
      [&](const ddpkit::TensorDict& d) { inner_step = ddpkit::int_of(d, "inner_step", "the data position"); });
  // Fragments of the model's layers (its children: fc1, fc2, fc3), one synced every H / P steps.
  ddpkit::diloco::DiLoCo diloco(
      manager, ddpkit::diloco::fragments_of(ddpkit::diloco::layers_of(*net), flags.integer("fragments"), "strided"),
      ddpkit::diloco::DiLoCoOptions().sync_every(flags.integer("sync-every")).codec(flags.str("codec")));
  ddpkit::ReplicaGroupSampler sampler(inputs.size(0), ddpkit::ReplicaGroupSamplerOptions()
                                                          .batch_size(32)
                                                          .replica_groups(static_cast<int>(flags.integer("sites")))
                                                          .replica_group(static_cast<int>(flags.integer("site")))
                                                          .group_size(pg->size())
                                                          .group_rank(pg->rank()));
  int64_t steps_run = 0;
  double loss_value = 0;
  const auto start = std::chrono::steady_clock::now();
  diloco.start();  // the first quorum: a site that starts late heals here
  while (inner_step < flags.integer("steps")) {
    const at::Tensor idx = sampler.batch(inner_step);
    inner.zero_grad();
    at::Tensor loss = torch::cross_entropy_loss(ddp.forward(inputs.index_select(0, idx)), labels.index_select(0, idx));
    loss.backward();
    inner.step();
    loss_value = loss.item<double>();
    ++inner_step, ++steps_run;
    diloco.after_inner_step();  // starts and applies fragment syncs on their schedule
    std::this_thread::sleep_for(std::chrono::milliseconds(flags.integer("step-ms")));
    if (pg->rank() == 0) std::printf("site %s step %lld loss %.4f\n", flags.str("site").c_str(),
                                     static_cast<long long>(inner_step), loss_value), std::fflush(stdout);
  }
  diloco.finish();  // the fragment in flight
  manager.close();  // the site leaves the job at once; heartbeats, state service and cross groups freed
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The model the sites agree on: every fragment's global parameters.
  std::vector<at::Tensor> global;
  for (size_t f = 0; f < diloco.fragments(); ++f) global.push_back(diloco.global_parameters(f));
  const auto& d = diloco.stats();
  if (pg->rank() == 0)
    std::printf("{\"site\": %ld, \"steps\": %lld, \"steps_run\": %lld, \"outer_steps\": %lld, \"heals\": %lld, "
                "\"sync_retries\": %lld, \"train_seconds\": %.4f, \"loss\": %.5f, \"global_checksum\": \"%s\"}\n",
                flags.integer("site"), static_cast<long long>(inner_step), static_cast<long long>(steps_run),
                static_cast<long long>(diloco.outer_steps()), static_cast<long long>(d.heals),
                static_cast<long long>(d.sync_retries), seconds, loss_value, checksum(global).c_str());
  return 0;
}

int main(int argc, char** argv) {
  return ddpkit::run_main("diloco_sites", [&] { return train(argc, argv); });
}
