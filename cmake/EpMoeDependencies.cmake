# Detection of the optional backends. Each result is a plain TRUE/FALSE
# variable EP_MOE_HAVE_<X>, turned into a compile definition and reported at
# run time by ep_moe_has_feature().

# --- nlohmann/json (header-only, Debian's nlohmann-json3-dev) ---------------
find_package(nlohmann_json 3.9 REQUIRED)

# --- CUDA toolkit, cuBLASLt, NCCL ------------------------------------------
set(EP_MOE_HAVE_CUDA FALSE)
set(EP_MOE_HAVE_CUBLASLT FALSE)
set(EP_MOE_HAVE_NCCL FALSE)
if(NOT EP_MOE_WITH_CUDA STREQUAL "OFF")
  if(NOT DEFINED CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT} AND EXISTS "/usr/local/cuda")
    set(CUDAToolkit_ROOT "/usr/local/cuda")
  endif()
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(EP_MOE_HAVE_CUDA TRUE)
    if(TARGET CUDA::cublasLt)
      set(EP_MOE_HAVE_CUBLASLT TRUE)
      # The layer's kernels (src/cuda): sm_80 and sm_90 machine code, and
      # sm_90 PTX for newer GPUs. Override with CMAKE_CUDA_ARCHITECTURES.
      if(NOT DEFINED CMAKE_CUDA_COMPILER)
        set(CMAKE_CUDA_COMPILER "${CUDAToolkit_NVCC_EXECUTABLE}")
      endif()
      if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
        set(CMAKE_CUDA_ARCHITECTURES "80-real;90")
      endif()
      enable_language(CUDA)
      set(CMAKE_CUDA_STANDARD 17)
      set(CMAKE_CUDA_STANDARD_REQUIRED ON)
      set(CMAKE_CUDA_VISIBILITY_PRESET hidden)
    endif()
    find_path(EP_MOE_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} $ENV{NCCL_ROOT}/include)
    find_library(EP_MOE_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} $ENV{NCCL_ROOT}/lib)
    if(EP_MOE_NCCL_INCLUDE_DIR AND EP_MOE_NCCL_LIBRARY)
      set(EP_MOE_HAVE_NCCL TRUE)
    endif()
  elseif(EP_MOE_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "EP_MOE_WITH_CUDA=ON but no CUDA toolkit was found (set CUDAToolkit_ROOT)")
  endif()
endif()

# --- MPI ----------------------------------------------------------------------
set(EP_MOE_HAVE_MPI FALSE)
if(NOT EP_MOE_WITH_MPI STREQUAL "OFF")
  find_package(MPI QUIET COMPONENTS C)
  if(MPI_C_FOUND)
    set(EP_MOE_HAVE_MPI TRUE)
  elseif(EP_MOE_WITH_MPI STREQUAL "ON")
    message(FATAL_ERROR "EP_MOE_WITH_MPI=ON but no MPI was found (install libopenmpi-dev)")
  endif()
endif()

# --- oneDNN (the matrix engine module) ----------------------------------------
# Debian's dnnl-config.cmake asks for OpenCL as REQUIRED (its GPU runtime is
# OCL), which would stop the whole configure where OpenCL's headers are
# missing: look for OpenCL first. The module also calls OpenMP itself.
set(EP_MOE_HAVE_ONEDNN FALSE)
if(NOT EP_MOE_WITH_ONEDNN STREQUAL "OFF")
  find_package(OpenCL QUIET)
  if(OpenCL_FOUND)
    find_package(dnnl CONFIG QUIET)
  endif()
  find_package(OpenMP QUIET COMPONENTS CXX)
  if(dnnl_FOUND AND OpenMP_CXX_FOUND)
    set(EP_MOE_HAVE_ONEDNN TRUE)
  elseif(EP_MOE_WITH_ONEDNN STREQUAL "ON")
    message(FATAL_ERROR "EP_MOE_WITH_ONEDNN=ON but no oneDNN was found (install libdnnl-dev ocl-icd-opencl-dev)")
  endif()
endif()
