# SPDX-License-Identifier: Apache-2.0
# run(<command> [args...]): one step of the consumer scripts (run_consumer.cmake,
# run_subdirectory.cmake); a failing step stops the script with the command and its output.
# The step's standard output is left in last_output.
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()
