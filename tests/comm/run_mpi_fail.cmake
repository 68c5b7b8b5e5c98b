# SPDX-License-Identifier: Apache-2.0
# Runs test_comm_mpi_fail under mpirun and judges it by what the ranks print: mpirun's own exit
# status says nothing here (with orte_enable_recovery 1 it is 0 whatever the ranks return).
#   cmake -DCMD="mpirun;...;test_comm_mpi_fail;kill" -DNP=4 -P run_mpi_fail.cmake
# Pass: mpirun returns 0 within the time limit, each of the NP - 1 survivors printed "ok" and no
# rank printed a sanitizer report (the ranks leave through _exit, so in the ASan build a report is
# the only trace of a finding).
execute_process(COMMAND ${CMD} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc
                TIMEOUT 45)
message("${out}")
string(REGEX MATCHALL "rank [0-9]+: ok -" oks "${out}")
list(LENGTH oks n_ok)
math(EXPR want "${NP} - 1")
if(NOT rc STREQUAL "0" OR NOT n_ok EQUAL want OR out MATCHES "FAIL" OR err MATCHES "Sanitizer")
  message(FATAL_ERROR "${n_ok} of ${want} survivors raised BackendError in time "
                      "(mpirun: ${rc})\n${err}")
endif()
