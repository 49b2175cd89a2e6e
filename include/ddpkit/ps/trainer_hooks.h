// DDP communication hooks of the parameter-server benchmark (seed trainer/hooks.py):
//
//   rpc_hook         every bucket is averaged by the trainer's parameter server
//   sparse_rpc_hook  sparse buckets by the server, dense ones allreduced on `pg`
//   hybrid_hook      sparse buckets allreduced on `sparse_pg` (Gloo: it has a sparse allreduce),
//                    dense ones on `dense_pg` (NCCL in the seed when on GPU)
//
// Each hook numbers batches itself (one batch per backward: the number moves on after the bucket
// with is_last()), which the server uses to tell iterations apart. With a MetricsLogger, each
// bucket's communication is timed as "hook_future_metric" events, keyed "batch,bucket" and named
// rpc_dense / rpc_sparse / <backend>_dense_allreduce / <backend>_sparse_allreduce.
#pragma once

#include <ddpkit/metrics/metrics_logger.h>
#include <ddpkit/ps/parameter_server.h>
#include <ddpkit/reducer/grad_bucket.h>

#include <memory>

namespace ddpkit {
namespace ps {

CommHook rpc_hook(std::shared_ptr<ParameterServerClient> client,
                  std::shared_ptr<metrics::MetricsLogger> log = nullptr);
CommHook sparse_rpc_hook(std::shared_ptr<ParameterServerClient> client, std::shared_ptr<ProcessGroup> pg,
                         std::shared_ptr<metrics::MetricsLogger> log = nullptr);
CommHook hybrid_hook(std::shared_ptr<ProcessGroup> sparse_pg, std::shared_ptr<ProcessGroup> dense_pg,
                     std::shared_ptr<metrics::MetricsLogger> log = nullptr);
// Times any hook's future the same way (e.g. the allreduce baseline), named `name`.
CommHook timed_hook(CommHook inner, std::shared_ptr<metrics::MetricsLogger> log, std::string name);

}  // namespace ps
}  // namespace ddpkit
