"""One rank of test_torchrun_elastic_restart: on the first attempt rank 1 dies after one all_reduce,
and a survivor that gets that far must get an error naming it (not hang); torchrun then restarts
every rank, and the second attempt must run through."""
import os, sys, datetime, torch, torch.distributed as dist
import ddpkit  # noqa
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("ddpkit", timeout=datetime.timedelta(seconds=30))
rank, w = dist.get_rank(), dist.get_world_size()
t = torch.full((1 << 18,), float(rank + 1))
dist.all_reduce(t)
assert torch.all(t == w * (w + 1) / 2)
if restart == 0 and rank == 1:
    print("rank 1 dies on attempt 0", flush=True)
    os._exit(1)
if restart == 0:
    try:
        dist.all_reduce(t)   # the peer is gone: must fail within the timeout, not hang
    except Exception as e:
        print(f"rank {rank} attempt 0: survivor error: {str(e).splitlines()[0][:150]}", flush=True)
        sys.exit(1)
print(f"rank {rank}/{w} attempt {restart}: ok", flush=True)
dist.destroy_process_group()
