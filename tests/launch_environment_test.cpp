// Launch-environment detection fed the exact variables each engine sets (from their sources:
// torchrun's run.py/api.py, Slurm's srun, Open MPI 4.1's mpirun as read off this machine, MPICH's
// Hydra, Kubeflow training-operator's envvar.go/elastic.go, Kubeflow Trainer's torch plugin, Ray
// Train's torch/config.py), checking the rank, world and rendezvous ddpkit derives.
#include "harness.h"

#include <ddpkit/comm/launch_environment.h>

namespace {

using ddpkit::detect_launch_environment;
using ddpkit::LaunchEnvironment;
using Env = std::map<std::string, std::string>;

std::string error_of(const Env& env) {
  try {
    detect_launch_environment(env);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

Env slurm_task(int procid, int localid, int nodeid) {
  // srun -N2 -n4 in job 4242 on node[1-2] (block distribution: tasks 0,1 on node1).
  return {{"SLURM_PROCID", std::to_string(procid)}, {"SLURM_LOCALID", std::to_string(localid)},
          {"SLURM_NODEID", std::to_string(nodeid)}, {"SLURM_NTASKS", "4"}, {"SLURM_NPROCS", "4"},
          {"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_STEP_NUM_NODES", "2"}, {"SLURM_NNODES", "2"},
          {"SLURM_JOB_NUM_NODES", "2"}, {"SLURM_JOB_NODELIST", "node[1-2]"}, {"SLURM_NODELIST", "node[1-2]"},
          {"SLURM_STEP_NODELIST", "node[1-2]"}, {"SLURM_TASKS_PER_NODE", "2(x2)"},
          {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}, {"SLURM_JOB_ID", "4242"}, {"SLURM_JOBID", "4242"},
          {"SLURM_STEP_ID", "0"}, {"SLURM_STEPID", "0"}, {"SLURMD_NODENAME", nodeid == 0 ? "node1" : "node2"},
          {"SLURM_CPUS_ON_NODE", "2"}, {"SLURM_TASK_PID", "12345"}};
}

Env torchrun_worker(int rank, int local_rank) {
  // torchrun --nnodes 2 --nproc-per-node 2: what its agent sets for each worker.
  return {{"RANK", std::to_string(rank)}, {"LOCAL_RANK", std::to_string(local_rank)}, {"WORLD_SIZE", "4"},
          {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", std::to_string(rank / 2)}, {"GROUP_WORLD_SIZE", "2"},
          {"ROLE_RANK", std::to_string(rank)}, {"ROLE_NAME", "default"}, {"ROLE_WORLD_SIZE", "4"},
          {"MASTER_ADDR", "head"}, {"MASTER_PORT", "29500"}, {"TORCHELASTIC_RESTART_COUNT", "1"},
          {"TORCHELASTIC_MAX_RESTARTS", "3"}, {"TORCHELASTIC_RUN_ID", "job7"},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"},
          {"OMP_NUM_THREADS", "1"}};
}

Env open_mpi_rank(int rank, int size, int local_rank, int local_size) {
  // mpirun -n SIZE (Open MPI 4.1.4): the variables its ranks see.
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)}, {"OMPI_COMM_WORLD_SIZE", std::to_string(size)},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(local_rank)},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(local_size)},
          {"OMPI_COMM_WORLD_NODE_RANK", std::to_string(local_rank)}, {"OMPI_UNIVERSE_SIZE", std::to_string(size)},
          {"OMPI_MCA_ess_base_jobid", "1266089985"}, {"OMPI_MCA_ess_base_vpid", std::to_string(rank)},
          {"OMPI_MCA_orte_num_nodes", std::to_string(size / local_size)},
          {"OMPI_MCA_orte_hnp_uri", "1266089984.0;tcp://192.0.2.2,10.0.0.1:55045;tcp6://[fd00::2]:55633"},
          {"PMIX_RANK", std::to_string(rank)}, {"PMIX_NAMESPACE", "1266089985"}};
}

