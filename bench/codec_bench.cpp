// Codec kernel bandwidth on one core, next to memcpy's and ATen's cast.
//
//   build/codec_bench [--elements N] [--reps R]
//
// GB/s counts bytes read + bytes written. "vs memcpy" is the kernel's GB/s over memcpy's GB/s on the
// same buffers in the same run (issue target: >= 0.5). The coalesce rows take the seed benchmark's
// sparse gradient (EmbeddingBag 1024 x 1024, batch 16 of 1024 indices: 16384 entries) and count the
// entries' bytes read plus the coalesced rows' bytes written; "vs_aten" is ATen's time over ddpkit's.
#include <ddpkit/codecs/cast.h>
#include <ddpkit/codecs/codec.h>
#include <ddpkit/codecs/quantize.h>
#include <ddpkit/codecs/sparse.h>
#include <ddpkit/error.h>
#include <ddpkit/runtime/program.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

struct Stats {
  double min_ms, p50_ms, p99_ms;
};

Stats time_it(int reps, const std::function<void()>& fn) {
  fn();  // warm: page faults, caches
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return {ms.front(), ms[ms.size() / 2], ms[std::min(ms.size() - 1, ms.size() * 99 / 100)]};
}

using ddpkit::codecs::Codec;

at::Tensor round_trip(const Codec& c, const at::Tensor& x) {
  at::Tensor bytes = at::empty({c.encoded_bytes(x.numel())}, at::kByte), out = at::empty_like(x);
  c.encode(x, bytes);
  c.decode(bytes, out);
  return out;
}

// Every codec of the outer all-reduce (codecs/codec.h): encode and decode rates on one core, in
// float32 values per second (and what that is as a link rate of encoded bits).
void outer_codecs(const at::Tensor& x, int reps) {
  const double n = static_cast<double>(x.numel());
  std::printf("\n# outer-all-reduce codecs (codecs/codec.h), one core: float32 values in/out per second; "
              "wire_Gbit/s = the encoded bits those values make per second\n");
  std::printf("%-6s %12s %14s %14s %14s %14s\n", "codec", "bytes/value", "encode_Mval/s", "decode_Mval/s",
              "encode_wireGb", "decode_wireGb");
  for (const auto& name : ddpkit::codecs::codec_names()) {
    const auto c = ddpkit::codecs::make_codec(name);
    at::Tensor bytes = at::empty({c->encoded_bytes(x.numel())}, at::kByte), out = at::empty_like(x);
    const Stats e = time_it(reps, [&] { c->encode(x, bytes); });
    const Stats d = time_it(reps, [&] { c->decode(bytes, out, 1.0f, true); });
    const double per_value = static_cast<double>(bytes.numel()) / n;
    const double ev = n / (e.p50_ms * 1e3), dv = n / (d.p50_ms * 1e3);  // millions of values per second
    std::printf("%-6s %12.4f %14.1f %14.1f %14.2f %14.2f\n", name.c_str(), per_value, ev, dv, ev * per_value * 8 / 1e3,
                dv * per_value * 8 / 1e3);
  }
}

