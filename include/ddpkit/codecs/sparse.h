// Coalescing the sparse gradients of embeddings (the sparse hooks, the parameter server's wire).
#pragma once

#include <ATen/ATen.h>

namespace ddpkit {
namespace codecs {

// The coalesced form of a sparse COO tensor: its rows in ascending order, each once, duplicates
// summed. For CPU tensors with one sparse dimension (an embedding's gradient) and float32/64,
// float16 or bfloat16 values, duplicates are summed in their order of appearance, one rounding
// per addition, in one pass over the values (at::coalesce sorts the indices first and takes
// three times as long on the seed's EmbeddingBag gradient: codec_bench); anything else goes to
// at::coalesce, whose order of duplicates is its sort's. A row index outside [0, size(0)) is an
// error that names it. Returns `sparse` itself when it is coalesced.
at::Tensor coalesce(const at::Tensor& sparse);

}  // namespace codecs
}  // namespace ddpkit
