# SPDX-License-Identifier: Apache-2.0
# cmake -DGRADCOMP_SOURCE_DIR=... -DSRC=... -DWORK=... -DGENERATOR=... -DCXX=... [-DBUILD=ON] -P run_subdirectory.cmake
# Configures the project in SRC, which takes gradcomp in with add_subdirectory(), with GoogleTest
# and Google Benchmark made unfindable (a find_package(... REQUIRED) of either then fails the
# configure), checks that gradcomp's tests, benchmarks and examples defaulted to off there and,
# with -DBUILD=ON, builds the consumer (and with it only the library) and runs it.
# WORK is kept between runs and configured with --fresh: a new cache, so the defaults are checked
# as a first configure sees them, while a repeated local run recompiles nothing unchanged.
cmake_minimum_required(VERSION 3.24)  # a script gets no policies otherwise (IN_LIST)
include(${CMAKE_CURRENT_LIST_DIR}/run_step.cmake)
run(${CMAKE_COMMAND} --fresh -S ${SRC} -B ${WORK} -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX}
    -DCMAKE_BUILD_TYPE=Release -DGRADCOMP_SOURCE_DIR=${GRADCOMP_SOURCE_DIR} -DGRADCOMP_CUDA=OFF
    -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DCMAKE_DISABLE_FIND_PACKAGE_benchmark=ON)
file(STRINGS ${WORK}/CMakeCache.txt options REGEX "^GRADCOMP_BUILD_")
foreach(option TESTS BENCH EXAMPLES PYTHON)
  if(NOT "GRADCOMP_BUILD_${option}:BOOL=OFF" IN_LIST options)
    message(FATAL_ERROR "GRADCOMP_BUILD_${option} is not OFF in a project that took gradcomp in "
                        "with add_subdirectory(): ${options}")
  endif()
endforeach()
if(NOT BUILD)
  message(STATUS "configured and generated; the build is left out (BUILD=OFF)")
  return()
endif()
run(${CMAKE_COMMAND} --build ${WORK} --target consumer)
run(${WORK}/consumer)
message(STATUS "${last_output}")
if(NOT last_output MATCHES "gradcomp subdirectory consumer: ok")
  message(FATAL_ERROR "unexpected output: ${last_output}")
endif()