// The outer all-reduce's error against the fp32 mean as the sites grow: ddpkit's two
// quantizations (each site's chunk once, the owner's mean once) against a ring that re-quantizes
// the running sum at every hop (PCCL, prime) and once more for its all-gather.
void outer_error_vs_sites() {
  const int64_t n = 1 << 20;
  std::printf("\n# outer all-reduce error vs sites: max |result - fp32 mean| / max |fp32 mean|, %lld values per site "
              "(randn, one seed per site)\n", static_cast<long long>(n));
  std::printf("%-6s %6s %16s %16s %8s\n", "codec", "sites", "two_quantizations", "requantize_per_hop", "ratio");
  for (const std::string name : {"bf16", "int8", "int4", "int2"}) {
    const auto c = ddpkit::codecs::make_codec(name);
    for (int sites : {2, 4, 8}) {
      std::vector<at::Tensor> x;
      for (int s = 0; s < sites; ++s) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + s);
        x.push_back(at::randn({n}, gen));
      }
      at::Tensor exact = at::zeros({n}, at::kDouble);
      for (const auto& v : x) exact += v.to(at::kDouble);
      exact = (exact / sites).to(at::kFloat);
      at::Tensor two = at::zeros({n});
      for (const auto& v : x) two += round_trip(*c, v) / static_cast<float>(sites);
      two = round_trip(*c, two);
      at::Tensor ring = round_trip(*c, x[0]);
      for (int s = 1; s < sites; ++s) ring = round_trip(*c, ring + x[s]);
      ring = round_trip(*c, ring / static_cast<float>(sites));
      const double scale = exact.abs().max().item<double>();
      const double e_two = (two - exact).abs().max().item<double>() / scale;
      const double e_ring = (ring - exact).abs().max().item<double>() / scale;
      std::printf("%-6s %6d %16.5f %16.5f %8.2f\n", name.c_str(), sites, e_two, e_ring, e_ring / e_two);
    }
  }
}

}  // namespace

