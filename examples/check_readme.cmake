# SPDX-License-Identifier: Apache-2.0
# cmake -DREADME=README.md -DEXAMPLE=readme_example.cpp -DOUT=readme_block.cpp -P check_readme.cmake
# Fails unless the first ```cpp block of README.md's "## C++" section is EXAMPLE byte for byte,
# so that the program a reader copies is the one ctest builds and runs. On a mismatch the block is
# written to OUT, for a diff against EXAMPLE.
cmake_minimum_required(VERSION 3.24)
file(READ ${README} readme)
file(READ ${EXAMPLE} example)
set(heading "\n## C++\n")
string(FIND "${readme}" "${heading}" start)
if(start EQUAL -1)
  message(FATAL_ERROR "${README}: no \"## C++\" section")
endif()
string(LENGTH "${heading}" length)
math(EXPR start "${start} + ${length} - 1")  # keep the newline: the fence must open a line
string(SUBSTRING "${readme}" ${start} -1 section)
string(FIND "${section}" "\n## " end)  # the next section's heading
if(NOT end EQUAL -1)
  string(SUBSTRING "${section}" 0 ${end} section)
endif()
set(fence "\n```cpp\n")
string(FIND "${section}" "${fence}" start)
if(start EQUAL -1)
  message(FATAL_ERROR "${README}: no ```cpp block in the \"## C++\" section")
endif()
string(LENGTH "${fence}" length)
math(EXPR start "${start} + ${length}")
string(SUBSTRING "${section}" ${start} -1 block)
# the block ends before the line that closes it; the block's last newline is part of it
string(FIND "${block}" "\n```\n" end)
if(end EQUAL -1)
  message(FATAL_ERROR "${README}: the ```cpp block of \"## C++\" is not closed")
endif()
math(EXPR end "${end} + 1")
string(SUBSTRING "${block}" 0 ${end} block)
if(NOT block STREQUAL example)
  file(WRITE ${OUT} "${block}")
  message(FATAL_ERROR "README.md's C++ example is not ${EXAMPLE}: make them the same "
                      "(the README's block is in ${OUT}; diff -u ${EXAMPLE} ${OUT})")
endif()
message(STATUS "README.md's C++ example is ${EXAMPLE}")