Env pytorchjob_pod(int pod, int nproc, int pods) {
  // training-operator envvar.go: RANK is the pod's index (master-0 is 0, worker-i is i+1),
  // WORLD_SIZE = pods x nprocPerNode.
  return {{"PYTHONUNBUFFERED", "0"},
          {"MASTER_PORT", "23456"},
          {"MASTER_ADDR", "mnist-master-0"},
          {"WORLD_SIZE", std::to_string(pods * nproc)},
          {"RANK", std::to_string(pod)},
          {"PET_NPROC_PER_NODE", std::to_string(nproc)},
          {"PET_NODE_RANK", std::to_string(pod)},
          {"PET_NNODES", std::to_string(pods)}};
}

TEST(LaunchEnvironment, NoneFound) {
  const auto e = detect_launch_environment(Env{{"HOME", "/root"}, {"PATH", "/usr/bin"}});
  EXPECT_FALSE(e.found());
  EXPECT_EQ(e.rank, -1);
}

TEST(LaunchEnvironment, Torchrun) {
  const auto e = detect_launch_environment(torchrun_worker(3, 1));
  EXPECT_EQ(e.engine, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.master_addr, "head");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_EQ(e.restart_count, 1);
  EXPECT_NE(e.summary.find("launched by torchrun: rank 3 of 4"), std::string::npos) << e.summary;
}

TEST(LaunchEnvironment, TorchrunInsideSrunIsTheInnerLauncher) {
  // srun -N2 --ntasks-per-node=1 torchrun --nproc-per-node 2: Slurm counts 2 tasks, torchrun 4 ranks.
  Env env = slurm_task(1, 0, 1);
  env["SLURM_NTASKS"] = env["SLURM_STEP_NUM_TASKS"] = "2";
  for (const auto& kv : torchrun_worker(3, 1)) env[kv.first] = kv.second;
  const auto e = detect_launch_environment(env);
  EXPECT_EQ(e.engine, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
}

TEST(LaunchEnvironment, DdpkitLaunch) {
  const auto e = detect_launch_environment(Env{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},
                                               {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                               {"MASTER_PORT", "40000"}, {"DDPKIT_LAUNCHED", "1"},
                                               {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                               {"TORCHELASTIC_RESTART_COUNT", "0"}});
  EXPECT_EQ(e.engine, "ddpkit-launch");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.master_port, 40000);
}

TEST(LaunchEnvironment, PartialTorchrunIsNamed) {
  EXPECT_THAT(error_of({{"RANK", "0"}}), ::testing::HasSubstr("RANK is set but WORLD_SIZE is not"));
  EXPECT_THAT(error_of({{"WORLD_SIZE", "2"}}), ::testing::HasSubstr("WORLD_SIZE is set but RANK is not"));
  EXPECT_THAT(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), ::testing::HasSubstr("RANK=2 is not below WORLD_SIZE=2"));
  EXPECT_THAT(error_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), ::testing::HasSubstr("RANK='x' is not an integer"));
}

TEST(LaunchEnvironment, SlurmSrunTwoNodesFourTasks) {
  const auto first = detect_launch_environment(slurm_task(0, 0, 0));
  EXPECT_EQ(first.engine, "slurm");
  EXPECT_EQ(first.rank, 0);
  EXPECT_EQ(first.master_addr, "node1");
  const auto e = detect_launch_environment(slurm_task(3, 1, 1));
  EXPECT_EQ(e.engine, "slurm");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.nnodes, 2);
  EXPECT_EQ(e.master_addr, "node1");
  EXPECT_EQ(e.master_port, 12000 + 4242);
  EXPECT_EQ(e.job_id, "4242");
  EXPECT_NE(e.summary.find("launched by slurm: rank 3 of 4 (local 1 of 2, node 1 of 2), rendezvous node1:16242"),
            std::string::npos)
      << e.summary;
}

