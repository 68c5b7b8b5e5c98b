# SPDX-License-Identifier: Apache-2.0
# cmake -DBUILD_DIR=... -DSRC=... -DWORK=... -DGENERATOR=... -DCXX=... -P run_consumer.cmake
file(REMOVE_RECURSE ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/run_step.cmake)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK}/prefix)
run(${CMAKE_COMMAND} -S ${SRC} -B ${WORK}/build -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX}
    -DCMAKE_PREFIX_PATH=${WORK}/prefix -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK}/build)
run(${WORK}/build/consumer)
message(STATUS "${last_output}")
if(NOT last_output MATCHES "gradcomp consumer: ok")
  message(FATAL_ERROR "unexpected output: ${last_output}")
endif()
