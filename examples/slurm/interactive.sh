#!/bin/bash
# ddpkit in an interactive Slurm allocation: salloc gives the nodes, srun starts one rank per task.
#   salloc -N2 --ntasks-per-node=2 examples/slurm/interactive.sh
# A C++ program of your own that calls ddpkit::init_process_group() runs the same way:
#   srun ./my_trainer
set -euo pipefail
srun ddpkit train --dataset synthetic --mlp-dims 64,512,512,10 --epochs 5
