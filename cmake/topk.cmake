# SPDX-License-Identifier: Apache-2.0
# Top-k family: the CUDA kernels are compiled without FMA contraction so that a * b + c rounds as
# on the CPU (x86-64-v2 has no FMA): the GPU's DGC update and decode equal the CPU twin bitwise.
if(GRADCOMP_WITH_CUDA)
  set_source_files_properties(${PROJECT_SOURCE_DIR}/kernels/cuda/topk_cuda.cu
                              ${PROJECT_SOURCE_DIR}/kernels/cuda/topk_select_cuda.cu
                              PROPERTIES COMPILE_OPTIONS "--fmad=false")
endif()