TEST(LaunchEnvironment, SlurmUnevenTasksPerNodeAndGivenMaster) {
  Env env = slurm_task(3, 0, 1);
  env["SLURM_STEP_TASKS_PER_NODE"] = "3,1";
  env["SLURM_STEP_NODELIST"] = "gpu-a[08-09]";
  env["MASTER_PORT"] = "23456";
  const auto e = detect_launch_environment(env);
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_EQ(e.master_addr, "gpu-a08");  // the step's first node, not the job's
  EXPECT_EQ(e.master_port, 23456);
  env["MASTER_ADDR"] = "10.1.2.3";
  EXPECT_EQ(detect_launch_environment(env).master_addr, "10.1.2.3");
}

TEST(LaunchEnvironment, SlurmBatchShellIsNotARank) {
  // What an sbatch script's own shell has (read off slurmd 22.05): no step, so not a rank of one.
  const auto e = detect_launch_environment(Env{{"SLURM_JOB_ID", "1"}, {"SLURM_JOB_NODELIST", "node[1-2]"},
                                               {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "0"},
                                               {"SLURM_NODELIST", "node[1-2]"}, {"SLURM_NPROCS", "4"},
                                               {"SLURM_NTASKS", "4"}, {"SLURM_NTASKS_PER_NODE", "2"},
                                               {"SLURM_PROCID", "0"}, {"SLURM_TASKS_PER_NODE", "2(x2)"}});
  EXPECT_FALSE(e.found());
}

TEST(LaunchEnvironment, SlurmPartialIsNamed) {
  EXPECT_THAT(error_of({{"SLURM_PROCID", "0"}}), ::testing::HasSubstr("SLURM_PROCID is set but SLURM_NTASKS is not"));
  Env env = slurm_task(0, 0, 0);
  for (const char* n : {"SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_NODELIST"}) env.erase(n);
  EXPECT_THAT(error_of(env), ::testing::HasSubstr("no SLURM_JOB_NODELIST"));
  env = slurm_task(0, 0, 0);
  env.erase("SLURM_JOB_ID");
  env.erase("SLURM_JOBID");
  EXPECT_THAT(error_of(env), ::testing::HasSubstr("no SLURM_JOB_ID"));
}

TEST(LaunchEnvironment, ContradictoryEnginesAreNamed) {
  // A batch script that exported RANK/WORLD_SIZE by hand, wrongly.
  Env env = slurm_task(1, 1, 0);
  env["RANK"] = "1";
  env["WORLD_SIZE"] = "8";
  env["MASTER_ADDR"] = "node1";
  env["MASTER_PORT"] = "29500";
  EXPECT_THAT(error_of(env), ::testing::HasSubstr("contradictory launch environment: env says rank 1 of 8 but Slurm "
                                                  "says SLURM_PROCID=1 SLURM_NTASKS=4"));
  // The usual `export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS` agrees, and is taken as given.
  env["WORLD_SIZE"] = "4";
  EXPECT_EQ(detect_launch_environment(env).engine, "env");
  // srun --mpi=pmi2 also sets PMI_RANK/PMI_SIZE: they must agree with Slurm's.
  Env pmi = slurm_task(1, 1, 0);
  pmi["PMI_RANK"] = "1";
  pmi["PMI_SIZE"] = "4";
  EXPECT_EQ(detect_launch_environment(pmi).engine, "slurm");
  pmi["PMI_SIZE"] = "2";
  EXPECT_THAT(error_of(pmi), ::testing::HasSubstr("PMI_SIZE=2"));
}

TEST(LaunchEnvironment, OpenMpiOneHostMeetsOnLoopback) {
  const auto e = detect_launch_environment(open_mpi_rank(1, 2, 1, 2));
  EXPECT_EQ(e.engine, "openmpi");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 12000 + static_cast<int>(1266089985LL % 20000));
}

