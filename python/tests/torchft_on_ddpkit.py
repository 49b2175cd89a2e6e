"""A pytest plugin that runs torchft's own tests on ddpkit: every ProcessGroupGloo that torchft's
modules name once the tests are collected (manager_integ_test, local_sgd_integ_test and the
checkpoint transport's tests make one per replica group and quorum) becomes
ddpkit.torchft.ProcessGroupDdpkit. The session fails if no test made one, so a torchft release
that stops naming ProcessGroupGloo cannot pass by running on Gloo.

    python -m pytest -p torchft_on_ddpkit --pyargs torchft.manager_integ_test torchft.ddp_test
"""
import sys

from ddpkit.torchft import ProcessGroupDdpkit

made = []


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


def pytest_sessionfinish(session, exitstatus):
    print(f"\ntorchft_on_ddpkit: {len(made)} ddpkit process groups made (one per replica group and quorum)",
          file=sys.stderr)
    if not made and exitstatus == 0 and session.testscollected:
        session.exitstatus = 1
        print("torchft_on_ddpkit: no test made a ProcessGroupGloo, so none ran on ddpkit", file=sys.stderr)
