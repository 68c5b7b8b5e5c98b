#!/usr/bin/env bash
set -u
out=$1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
b=build-gpu
nccl_root=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
cmake -S . -B $b -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native \
  -DCMAKE_PREFIX_PATH=$PWD/.gpu-deps/prefix -DGRADCOMP_BUILD_PYTHON=ON \
  -DGRADCOMP_BUILD_TESTS=OFF -DGRADCOMP_BUILD_BENCH=OFF -DPython_EXECUTABLE=$(command -v python3) \
  -DGRADCOMP_NCCL_ROOT=$nccl_root > $out/build4.log 2>&1
timeout 120 cmake --build $b -j 16 >> $out/build4.log 2>&1 || { tail -20 $out/build4.log; exit 1; }
echo "$(date -u +%T) built"
echo "objects defining ostream::_M_insert<long>:"; for o in $(find $b/CMakeFiles -name "*.o"); do nm -C --defined-only $o 2>/dev/null | grep -q "_M_insert<long>" && echo "  $o"; done
mkdir -p $b/pyroot && cp -r python_bindings/gradcomp $b/pyroot/ && cp $b/python_bindings/_C*.so $b/pyroot/gradcomp/
export PYTHONPATH=$PWD/$b/pyroot
cd tests/python && timeout 100 python3 -m pytest -q -rs -p no:cacheprovider -n 8 --timeout 90 test_gpu.py > $out/pytest4.log 2>&1
echo "$(date -u +%T) pytest: $(tail -1 $out/pytest4.log)"
grep -E "^FAILED|^SKIPPED|^E  .*(Error|assert)" $out/pytest4.log | head -20