TEST(LaunchEnvironment, OpenMpi5OneHostDerivesThePortFromItsNamespace) {
  // Open MPI 5 (PRRTE, Debian 13): no OMPI_MCA_ess_base_jobid; the PMIx namespace names the job.
  Env env = open_mpi_rank(1, 2, 1, 2);
  env.erase("OMPI_MCA_ess_base_jobid");
  env.erase("OMPI_MCA_orte_hnp_uri");
  env["PMIX_NAMESPACE"] = "prterun-vm-2440@1";
  const auto a = detect_launch_environment(env);
  env["OMPI_COMM_WORLD_RANK"] = env["OMPI_COMM_WORLD_LOCAL_RANK"] = "0";
  const auto b = detect_launch_environment(env);
  EXPECT_EQ(a.master_addr, "127.0.0.1");
  EXPECT_EQ(a.master_port, b.master_port);
  EXPECT_GE(a.master_port, 12000);
  EXPECT_LT(a.master_port, 32000);
}

TEST(LaunchEnvironment, OpenMpiAcrossHostsMeetsAtMpirunsHost) {
  const auto e = detect_launch_environment(open_mpi_rank(3, 4, 1, 2));
  EXPECT_EQ(e.master_addr, "192.0.2.2");  // mpirun's first address, from OMPI_MCA_orte_hnp_uri
  EXPECT_EQ(e.nnodes, 2);
  Env given = open_mpi_rank(3, 4, 1, 2);
  given["MASTER_ADDR"] = "10.9.0.1";
  given["MASTER_PORT"] = "30001";
  const auto g = detect_launch_environment(given);
  EXPECT_EQ(g.master_addr, "10.9.0.1");
  EXPECT_EQ(g.master_port, 30001);
  Env bare = open_mpi_rank(3, 4, 1, 2);
  bare.erase("OMPI_MCA_orte_hnp_uri");
  EXPECT_THAT(error_of(bare), ::testing::HasSubstr("-x MASTER_ADDR"));
  EXPECT_THAT(error_of({{"OMPI_COMM_WORLD_RANK", "0"}}), ::testing::HasSubstr("OMPI_COMM_WORLD_SIZE is not"));
}

TEST(LaunchEnvironment, MpirunInsideASlurmAllocationIsTheInnerLauncher) {
  // Open MPI's daemons are started by srun, one per node: their ranks inherit the daemon's Slurm task.
  Env env = slurm_task(1, 0, 1);
  env["SLURM_NTASKS"] = env["SLURM_STEP_NUM_TASKS"] = "2";
  for (const auto& kv : open_mpi_rank(5, 8, 1, 4)) env[kv.first] = kv.second;
  const auto e = detect_launch_environment(env);
  EXPECT_EQ(e.engine, "openmpi");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
}

TEST(LaunchEnvironment, MpichHydra) {
  Env env{{"PMI_RANK", "2"},        {"PMI_SIZE", "4"},        {"PMI_FD", "6"},
          {"MPI_LOCALRANKID", "2"}, {"MPI_LOCALNRANKS", "4"}, {"PMI_HOSTNAME", "vm"}};
  auto e = detect_launch_environment(env);
  EXPECT_EQ(e.engine, "mpich");
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  env["MPI_LOCALNRANKS"] = "2";
  env["MPI_LOCALRANKID"] = "0";
  EXPECT_THAT(error_of(env), ::testing::HasSubstr("MPICH across hosts names no rendezvous host"));
  env["MASTER_ADDR"] = "h0";
  env["MASTER_PORT"] = "29500";
  e = detect_launch_environment(env);
  EXPECT_EQ(e.master_addr, "h0");
  EXPECT_EQ(e.master_port, 29500);
}

TEST(LaunchEnvironment, KubeflowPyTorchJobOneProcessPerPod) {
  const auto e = detect_launch_environment(pytorchjob_pod(2, 1, 3));
  EXPECT_EQ(e.engine, "kubeflow-pytorchjob");
  EXPECT_FALSE(e.per_node);
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 3);
  EXPECT_EQ(e.node_rank, 2);
  EXPECT_EQ(e.master_addr, "mnist-master-0");
  EXPECT_EQ(e.master_port, 23456);
}