static int program_main(int argc, char** argv) {
  int64_t n = 25 * 1000 * 1000;  // the 25M-parameter MLP's gradient
  int reps = 15;
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 < argc && !std::strcmp(argv[i], "--elements")) n = std::atoll(argv[i + 1]);
    else if (i + 1 < argc && !std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else throw ddpkit::UsageError(std::string("unknown argument '") + argv[i] + "'" +
                                  (i + 1 < argc ? "" : " (or a flag without its value)"));
  }
  if (n < 1 || reps < 1) throw ddpkit::UsageError("--elements and --reps must be positive integers");
  at::set_num_threads(1);
  at::Tensor f32 = at::randn({n}), f32_out = at::empty({n});
  at::Tensor h = at::empty({n}, at::kHalf), b = at::empty({n}, at::kBFloat16);
  ddpkit::codecs::cast_scaled_into(f32, h, 0.5);
  ddpkit::codecs::cast_scaled_into(f32, b, 0.5);
  std::vector<at::Tensor> parts{h, h.clone()};
  at::Tensor hsum = at::empty({n}, at::kHalf);

  const double f32_bytes = 4.0 * n, lp_bytes = 2.0 * n;
  const Stats memcpy_stats = time_it(reps, [&] { std::memcpy(f32_out.data_ptr(), f32.data_ptr(), f32_bytes); });
  const double memcpy_gbs = 2 * f32_bytes / (memcpy_stats.p50_ms * 1e6);

  std::printf("# codec kernels, one core, %lld elements, SIMD level %s, %d reps\n", static_cast<long long>(n),
              ddpkit::codecs::simd_level_name(), reps);
  std::printf("# GB/s = (bytes read + bytes written) / p50 time\n");
  std::printf("%-28s %10s %10s %10s %10s %10s\n", "kernel", "min_ms", "p50_ms", "p99_ms", "GB/s", "vs_memcpy");
  auto row = [&](const char* name, double bytes, const Stats& s) {
    const double gbs = bytes / (s.p50_ms * 1e6);
    std::printf("%-28s %10.2f %10.2f %10.2f %10.2f %10.2f\n", name, s.min_ms, s.p50_ms, s.p99_ms, gbs, gbs / memcpy_gbs);
  };
  row("memcpy fp32", 2 * f32_bytes, memcpy_stats);
  row("fp32->fp16 x scale (ddpkit)", f32_bytes + lp_bytes, time_it(reps, [&] { ddpkit::codecs::cast_scaled_into(f32, h, 0.5); }));
  row("fp16->fp32 (ddpkit)", f32_bytes + lp_bytes, time_it(reps, [&] { ddpkit::codecs::cast_scaled_into(h, f32_out, 1.0); }));
  row("fp32->bf16 x scale (ddpkit)", f32_bytes + lp_bytes, time_it(reps, [&] { ddpkit::codecs::cast_scaled_into(f32, b, 0.5); }));
  row("bf16->fp32 (ddpkit)", f32_bytes + lp_bytes, time_it(reps, [&] { ddpkit::codecs::cast_scaled_into(b, f32_out, 1.0); }));
  row("fp16 sum of 2 (ddpkit)", 3 * lp_bytes, time_it(reps, [&] { ddpkit::codecs::sum_low_precision_into(parts, hsum); }));
  // int8 blocks of 512: bytes = fp32 in + int8 codes and scales out (and the reverse).
  const int64_t block = 512;
  at::Tensor enc = at::empty({ddpkit::codecs::int8_encoded_bytes(n, block)}, at::kByte);
  at::Tensor residual = at::empty({n});
  const double enc_bytes = static_cast<double>(enc.numel());
  row("fp32->int8 quantize (ddpkit)", f32_bytes + enc_bytes,
      time_it(reps, [&] { ddpkit::codecs::int8_encode(f32, n, n, block, enc); }));
  row("fp32->int8 + error feedback", 2 * f32_bytes + enc_bytes,
      time_it(reps, [&] { ddpkit::codecs::int8_encode(f32, n, n, block, enc, residual); }));
  row("int8->fp32 dequantize", f32_bytes + enc_bytes,
      time_it(reps, [&] { ddpkit::codecs::int8_decode(enc, n, block, f32_out, n); }));
  row("int8 dequantize-accumulate", 2 * f32_bytes + enc_bytes,
      time_it(reps, [&] { ddpkit::codecs::int8_decode(enc, n, block, f32_out, n, 0.5f, true); }));
  row("int8 quantize+dequantize", 2 * (f32_bytes + enc_bytes), time_it(reps, [&] {
        ddpkit::codecs::int8_encode(f32, n, n, block, enc);
        ddpkit::codecs::int8_decode(enc, n, block, f32_out, n);
      }));
  row("uint8 quantize (ATen ops)", f32_bytes + n, time_it(std::max(reps / 5, 2), [&] {
        at::clamp(at::round(f32 / 0.01) + 128, 0, 255).to(at::kByte);
      }));
  row("fp32->fp16 (ATen .to)", f32_bytes + lp_bytes, time_it(reps, [&] { h.copy_(f32); }));
  row("fp32->fp16 x scale (ATen)", f32_bytes + lp_bytes, time_it(reps, [&] { h.copy_(f32); h.div_(2); }));
  row("fp16->fp32 (ATen)", f32_bytes + lp_bytes, time_it(reps, [&] { f32_out.copy_(h); }));
  row("fp32->bf16 (ATen .to)", f32_bytes + lp_bytes, time_it(reps, [&] { b.copy_(f32); }));

  const int64_t rows = 1024, width = 1024, entries = 16 * 1024;
  at::Tensor grad = at::_sparse_coo_tensor_unsafe(at::randint(0, rows, {1, entries}, at::kLong),
                                                  at::randn({entries, width}), {rows, width});
  const double unique = static_cast<double>(std::get<0>(at::_unique(grad._indices()[0])).numel());
  const double sparse_bytes = 4.0 * width * (entries + unique) + 8.0 * entries;
  const Stats ours = time_it(reps, [&] { ddpkit::codecs::coalesce(grad); });
  const Stats aten = time_it(reps, [&] { grad.coalesce(); });
  row("sparse coalesce (ddpkit)", sparse_bytes, ours);
  row("sparse coalesce (ATen)", sparse_bytes, aten);
  std::printf("# coalesce vs_aten %.2f (ATen p50 / ddpkit p50)\n", aten.p50_ms / ours.p50_ms);
  outer_codecs(f32, reps);
  outer_error_vs_sites();
  return 0;
}

int main(int argc, char** argv) {
  return ddpkit::run_main("codec_bench", [&] { return program_main(argc, argv); },
                          [] { return std::string("usage: codec_bench [--elements N] [--reps R]\n"); });
}
