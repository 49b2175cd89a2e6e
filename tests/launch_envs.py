#!/usr/bin/python3
"""`ddpkit train` started the way Kubernetes and Ray start it: real processes on this host, each
given exactly the environment its engine sets (no RANK invented by the test where the engine sets
none), ending with the parameters of `ddpkit train --nproc 4`.

    kubeflow-trainer   2 "pods" with Trainer v2's PET_NNODES/PET_NODE_RANK/PET_NPROC_PER_NODE=2/
                       PET_MASTER_ADDR/PET_MASTER_PORT: each `ddpkit train` starts its pod's 2 ranks
    pytorchjob         2 pods of a PyTorchJob with nprocPerNode 2 (RANK = the pod's index,
                       WORLD_SIZE = 4, PET_*): the same
    pytorchjob-1       4 pods, one process each (master-0 and workers 0-2: RANK 0..3)
    ray-train          4 workers with Ray Train's variables (RANK, LOCAL_RANK, WORLD_SIZE,
                       LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR/PORT, ACCELERATE_TORCH_DEVICE), as
                       2 "nodes" (Ray Train itself, one node: python/tests/test_ray_train.py)

and examples/kubernetes/*.yaml read as the operator reads them: the variables each pod gets, and
what ddpkit makes of them.

    tests/launch_envs.py build/ddpkit
"""
import glob
import os
import subprocess
import sys
import tempfile
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from checkpoint_resume import ckpt, differences  # noqa: E402
from ports import free_port  # noqa: E402

# The Python whose torch goes with the build (torchrun, the Python package): tests/CMakeLists.txt sets it.
TORCH_PYTHON = os.environ.get("DDPKIT_TORCH_PYTHON", "/usr/bin/python3")

STEPS = 200
TRAIN = ["train", "--dataset", "synthetic", "--mlp-dims", "64,256,10", "--synthetic-size", "4096", "--batch-size",
         "32", "--epochs", "100", "--steps", str(STEPS), "--checkpoint-every", "100", "--no-eval", "--quiet",
         "--timeout-s", "60"]
# What the test's own environment may carry from a launcher around it.
ENGINE_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
               "DDPKIT_LAUNCHED", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


