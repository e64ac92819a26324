# Build options. The optional backends take AUTO (build when found), ON
# (required) or OFF.
set(EP_MOE_WITH_CUDA AUTO CACHE STRING "Build the CUDA/cuBLASLt/NCCL backend: AUTO, ON or OFF")
set_property(CACHE EP_MOE_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
set(EP_MOE_WITH_MPI AUTO CACHE STRING "Build the MPI communicator: AUTO, ON or OFF")
set_property(CACHE EP_MOE_WITH_MPI PROPERTY STRINGS AUTO ON OFF)
set(EP_MOE_WITH_ONEDNN AUTO CACHE STRING "Build the oneDNN matrix engine (AMX prefill): AUTO, ON or OFF")
set_property(CACHE EP_MOE_WITH_ONEDNN PROPERTY STRINGS AUTO ON OFF)

option(EP_MOE_BUILD_TESTS "Build the tests" ${PROJECT_IS_TOP_LEVEL})
option(EP_MOE_BUILD_EXAMPLES "Build the demo and examples" ${PROJECT_IS_TOP_LEVEL})
option(EP_MOE_BUILD_BENCH "Build the benchmark" ${PROJECT_IS_TOP_LEVEL})
option(EP_MOE_WERROR "Treat compiler warnings as errors" OFF)
option(EP_MOE_BUILD_FUZZERS "Build the libFuzzer targets of the parsers (clang only)" OFF)
set(EP_MOE_SANITIZE "" CACHE STRING "Sanitizers for library and tests: '', 'address;undefined' or 'thread'")

find_package(Doxygen QUIET)
if(DOXYGEN_FOUND)
  set(_ep_moe_docs_default ${PROJECT_IS_TOP_LEVEL})
else()
  set(_ep_moe_docs_default OFF)
endif()
option(EP_MOE_BUILD_DOCS "Build the Doxygen API documentation (a test checks it has no warnings)"
       ${_ep_moe_docs_default})

set(EP_MOE_WARNINGS -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor)
if(EP_MOE_WERROR)
  list(APPEND EP_MOE_WARNINGS -Werror)
endif()

if(EP_MOE_SANITIZE)
  set(_san_flags "")
  foreach(_s IN LISTS EP_MOE_SANITIZE)
    list(APPEND _san_flags -fsanitize=${_s})
  endforeach()
  add_compile_options(${_san_flags} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  # GCC's instrumentation makes -Wmaybe-uninitialized report libstdc++'s
  # std::regex (tests/capi/test_bad_args.cpp), 22 false reports a build;
  # the CI build, without sanitizers, keeps the warning as an error.
  add_compile_options($<$<COMPILE_LANG_AND_ID:CXX,GNU>:-Wno-maybe-uninitialized>)
  add_link_options(${_san_flags})
endif()
