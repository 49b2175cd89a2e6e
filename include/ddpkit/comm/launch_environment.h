// Which engine started this process, and what it says about the job: rank, world size, where to
// meet. Read from the environment each engine sets (docs/launching.md has the table and the order
// of precedence); init_process_group() and `ddpkit train`/`ddpkit launch` use it.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace ddpkit {

struct LaunchEnvironment {
  // "torchrun", "ddpkit-launch", "kubeflow-pytorchjob", "ray-train", "env" (torchrun's variables
  // set by something else), "slurm", "openmpi", "mpich", "kubeflow-trainer", or "" (none found).
  std::string engine;
  // True when the environment describes a node that must start `local_world_size` processes
  // itself (Kubeflow Trainer v2, or PyTorchJob with nprocPerNode > 1, with no torchrun inside):
  // `rank` is then unset and `node_rank`/`nnodes` say where this node's ranks go
  // (rank = node_rank * local_world_size + local index).
  bool per_node = false;
  int rank = -1;
  int world_size = -1;
  int local_rank = -1;
  int local_world_size = -1;
  int node_rank = -1;
  int nnodes = -1;
  std::string master_addr;  // the rendezvous host: rank 0 serves the store there
  int master_port = -1;
  // Restarts the engine has made so far (TORCHELASTIC_RESTART_COUNT, SLURM_RESTART_COUNT), for
  // a fresh store key space per attempt; -1 when the engine does not count.
  int restart_count = -1;
  std::string job_id;  // the engine's job id where it has one (Slurm, Open MPI)
  // What was read, in one line: "ddpkit: launched by slurm: rank 3 of 4 (local 1 of 2, node 1 of
  // 2), rendezvous node1:12345 (port from SLURM_JOB_ID)".
  std::string summary;

  bool found() const { return !engine.empty(); }
};

// Detection over an explicit set of variables (what tests feed it); UsageError-style ddpkit
// errors (c10::Error, message starting "ddpkit: ") name a partial or contradictory environment.
LaunchEnvironment detect_launch_environment(const std::map<std::string, std::string>& env);
// Over this process's environment.
LaunchEnvironment detect_launch_environment();

// Slurm's compressed host lists, expanded: "node[1-3,7],gpu-a[08-09]" -> node1 node2 node3 node7
// gpu-a08 gpu-a09 (zero padding kept). Error naming the list for a malformed one.
std::vector<std::string> expand_slurm_hostlist(const std::string& list);
// Slurm's tasks-per-node lists, expanded per node: "2(x3),1" -> 2 2 2 1.
std::vector<int> expand_slurm_tasks_per_node(const std::string& list);

}  // namespace ddpkit
