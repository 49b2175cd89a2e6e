// The communication of DDP's buckets in the cost model: the Reducer's bucket assignment, and
// what each hook does with a bucket (src/plan/step_program.h; the reasoning is in docs/plan.md).
#include <ddpkit/ddp/distributed_data_parallel.h>
#include <ddpkit/hooks/default_hooks.h>
#include <ddpkit/reducer/bucket_assignment.h>

#include "step_program.h"

#include <algorithm>
#include <cmath>

namespace ddpkit {
namespace plan {
namespace detail {

std::vector<Bucket> ddp_buckets(const ModelProfile& model, double cap_mb, double time_scale) {
  std::vector<at::Tensor> shapes;
  std::vector<size_t> reversed;
  for (size_t k = 0; k < model.params.size(); ++k) {
    shapes.push_back(at::empty(model.params[k].shape, at::TensorOptions().dtype(at::kFloat).device(at::kMeta)));
    reversed.push_back(model.params.size() - 1 - k);
  }
  const auto mib = [](double mb) { return static_cast<size_t>(mb * 1024 * 1024); };
  const BucketAssignment assignment = compute_bucket_assignment_by_size(
      shapes, {mib(DistributedDataParallelOptions().first_bucket_cap_mb()), mib(cap_mb)}, {}, reversed);
  std::vector<Bucket> out;
  for (const auto& indices : assignment.buckets) {
    Bucket b;
    b.params = indices;
    for (size_t k : indices) {
      b.numel += model.params[k].numel;
      b.ready_ms = std::max(b.ready_ms, model.params[k].grad_ready_ms * time_scale);
    }
    out.push_back(b);
  }
  std::stable_sort(out.begin(), out.end(), [](const Bucket& a, const Bucket& b) { return a.ready_ms < b.ready_ms; });
  return out;
}

int powersgd_rank_of(const Candidate& c) {
  return c.powersgd_rank > 0 ? c.powersgd_rank : hooks::default_powersgd_rank(to_string(c.hook));
}

// PowerSGD on one bucket: its matrices worth compressing travel as P (n x r) and Q (m x r); the
// rest (vectors, small matrices) as one plain allreduce.
namespace {

Comm powersgd_bucket(const ModelProfile& model, const Bucket& b, int r, const Network& net) {
  Comm total;
  double plain = 0, p_bytes = 0, q_bytes = 0, flops = 0, compressed = 0, products_ms = 0;
  for (size_t k : b.params) {
    const auto& shape = model.params[k].shape;
    int64_t n = shape.empty() ? 1 : shape[0], m = 1;
    for (size_t d = 1; d < shape.size(); ++d) m *= shape[d];
    if (shape.size() >= 2 && static_cast<double>((n + m) * r) * 2 < static_cast<double>(n * m)) {
      p_bytes += 4.0 * n * r;
      q_bytes += 4.0 * m * r;
      products_ms += net.powersgd_products_ms(n, m, r);
      flops += 2.0 * n * r * r;  // P's orthogonalization
      compressed += 4.0 * n * m;
    } else {
      plain += 4.0 * model.params[k].numel;
    }
  }
  // The hook works a matrix in cache-sized blocks of rows: last step's error is added to a block
  // the first product then reads from cache, and the third product's block is written back to
  // the bucket and subtracted into the new error from cache. Beyond the products, one pass over
  // the compressed matrices (bench/powersgd_passes.py times the hook's passes alone).
  total.cpu_ms += products_ms + net.flops_ms(flops) + net.copy_ms(compressed);
  if (plain > 0) total += net.collective(Op::kAllreduce, plain);
  if (p_bytes > 0) total += net.collective(Op::kAllreduce, p_bytes);
  if (q_bytes > 0) total += net.collective(Op::kAllreduce, q_bytes);
  return total;
}

// batched_powerSGD_hook: the bucket as one zero-padded square matrix, compressed at rank r.
Comm batched_powersgd_bucket(const Bucket& b, int r, const Network& net) {
  const double side = std::ceil(std::sqrt(static_cast<double>(b.numel)));
  const double rank = std::min(side, static_cast<double>(r));
  const double padded = 4.0 * side * side, factor = 4.0 * side * rank;
  Comm total;
  // The padded copy with last step's error added, the new error, and the result back: as
  // powerSGD_hook's three passes; P = M Q, Q = M^T P, M ~ P Q^T and P's orthogonalization.
  total.cpu_ms += net.powersgd_products_ms(side, side, rank) + net.flops_ms(2.0 * side * rank * rank) +
                  net.copy_ms(3 * padded) + net.copy_ms(2 * 4.0 * b.numel);
  total += net.collective(Op::kAllreduce, factor);
  total += net.collective(Op::kAllreduce, factor);
  return total;
}

}  // namespace

// `subgroup`: post_local_sgd's group of consecutive ranks (subgroup_job).
Comm ddp_bucket(const ModelProfile& model, const JobSpec& job, const Candidate& c, const Bucket& b,
                const Network& net, const Network& subgroup) {
  const double bytes = 4.0 * b.numel;
  Comm comm;
  const Hook h = c.hook;
  if (h == Hook::kNoop) return comm;
  if (h == Hook::kNone) {
    if (job.world_size > 1 && net.one_host()) return net.collective(Op::kAllreduceInPlace, bytes);
    comm.cpu_ms += net.copy_ms(2 * bytes);  // gradients into the bucket and back
    comm += net.collective(Op::kAllreduce, bytes);
    return comm;
  }
  comm.cpu_ms += net.copy_ms(2 * bytes);
  if (h == Hook::kAllreduce) {
    comm += net.collective(Op::kAllreduce, bytes);
  } else if (h == Hook::kFp16 || h == Hook::kBf16) {
    comm.cpu_ms += net.cast_ms(bytes);
    comm += net.collective(Op::kAllreduce16, bytes / 2);
  } else if (h == Hook::kInt8) {
    comm.cpu_ms += net.int8_ms(bytes);
    // Two alltoalls of one byte per element plus a 4-byte scale per 512.
    const double payload = bytes / 4 * (1 + 4.0 / 512);
    comm += net.collective(Op::kAlltoall, payload);
    comm += net.collective(Op::kAlltoall, payload);
  } else if (h == Hook::kFp16Wrapper || h == Hook::kBf16Wrapper) {
    // compress_wrapper around allreduce_hook: a 16-bit copy of the bucket, divided by ATen (a
    // pass at the copy rate in bf16, far slower in float16), allreduced through the slots (not
    // cast in pieces there, as fp16/bf16 are), cast back.
    comm.cpu_ms += net.cast_ms(bytes) + (h == Hook::kFp16Wrapper ? net.fp16_div_ms(bytes) : net.copy_ms(bytes / 2));
    comm += net.collective(Op::kAllreduce, bytes / 2);
  } else if (h == Hook::kQuantizePerTensor || h == Hook::kQuantizePerChannel) {
    // PyTorch's hooks: uint8 codes of the bucket gathered from every rank, each rank's decoded
    // into their mean in the bucket (one pass).
    comm.cpu_ms += net.uint8_encode_ms(bytes) + net.world() * net.uint8_decode_ms(bytes);
    comm += net.collective(Op::kAllgather, net.world() * bytes / 4);
  } else if (h == Hook::kPowerSgd) {
    comm += powersgd_bucket(model, b, powersgd_rank_of(c), net);
  } else if (h == Hook::kBatchedPowerSgd) {
    comm += batched_powersgd_bucket(b, powersgd_rank_of(c), net);
  } else if (h == Hook::kPostLocalSgd) {
    // Past its start the hook allreduces the bucket within the rank's group (--local-sgd-group-size),
    // else leaves it local: the bucket's copies alone.
    if (c.local_sgd_group_size > 1) comm += subgroup.collective(Op::kAllreduce, bytes);
  } else {
    DDPKIT_CHECK(false, "the cost model has no hook '", to_string(h), "'");
  }
  return comm;
}

// post_local_sgd's subgroups: `size` consecutive ranks, within a host where they fit in one, else
// whole hosts of them.

}  // namespace detail
}  // namespace plan
}  // namespace ddpkit
