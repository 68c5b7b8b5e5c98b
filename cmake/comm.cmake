# SPDX-License-Identifier: Apache-2.0
# The communication layer's engines: MPI (Debian OpenMPI) and, in CUDA builds, NCCL from the CUDA
# toolkit. Without MPI (or without CUDA) the stubs in comm/nompi (comm/nonccl) are compiled
# instead: the classes exist and their constructors throw a clear error.
set(MPI_CXX_SKIP_MPICXX ON CACHE BOOL "C API only (no deprecated C++ bindings)")
find_package(MPI COMPONENTS CXX)
if(MPI_CXX_FOUND)
  file(GLOB GRADCOMP_MPI_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/comm/mpi/*.cpp)
  target_sources(gradcomp PRIVATE ${GRADCOMP_MPI_SOURCES})
  target_link_libraries(gradcomp PUBLIC MPI::MPI_CXX)
  set(GRADCOMP_WITH_MPI ON)
else()
  message(WARNING "gradcomp: MPI not found; MpiCommunicator will throw (apt-get install libopenmpi-dev)")
  file(GLOB GRADCOMP_MPI_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/comm/nompi/*.cpp)
  target_sources(gradcomp PRIVATE ${GRADCOMP_MPI_SOURCES})
  set(GRADCOMP_WITH_MPI OFF)
endif()
message(STATUS "gradcomp: MPI ${GRADCOMP_WITH_MPI} (${MPIEXEC_EXECUTABLE})")

set(GRADCOMP_WITH_NCCL OFF)
if(GRADCOMP_WITH_CUDA)
  # GRADCOMP_NCCL_ROOT: an NCCL outside the toolkit, e.g. the nvidia-nccl wheel PyTorch installs
  # (include/nccl.h, lib/libnccl.so.2: a wheel has no libnccl.so link)
  set(GRADCOMP_NCCL_ROOT "" CACHE PATH "NCCL installation to use when the CUDA toolkit has none")
  find_path(GRADCOMP_NCCL_INCLUDE nccl.h
            HINTS ${GRADCOMP_NCCL_ROOT}/include ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  find_library(GRADCOMP_NCCL_LIB NAMES nccl libnccl.so.2
               HINTS ${GRADCOMP_NCCL_ROOT}/lib ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
  if(GRADCOMP_NCCL_INCLUDE AND GRADCOMP_NCCL_LIB)
    set(GRADCOMP_WITH_NCCL ON)
  else()
    message(WARNING "gradcomp: NCCL (nccl.h, libnccl.so) not found in the CUDA toolkit; NcclCommunicator will throw")
  endif()
endif()
if(GRADCOMP_WITH_NCCL)
  file(GLOB GRADCOMP_NCCL_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/comm/nccl/*.cpp)
  target_sources(gradcomp PRIVATE ${GRADCOMP_NCCL_SOURCES})
  target_include_directories(gradcomp PRIVATE ${GRADCOMP_NCCL_INCLUDE})
  target_link_libraries(gradcomp PUBLIC ${GRADCOMP_NCCL_LIB})
else()
  file(GLOB GRADCOMP_NCCL_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/comm/nonccl/*.cpp)
  target_sources(gradcomp PRIVATE ${GRADCOMP_NCCL_SOURCES})
  if(GRADCOMP_WITH_CUDA)  # the stub then says "built without NCCL", not "without CUDA"
    set_source_files_properties(${GRADCOMP_NCCL_SOURCES} PROPERTIES COMPILE_DEFINITIONS
                                GRADCOMP_CUDA_NO_NCCL)
  endif()
endif()
message(STATUS "gradcomp: NCCL ${GRADCOMP_WITH_NCCL}")
