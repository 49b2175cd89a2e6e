// What a DiLoCo is set up with: its options checked, and its fragments made of a model's layers.
#include <ddpkit/diloco/diloco.h>
#include <ddpkit/error.h>

#include <map>

namespace ddpkit {
namespace diloco {

void DiLoCoOptions::validate(int64_t fragments) const {
  DDPKIT_CHECK(fragments >= 1, "DiLoCo: fragments must be >= 1, got ", fragments);
  DDPKIT_CHECK(sync_every() >= 1, "DiLoCo: sync_every must be >= 1 (inner steps between syncs), got ", sync_every());
  DDPKIT_CHECK(sync_every() % fragments == 0, "DiLoCo: sync_every (", sync_every(), ") must be a multiple of the ",
               fragments, " fragments");
  const int64_t period = sync_every() / fragments;
  DDPKIT_CHECK(fragment_delay() >= 0 && fragment_delay() < period, "DiLoCo: fragment_delay must be in 0..", period - 1,
               " (sync_every / fragments - 1), got ", fragment_delay());
  DDPKIT_CHECK(fragment_alpha() >= 0 && fragment_alpha() <= 1, "DiLoCo: fragment_alpha must be in [0, 1], got ",
               fragment_alpha());
  DDPKIT_CHECK(round_seconds() >= 0, "DiLoCo: round_seconds must be >= 0, got ", round_seconds());
  DDPKIT_CHECK(piece_bytes() >= 0, "DiLoCo: piece_bytes must be >= 0 (0: the cross group's own), got ", piece_bytes());
  DDPKIT_CHECK(round_seconds() == 0 || (fragments == 1 && fragment_delay() == 0),
               "DiLoCo: time-budgeted rounds (round_seconds) take one fragment and no fragment_delay");
  DDPKIT_CHECK(outer_lr() > 0, "DiLoCo: outer_lr must be > 0, got ", outer_lr());
  DDPKIT_CHECK(outer_momentum() >= 0 && outer_momentum() < 1, "DiLoCo: outer_momentum must be in [0, 1), got ",
               outer_momentum());
  DDPKIT_CHECK(fragments == 1 || !parameters_sharded(),
               "DiLoCo: fragments > 1 split the model by layers; FSDP's shards (parameters_sharded) are flat");
  codecs::make_codec(codec());  // an unknown codec: an error listing them
}

std::vector<std::vector<at::Tensor>> fragments_of(const std::vector<std::vector<at::Tensor>>& layers, int64_t count,
                                                  const std::string& layout) {
  DDPKIT_CHECK(count >= 1, "DiLoCo: fragments must be >= 1, got ", count);
  DDPKIT_CHECK(static_cast<int64_t>(layers.size()) >= count, "DiLoCo: ", count, " fragments of ", layers.size(),
               " layers: give at most one fragment per layer");
  DDPKIT_CHECK(layout == "strided" || layout == "sequential", "DiLoCo: the fragment layout is strided or sequential, got '",
               layout, "'");
  std::vector<std::vector<at::Tensor>> out(static_cast<size_t>(count));
  const auto n = static_cast<int64_t>(layers.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t f = layout == "strided" ? i % count : i * count / n;
    for (const auto& p : layers[static_cast<size_t>(i)]) out[static_cast<size_t>(f)].push_back(p);
  }
  return out;
}

std::vector<std::vector<at::Tensor>> layers_of(const torch::nn::Module& module,
                                               const std::vector<std::shared_ptr<torch::nn::Module>>& units) {
  std::vector<std::vector<at::Tensor>> layers;
  if (units.empty()) {
    // The module's own parameters first, as parameters() lists them, then each child's.
    std::vector<at::Tensor> own = module.parameters(/*recurse=*/false);
    if (!own.empty()) layers.push_back(std::move(own));
    for (const auto& child : module.children()) {
      std::vector<at::Tensor> params = child->parameters();
      if (!params.empty()) layers.push_back(std::move(params));
    }
    DDPKIT_CHECK(!layers.empty(), "DiLoCo: layers_of: the module has no parameters");
    return layers;
  }
  std::map<const void*, size_t> unit_of;
  for (size_t u = 0; u < units.size(); ++u)
    for (const auto& p : units[u]->parameters()) unit_of[p.unsafeGetTensorImpl()] = u;
  long last = -2;  // the unit of the last parameter (-1: none)
  for (const auto& p : module.parameters()) {
    auto it = unit_of.find(p.unsafeGetTensorImpl());
    const long u = it == unit_of.end() ? -1 : static_cast<long>(it->second);
    if (u != last || layers.empty()) layers.emplace_back();
    layers.back().push_back(p);
    last = u;
  }
  DDPKIT_CHECK(!layers.empty(), "DiLoCo: layers_of: the module has no parameters");
  return layers;
}

}  // namespace diloco
}  // namespace ddpkit
