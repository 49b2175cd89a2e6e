// Launch-environment detection: torchrun's variables (set by torchrun, `ddpkit launch`, Kubeflow's
// PyTorchJob, Ray Train or the user), Open MPI, Slurm, MPICH/PMI and Kubeflow Trainer's per-node
// PET_* variables, in that order (the innermost launcher first: torchrun inside srun, mpirun
// inside an allocation). docs/launching.md has the table.
#include <ddpkit/comm/launch_environment.h>

#include <ddpkit/error.h>

#include <cstdint>
#include <cstdlib>
#include <sstream>

extern char** environ;

namespace ddpkit {

namespace {

using Env = std::map<std::string, std::string>;

// Ports derived from a job id fall in [12000, 32000): below Linux's ephemeral range, where Gloo's
// and gRPC's listeners take theirs, so a derived port is not already taken by one of them.
constexpr int kDerivedPortBase = 12000;
constexpr int kDerivedPortSpan = 20000;

bool has(const Env& env, const char* name) {
  auto it = env.find(name);
  return it != env.end() && !it->second.empty();
}

std::string get(const Env& env, const char* name) {
  auto it = env.find(name);
  return it == env.end() ? std::string() : it->second;
}

long long parse_int(const std::string& name, const std::string& value, long long min_value) {
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(value.c_str(), &end, 10);
  DDPKIT_CHECK(!value.empty() && end && *end == '\0' && errno == 0 && x >= min_value, "environment variable ",
               name, "='", value, "' is not an integer >= ", min_value);
  return x;
}

int int_var(const Env& env, const char* name, int min_value = 0) {
  return static_cast<int>(parse_int(name, get(env, name), min_value));
}

// The first of `names` that is set, or "".
std::string first_set(const Env& env, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (has(env, n)) return n;
  return "";
}

int derived_port(const std::string& from, const std::string& id) {
  const long long x = parse_int(from, id, 0);
  return kDerivedPortBase + static_cast<int>(x % kDerivedPortSpan);
}

void set_master_from_env(const Env& env, LaunchEnvironment& e) {
  if (has(env, "MASTER_ADDR")) e.master_addr = get(env, "MASTER_ADDR");
  if (has(env, "MASTER_PORT")) e.master_port = int_var(env, "MASTER_PORT", 1);
}

void check_ranks(const LaunchEnvironment& e, const std::string& rank_var, const std::string& world_var) {
  DDPKIT_CHECK(e.world_size >= 1, world_var, "=", e.world_size, " must be >= 1");
  DDPKIT_CHECK(e.rank < e.world_size, rank_var, "=", e.rank, " is not below ", world_var, "=", e.world_size);
  if (e.local_rank >= 0 && e.local_world_size >= 1)
    DDPKIT_CHECK(e.local_rank < e.local_world_size, "local rank ", e.local_rank, " is not below the local world size ",
                 e.local_world_size);
}

// A second engine present beside the chosen one must agree on rank and world size: the common
// `export RANK=$SLURM_PROCID` in a batch script is fine, a stale or copied value is not.
void check_agrees(const Env& env, const LaunchEnvironment& e, const char* engine, const char* rank_var,
                  const char* world_var) {
  if (!has(env, rank_var) || !has(env, world_var)) return;
  const int r = int_var(env, rank_var), w = int_var(env, world_var, 1);
  DDPKIT_CHECK(r == e.rank && w == e.world_size, "contradictory launch environment: ", e.engine, " says rank ",
               e.rank, " of ", e.world_size, " but ", engine, " says ", rank_var, "=", r, " ", world_var, "=", w,
               ": unset the variables of the one that did not start this process");
}

// torchrun's own variables name this process's rank directly.
bool detect_torchrun_style(const Env& env, LaunchEnvironment& e) {
  const bool r = has(env, "RANK"), w = has(env, "WORLD_SIZE");
  if (!r && !w) return false;
  DDPKIT_CHECK(r && w, "partial launch environment: ", r ? "RANK" : "WORLD_SIZE", " is set but ",
               r ? "WORLD_SIZE" : "RANK", " is not (torchrun, Kubeflow and Ray set both)");
  e.rank = int_var(env, "RANK");
  e.world_size = int_var(env, "WORLD_SIZE", 1);
  if (has(env, "LOCAL_RANK")) e.local_rank = int_var(env, "LOCAL_RANK");
  if (has(env, "LOCAL_WORLD_SIZE")) e.local_world_size = int_var(env, "LOCAL_WORLD_SIZE", 1);
  set_master_from_env(env, e);
  if (has(env, "TORCHELASTIC_RESTART_COUNT")) e.restart_count = int_var(env, "TORCHELASTIC_RESTART_COUNT");
  if (has(env, "DDPKIT_LAUNCHED")) {
    e.engine = "ddpkit-launch";
  } else if (has(env, "TORCHELASTIC_RUN_ID")) {
    e.engine = "torchrun";
    if (has(env, "GROUP_RANK")) e.node_rank = int_var(env, "GROUP_RANK");
  } else if (has(env, "NODE_RANK") && env.count("ACCELERATE_TORCH_DEVICE")) {
    e.engine = "ray-train";  // ray/train/torch/config.py: _set_torch_distributed_env_vars
    e.node_rank = int_var(env, "NODE_RANK");
    // Ray Train's own torch.distributed group (TorchConfig, set up before the training function
    // runs) serves its store at MASTER_PORT on rank 0 for the whole run: ddpkit meets next to it.
    if (e.master_port > 0) e.master_port += 1;
  } else if (has(env, "PET_NODE_RANK") || has(env, "PET_NNODES")) {
    e.engine = "kubeflow-pytorchjob";  // training-operator envvar.go: RANK is the pod's index
    if (has(env, "PET_NNODES")) {
      const std::string nn = get(env, "PET_NNODES");
      DDPKIT_CHECK(nn.find(':') == std::string::npos, "PET_NNODES=", nn,
                   " is an elastic range: elastic rendezvous is torchrun's; run the container's command under "
                   "torchrun (it reads PET_*), which starts ddpkit with RANK and WORLD_SIZE");
      e.nnodes = int_var(env, "PET_NNODES", 1);
    }
    e.node_rank = has(env, "PET_NODE_RANK") ? int_var(env, "PET_NODE_RANK") : e.rank;
    const std::string nproc = get(env, "PET_NPROC_PER_NODE");
    if (!nproc.empty()) {
      DDPKIT_CHECK(nproc.find_first_not_of("0123456789") == std::string::npos, "PET_NPROC_PER_NODE=", nproc,
                   ": ddpkit needs a number of processes per pod (nprocPerNode: \"2\"), or run under torchrun");
      const int per_pod = int_var(env, "PET_NPROC_PER_NODE", 1);
      if (per_pod > 1) {
        // RANK is the pod's index and WORLD_SIZE counts processes: this process starts the pod's.
        e.per_node = true;
        e.local_world_size = per_pod;
        e.node_rank = e.rank;
        if (e.nnodes < 0) e.nnodes = e.world_size / per_pod;
        DDPKIT_CHECK(e.nnodes * per_pod == e.world_size, "WORLD_SIZE=", e.world_size, " is not PET_NNODES=",
                     e.nnodes, " x PET_NPROC_PER_NODE=", per_pod);
        DDPKIT_CHECK(e.node_rank < e.nnodes, "RANK=", e.node_rank, " (the pod's index) is not below PET_NNODES=",
                     e.nnodes);
        e.rank = -1;
        return true;
      }
    }
  } else {
    e.engine = "env";
    check_agrees(env, e, "Slurm", "SLURM_PROCID", "SLURM_NTASKS");
    check_agrees(env, e, "Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
    check_agrees(env, e, "MPICH/PMI", "PMI_RANK", "PMI_SIZE");
  }
  check_ranks(e, "RANK", "WORLD_SIZE");
  return true;
}

// The first IPv4 address of mpirun's URI: "1266089984.0;tcp://192.0.2.2,10.0.0.1:55045;tcp6://...".
std::string mpirun_host(const std::string& uri) {
  const auto at = uri.find("tcp://");
  if (at == std::string::npos) return "";
  const auto start = at + 6;
  const auto end = uri.find_first_of(",:;", start);
  return uri.substr(start, end == std::string::npos ? std::string::npos : end - start);
}

bool detect_open_mpi(const Env& env, LaunchEnvironment& e) {
  const bool r = has(env, "OMPI_COMM_WORLD_RANK"), w = has(env, "OMPI_COMM_WORLD_SIZE");
  if (!r && !w) return false;
  DDPKIT_CHECK(r && w, "partial Open MPI environment: ", r ? "OMPI_COMM_WORLD_RANK" : "OMPI_COMM_WORLD_SIZE",
               " is set but ", r ? "OMPI_COMM_WORLD_SIZE" : "OMPI_COMM_WORLD_RANK", " is not");
  e.engine = "openmpi";
  e.rank = int_var(env, "OMPI_COMM_WORLD_RANK");
  e.world_size = int_var(env, "OMPI_COMM_WORLD_SIZE", 1);
  if (has(env, "OMPI_COMM_WORLD_LOCAL_RANK")) e.local_rank = int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK");
  if (has(env, "OMPI_COMM_WORLD_LOCAL_SIZE")) e.local_world_size = int_var(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  if (has(env, "OMPI_MCA_orte_num_nodes")) e.nnodes = int_var(env, "OMPI_MCA_orte_num_nodes", 1);
  e.job_id = get(env, "OMPI_MCA_ess_base_jobid");
  check_ranks(e, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
  set_master_from_env(env, e);
  if (e.master_addr.empty()) {
    if (e.local_world_size == e.world_size) {
      e.master_addr = "127.0.0.1";  // every rank on this host
    } else {
      // Rank 0 serves the store; Open MPI places it on mpirun's own host whenever that host runs
      // ranks. init_process_group checks rank 0 is there and names the fix if not.
      e.master_addr = mpirun_host(get(env, "OMPI_MCA_orte_hnp_uri"));
      DDPKIT_CHECK(!e.master_addr.empty(), "Open MPI across hosts without MASTER_ADDR, and no mpirun address in "
                   "OMPI_MCA_orte_hnp_uri: pass the rendezvous host with mpirun -x MASTER_ADDR=<rank 0's host>");
    }
  }
  if (e.master_port < 0 && !e.job_id.empty()) e.master_port = derived_port("OMPI_MCA_ess_base_jobid", e.job_id);
  if (e.master_port < 0 && has(env, "PMIX_NAMESPACE")) {
    // Open MPI 5 (PRRTE) has no numeric job id; its PMIx namespace ("prterun-host-2440@1") is the
    // job's name on every rank alike.
    e.job_id = get(env, "PMIX_NAMESPACE");
    uint64_t h = 1469598103934665603ULL;  // FNV-1a: the same on every rank, whatever the build
    for (unsigned char ch : e.job_id) h = (h ^ ch) * 1099511628211ULL;
    e.master_port = kDerivedPortBase + static_cast<int>(h % kDerivedPortSpan);
  }
  return true;
}

bool detect_slurm(const Env& env, LaunchEnvironment& e) {
  if (!has(env, "SLURM_PROCID")) return false;
  const std::string world_var = first_set(env, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"});
  DDPKIT_CHECK(!world_var.empty(), "partial Slurm environment: SLURM_PROCID is set but SLURM_NTASKS is not "
               "(srun sets both; in a batch script, start the ranks with srun)");
  // A batch script's own shell has SLURM_PROCID=0 and the job's SLURM_NTASKS too, but no step:
  // it is not a rank (a process run there without srun would wait for ranks that never come).
  if (!has(env, "SLURM_STEP_ID") && !has(env, "SLURM_STEPID")) return false;
  e.engine = "slurm";
  e.rank = int_var(env, "SLURM_PROCID");
  e.world_size = int_var(env, world_var.c_str(), 1);
  if (has(env, "SLURM_LOCALID")) e.local_rank = int_var(env, "SLURM_LOCALID");
  if (has(env, "SLURM_NODEID")) e.node_rank = int_var(env, "SLURM_NODEID");
  const std::string nodes_var = first_set(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"});
  std::vector<std::string> hosts;
  if (!nodes_var.empty()) hosts = expand_slurm_hostlist(get(env, nodes_var.c_str()));
  if (!hosts.empty()) e.nnodes = static_cast<int>(hosts.size());
  const std::string per_node_var = first_set(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"});
  if (!per_node_var.empty() && e.node_rank >= 0) {
    const auto per_node = expand_slurm_tasks_per_node(get(env, per_node_var.c_str()));
    DDPKIT_CHECK(e.node_rank < static_cast<int>(per_node.size()), "SLURM_NODEID=", e.node_rank, " but ",
                 per_node_var, "='", get(env, per_node_var.c_str()), "' lists ", per_node.size(), " nodes");
    e.local_world_size = per_node[static_cast<size_t>(e.node_rank)];
  }
  e.job_id = get(env, "SLURM_JOB_ID").empty() ? get(env, "SLURM_JOBID") : get(env, "SLURM_JOB_ID");
  if (has(env, "SLURM_RESTART_COUNT")) e.restart_count = int_var(env, "SLURM_RESTART_COUNT");
  check_ranks(e, "SLURM_PROCID", world_var);
  check_agrees(env, e, "PMI (srun --mpi)", "PMI_RANK", "PMI_SIZE");
  set_master_from_env(env, e);
  if (e.master_addr.empty()) {
    DDPKIT_CHECK(!hosts.empty(), "partial Slurm environment: no SLURM_JOB_NODELIST to find rank 0's host "
                 "(or set MASTER_ADDR)");
    e.master_addr = hosts.front();  // srun places task 0 on the step's first node
  }
  if (e.master_port < 0) {
    DDPKIT_CHECK(!e.job_id.empty(), "partial Slurm environment: no SLURM_JOB_ID to derive the rendezvous port "
                 "from (or set MASTER_PORT)");
    e.master_port = derived_port("SLURM_JOB_ID", e.job_id);
  }
  return true;
}

bool detect_pmi(const Env& env, LaunchEnvironment& e) {
  const bool r = has(env, "PMI_RANK"), w = has(env, "PMI_SIZE");
  if (!r && !w) return false;
  DDPKIT_CHECK(r && w, "partial MPICH/PMI environment: ", r ? "PMI_RANK" : "PMI_SIZE", " is set but ",
               r ? "PMI_SIZE" : "PMI_RANK", " is not");
  e.engine = "mpich";
  e.rank = int_var(env, "PMI_RANK");
  e.world_size = int_var(env, "PMI_SIZE", 1);
  // Hydra's (MPICH, Intel MPI) per-host numbering.
  if (has(env, "MPI_LOCALRANKID")) e.local_rank = int_var(env, "MPI_LOCALRANKID");
  if (has(env, "MPI_LOCALNRANKS")) e.local_world_size = int_var(env, "MPI_LOCALNRANKS", 1);
  check_ranks(e, "PMI_RANK", "PMI_SIZE");
  set_master_from_env(env, e);
  if (e.master_addr.empty()) {
    DDPKIT_CHECK(e.local_world_size == e.world_size, "MPICH across hosts names no rendezvous host: pass "
                 "MASTER_ADDR=<rank 0's host> (mpiexec -genv MASTER_ADDR host)");
    e.master_addr = "127.0.0.1";
  }
  return true;
}

// Kubeflow Trainer v2 (and elastic PyTorchJobs): torchrun's flags as PET_* for a node, no RANK.
bool detect_per_node(const Env& env, LaunchEnvironment& e) {
  if (!has(env, "PET_NNODES") && !has(env, "PET_NODE_RANK") && !has(env, "PET_RDZV_ENDPOINT")) return false;
  const std::string nn = get(env, "PET_NNODES");
  DDPKIT_CHECK(!has(env, "PET_RDZV_ENDPOINT") && nn.find(':') == std::string::npos,
               "an elastic PyTorchJob (PET_RDZV_ENDPOINT, PET_NNODES=", nn, "): elastic rendezvous is torchrun's; "
               "run the container's command under torchrun (it reads PET_*), which starts ddpkit with RANK and "
               "WORLD_SIZE (examples/kubernetes/pytorchjob-elastic.yaml)");
  DDPKIT_CHECK(has(env, "PET_NNODES") && has(env, "PET_NODE_RANK"), "partial Kubeflow environment: ",
               has(env, "PET_NNODES") ? "PET_NODE_RANK" : "PET_NNODES", " is not set");
  e.engine = "kubeflow-trainer";
  e.nnodes = int_var(env, "PET_NNODES", 1);
  e.node_rank = int_var(env, "PET_NODE_RANK");
  DDPKIT_CHECK(e.node_rank < e.nnodes, "PET_NODE_RANK=", e.node_rank, " is not below PET_NNODES=", e.nnodes);
  const std::string nproc = get(env, "PET_NPROC_PER_NODE");
  DDPKIT_CHECK(nproc.empty() || nproc.find_first_not_of("0123456789") == std::string::npos, "PET_NPROC_PER_NODE=",
               nproc, ": ddpkit needs a number of processes per node (numProcPerNode: 2), or run under torchrun");
  e.local_world_size = nproc.empty() ? 1 : int_var(env, "PET_NPROC_PER_NODE", 1);
  e.world_size = e.nnodes * e.local_world_size;
  e.master_addr = has(env, "PET_MASTER_ADDR") ? get(env, "PET_MASTER_ADDR") : get(env, "MASTER_ADDR");
  const char* port_var = has(env, "PET_MASTER_PORT") ? "PET_MASTER_PORT" : "MASTER_PORT";
  if (has(env, port_var)) e.master_port = int_var(env, port_var, 1);
  DDPKIT_CHECK(!e.master_addr.empty() && e.master_port > 0,
               "partial Kubeflow environment: PET_MASTER_ADDR and PET_MASTER_PORT name the rendezvous");
  if (e.local_world_size == 1) {
    e.rank = e.node_rank;
    e.local_rank = 0;
  } else {
    e.per_node = true;
  }
  return true;
}

std::string summarize(const LaunchEnvironment& e) {
  std::ostringstream s;
  s << "ddpkit: launched by " << e.engine << ": ";
  if (e.per_node)
    s << "node " << e.node_rank << " of " << e.nnodes << ", " << e.local_world_size << " processes per node";
  else
    s << "rank " << e.rank << " of " << e.world_size;
  if (!e.per_node && e.local_rank >= 0) {
    s << " (local " << e.local_rank;
    if (e.local_world_size > 0) s << " of " << e.local_world_size;
    if (e.node_rank >= 0) s << ", node " << e.node_rank << (e.nnodes > 0 ? " of " + std::to_string(e.nnodes) : "");
    else if (e.nnodes > 0) s << ", " << e.nnodes << (e.nnodes == 1 ? " node" : " nodes");
    s << ")";
  }
  if (!e.master_addr.empty()) s << ", rendezvous " << e.master_addr << ":" << e.master_port;
  return s.str();
}

}  // namespace

LaunchEnvironment detect_launch_environment(const Env& env) {
  LaunchEnvironment e;
  if (detect_torchrun_style(env, e) || detect_open_mpi(env, e) || detect_slurm(env, e) || detect_pmi(env, e) ||
      detect_per_node(env, e))
    e.summary = summarize(e);
  return e;
}

LaunchEnvironment detect_launch_environment() {
  Env env;
  for (char** p = environ; p && *p; ++p) {
    const std::string entry(*p);
    const auto eq = entry.find('=');
    if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return detect_launch_environment(env);
}

std::vector<std::string> expand_slurm_hostlist(const std::string& list) {
  std::vector<std::string> hosts;
  size_t i = 0;
  while (i < list.size()) {
    // One item: a prefix, then optionally [ranges], then maybe a suffix; items split by commas
    // outside brackets.
    size_t end = i;
    int depth = 0;
    while (end < list.size() && (depth > 0 || list[end] != ',')) {
      if (list[end] == '[') ++depth;
      if (list[end] == ']') --depth;
      DDPKIT_CHECK(depth >= 0 && depth <= 1, "malformed Slurm host list '", list, "'");
      ++end;
    }
    DDPKIT_CHECK(depth == 0, "malformed Slurm host list '", list, "': unclosed '['");
    const std::string item = list.substr(i, end - i);
    DDPKIT_CHECK(!item.empty(), "malformed Slurm host list '", list, "': empty entry");
    const auto open = item.find('[');
    if (open == std::string::npos) {
      hosts.push_back(item);
    } else {
      const auto close = item.find(']', open);
      const std::string prefix = item.substr(0, open), suffix = item.substr(close + 1);
      const std::string ranges = item.substr(open + 1, close - open - 1);
      std::stringstream rs(ranges);
      std::string range;
      while (std::getline(rs, range, ',')) {
        const auto dash = range.find('-');
        const std::string lo = range.substr(0, dash), hi = dash == std::string::npos ? lo : range.substr(dash + 1);
        DDPKIT_CHECK(!lo.empty() && !hi.empty() && lo.find_first_not_of("0123456789") == std::string::npos &&
                         hi.find_first_not_of("0123456789") == std::string::npos,
                     "malformed Slurm host list '", list, "': range '", range, "'");
        const long long a = std::stoll(lo), b = std::stoll(hi);
        DDPKIT_CHECK(a <= b && b - a < 100000, "malformed Slurm host list '", list, "': range '", range, "'");
        // A suffix may hold further brackets: rack[1-2]-node[1-2].
        const std::vector<std::string> tails =
            suffix.find('[') == std::string::npos ? std::vector<std::string>{suffix} : expand_slurm_hostlist(suffix);
        for (long long n = a; n <= b; ++n) {
          std::string digits = std::to_string(n);
          if (digits.size() < lo.size()) digits.insert(0, lo.size() - digits.size(), '0');  // node[01-10]
          for (const auto& tail : tails) hosts.push_back(prefix + digits + tail);
        }
      }
    }
    i = end + 1;
  }
  return hosts;
}

std::vector<int> expand_slurm_tasks_per_node(const std::string& list) {
  std::vector<int> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto paren = item.find("(x");
    const std::string count = item.substr(0, paren);
    const int n = static_cast<int>(parse_int("SLURM_TASKS_PER_NODE", count, 0));
    int times = 1;
    if (paren != std::string::npos) {
      DDPKIT_CHECK(item.back() == ')', "malformed Slurm tasks-per-node list '", list, "'");
      times = static_cast<int>(parse_int("SLURM_TASKS_PER_NODE", item.substr(paren + 2, item.size() - paren - 3), 1));
    }
    out.insert(out.end(), static_cast<size_t>(times), n);
  }
  DDPKIT_CHECK(!out.empty(), "malformed Slurm tasks-per-node list '", list, "'");
  return out;
}

}  // namespace ddpkit
