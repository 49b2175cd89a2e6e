# The libraries a found Torch package links, made its own (included after find_package(Torch), by
# ddpkit's build and by its installed CMake package, so a program that links ddpkit links the same).
# Idempotent.

# TorchConfig finds libtorch.so with find_library(... PATHS <torch>/lib), which searches the system's
# folders first: with pip's torch (CMAKE_PREFIX_PATH=torch.utils.cmake_prefix_path) on a Debian host
# that also has libtorch-dev, the `torch` target then named Debian's libtorch.so beside pip's
# libtorch_cpu.so, two libtorch versions in one link. Point it at the libtorch the package is for.
get_filename_component(_torch_lib_dir "${TORCH_LIBRARY}" DIRECTORY)
get_filename_component(_torch_lib_dir "${_torch_lib_dir}" REALPATH)
get_filename_component(_torch_own_lib_dir "${TORCH_INSTALL_PREFIX}/lib" REALPATH)
# (Debian's own package keeps its libraries in lib/<triplet>, not <prefix>/lib: nothing to do there.)
if(NOT _torch_lib_dir STREQUAL _torch_own_lib_dir AND EXISTS "${_torch_own_lib_dir}/libtorch.so")
  message(STATUS "ddpkit: TorchConfig picked ${TORCH_LIBRARY}; using ${_torch_own_lib_dir}/libtorch.so, its own")
  set(TORCH_LIBRARY "${_torch_own_lib_dir}/libtorch.so" CACHE FILEPATH "libtorch.so of the Torch package found" FORCE)
  set_target_properties(torch PROPERTIES IMPORTED_LOCATION "${TORCH_LIBRARY}")
endif()
# The same search put Debian's libc10.so (C10_LIBRARY) into TORCH_LIBRARIES: every library listed
# by path that the package has a copy of comes from the package.
set(_libs "")
foreach(_lib IN LISTS TORCH_LIBRARIES)
  if(IS_ABSOLUTE "${_lib}")
    get_filename_component(_name "${_lib}" NAME)
    get_filename_component(_dir "${_lib}" DIRECTORY)
    get_filename_component(_dir "${_dir}" REALPATH)
    if(NOT _dir STREQUAL _torch_own_lib_dir AND EXISTS "${_torch_own_lib_dir}/${_name}")
      message(STATUS "ddpkit: TorchConfig listed ${_lib}; using ${_torch_own_lib_dir}/${_name}, its own")
      set(_lib "${_torch_own_lib_dir}/${_name}")
    endif()
  endif()
  list(APPEND _libs "${_lib}")
endforeach()
set(TORCH_LIBRARIES "${_libs}")

# pip's CUDA torch: its libraries come with the wheel's nvidia-* packages (site-packages/nvidia/*/lib,
# found by libtorch_cuda's own RUNPATH), and FindCUDAToolkit's CUDA:: targets name the system
# toolkit's, which may be older (13.0 beside the wheel's 13.2) and carry an NCCL of their own. Link
# and run against the wheel's: its cudart and nvrtc replace the toolkit's in the CUDA:: targets, and
# the linker looks in the wheel's folders first for what libtorch_cuda needs (libnccl.so.2), so a
# process holds one libnccl.so.2, the wheel's.
get_filename_component(_wheel_nvidia "${TORCH_INSTALL_PREFIX}/../nvidia" ABSOLUTE)
if(TARGET torch_cuda AND IS_DIRECTORY "${_wheel_nvidia}")
  file(GLOB _wheel_lib_dirs LIST_DIRECTORIES true "${_wheel_nvidia}/*/lib")
  set(_wheel_cuda_lib_dirs "")
  foreach(_dir IN LISTS _wheel_lib_dirs)
    if(IS_DIRECTORY "${_dir}")
      list(APPEND _wheel_cuda_lib_dirs "${_dir}")
      set_property(TARGET torch APPEND PROPERTY INTERFACE_LINK_OPTIONS "LINKER:-rpath-link,${_dir}")
    endif()
  endforeach()
  foreach(_pair IN ITEMS "cudart;libcudart.so.*" "nvrtc;libnvrtc.so.*")
    list(GET _pair 0 _name)
    list(GET _pair 1 _pattern)
    set(_found "")
    foreach(_dir IN LISTS _wheel_cuda_lib_dirs)
      file(GLOB _candidates "${_dir}/${_pattern}")
      list(FILTER _candidates EXCLUDE REGEX "builtins")
      if(_candidates)
        list(GET _candidates 0 _found)
        break()
      endif()
    endforeach()
    if(_found AND TARGET CUDA::${_name})
      set_target_properties(CUDA::${_name} PROPERTIES IMPORTED_LOCATION "${_found}")
      if(_name STREQUAL "nvrtc")  # TorchConfig also lists the toolkit's nvrtc by path in TORCH_LIBRARIES
        if(TARGET caffe2::nvrtc_runtime)
          set_property(TARGET caffe2::nvrtc_runtime PROPERTY INTERFACE_LINK_LIBRARIES "${_found}")
        endif()
        list(FIND TORCH_LIBRARIES "${CUDA_NVRTC_LIB}" _at)
        if(_at GREATER_EQUAL 0)
          list(REMOVE_AT TORCH_LIBRARIES ${_at})
          list(INSERT TORCH_LIBRARIES ${_at} "${_found}")
        endif()
      endif()
    endif()
  endforeach()
  message(STATUS "ddpkit: CUDA libraries from the torch wheel (${_wheel_nvidia})")
endif()

