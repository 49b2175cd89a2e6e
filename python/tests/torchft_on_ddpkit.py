"""A pytest plugin that runs torchft's own tests on ddpkit: every ProcessGroupGloo that torchft's
modules name once the tests are collected (manager_integ_test, local_sgd_integ_test and the
checkpoint transport's tests make one per replica group and quorum) becomes
ddpkit.torchft.ProcessGroupDdpkit; and where a module builds a native torch group with
`dist.ProcessGroupGloo(store, rank, size, enable_reconfigure=True)` (torchft after 0.2.0: the
Manager reconfigures it per quorum), that call makes a native ddpkit backend instead. The session
fails if no test made either, so a torchft release that stops naming them cannot pass by running
on Gloo.

    python -m pytest -p torchft_on_ddpkit --pyargs torchft.manager_integ_test torchft.ddp_test
"""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import ddpkit
import ddpkit.torchft
from ddpkit.torchft import ProcessGroupDdpkit

made = []
native = []


class _DistWithDdpkit:
    """torch.distributed as a test module sees it, with ProcessGroupGloo making ddpkit backends."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def ProcessGroupGloo(store, rank, size, timeout=timedelta(seconds=60), enable_reconfigure=False):  # noqa: N802
        # The backend of ddpkit.torchft.native_group (the tests register it under Gloo's type).
        native.append((rank, size, enable_reconfigure))
        return ddpkit.torchft.native_group(store, rank, size, timeout)._get_backend(torch.device("cpu")) \
            if enable_reconfigure else ddpkit._C._make_backend(store, rank, size, timeout.total_seconds(), 2, True)


class _Counted(ProcessGroupDdpkit):
    def _create_pg(self, store, rank, world_size):
        made.append((rank, world_size))
        return super()._create_pg(store, rank, world_size)


def pytest_collection_modifyitems(session, config, items):
    # The test modules and what they import (torchft._test.diloco_trainer makes the DiLoCo tests'
    # groups); torchft.process_group itself keeps its class.
    from torchft.process_group import ProcessGroupGloo
    for name, module in list(sys.modules.items()):
        if (name == "torchft" or name.startswith("torchft.")) and name != "torchft.process_group" \
                and getattr(module, "ProcessGroupGloo", None) is ProcessGroupGloo:
            module.ProcessGroupGloo = _Counted
        if (name == "torchft" or name.startswith("torchft.")) and getattr(module, "dist", None) is dist:
            module.dist = _DistWithDdpkit()


def pytest_sessionfinish(session, exitstatus):
    print(f"\ntorchft_on_ddpkit: {len(made)} ddpkit process groups made (one per replica group and quorum), "
          f"{len(native)} native ddpkit groups", file=sys.stderr)
    if not made and not native and exitstatus == 0 and session.testscollected:
        session.exitstatus = 1
        print("torchft_on_ddpkit: no test made a ProcessGroupGloo, so none ran on ddpkit", file=sys.stderr)