def start(ddpkit, d, envs):
    base = {k: v for k, v in os.environ.items()
            if k not in ENGINE_VARS and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PET_"))}
    procs = [subprocess.Popen([ddpkit] + TRAIN + ["--checkpoint-dir", d], env=dict(base, **e), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for e in envs]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        outs.append((p.returncode, err))
    return outs


def cases(port):
    m = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    trainer = [{"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(n), "PET_MASTER_ADDR": "127.0.0.1",
                "PET_MASTER_PORT": str(port)} for n in range(2)]
    pytorchjob = [dict(m, PYTHONUNBUFFERED="0", WORLD_SIZE="4", RANK=str(n), PET_NPROC_PER_NODE="2",
                       PET_NODE_RANK=str(n), PET_NNODES="2") for n in range(2)]
    pytorchjob1 = [dict(m, PYTHONUNBUFFERED="0", WORLD_SIZE="4", RANK=str(n), PET_NPROC_PER_NODE="1",
                        PET_NODE_RANK=str(n), PET_NNODES="4") for n in range(4)]
    ray = [dict(m, RANK=str(r), LOCAL_RANK=str(r % 2), WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", NODE_RANK=str(r // 2),
                ACCELERATE_TORCH_DEVICE="cpu") for r in range(4)]
    return {"kubeflow-trainer": trainer, "pytorchjob": pytorchjob, "pytorchjob-1": pytorchjob1, "ray-train": ray}


def operator_envs(job):
    """The variables Kubeflow's training operator gives each pod of a PyTorchJob (training-operator
    pkg/controller.v1/pytorch/envvar.go, master.go and elastic.go), from the job's YAML."""
    spec, name = job["spec"], job["metadata"]["name"]
    replicas = spec["pytorchReplicaSpecs"]
    nproc = int(spec.get("nprocPerNode", "1"))
    total = sum(r["replicas"] for r in replicas.values())

    def port(kind):
        for c in replicas[kind]["template"]["spec"]["containers"]:
            for p in c.get("ports", []):
                if p["name"] == "pytorchjob-port":
                    return p["containerPort"]
    pods = []
    for kind in ("Master", "Worker"):
        for i in range(replicas.get(kind, {}).get("replicas", 0)):
            env = {"PYTHONUNBUFFERED": "0"}
            if "Master" in replicas:
                rank = i + (1 if kind == "Worker" else 0)
                env.update(MASTER_ADDR=f"{name}-master-0", MASTER_PORT=str(port("Master")), WORLD_SIZE=str(total * nproc),
                           RANK=str(rank), PET_NPROC_PER_NODE=str(nproc), PET_NODE_RANK=str(rank))
            if "elasticPolicy" in spec:
                e = spec["elasticPolicy"]
                env.update(PET_RDZV_ENDPOINT=f"{name}-worker-0:{port('Worker')}", PET_RDZV_BACKEND=e["rdzvBackend"],
                           PET_NNODES=f"{e['minReplicas']}:{e['maxReplicas']}", PET_MAX_RESTARTS=str(e["maxRestarts"]),
                           PET_NPROC_PER_NODE=str(nproc))
            else:
                env["PET_NNODES"] = str(total)
            command = replicas[kind]["template"]["spec"]["containers"][0]["command"]
            pods.append((f"{kind.lower()}-{i}", env, command))
    return pods


def examples(build_python):
    """examples/kubernetes/*.yaml against what the operator sets: each pod of pytorchjob.yaml is the
    launcher of its ranks, in order; the elastic one's variables are refused by ddpkit itself (and its
    container runs torchrun, which takes them)."""
    import json
    import yaml
    failed = []
    probe = "import json\nfrom ddpkit import _C\nprint(json.dumps(_C.launch_environment()))"
    for path in sorted(glob.glob(os.path.join(HERE, "..", "examples", "kubernetes", "*.yaml"))):
        job = yaml.safe_load(open(path))
        for pod, env, command in operator_envs(job):
            base = {k: v for k, v in os.environ.items() if k not in ENGINE_VARS and not k.startswith("PET_")}
            out = subprocess.run([TORCH_PYTHON, "-c", probe], env=dict(base, PYTHONPATH=build_python, **env),
                                 capture_output=True, text=True)
            elastic = "elasticPolicy" in job["spec"]
            if elastic:
                ok = out.returncode != 0 and "elastic rendezvous is torchrun's" in out.stderr and \
                    command[:3] == ["python3", "-m", "torch.distributed.run"]
                what = "refused, the container runs torchrun" if ok else out.stderr[-500:]
            else:
                d = json.loads(out.stdout) if out.returncode == 0 else {}
                ok = d.get("per_node") and d.get("node_rank") == int(env["RANK"]) and d.get("local_world_size") == 2 \
                    and command[:2] == ["ddpkit", "train"]
                what = (f"node {d.get('node_rank')} of {d.get('nnodes')}, {d.get('local_world_size')} ranks, "
                        f"rendezvous {d.get('master_addr')}:{d.get('master_port')}") if d else out.stderr[-500:]
            print(f"{os.path.basename(path)} {pod}: {what}")
            if not ok:
                failed.append(f"{os.path.basename(path)} {pod}")
    return failed


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    ddpkit = os.path.abspath(sys.argv[1])
    work = tempfile.mkdtemp(prefix="ddpkit-envs-")
    failed = []
    try:
        ref = os.path.join(work, "ref")
        subprocess.run([ddpkit] + TRAIN + ["--nproc", "4", "--checkpoint-dir", ref], check=True, capture_output=True,
                       timeout=300)
        for name in cases(0):
            envs = cases(free_port())[name]  # a fresh port per case: no store of the previous case in the way
            d = os.path.join(work, name)
            outs = start(ddpkit, d, envs)
            bad = [f"process {i} exited {rc}:\n{err[-1500:]}" for i, (rc, err) in enumerate(outs) if rc != 0]
            engine = sorted({line.split(":")[1].strip() for _, err in outs for line in err.splitlines()
                             if line.startswith("ddpkit: launched by")})
            diffs = [] if bad else differences(ckpt(ref, STEPS), ckpt(d, STEPS))
            print(f"{name}: {len(envs)} processes, detected {engine}: "
                  + ("; ".join(bad) if bad else "bit-identical to --nproc 4" if not diffs else "DIFFERENT"))
            if bad or diffs or not engine:
                failed.append(name)
        build_python = os.path.join(os.path.dirname(ddpkit), "python")
        if os.path.isdir(os.path.join(build_python, "ddpkit")):
            failed += examples(build_python)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if failed:
        sys.exit(f"FAILED: {', '.join(failed)}")


if __name__ == "__main__":
    main()
