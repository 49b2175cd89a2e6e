// A program that uses ft::Manager, built by tests/install_consumer.sh with the CMake lines of the
// README's "Using ddpkit from your project", copied from the README itself: the targets the README
// names must link a fault-tolerant program. Run under `ddpkit launch --nproc 1`.
#include <ddpkit/ddpkit.h>
#include <ddpkit/ft/lighthouse.h>
#include <ddpkit/ft/manager.h>

#include <cstdio>

int main() {
  auto pg = ddpkit::init_process_group();
  ddpkit::ft::Lighthouse lighthouse(ddpkit::ft::LighthouseOptions{});
  lighthouse.start();
  ddpkit::ft::Manager manager(pg, ddpkit::ft::ManagerOptions().lighthouse(lighthouse.address()).group_id("readme"));
  while (manager.step() < 3) {
    manager.start_step();
    manager.should_commit();
  }
  manager.close();
  std::printf("readme app: %lld steps committed\n", static_cast<long long>(manager.step()));
  return 0;
}
