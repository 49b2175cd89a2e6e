# Facts about the libtorch we found, turned into compile definitions once, here.
find_package(Threads REQUIRED)
set(DDPKIT_TORCH_DEFINITIONS "")

# The C++ standard follows libtorch: from 2.13 its headers require C++20 (ATen stops with "C++20 or
# later compatible compiler is required"); below, ddpkit stays C++17, which 1.13's headers need.
if(Torch_VERSION VERSION_GREATER_EQUAL 2.13)
  set(CMAKE_CXX_STANDARD 20)
  set(CMAKE_CUDA_STANDARD 20)
else()
  set(CMAKE_CXX_STANDARD 17)
endif()
set(CMAKE_CXX_STANDARD_REQUIRED ON)

# Which libraries the `torch` target and TORCH_LIBRARIES name (a pip torch on a Debian host):
# cmake/TorchLibraries.cmake, which the installed CMake package runs for its users too.
include(${CMAKE_CURRENT_LIST_DIR}/TorchLibraries.cmake)

# Debian's TorchConfig carries USE_C10D_GLOO on torch_cpu; a bare libtorch may not.
get_target_property(_torch_cpu_defs torch_cpu INTERFACE_COMPILE_DEFINITIONS)
if(NOT _torch_cpu_defs MATCHES "USE_C10D_GLOO")
  list(APPEND DDPKIT_TORCH_DEFINITIONS USE_C10D_GLOO)
endif()

# The c10d Gloo header includes <gloo/...>: Debian ships them in libgloo-dev. ddpkit holds no gloo
# layout, so they need not be the gloo libtorch was built with (tests/gloo_symbols.py checks it).
find_path(DDPKIT_GLOO_INCLUDE gloo/algorithm.h HINTS ${TORCH_INCLUDE_DIRS})
if(NOT DDPKIT_GLOO_INCLUDE)
  message(FATAL_ERROR "gloo headers not found: install libgloo-dev (scripts/install-deps.sh); pip's torch ships "
                      "none, and Debian's serve it (docs/compat.md, \"Gloo headers\")")
endif()

# NCCL: present when libtorch was built with CUDA (torch_cuda carries USE_C10D_NCCL).
set(DDPKIT_HAVE_NCCL OFF)
if(TARGET torch_cuda)
  get_target_property(_torch_cuda_defs torch_cuda INTERFACE_COMPILE_DEFINITIONS)
  if(_torch_cuda_defs MATCHES "USE_C10D_NCCL")
    set(DDPKIT_HAVE_NCCL ON)
  endif()
endif()
message(STATUS "ddpkit: libtorch ${Torch_VERSION}, NCCL backend: ${DDPKIT_HAVE_NCCL}, flags: ${TORCH_CXX_FLAGS}")

# find_package(Torch) makes its imported targets (torch, torch_cpu, c10, ...) visible in this
# directory only. When a user's project does add_subdirectory(ddpkit) without finding Torch first,
# its targets that link ddpkit would see "torch_cpu" as an unknown target: make them global.
get_directory_property(_ddpkit_imported IMPORTED_TARGETS)
foreach(_t IN LISTS _ddpkit_imported)
  get_target_property(_is_global ${_t} IMPORTED_GLOBAL)
  if(NOT _is_global)
    set_target_properties(${_t} PROPERTIES IMPORTED_GLOBAL TRUE)
  endif()
endforeach()
