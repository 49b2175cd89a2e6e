// ddpkit._C.ft and ddpkit._C.diloco (ft_bindings.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace ddpkit {
namespace python {

void bind_ft(pybind11::module& m);

}  // namespace python
}  // namespace ddpkit
