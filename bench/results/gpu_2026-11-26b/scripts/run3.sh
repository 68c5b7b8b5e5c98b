#!/usr/bin/env bash
set -u
out=$1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
b=build-gpu
nccl_root=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
cmake -S . -B $b -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADCOMP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native \
  -DCMAKE_PREFIX_PATH=$PWD/.gpu-deps/prefix -DGRADCOMP_BUILD_PYTHON=ON \
  -DGRADCOMP_BUILD_TESTS=OFF -DGRADCOMP_BUILD_BENCH=OFF -DPython_EXECUTABLE=$(command -v python3) \
  -DGRADCOMP_NCCL_ROOT=$nccl_root > $out/build3.log 2>&1
timeout 200 cmake --build $b -j 16 >> $out/build3.log 2>&1 || { tail -20 $out/build3.log; exit 1; }
echo "$(date -u +%T) built"
mkdir -p $b/pyroot && cp -r python_bindings/gradcomp $b/pyroot/ && cp $b/python_bindings/_C*.so $b/pyroot/gradcomp/
export PYTHONPATH=$PWD/$b/pyroot
for n in onebit powersgd; do timeout 40 python3 .gpu-deps/drv.py $n 2>&1 | grep -v "^  File \"/usr/lib\|multiprocessing" | head -30; done > $out/faults.log 2>&1
echo "$(date -u +%T) faulthandler runs done"
timeout 150 cuda-gdb -batch -ex "set pagination off" -ex "set cuda api_failures ignore" -ex run \
  -ex "bt 40" -ex "info threads" --args python3 .gpu-deps/drv.py quant > $out/gdb.log 2>&1
echo "$(date -u +%T) gdb rc $?"
grep -n -A45 "SIGSEGV" $out/gdb.log | head -60