TEST(LaunchEnvironment, KubeflowPyTorchJobSeveralProcessesPerPod) {
  Env worker = pytorchjob_pod(1, 2, 3);
  const auto e = detect_launch_environment(worker);
  EXPECT_TRUE(e.per_node);  // this process starts the pod's two ranks: 2 and 3
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.nnodes, 3);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.rank, -1);
  worker["WORLD_SIZE"] = "5";
  EXPECT_THAT(error_of(worker), ::testing::HasSubstr("WORLD_SIZE=5 is not PET_NNODES=3 x PET_NPROC_PER_NODE=2"));
}

TEST(LaunchEnvironment, KubeflowElasticPyTorchJobPointsToTorchrun) {
  // elastic.go, no Master replica: no RANK, an nnodes range and a c10d endpoint.
  Env env{{"PYTHONUNBUFFERED", "0"}, {"PET_RDZV_ENDPOINT", "elastic-worker-0:23456"}, {"PET_RDZV_BACKEND", "c10d"},
          {"PET_NNODES", "1:4"},     {"PET_MAX_RESTARTS", "3"},                       {"PET_NPROC_PER_NODE", "1"}};
  EXPECT_THAT(error_of(env), ::testing::HasSubstr("elastic rendezvous is torchrun's"));
}

TEST(LaunchEnvironment, KubeflowTrainerV2) {
  Env node{{"PET_NNODES", "2"}, {"PET_NPROC_PER_NODE", "2"}, {"PET_NODE_RANK", "1"},
           {"PET_MASTER_ADDR", "job-node-0-0.job"}, {"PET_MASTER_PORT", "29400"}};
  auto e = detect_launch_environment(node);
  EXPECT_EQ(e.engine, "kubeflow-trainer");
  EXPECT_TRUE(e.per_node);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.master_addr, "job-node-0-0.job");
  EXPECT_EQ(e.master_port, 29400);
  node["PET_NPROC_PER_NODE"] = "1";
  e = detect_launch_environment(node);
  EXPECT_FALSE(e.per_node);
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  node["PET_NPROC_PER_NODE"] = "auto";
  EXPECT_THAT(error_of(node), ::testing::HasSubstr("PET_NPROC_PER_NODE=auto"));
  EXPECT_THAT(error_of({{"PET_NNODES", "2"}}), ::testing::HasSubstr("PET_NODE_RANK is not set"));
}

TEST(LaunchEnvironment, RayTrain) {
  // ray/train/torch/config.py: set_env_vars (MASTER_ADDR/PORT) and _set_torch_distributed_env_vars.
  const auto e = detect_launch_environment(Env{{"MASTER_ADDR", "10.0.0.5"}, {"MASTER_PORT", "41000"},
                                               {"LOCAL_RANK", "0"}, {"RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"},
                                               {"WORLD_SIZE", "4"}, {"NODE_RANK", "1"},
                                               {"ACCELERATE_TORCH_DEVICE", "cpu"}});
  EXPECT_EQ(e.engine, "ray-train");
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.master_addr, "10.0.0.5");
  EXPECT_EQ(e.master_port, 41001);  // Ray's own torch.distributed group holds 41000
}

TEST(SlurmHostlist, Expands) {
  using V = std::vector<std::string>;
  EXPECT_EQ(ddpkit::expand_slurm_hostlist("node1"), V{"node1"});
  EXPECT_EQ(ddpkit::expand_slurm_hostlist("node[1-3,7],gpu-a[08-10]"),
            (V{"node1", "node2", "node3", "node7", "gpu-a08", "gpu-a09", "gpu-a10"}));
  EXPECT_EQ(ddpkit::expand_slurm_hostlist("a,b[2]"), (V{"a", "b2"}));
  EXPECT_EQ(ddpkit::expand_slurm_hostlist("rack[1-2]-n[1-2]"), (V{"rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"}));
  for (const char* bad : {"node[1-", "node[3-1]", "node[a-b]", "a,,b", "x]"}) {
    EXPECT_THROW(ddpkit::expand_slurm_hostlist(bad), c10::Error) << bad;
  }
  EXPECT_EQ(ddpkit::expand_slurm_tasks_per_node("2(x3),1"), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_THROW(ddpkit::expand_slurm_tasks_per_node("2(x"), c10::Error);
}

}  // namespace
